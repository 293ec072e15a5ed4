"""The ring layer's structure in the schedule simulator (issue 29 planning, CPU): decode.persistent_schedule's task
graph of the 8B layer at one row (the kernel's form: fused norms, every split), each task's duration from what the
H200 measured for the ring layer (docs/persistent.md, "Why the ring layer is slow"): a projection task streams its
stages at its CTA's share of 4.36 TB/s with the ring's 13 stages in flight before its wait, plus a fixed cost per
task; an attention partial and a combine their measured busy times; a counter seen 1.34 µs after its last
increment. Calibrated against the `.nm` diagnostic (no unit arithmetic: 46.6 µs a layer), it then prices what a
rebuilt layer would change: wider projection tasks, a cheaper task end, a shorter attention chain.

    python scripts/ring_layer_model.py [--context 1024] [--json FILE]
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

US = 1e-6
MEASURED = dict(task_us=0.6, partial_us=5.2, combine_us=1.7, handoff_us=1.34)   # the ring's `.nm` trace, H200
RING_BYTES = 13 * (8192 + 256)                                                   # the ring's stages in flight


def layer_us(context: int, widths: int = 16, task_us: float = MEASURED["task_us"],
             partial_us: float = MEASURED["partial_us"], combine_us: float = MEASURED["combine_us"],
             handoff_us: float = MEASURED["handoff_us"], splits=None) -> tuple:
    """(makespan of one layer in µs, its bytes floor in µs) in the simulator under these costs."""
    from decode import persistent_schedule as ps
    from futx.config import preset

    cfg = preset("llama-3.1-8b")
    model = ps.Model(task_s=task_us * US, handoff_s=handoff_us * US, prefetch_bytes=RING_BYTES)
    w = {k: widths for k in ("qkv", "o", "gate_up", "down")}
    sched = ps.make_schedule(cfg, 1, context, widths=w, model=model, fused_norm=True, every_split=True,
                             splits=splits, ctas=ps.SMS)
    dur, _ = model.times(sched.graph, sched.ctas)
    fixed = {"attn_partial": partial_us * US, "attn_combine": combine_us * US}
    durations = {t.id: fixed.get(t.kind, dur[t.id]) for t in sched.graph.tasks}
    res = ps.simulate(sched, durations)
    return res.makespan / US, ps.floor_s(sched.graph) / US


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []

    def row(name, **kw):
        span, floor = layer_us(a.context, **kw)
        rows.append(dict(case=name, layer_us=span, floor_us=floor, **kw))
        print(f"  {name:58s} {span:6.1f} µs  ({100 * floor / span:3.0f}% of the {floor:.1f} µs floor)", flush=True)

    print(f"8B layer, one row at context {a.context}, 132 CTAs, the ring's measured costs {MEASURED}:")
    row("as measured (16-channel tasks)")
    row("no task cost", task_us=0.0)
    row("no hand-off cost", handoff_us=0.0)
    for w in (32, 64, 128):
        row(f"{w}-channel tasks", widths=w)
    row("attention partial 2 µs, combine 0.5 µs", partial_us=2.0, combine_us=0.5)
    row("64-channel tasks, task 0.3 µs, partial 2 µs, combine 0.5", widths=64, task_us=0.3, partial_us=2.0,
        combine_us=0.5)
    row("the same, hand-off 0.5 µs", widths=64, task_us=0.3, partial_us=2.0, combine_us=0.5, handoff_us=0.5)
    if a.json:
        Path(a.json).write_text(json.dumps({"measured": MEASURED, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
