"""Decode projections as they run inside a decode step: weights not in L2, one CUDA-graph replay each.

    python scripts/bench_decode_linear.py [--layers layer-8b,layer-70b] [--m 1,8,16,32] [--quack]
                                          [--cands futx-int4,torch-bf16,...]

For each projection (QKV, O, gate/up, down) of each layer and each M, every candidate is captured in a
CUDA graph as `reps` x [L2 flush, projection]; a graph of `reps` flushes alone is timed in the same
rounds and subtracted. The flush *reads* a 128 MB buffer (2.5x the L2) (clean lines: no write-backs later).
Rounds are interleaved across candidates; medians are reported, with achieved bandwidth = bytes of
weights + scales / time and its fraction of the 4.36 TB/s HBM read floor measured on this H200.

Candidates: futx INT4 (g128) / E4M3 / BF16 as the ops pick them (decode.plan), design comparisons
(`int4-nofold`, `int4-nopdl`: the M = 1 GEMV without the folded nibble bias / without programmatic
dependent launch; `int4-skinny`: the skinny kernel where the GEMV runs), torch._weight_int4pack_mm (g128,
the gpt-fast/torchao kernel), torch BF16 matmul, and quack's gemm_w4a16 `int4` (optional: --quack, needs
quack-kernels and the DSL).
Writes decode_linear.{json,md} to $OUT when set; prints a compact table last.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from decode import plan

FLOOR_TBPS = 4.36
GROUP = 128
PROJS = ("qkv", "o", "gate_up", "down")
EPILOGUE = {"qkv": "store", "o": "residual", "gate_up": "swiglu", "down": "residual"}


# ---- candidates ---------------------------------------------------------------------------------
def futx_candidates(n, k, m, proj, gen):
    from futx.ops.decode_linear import run_variant

    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    r = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    epi = EPILOGUE[proj]
    res = r if epi == "residual" else None
    out = torch.empty(m, n // 2 if epi == "swiglu" else n, dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(64 * n * 32, device="cuda")
    packed = torch.randint(-2**31, 2**31 - 1, (n // 16, k // 64, 32, 4), dtype=torch.int32, device="cuda",
                           generator=gen)
    scales = (torch.rand(n // 16, k // GROUP, 16, device="cuda", generator=gen) * 0.01).half()
    raw = torch.randint(0, 126, (n, k), dtype=torch.uint8, device="cuda", generator=gen)
    e4 = raw.view(torch.float8_e4m3fn)
    e4s = torch.rand(n, device="cuda", generator=gen) * 1e-3
    wb = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()

    def call(fmt, w, s, kernel="auto", variant=""):
        return lambda: run_variant(fmt, x, w, s, GROUP, epi, res, kernel, variant, out=out, workspace=ws)

    int4_bytes = n * k // 2 + n * (k // GROUP) * 2
    cands = {
        "futx-int4": (call("int4", packed, scales), int4_bytes),
        "futx-e4m3": (call("e4m3", e4, e4s), n * k + 4 * n),
        "futx-bf16": (call("bf16", wb, None), 2 * n * k),
    }
    if m == 1:
        for v in ("nofold", "nopdl"):
            cands[f"futx-int4-{v}"] = (call("int4", packed, scales, "gemv", v), int4_bytes)
    elif plan.choose("int4", GROUP, epi, m, n, k).kind == "gemv":
        cands["futx-int4-skinny"] = (call("int4", packed, scales, "skinny"), int4_bytes)
    return x, cands


def plan_note(n, k, m, proj) -> str:
    """Which kernel and launch shape the ops pick for INT4 (reported with the timings)."""
    c = plan.choose("int4", GROUP, EPILOGUE[proj], m, n, k)
    return f"gemv tiles={c.tiles}" if c.kind == "gemv" else f"skinny split={c.split}"


def torch_candidates(x, n, k, gen):
    cands = {}
    wb = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    cands["torch-bf16"] = (lambda: torch.nn.functional.linear(x, wb), 2 * n * k)
    try:
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        try:
            wp = torch.ops.aten._convert_weight_to_int4pack(q, 8)
        except RuntimeError:  # older torch: int32 [N, K] nibbles
            wp = torch.ops.aten._convert_weight_to_int4pack(
                torch.stack([q & 0xF, q >> 4], -1).reshape(n, k).int(), 8)
        sz = (torch.rand(k // GROUP, n, 2, device="cuda", generator=gen) * 0.01).bfloat16()
        torch._weight_int4pack_mm(x, wp, GROUP, sz)
        cands["torch-int4"] = (lambda: torch._weight_int4pack_mm(x, wp, GROUP, sz),
                               n * k // 2 + n * (k // GROUP) * 4)
    except Exception as exc:  # noqa: BLE001 - report, keep going
        print(f"  torch-int4 unavailable: {str(exc).splitlines()[0][:120]}", file=sys.stderr)
    return cands


def quack_candidate(x, n, k, gen):
    from quack.gemm_w4 import gemm_w4a16, prepare_w4_weight

    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    sf = (torch.rand(n, k // GROUP, device="cuda", generator=gen) * 0.01).bfloat16()
    blob, sf_blob = prepare_w4_weight(q, sf, wformat="int4")
    gemm_w4a16(x, blob, sf_blob, wformat="int4")
    nbytes = blob.numel() * blob.element_size() + sf_blob.numel() * sf_blob.element_size()  # its scale strip
    return {"quack-w4a16": (lambda: gemm_w4a16(x, blob, sf_blob, wformat="int4"), nbytes)}


# ---- timing -------------------------------------------------------------------------------------
class Flush:
    """Evict L2 by reading a buffer several times its size (reads leave no dirty lines behind)."""

    def __init__(self, mb: int = 128):
        self.buf = torch.ones(mb << 18, device="cuda")  # mb MiB of float32
        self.sink = torch.empty((), device="cuda")

    def __call__(self):
        torch.amax(self.buf, dim=0, out=self.sink)


def capture(fns, reps: int):
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(reps):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph


def time_graph(graph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3  # us


def bench(cands: dict, flush: Flush, reps: int, rounds: int) -> dict:
    graphs, out = {}, {}
    for name, (fn, nbytes) in cands.items():
        try:
            fn()
            torch.cuda.synchronize()
            graphs[name] = capture([flush, fn], reps)
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"}
    base = capture([flush], reps)
    times = {name: [] for name in graphs}
    flush_t = []
    names = list(graphs)
    for r in range(rounds):
        order = names[r % max(1, len(names)):] + names[:r % max(1, len(names))]
        flush_t.append(time_graph(base))
        for name in order:
            times[name].append(time_graph(graphs[name]))
    f = statistics.median(flush_t)
    for name, ts in times.items():
        us = max((statistics.median(ts) - f) / reps, 1e-3)
        nbytes = cands[name][1]
        out[name] = {"us": us, "gbps": nbytes / us / 1e3, "floor_frac": nbytes / us / 1e6 / FLOOR_TBPS,
                     "bytes": nbytes, "spread": (max(ts) - min(ts)) / statistics.median(ts)}
    out["_flush_us"] = f / reps
    return out


# ---- report -------------------------------------------------------------------------------------
def table(results: list[dict], cand_names: list[str]) -> str:
    head = "| layer | proj | M | " + " | ".join(cand_names) + " |"
    lines = [head, "|" + "---|" * (3 + len(cand_names))]
    for row in results:
        cells = []
        for c in cand_names:
            e = row["cands"].get(c, {})
            cells.append(f"{e['us']:.1f} ({100 * e['floor_frac']:.0f}%)" if "us" in e else "-")
        lines.append(f"| {row['layer']} | {row['proj']} | {row['m']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def layer_sums(results: list[dict], cand_names: list[str]) -> list[dict]:
    sums = {}
    for row in results:
        key = (row["layer"], row["m"])
        acc = sums.setdefault(key, {})
        for c in cand_names:
            e = row["cands"].get(c, {})
            if "us" in e and acc.get(c, 0.0) is not None:
                acc[c] = acc.get(c, 0.0) + e["us"]
                acc[c + "#bytes"] = acc.get(c + "#bytes", 0) + e["bytes"]
            else:
                acc[c] = None
    rows = []
    for (layer, m), acc in sums.items():
        cands = {}
        for c in cand_names:
            if acc.get(c):
                b = acc[c + "#bytes"]
                cands[c] = {"us": acc[c], "bytes": b, "floor_frac": b / acc[c] / 1e6 / FLOOR_TBPS}
        rows.append({"layer": layer, "proj": "sum", "m": m, "cands": cands})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="layer-8b,layer-70b")
    ap.add_argument("--m", default="1,8,16,32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--quack", action="store_true", help="add quack gemm_w4a16 (int4, g128); JIT compiles")
    ap.add_argument("--watchdog", type=float, default=240.0, help="seconds per shape before aborting")
    ap.add_argument("--cands", default="", help="comma list: time only these candidates (e.g. a JIT run with "
                    "quack: torch-bf16,quack-w4a16 keeps futx kernels from compiling)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    import futx.ops  # noqa: F401
    from futx.config import preset

    p = torch.cuda.get_device_properties(0)
    info = {"gpu": p.name, "sms": p.multi_processor_count, "torch": torch.__version__,
            "kernels": os.environ.get("FUTX_KERNELS", "auto"), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print("bench_decode_linear:", info, flush=True)
    flush = Flush()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, names = [], []
    use_quack = args.quack
    for layer in args.layers.split(","):
        shapes = preset(layer).projection_shapes()
        for proj in PROJS:
            n, k = shapes[proj]
            for m in (int(v) for v in args.m.split(",")):
                faulthandler.dump_traceback_later(args.watchdog, exit=True)
                t0 = time.time()
                x, cands = futx_candidates(n, k, m, proj, gen)
                cands.update(torch_candidates(x, n, k, gen))
                if use_quack:
                    try:
                        cands.update(quack_candidate(x, n, k, gen))
                    except Exception as exc:  # noqa: BLE001
                        print(f"  quack unavailable ({type(exc).__name__}: {str(exc)[:120]}); dropping it",
                              file=sys.stderr)
                        use_quack = False
                if args.cands:
                    cands = {c: v for c, v in cands.items() if c in args.cands.split(",")}
                res = bench(cands, flush, args.reps, args.rounds)
                faulthandler.cancel_dump_traceback_later()
                for c in res:
                    if not c.startswith("_") and c not in names:
                        names.append(c)
                results.append({"layer": layer, "proj": proj, "n": n, "k": k, "m": m, "cands": res,
                                "plan": plan_note(n, k, m, proj)})
                best = min((v["us"], c) for c, v in res.items() if not c.startswith("_") and "us" in v)
                errs = {c: v["error"] for c, v in res.items() if isinstance(v, dict) and "error" in v}
                print(f"{layer} {proj:7s} M={m:2d} N={n} K={k} [{plan_note(n, k, m, proj)}]: "
                      f"futx-int4 {res.get('futx-int4', {}).get('us', float('nan')):.1f} us, "
                      f"fastest {best[1]} {best[0]:.1f} us "
                      f"({time.time() - t0:.1f} s){' errors: ' + json.dumps(errs) if errs else ''}", flush=True)
                del x, cands
                torch.cuda.empty_cache()
    sums = layer_sums(results, names)
    md = ("# Decode projections (L2 flushed, CUDA-graph replay, median of rounds)\n\n"
          f"{json.dumps(info)}\n\nus per call (fraction of the {FLOOR_TBPS} TB/s read floor for that "
          "candidate's bytes)\n\n" + table(results, names) + "\n\n## Per layer (sum of the four projections)\n\n"
          + table(sums, names) + "\n")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "decode_linear.json").write_text(json.dumps({"info": info, "rows": results, "sums": sums},
                                                               indent=1, default=str))
        Path(out, "decode_linear.md").write_text(md)
    print("\n" + table(sums, names))
    goal = {"layer-8b": 35.0, "layer-70b": 115.0}
    for row in sums:
        if row["m"] == 1 and row["layer"] in goal and "futx-int4" in row["cands"]:
            us = row["cands"]["futx-int4"]["us"]
            print(f"GOAL {row['layer']} INT4 M=1 sum: {us:.1f} us (goal <= {goal[row['layer']]}) "
                  f"{'MET' if us <= goal[row['layer']] else 'MISSED'}")


if __name__ == "__main__":
    main()
