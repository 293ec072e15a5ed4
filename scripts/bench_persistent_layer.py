"""A decode layer's four INT4 projections at M = 1 (8B shape): one persistent launch of the layer's task table
(decode/persistent_layer.py: the tile GEMV's bodies ordered by counters; attention tasks only wait and signal)
against the four standalone tile GEMV launches with programmatic dependent launch, each as a CUDA graph replayed
back to back, interleaved (bench_engine's Timer), median of --rounds. Floor: the projections' INT4 bytes / 4.36 TB/s (25.8 us for the
8B layer). What it answers (issue 29): how much of the 37.4 us the projections take in today's step is launch
boundaries that counters remove.

  python scripts/bench_persistent_layer.py [--shape llama-3.1-8b] [--copies 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def standalone(lw, h, attn, eps, outs=None):
    """The four projections as standalone tile GEMV launches (the persistent kernel's variants: 8 warps, the
    fused norm on QKV and gate/up) -> (qkv, hmid, act, h_out); into `outs` when given, else into new
    NaN-poisoned tensors."""
    import torch

    from decode import plan
    from decode.persistent_host import LAYER_WARPS as WARPS
    from futx.runtime import get_kernel

    shapes = (lw.qkv.shape[0], lw.o.shape[0], lw.gateup.shape[0] // 2, lw.down.shape[0])
    if outs is None:
        outs = [torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda") for n in shapes]

    def run(epilogue, norm, x, w, r, y):
        get_kernel(plan.tile_key("int4", 128, epilogue, WARPS, norm=norm))(
            x, w.packed, w.scales, r, y, *((eps,) if norm else ()))
        return y

    qkv = run("store", True, h, lw.qkv, None, outs[0])
    hmid = run("residual", False, attn, lw.o, h, outs[1])
    act = run("swiglu", True, hmid, lw.gateup, None, outs[2])
    return qkv, hmid, act, run("residual", False, act, lw.down, hmid, outs[3])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--copies", type=int, default=16, help="layers per graph replay (back to back)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--json", default=None)
    p.add_argument("--once", action="store_true", help="run each candidate a few times eagerly and stop (for Nsight "
                   "Compute: scripts/gpu/persistent.sh ncu)")
    a = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench_persistent_layer: needs a CUDA GPU")
        return 2
    import tuning_space

    from decode.persistent_schedule import HBM_BYTES_PER_S, make_schedule, projection_floor_s, task_table
    from futx.config import PRESETS
    from futx.engine.packed import random_packed
    from futx.runtime import get_kernel
    from scripts.bench_engine import Timer, graph_of

    tuning_space.register()
    cfg = PRESETS[a.shape].replace(num_hidden_layers=1)
    lw = random_packed(cfg, "int4", device="cuda").layers[0]
    h = torch.randn(1, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    attn = torch.randn(1, cfg.q_size, device="cuda").to(torch.bfloat16)
    eps = cfg.rms_norm_eps
    outs = [torch.empty_like(t) for t in standalone(lw, h, attn, eps)]
    mine = [torch.empty_like(t) for t in outs]
    cands = {"standalone (4 launches, PDL)": lambda: standalone(lw, h, attn, eps, mine)}
    floor_us = None
    for c in (1, 2):
        sched = make_schedule(cfg, 1, 1024, ctas=132 * c)
        floor_us = projection_floor_s(sched.graph, HBM_BYTES_PER_S) * 1e6
        table = task_table(sched).cuda()
        counters = torch.zeros(len(sched.graph.counters), dtype=torch.int32, device="cuda")
        k = get_kernel("decode.persistent.projections.m1" + ("" if c == 1 else f".c{c}"))

        def persistent(k=k, table=table, counters=counters):
            counters.zero_()
            k(table, counters, h, lw.qkv.packed, lw.qkv.scales, outs[0], attn, lw.o.packed, lw.o.scales, outs[1],
              lw.gateup.packed, lw.gateup.scales, outs[2], lw.down.packed, lw.down.scales, outs[3], eps)
        cands[f"persistent, {132 * c} CTAs ({c} per SM)"] = persistent

    torch.cuda.synchronize()
    if a.once:
        for fn in cands.values():
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        return 0
    stream = torch.cuda.Stream()
    graphs = {name: graph_of(fn, stream, a.copies) for name, fn in cands.items()}
    times = Timer(1, a.rounds).run({name: g.replay for name, g in graphs.items()})
    us = {n: t["ms"] * 1e3 / a.copies for n, t in times.items()}
    rows = [{"candidate": n, "us": u, "of_floor": floor_us / u} for n, u in us.items()]
    for r in rows:
        print(f"{r['candidate']:40s} {r['us']:7.2f} us per layer's projections ({100 * r['of_floor']:.0f}% of the "
              f"{floor_us:.1f} us floor)", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": a.shape,
                                            "floor_us": floor_us, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
