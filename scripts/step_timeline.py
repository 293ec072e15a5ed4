"""Where a decode step's time goes on the GPU: the kernels of one CUDA-graph replay of the engine's step, traced with
the PyTorch profiler (CUPTI), as a timeline: the step's span, the time some kernel runs (the union of their
intervals), the idle time between them, how much consecutive kernels overlap (programmatic dependent launch), and
the busy time per kind of kernel. Random weights and cache, every row at position context - 1.

    python scripts/step_timeline.py [--shape llama-3.1-8b] [--batch 1] [--context 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# kernel name -> kind (the first pattern that matches; CuTe DSL kernel names carry their class names)
KINDS = (("rms+qkv / rms+gate-up (tile GEMV, fused norm)", r"GemvTileNorm"),
         ("o / down (tile GEMV, residual)", r"GemvTile"),
         ("attention", r"DecodeAttention"),
         ("persistent layer", r"PersistentLayer"),
         ("persistent ring layer", r"RingLayer"),
         ("other futx GEMV / skinny (at M = 1: the LM head)", r"[Gg]emv|Skinny"),
         ("argmax (futx kernel, rule E7)", r"ArgmaxRows"),
         ("torch (embedding, copies, argmax)", r"."))
SPLIT_GAP_US = 20.0   # replays are synchronized apart: a longer gap starts the next step


def kind_of(name: str) -> str:
    return next(k for k, pat in KINDS if re.search(pat, name))


def steps_of(events: list) -> list:
    """Kernel events [(start us, end us, name)] sorted, split into steps at gaps > SPLIT_GAP_US."""
    steps, cur, end = [], [], 0.0
    for e in sorted(events):
        if cur and e[0] - end > SPLIT_GAP_US:
            steps.append(cur)
            cur = []
        end = max(end, e[1]) if cur else e[1]
        cur.append(e)
    if cur:
        steps.append(cur)
    return steps


def analyse(step: list) -> dict:
    """Span, busy (union), idle, overlap and busy time per kind of one step's kernels."""
    span = max(e[1] for e in step) - step[0][0]
    busy, cur_s, cur_e = 0.0, None, None
    for s, e, _ in step:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    total = sum(e - s for s, e, _ in step)
    per_kind: dict = {}
    per_name: dict = {}
    for s, e, n in step:
        k = kind_of(n)
        per_kind[k] = per_kind.get(k, 0.0) + (e - s)
        per_name[n[:100]] = per_name.get(n[:100], 0.0) + (e - s)
    gaps, end = [], step[0][1]
    for s, e, _ in step[1:]:
        gaps.append(s - end)
        end = max(end, e)
    return {"kernels": len(step), "span_us": span, "busy_us": busy, "idle_us": span - busy,
            "overlap_us": total - busy, "idle_gaps": sum(1 for g in gaps if g > 0),
            "mean_idle_gap_us": statistics.mean([g for g in gaps if g > 0] or [0.0]),
            "kernel_us_by_kind": per_kind, "kernel_us_by_name": per_name}


def timeline_rules(a: argparse.Namespace) -> dict:
    """KernelOps attributes of the traced step: the rules asked for (several: the bench's union candidate, the last),
    all off with --rules-off, else none (as routed)."""
    from scripts.bench_engine import RULES_OFF, engine_rules

    if a.rules_off:
        return {k: v for off in RULES_OFF.values() for k, v in off.items()}
    named = engine_rules(a, a.batch)
    return named[-1][1] if named else {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--weights", default="int4")
    p.add_argument("--cache", default="int4")
    p.add_argument("--replays", type=int, default=7)
    p.add_argument("--persistent", action="store_true", help="the step (1..8 rows) on the persistent layer kernel")
    p.add_argument("--ring", action="store_true", help="the step (1..8 rows) on the persistent ring layer kernel "
                   "(decode/persistent_ring.py)")
    p.add_argument("--pdl-attention", action="store_true", help="the step's attention as a programmatic dependent "
                   "launch of its QKV projection (routing rule E5 on)")
    p.add_argument("--final-norm-kernel", action="store_true", help="the final RMSNorm as one kernel (rule E6 on)")
    p.add_argument("--argmax-kernel", action="store_true", help="the greedy argmax on futx's kernel (rule E7 on)")
    p.add_argument("--rules-off", action="store_true", help="rules E5, E6 and E7 off, whatever futx.engine.backends "
                   "routes (the step they are compared with)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.rules_off and (a.pdl_attention or a.final_norm_kernel or a.argmax_kernel):
        p.error("--rules-off turns off the rules --pdl-attention / --final-norm-kernel / --argmax-kernel turn on")
    import torch

    if not torch.cuda.is_available():
        print("step_timeline: needs a CUDA GPU")
        return 2
    from scripts.bench_engine import engine_rules, replaying_model

    persistent = "ring" if a.ring else a.persistent
    rules = timeline_rules(a)
    named = engine_rules(a, a.batch)
    named = named[:-1] if len(named) > 1 else named   # the rules asked for, for the label (not their union)
    cfg, m, g = replaying_model(a.shape, a.weights, a.cache, a.batch, a.context, persistent=persistent, rules=rules)
    for _ in range(3):
        g.replay(a.batch)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.replays):
            g.replay(a.batch)
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    events = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in trace["traceEvents"]
              if e.get("cat") == "kernel" and "dur" in e]
    steps = [analyse(s) for s in steps_of(events)]
    if not steps:
        print("step_timeline: no kernels traced")
        return 1
    best = sorted(steps, key=lambda s: s["span_us"])[len(steps) // 2]   # the median step
    out = {"device": torch.cuda.get_device_name(), "shape": cfg.name, "batch": a.batch, "context": a.context,
           "weights": a.weights, "cache": a.cache, "persistent": persistent, "rules": rules,
           "steps_traced": len(steps),
           "median_step": best, "spans_us": [s["span_us"] for s in steps]}
    label = {"ring": " persistent ring", True: " persistent"}.get(persistent, "") \
        + "".join(f" {n}" for n, _ in named)
    print(f"{cfg.name} ({a.weights}/{a.cache}) B={a.batch} ctx={a.context}{label}: "
          f"{best['kernels']} kernels, span {best['span_us']:.1f} us, kernels busy {best['busy_us']:.1f} us, "
          f"idle {best['idle_us']:.1f} us in {best['idle_gaps']} gaps (mean {best['mean_idle_gap_us']:.2f} us), "
          f"overlap {best['overlap_us']:.1f} us", flush=True)
    for k, v in best["kernel_us_by_kind"].items():
        print(f"  {k:48s} {v:9.1f} us", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
