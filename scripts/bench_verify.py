"""The speculative verify (block) step on the H200: `futx bench decode --speculative` (scripts/bench_engine.py).

For each point BATCHxCONTEXT, weight x cache format and draft count k in --num-draft, one CUDA graph of the block
step: BATCH requests of k + 1 rows each (the last accepted token and k drafts at positions context - 1 ..
context - 1 + k of a random-filled cache), attention causal inside each block; k = 0 is the plain decode step.
Reported: ms per verification, its ratio to k = 0 (what a verification must win back in accepted drafts), and the
tokens/s it would give if every draft were accepted (an upper bound; the real rate is (accepted + 1) per
verification, futx generate --speculative reports it). Points where BATCH x (k + 1) exceeds the projections' 64
rows are skipped and listed.

  futx bench decode --speculative --weights int4 --cache int4 --points 1x1024,8x1024,32x1024 --out verify.json
  futx bench decode --speculative --shape llama-3.1-70b --weights int4 --cache int4 --points 1x1024,8x1024,32x1024
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from futx.engine.support import MAX_BATCH  # noqa: E402

MAX_DRAFT = 7


def draft_list(value: str) -> list[int]:
    """K,K,... each in 0..7 (0: the plain step), no repeats."""
    try:
        ks = [int(x) for x in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma-separated list of draft counts") from None
    if any(not 0 <= k <= MAX_DRAFT for k in ks) or len(set(ks)) != len(ks):
        raise argparse.ArgumentTypeError(f"draft counts must be distinct and in 0..{MAX_DRAFT}, got {value!r}")
    return ks


BLOCK_WAYS = ("prewrite", "kernel")   # futx.engine.backends.BLOCK_ATTENTION's one-launch ways


def block_list(value: str) -> list[str]:
    """--block-attention: comma-separated ways of writing a block's rows (BLOCK_WAYS)."""
    ways = [w.strip() for w in value.split(",") if w.strip()]
    bad = [w for w in ways if w not in BLOCK_WAYS]
    if not ways or bad or len(set(ways)) != len(ways):
        raise argparse.ArgumentTypeError(f"expected distinct ways from {', '.join(BLOCK_WAYS)}, got {value!r}")
    return ways


def blocks_for(batch: int, context: int, k: int, vocab: int) -> list[tuple[int, int, list[int]]]:
    """BATCH requests (slots 0..BATCH-1), each its last token at position context - 1 and k drafts after it."""
    return [(s, context - 1, [(7 * s + 3 * j + 1) % vocab for j in range(k + 1)]) for s in range(batch)]


def fits(batch: int, k: int) -> bool:
    return batch * (k + 1) <= MAX_BATCH


def eager_timer(reps: int, rounds: int) -> Callable[[dict], dict]:
    """Wall-clock timing of eager candidates (the emulated backend on the CPU: tests, not measurements)."""

    def run(cands: dict) -> dict:
        times = {k: [] for k in cands}
        for _ in range(rounds):
            for name, fn in cands.items():
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                times[name].append((time.perf_counter() - t0) * 1e3 / reps)
        return {k: {"ms": statistics.median(v), "spread": (max(v) - min(v)) / statistics.median(v)}
                for k, v in times.items()}

    return run


def measure_point(packed: dict, cfg, batch: int, context: int, ks: Sequence[int], pairs: Sequence[tuple[str, str]],
                  timer: Callable[[dict], dict], backend: str = "kernels", device="cuda",
                  ways: Sequence[str] = ("kernel",)) -> dict:
    """One point: {"batch", "context", "rows": [...], "skipped": [k, ...]} for every weight/cache pair, way of
    writing the block's rows (candidates named "w/c" with one way, "w/c way" with several) and k."""
    from futx.engine.cache import EngineCache
    from futx.engine.model import DecodeModel

    cap = -(-(context + MAX_DRAFT) // 8) * 8
    fit = [k for k in ks if fits(batch, k)]
    point = {"batch": batch, "context": context, "rows": [], "skipped": [k for k in ks if not fits(batch, k)]}
    caches = {cf: EngineCache(cfg, cf, batch, cap, device, keep_values=backend == "emulated")
              for cf in sorted({cf for _, cf in pairs})}
    if backend == "kernels":
        for i, c in enumerate(caches.values()):
            c.randomize(i)
    cands, keep = {}, []
    for (wf, cf), way in ((p, w) for p in pairs for w in ways):
        name = f"{wf}/{cf}" + (f" {way}" if len(ways) > 1 else "")
        for k in fit:
            width = k + 1
            m = DecodeModel(packed[wf], cf, max_batch=batch, capacity=cap, shared_cache=caches[cf], backend=backend,
                            device=device, max_rows=batch * width)
            if backend == "kernels":
                m.ops.block_attention = way
            blocks = blocks_for(batch, context, k, cfg.vocab_size)
            if backend == "kernels":
                from futx.engine.graphs import BlockGraphs

                g = BlockGraphs(m, width, buckets=[batch], widths=[width], max_requests=batch)
                m.load_blocks(blocks, width, batch)
                fn = g.graphs[(batch, width)].replay
            else:
                step = m.load_blocks(blocks, width, batch)
                fn = (lambda m=m, step=step: m.step(step.rows, step.width))
            keep.append(m)
            cands[(name, k)] = fn
    t = timer({f"{name} k={k}": fn for (name, k), fn in cands.items()})
    for name, k in cands:
        r = t[f"{name} k={k}"]
        base = t.get(f"{name} k=0")
        point["rows"].append({"candidate": name, "k": k, "rows": batch * (k + 1), "ms": r["ms"],
                              "spread": r["spread"], "vs_k0": r["ms"] / base["ms"] if base else None,
                              "tokens_per_s_all_accepted": batch * (k + 1) / r["ms"] * 1e3})
    return point


def render(results: dict) -> str:
    lines = [f"verify step, {results['shape']} ({results['layers']} layers), {results['gpu']}, {results['date']}", "",
             "| B | context | weights/cache | k | rows | ms / verification | vs k = 0 | tokens/s if all accepted |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for pt in results["points"]:
        for r in pt["rows"]:
            vs = f"{r['vs_k0']:.2f}x" if r["vs_k0"] is not None else "–"
            lines.append(f"| {pt['batch']} | {pt['context']} | {r['candidate']} | {r['k']} | {r['rows']} | "
                         f"{r['ms']:.3f} | {vs} | {r['tokens_per_s_all_accepted']:.0f} |")
        if pt["skipped"]:
            lines.append(f"| {pt['batch']} | {pt['context']} | – | {','.join(map(str, pt['skipped']))} | > {MAX_BATCH} "
                         "| skipped: more rows than one step holds | – | – |")
    return "\n".join(lines)


def run(a, timer: Optional[Callable[[dict], dict]] = None, backend: str = "kernels", device="cuda") -> dict:
    """futx bench decode --speculative: every point, written (--out/--md) as bench_engine.save does."""
    import torch

    from futx import atomic
    from futx.engine import random_packed

    from scripts.bench_engine import Timer, config_for

    if backend == "kernels" and not torch.cuda.is_available():
        raise SystemExit("futx bench decode --speculative needs a CUDA GPU")
    cfg = config_for(a.shape, a.layers) if isinstance(a.shape, str) else a.shape
    pairs = [(wf, cf) for wf in a.weights for cf in a.cache]
    timer = timer or Timer(a.reps, a.rounds).run
    wfs = list(dict.fromkeys(wf for wf, _ in pairs))
    packed = {wf: random_packed(cfg, wf, seed=i, device=device) for i, wf in enumerate(wfs)}
    for wf in wfs[1:]:
        packed[wf].embed, packed[wf].lm_head = packed[wfs[0]].embed, packed[wfs[0]].lm_head
    results = {"gpu": torch.cuda.get_device_name() if backend == "kernels" else "cpu (emulated)",
               "torch": torch.__version__, "shape": cfg.name, "layers": cfg.num_hidden_layers,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
               "speculative": True, "num_draft": list(a.num_draft), "points": []}
    import json

    for batch, context in a.points:
        with torch.inference_mode():
            point = measure_point(packed, cfg, batch, context, a.num_draft, pairs, timer, backend, device,
                                  getattr(a, "block_attention", None) or ("kernel",))
        results["points"].append(point)
        for r in point["rows"]:
            vs = f"  {r['vs_k0']:.2f}x k=0" if r["vs_k0"] is not None else ""
            print(f"B={batch:3d} ctx={context:5d} {r['candidate']:10s} k={r['k']} ({r['rows']:2d} rows) "
                  f"{r['ms']:8.3f} ms{vs}  {r['tokens_per_s_all_accepted']:9.0f} tok/s if all accepted", flush=True)
        if point["skipped"]:
            print(f"B={batch:3d} ctx={context:5d} k={point['skipped']} skipped: more than {MAX_BATCH} rows", flush=True)
        if a.out:
            atomic.write_text(a.out, json.dumps(results, indent=1))
        if backend == "kernels":
            torch.cuda.empty_cache()
    md = render(results)
    print(md)
    if a.md:
        atomic.write_text(a.md, md + "\n")
    return results
