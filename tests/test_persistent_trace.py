"""The ring layer's task trace summary (futx.engine.persistent_trace) on the CPU: a trace laid out as the traced
kernel writes it, from the schedule simulator's start / ready / end times, reads back as those times per kind and
layer; traces that did not come from a traced run, or that go backwards, are refused."""

import pytest
import torch

from decode import persistent_schedule as ps
from decode.persistent_host import TRACE_FIELDS
from futx.config import preset
from futx.engine.persistent_trace import report, summarize


def _traced(layers=2, ctas=6):
    sched = ps.make_schedule(preset("layer-1b"), 1, 300, layers=layers, ctas=ctas, splits=4, fused_norm=True,
                             every_split=True)
    table = ps.task_table(sched)
    sim = ps.simulate(sched)
    trace = torch.full((*table.shape[:2], len(TRACE_FIELDS)), -1, dtype=torch.int64)
    for c, lst in enumerate(sched.lists):
        for j, i in enumerate(lst):
            trace[c, j, 0] = round(sim.start[i] * 1e9) + 1000   # ns, as the global timer
            trace[c, j, 1] = round(sim.ready[i] * 1e9) + 1000
            trace[c, j, 2] = round(sim.end[i] * 1e9) + 1000
            if sched.graph.tasks[i].kind in ("qkv", "o", "gate_up", "down"):
                trace[c, j, 3] = round(sim.start[i] * 1e9) + 1000
    return sched, sim, table, trace


def test_summary_reads_back_the_simulated_times():
    sched, sim, table, trace = _traced()
    s = summarize(table, trace)
    tasks = sched.graph.tasks
    assert s["tasks"] == len(tasks) and len(s["layers"]) == 2
    assert s["span_us"] == pytest.approx(sim.makespan * 1e6, abs=0.01)
    for name in ("qkv", "attn_partial", "o", "gate_up", "down"):
        mine = [t.id for t in tasks if t.kind == name]
        busy = sum(sim.end[i] - sim.ready[i] for i in mine) * 1e6
        assert s["kinds"][name]["busy"]["n"] == len(mine)
        assert s["kinds"][name]["busy"]["sum_us"] == pytest.approx(busy, abs=0.01 * len(mine))
    assert "lead" in s["kinds"]["qkv"] and "lead" not in s["kinds"]["attn_partial"]
    for lay in s["layers"]:   # the layer's phases in dependency order
        ph = lay["phases_us"]
        assert ph["qkv"][0] <= ph["attn_partial"][0] <= ph["o"][0] <= ph["gate_up"][0] <= ph["down"][0]
        assert ph["o"][0] >= ph["attn_partial"][1] - 1e-3   # O waits for all attention
        assert ph["down"][0] >= ph["gate_up"][1] - 1e-3
    text = report(s)
    assert "gate_up" in text and "layer span" in text


def test_summary_refuses_a_trace_that_did_not_run():
    _, _, table, trace = _traced()
    with pytest.raises(ValueError, match="no timestamps"):
        summarize(table, torch.full_like(trace, -1))
    bad = trace.clone()
    bad[0, 0, 2] = bad[0, 0, 1] - 5
    with pytest.raises(ValueError, match="backwards"):
        summarize(table, bad)
    with pytest.raises(ValueError, match="does not match"):
        summarize(table, trace[:, :, :3])


def test_ring_layer_model_prices_the_measured_costs():
    """scripts/ring_layer_model.py: the simulator under the ring's measured costs gives a layer above its bytes floor,
    and taking a cost away never makes it longer."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import ring_layer_model as rlm

    span, floor = rlm.layer_us(1024)
    assert 25.0 < floor < 27.0 and span > floor
    assert rlm.layer_us(1024, task_us=0.0)[0] <= span
    assert rlm.layer_us(1024, handoff_us=0.0)[0] <= span
    assert rlm.layer_us(1024, partial_us=2.0, combine_us=0.5)[0] <= span
