"""The ring layer's tuning space on the GPU (issue 29): the 8B step (or --shape) at each --points (batch x context,
INT4 weights and cache) on the shipped step, the routed ring layer and its tuning-space variants
(futx.runtime.catalog.persistent.RING_TUNING: "la" the consumers one stage ahead, "s4" / "s8" shallower rings, "ew"
an epilogue warp, "g2" / "g4" stage groups, "nm" the diagnostic without the units' arithmetic), one
CUDA graph each over one model and cache, replays interleaved in one process; median ms per step and fraction of
the bytes floor. What it decides: the ring kernel's routed form (docs/persistent.md).

    python scripts/bench_ring_variants.py [--shape llama-3.1-8b] [--points 1x1024,8x1024] [--variants la,s4,s8]
                                          [--json FILE]
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from futx.runtime.catalog.persistent import RING_DIAGNOSTIC, RING_TUNING

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--points", default="1x1024,8x1024", help="comma-separated BATCHxCONTEXT, batch 1..8")
    p.add_argument("--variants", default=",".join(RING_TUNING), help=f"of {sorted(RING_TUNING)}")
    p.add_argument("--reps", type=int, default=20, help="graph replays per timed round")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (the median is reported)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in RING_TUNING]
    if bad:
        p.error(f"unknown variants {bad}; the ring's are {sorted(RING_TUNING)}")
    points = [tuple(int(x) for x in s.split("x")) for s in a.points.split(",")]
    import torch

    if not torch.cuda.is_available():
        print("bench_ring_variants: needs a CUDA GPU")
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tuning_space

    from futx.engine.graphs import GraphSteps
    from futx.engine.persistent import PersistentStep
    from scripts.bench_engine import HBM_BYTES_PER_S, Timer, replaying_model, step_bytes

    tuning_space.register()
    rows = []
    for batch, context in points:
        cfg, m, shipped = replaying_model(a.shape, "int4", "int4", batch, context)
        cands, keep = {"shipped": lambda g=shipped: g.replay(batch)}, []
        for v in ["", *variants]:
            m.persistent = PersistentStep(m, body="ring", variant=v, diagnostic=v in RING_DIAGNOSTIC)
            g = GraphSteps(m, buckets=[batch])
            keep.append((m.persistent, g))
            cands["ring" + (f".{v}" if v else "")] = lambda g=g: g.replay(batch)
        m.persistent = None
        floor = step_bytes(m, batch, context) / HBM_BYTES_PER_S * 1e3
        res = Timer(a.reps, a.rounds).run(cands)
        print(f"{cfg.name} {batch} x {context} (INT4 weights and cache; bytes floor {floor:.3f} ms; "
              f"{torch.cuda.get_device_name()}):")
        for name, r in res.items():
            note = "  (diagnostic: no unit arithmetic, wrong outputs)" if name.split(".")[-1] in RING_DIAGNOSTIC else ""
            print(f"  {name:12s} {r['ms']:7.3f} ms  ({100 * floor / r['ms']:4.1f}% of the floor, spread "
                  f"{100 * r['spread']:.1f}%){note}", flush=True)
            rows.append(dict(shape=cfg.name, batch=batch, context=context, candidate=name, floor_ms=floor, **r))
        del keep, shipped, m
        torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
