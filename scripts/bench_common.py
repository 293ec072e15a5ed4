"""Shared timing helpers for the prefill benchmarks: CUDA-graph replay, interleaved rounds, medians.

time_candidates({name: fn}, ...) captures `reps` back-to-back calls of each fn into a CUDA graph (eager
loop if capture fails), then runs `rounds` rounds in which every candidate is timed once with CUDA
events, in a rotated order; returns per-call medians in microseconds. A watchdog (faulthandler) kills
the process with a traceback if one shape takes longer than `watchdog_s`, so a hung kernel never
hangs the GPU run.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import statistics
import sys
from pathlib import Path

import torch


def gpu_info() -> dict:
    p = torch.cuda.get_device_properties(0)
    return {"gpu": p.name, "sms": p.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def out_dir() -> Path | None:
    d = os.environ.get("OUT")
    if not d:
        return None
    Path(d).mkdir(parents=True, exist_ok=True)
    return Path(d)


def arm_watchdog(seconds: float) -> None:
    faulthandler.cancel_dump_traceback_later()
    faulthandler.dump_traceback_later(seconds, exit=True)


def disarm_watchdog() -> None:
    faulthandler.cancel_dump_traceback_later()


def _runner(fn, reps: int):
    """A zero-argument callable that performs `reps` calls, as a graph replay when possible."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        return graph.replay, "graph", graph
    except Exception as exc:  # noqa: BLE001 - e.g. a library that syncs during capture
        torch.cuda.synchronize()
        print(f"  (graph capture failed: {str(exc).splitlines()[0][:100]}; timing eager calls)", file=sys.stderr)

        def eager():
            for _ in range(reps):
                fn()
        return eager, "eager", None


def time_candidates(cands: dict, flops: float | None = None, rounds: int = 5, target_ms: float = 8.0,
                    max_reps: int = 50) -> dict:
    """{name: fn} -> {name: {"us": median per call, "spread": (max-min)/median, "mode": graph|eager}}."""
    runners, errors = {}, {}
    for name, fn in cands.items():
        try:
            fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            one = max(start.elapsed_time(end), 1e-3)
            reps = int(max(1, min(max_reps, target_ms / one)))
            run, mode, keep = _runner(fn, reps)
            runners[name] = (run, reps, mode, keep)
        except Exception as exc:  # noqa: BLE001 - report and keep benchmarking the others
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    times = {name: [] for name in runners}
    names = list(runners)
    for r in range(rounds):
        order = names[r % max(1, len(names)):] + names[: r % max(1, len(names))]
        for name in order:
            run, reps, _, _ = runners[name]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / reps)
    out = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        out[name] = {"us": med, "spread": (max(ts) - min(ts)) / med, "mode": runners[name][2], "reps": runners[name][1]}
        if flops:
            out[name]["tflops"] = flops / med / 1e6
    for name, err in errors.items():
        out[name] = {"error": err}
    del runners
    return out


def capture_calls(fn, calls: int) -> "torch.cuda.CUDAGraph":
    """One CUDA graph of fn(0), fn(1), ..., fn(calls - 1) (captured on a side stream)."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    return g


def replay_us(g, calls: int) -> float:
    """µs per call of one replay of a graph of `calls` calls (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
