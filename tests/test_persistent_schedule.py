"""CPU checks of the persistent decode kernel's plan (decode/persistent_schedule.py, issue 29): for every layer shape
decode serves, every row count and a few contexts, the task graph is acyclic, each output tile is written once,
counter targets count their producers, and the per-CTA lists neither deadlock nor read before a write, simulated
on several CTA counts; wrong plans are reported with the tasks named."""

from __future__ import annotations

import random

import pytest

from decode import persistent_schedule as ps
from futx.config import PRESETS, preset
from futx.engine.packed import default_group_size

# one preset per distinct layer shape decode serves (head dim 64 / 128, GQA group <= 8): llama-3.1-8b is layer-8b
SHAPES = {}
for _name, _cfg in PRESETS.items():
    _key = (_cfg.hidden_size, _cfg.intermediate_size, _cfg.num_attention_heads, _cfg.num_key_value_heads,
            _cfg.head_dim)
    if _cfg.head_dim in (64, 128) and _cfg.group_size <= 8:
        SHAPES.setdefault(_key, _name)
SHAPES = sorted(SHAPES.values())
CONTEXTS = (1, 63, 64, 1025, 8191)
CTAS = (1, 7, 132, 264)


def _graph(name, m, context, **kw):
    cfg = preset(name)
    return ps.build_graph(cfg, m, context, group_size=default_group_size(cfg), **kw)


def test_the_supported_shapes_are_the_ones_decode_serves():
    assert SHAPES == ["layer-1b", "layer-70b", "layer-8b", "smollm2-135m"]   # layer-405b: group 16


@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("name", SHAPES)
def test_graph_counters_and_simulated_lists(name, m):
    for i, context in enumerate(CONTEXTS):
        g = _graph(name, m, context)
        ps.check_outputs(g)   # every handed-on tile written exactly once (build_graph runs it too)
        signalers, counted = {}, set()
        for t in g.tasks:   # producers come sorted: the last is the highest numbered
            assert all(g.producers[r][-1] < t.id for r in t.reads if g.producers[r]), f"{t.name}: a cycle"
            for k in t.signals:
                signalers.setdefault(k, []).append(t.id)
        for t in g.tasks:
            assert len(t.waits) <= 1 and len(t.signals) <= 2
            for k, target in t.waits:  # one layer: the target is the number of tasks that count on the counter
                assert target == len(signalers[k]) == len(g.counters[k].generations[0])
                if k not in counted:   # the counted tasks are producers of what the (first) waiter reads
                    counted.add(k)
                    assert g.deps(t) >= set(signalers[k]), t.name
            assert t.waits or t.kind == "row_factor"
        per_head = 2 + (m if g.splits > 1 and max(g.contexts) > g.tile_tokens else 0)
        assert len(g.counters) <= g.config.num_key_value_heads * per_head + 5
        # one CTA count per context, all four over the loop (each context meets each count over the Ms)
        s = ps.assign(g, CTAS[(i + m) % len(CTAS)])
        r = ps.check(s)   # simulates: raises on deadlock or a read before its writer ends
        assert r.makespan >= ps.floor_s(g) * (1 - 1e-9), "faster than the bytes allow"
        assert all(g.tasks[i].id == i for i in range(len(g.tasks)))
        assert all(ps.list_order(g.tasks[a]) < ps.list_order(g.tasks[b]) for lst in s.lists for a, b in zip(lst, lst[1:]))
        assert sum(len(lst) for lst in s.lists) == len(g.tasks)


@pytest.mark.parametrize("name", SHAPES)
def test_static_verification(name):
    """Any durations: reads ordered after their writers through the counters, cumulative targets exact, no
    deadlock, and the physical buffers (in-place residual, one scratch per kind) free of races."""
    ps.verify(ps.assign(_graph(name, 3, 1025), 7))
    if name in ("layer-1b", "smollm2-135m"):   # across layers (the scratch reused, cumulative targets): the small ones
        ps.verify(ps.assign(_graph(name, 3, 64, layers=2, head=True), 132))


def test_a_whole_step_reuses_the_layer_counters_with_cumulative_targets():
    one, step = _graph("smollm2-135m", 2, 1025), _graph("smollm2-135m", 2, 1025, layers=3, head=True)
    assert len(step.counters) == len(one.counters) + 1          # + the down output feeding the next row factor
    rf = next(t for t in step.tasks if t.kind == "qkv").waits[0][0]
    head = [t for t in step.tasks if t.kind == "lm_head"]
    assert {t.waits[0] for t in head} == {(rf, 4)}                # the final norm is the 4th row factor counted
    for t in step.tasks:
        for k, target in t.waits:
            assert target == step.counters[k].target(t.layer)
    s = ps.assign(step, 264)
    ps.check(s)
    ps.verify(s)


def test_random_durations_never_deadlock_nor_read_early():
    s = ps.assign(_graph("llama-3.1-8b", 2, 1025), 132)
    for seed in range(3):
        rng = random.Random(seed)
        ps.check(s, ps.simulate(s, durations=lambda t: rng.uniform(0.0, 5e-6)))
    ps.check(s, ps.simulate(s, durations={t.id: 1e-6 for t in s.graph.tasks}))


def test_per_row_contexts():
    g = _graph("layer-1b", 3, (1, 8191, 64))
    partials = [t for t in g.tasks if t.kind == "attn_partial" and t.args[1] == 0]
    assert [sum(t.args[0] == r for t in partials) for r in range(3)] == [1, g.splits, 2]   # 64 tokens: 2 tiles
    ps.check(ps.assign(g, 132))


def test_default_machine_and_model_defaults():
    s = ps.make_schedule(PRESETS["layer-1b"], 2, 64)
    assert s.ctas == ps.SMS * ps.CTAS_PER_SM == 264 and s.model == ps.Model()
    assert ps.PREFETCH_BYTES == 16 * 1024   # the tile GEMV's first batch: 8 warps x 2 units of 1 KB


def test_a_consumer_before_its_producer_on_one_cta_is_a_deadlock():
    s = ps.assign(_graph("smollm2-135m", 1, 63), 1)
    lst = s.lists[0]
    qkv = next(i for i in lst if s.graph.tasks[i].kind == "qkv")
    bad = ps.Schedule(s.graph, [[qkv] + [i for i in lst if i != qkv]])
    with pytest.raises(ps.Deadlock, match=r"CTA 0 runs L0 qkv\[0:16\].*needs L0 row_factor, queued behind L0 qkv"):
        ps.simulate(bad)
    with pytest.raises(AssertionError, match="against the lists. topological order"):
        ps.verify(bad)


def test_a_cycle_across_two_ctas_is_named():
    g = _graph("smollm2-135m", 1, 63)
    kind = {t.id: t.kind for t in g.tasks}
    rf2 = next(i for i in kind if kind[i] == "row_factor2")
    gate_up = next(i for i in kind if kind[i] == "gate_up")
    qkv = [i for i in kind if kind[i] == "qkv"]
    rest = [i for i in kind if i not in (rf2, gate_up, qkv[-1])]
    # CTA 1 runs a gate/up block (needs row_factor2) before the last QKV block that CTA 0's attention needs
    with pytest.raises(ps.Deadlock) as err:
        ps.simulate(ps.Schedule(g, [rest + [rf2], [gate_up, qkv[-1]]]))
    assert {c for c, _ in err.value.cycle} == {0, 1}
    assert "L0 gate_up[0:16]" in str(err.value) and f"L0 qkv[{g.tasks[qkv[-1]].args[0]}:" in str(err.value)


def test_check_catches_a_missing_wait():
    s = ps.assign(_graph("smollm2-135m", 1, 63), 7)
    for t in s.graph.tasks:
        if t.kind == "qkv":
            t.waits = []
    slow_norm = {t.id: (5e-6 if t.kind == "row_factor" else 1e-7) for t in s.graph.tasks}
    with pytest.raises(AssertionError, match=r"L0 qkv\[\d+:\d+\] reads rf0.*before L0 row_factor writes it"):
        ps.check(s, ps.simulate(s, durations=slow_norm))


def test_verify_catches_a_racy_buffer_layout():
    s = ps.assign(_graph("smollm2-135m", 2, 63), 7)

    def act_in_the_residual(buf, layer):   # the SwiGLU output would overwrite hmid while gate/up still reads it
        return ("x", 0) if buf == "act" else ps.physical(buf, layer)
    with pytest.raises(AssertionError, match=r"L0 gate_up\[0:16\] overwrites act0.*while L0 gate_up.*hmid0"):
        ps.verify(s, act_in_the_residual)


    def attn_over_qkv(buf, layer):   # safe: a head's output lands on the Q columns only its own attention read
        return ("qkv", 0) if buf == "attn" else ps.physical(buf, layer)
    ps.verify(s, attn_over_qkv)


def test_bad_input_is_named():
    cfg = PRESETS["llama-3.1-8b"]
    for m in (0, 9):
        with pytest.raises(ValueError, match=f"M = {m}"):
            ps.build_graph(cfg, m, 64)
    with pytest.raises(ValueError, match="head dim 96"):
        ps.build_graph(cfg.replace(head_dim=96), 1, 64)
    with pytest.raises(ValueError, match="GQA group 16"):
        ps.build_graph(PRESETS["layer-405b"], 1, 64)
    with pytest.raises(ValueError, match="context 0"):
        ps.build_graph(cfg, 1, 0)
    with pytest.raises(ValueError, match="2 contexts for M = 3"):
        ps.build_graph(cfg, 3, (5, 6))
    with pytest.raises(ValueError, match="down tile width 24"):
        ps.build_graph(cfg, 1, 64, widths={"down": 24})
    with pytest.raises(ValueError, match="K = 576 is not a multiple of the INT4 group size 128"):
        ps.build_graph(PRESETS["smollm2-135m"], 1, 64)
    with pytest.raises(ValueError, match="ctas must be a positive integer, got 0"):
        ps.assign(ps.build_graph(cfg, 1, 64), 0)
    with pytest.raises(ValueError, match="exactly one CTA"):
        ps.Schedule(ps.build_graph(PRESETS["layer-1b"], 1, 64), [[0]])


def test_wider_tiles_move_the_edges_with_them():
    g = _graph("layer-1b", 2, 1025, widths={"qkv": 48, "o": 64, "gate_up": 96, "down": 32})
    ps.check(ps.assign(g, 7))
    straddling = [t for t in g.tasks if t.kind == "qkv" and len(t.signals) > 1]
    assert straddling, "48-row QKV tiles straddle 64-channel heads and count for both"


def test_bytes_and_the_layer_floor_match_the_project():
    """docs/results.md: the 8B layer's four INT4 projections have a 25.8 us floor at 4.36 TB/s (g128: half a
    byte per weight and an fp16 scale per 128)."""
    g = _graph("llama-3.1-8b", 1, 1024)
    by_kind = ps.bytes_by_kind(g)
    for proj, (n, k) in g.config.projection_shapes().items():
        assert by_kind[proj] == n * k // 2 + n * k // 128 * 2
    assert by_kind["attn_partial"] == 8 * 1024 * (64 + 64 + 8)   # INT4 K and V rows and their f32 scales
    assert abs(ps.projection_floor_s(g) * 1e6 - 25.8) < 0.05
    step = _graph("smollm2-135m", 1, 64, head=True)
    assert ps.bytes_by_kind(step)["lm_head"] == 49152 * 576 * 2


def test_task_table_layout():
    s = ps.assign(_graph("smollm2-135m", 2, 1025, layers=2, head=True), 7)
    table = ps.task_table(s)
    assert table.shape == (7, max(map(len, s.lists)) + 1, len(ps.FIELDS))
    f = {name: i for i, name in enumerate(ps.FIELDS)}
    for c, lst in enumerate(s.lists):
        rows = table[c].tolist()
        assert rows[len(lst)][f["kind"]] == -1
        for i, row in zip(lst, rows):
            t = s.graph.tasks[i]
            assert ps.KINDS[row[f["kind"]]] == t.kind and row[f["layer"]] == t.layer
            assert row[f["a0"]:f["a0"] + len(t.args)] == list(t.args)
            waits = [(row[f["wait0"]], row[f["target0"]]), (row[f["wait1"]], row[f["target1"]])]
            assert [w for w in waits if w[0] >= 0] == t.waits
            assert [x for x in (row[f["signal0"]], row[f["signal1"]]) if x >= 0] == t.signals


def test_restated_constants_agree_with_their_sources():
    from futx.quant import layouts
    assert ps.CHANNELS == layouts.INT4_WEIGHT.block_n
    pytest.importorskip("cutlass")
    from decode import dequant, gemv_tile
    assert dequant.BLOCK_N == ps.CHANNELS and gemv_tile.DEFAULT_PREFETCH == ps.PREFETCH_UNITS


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("context", [1, 64, 1025])
def test_the_kernel_form_fuses_the_norms_and_lists_every_split(context, m):
    """build_graph(fused_norm=True, every_split=True), the table the layer kernel runs (futx.engine.persistent) for
    1, 3 and 8 rows: no row-factor tasks in the layers (QKV waits on the previous layer's down blocks directly), all
    `splits` partials of every (row, head) whatever the context, each reading the head's new K/V columns (the kernel
    picks at run time which holds the token), and still race- and deadlock-free across layers."""
    g = _graph("layer-1b", m, context, layers=2, splits=4, fused_norm=True, every_split=True)
    kinds = {t.kind for t in g.tasks}
    assert "row_factor" not in kinds and "row_factor2" not in kinds
    partials = [t for t in g.tasks if t.kind == "attn_partial"]
    assert len(partials) == 2 * m * g.config.num_key_value_heads * 4 and all(t.args[3] == 4 for t in partials)
    assert {t.args[0] for t in partials} == set(range(m))
    assert all(any(r.buf == "qkv" and r.c0 >= g.config.q_size for r in t.reads) for t in partials)
    assert sum(t.kind == "attn_combine" for t in g.tasks) == 2 * m * g.config.num_key_value_heads
    qkv1 = next(t for t in g.tasks if t.kind == "qkv" and t.layer == 1)
    (counter, target), = qkv1.waits
    assert {g.tasks[p].kind for p in g.counters[counter].generations[1]} == {"down"}
    s = ps.assign(g, 7)
    ps.check(s)
    ps.verify(s)
    unfused = _graph("layer-1b", m, context, layers=2, splits=4, every_split=True)
    assert len(g.counters) < len(unfused.counters)   # the row factors' counters are gone
