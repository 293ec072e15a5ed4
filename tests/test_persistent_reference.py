"""The persistent decode layer's task semantics (futx/engine/persistent_reference.py, issue 29) against the engine:
the task table of decode.persistent_schedule, interpreted task by task on resident CTAs, computes the emulated
engine's decode step (hidden rows, logits, the new cache rows) for M = 1, 3, 8 rows, contexts 1..130 in one or
several splits, 1, 7 or many CTAs and any interleaving; broken tables are caught."""

from __future__ import annotations

import pytest
import torch

from decode import persistent_schedule as ps
from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.engine import DecodeModel, pack_model
from futx.engine.backends import fused_norm
from futx.engine.persistent_reference import ReadBeforeWrite, run_schedule, run_task_table, split_tiles

pytestmark = pytest.mark.usefixtures("single_thread")
# head dim 64 (a decode-attention size), GQA group 2; every K a multiple of 128, so INT4 g128 and the engine
# scales the outputs by the row factor at M <= 8 (the fused tile GEMV's form); glue="norm-kernel" the other form
CFG = tiny_config(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, num_hidden_layers=2, vocab_size=300)
F = {name: i for i, name in enumerate(ps.FIELDS)}
BF16_STEP = 2.0 ** -7   # a BF16 value's spacing relative to it is at most this


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=3)


@pytest.fixture(scope="module")
def packed(weights):
    return {fmt: pack_model(weights, fmt, progress=False) for fmt in ("int4", "e4m3")}


def _models(packed, m, contexts, *, cache="int4", glue="fused", n=2, seed=0, paged=False):
    """n emulated models with the same history in every layer (random K/V rows before each row's position),
    and the step's inputs: tokens, positions (context - 1) and distinct slots, not in row order. paged: a paged
    cache of 128-position pages, each slot's pages in random order."""
    models = [DecodeModel(packed, cache, max_batch=8, capacity=256, backend="emulated", device="cpu", glue=glue,
                          keep_logits=True, pages=16 if paged else None, page_size=128) for _ in range(n)]
    gen = torch.Generator().manual_seed(seed)
    if paged:
        pages = torch.randperm(16, generator=gen).view(8, 2).tolist()
        for model in models:
            for slot, own in enumerate(pages):
                model.cache.set_pages(slot, own)
    slots = torch.randperm(8, generator=gen)[:m].tolist()
    for layer in range(CFG.num_hidden_layers):
        for slot, ctx in zip(slots, contexts):
            if ctx > 1:
                k, v = (torch.randn(ctx - 1, CFG.num_key_value_heads, CFG.head_dim, generator=gen) for _ in "kv")
                for model in models:
                    model.cache.write_rows(layer, torch.full((ctx - 1,), slot), torch.arange(ctx - 1), k, v)
    tokens = torch.randint(0, CFG.vocab_size, (m,), generator=gen).tolist()
    return models, tokens, [c - 1 for c in contexts], slots


def _schedule(m, contexts, ctas, splits=None, cache="int4", layers=CFG.num_hidden_layers, head=True):
    return ps.make_schedule(CFG, m, contexts, layers=layers, head=head, ctas=ctas, splits=splits, cache=cache)


def _cache_tensors(model, layer):
    out = [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
           for t in model.cache.layers[layer].tensors() if t is not None]
    return out + list(model.cache.values[layer])


def _same_cache(a, b, layers):
    return all(torch.equal(x, y) for layer in layers
               for x, y in zip(_cache_tensors(a, layer), _cache_tensors(b, layer)))


def _bf16_close(got, want, what):
    """Within 4 BF16 steps of the values (or of their mean size): what a one-step change of some attention outputs
    (split-KV merging rounds differently, see futx/engine/persistent_reference.py) makes of the residual stream and
    logits two layers on (measured over 30 seeds of the multi-split cases: at most 2.2 steps). A rounding-level
    mistake elsewhere would pass here, not in the one-split cases, which must match bit for bit."""
    scale = want.float().abs().mean()
    torch.testing.assert_close(got.float(), want.float(), rtol=4 * BF16_STEP, atol=4 * BF16_STEP * scale,
                               msg=lambda m: f"{what}: {m}")


def _active(schedule):
    return max(t.args[3] for t in schedule.graph.tasks if t.kind == "attn_partial")


CASES = [   # M, contexts, CTAs, splits (None: decode attention's own count, one split at these contexts)
    (1, (1,), 1, None),
    (1, (130,), 7, 4),
    (3, (1, 63, 64), 7, None),
    (3, (63, 64, 130), 264, 4),
    (8, (1, 2, 63, 64, 65, 100, 129, 130), 264, 3),
    (8, (130,) * 8, 132, 5),
]


@pytest.mark.parametrize("m,contexts,ctas,splits", CASES)
def test_the_table_computes_the_engine_step(packed, m, contexts, ctas, splits):
    (engine, interp), tokens, positions, slots = _models(packed["int4"], m, contexts)
    engine.run(tokens, positions, slots)
    s = _schedule(m, contexts, ctas, splits)
    assert (_active(s) > 1) == (splits is not None)
    r = run_schedule(interp, s, tokens, positions, slots)
    assert len(r.order) == len(s.graph.tasks)
    assert r.counters == [ctr.target(s.graph.layers) for ctr in s.graph.counters]   # every producer counted once
    hidden, logits = engine.buffers.hidden[:m], engine.buffers.logits[:m]
    assert _same_cache(engine, interp, [0])   # layer 0's new K/V rows come before any attention output
    if _active(s) == 1:   # one softmax per (row, head), as the engine's: bit for bit
        assert torch.equal(r.hidden, hidden) and torch.equal(r.logits, logits)
        assert _same_cache(engine, interp, range(CFG.num_hidden_layers))
    else:                 # merged split partials: float32 rounding of the attention output
        _bf16_close(r.hidden, hidden, "hidden")
        _bf16_close(r.logits, logits, "logits")


@pytest.mark.parametrize("m", (1, 3, 8))
def test_the_row_factor_in_both_of_the_engines_forms(packed, m):
    """The engine scales the projection's float32 outputs by the row factor where the kernels fuse it (INT4 g128
    at M <= 8 here) and stores a normalized BF16 row first elsewhere (glue="norm-kernel"): the QKV and gate/up
    tasks follow it either way."""
    contexts = (64,) * m
    (engine, _), tokens, positions, slots = _models(packed["int4"], m, contexts)
    x = engine.packed.embed[torch.tensor(tokens)]
    assert fused_norm(x, engine.packed.layers[0].qkv, "store") and fused_norm(x, engine.packed.layers[0].gateup,
                                                                               "swiglu")
    (engine, interp), tokens, positions, slots = _models(packed["int4"], m, contexts, glue="norm-kernel")
    engine.run(tokens, positions, slots)
    r = run_schedule(interp, _schedule(m, contexts, 7), tokens, positions, slots)
    assert torch.equal(r.hidden, engine.buffers.hidden[:m]) and torch.equal(r.logits, engine.buffers.logits[:m])


@pytest.mark.parametrize("cache,paged", [("bf16", False), ("e4m3", False), ("int4", True)])
def test_other_cache_and_weight_formats(packed, cache, paged):
    """E4M3 weights, a BF16 cache (16-token attention tiles), an E4M3 mirror or a paged cache: the same
    equality."""
    m, contexts = 3, (5, 64, 130)
    (engine, interp), tokens, positions, slots = _models(packed["e4m3"], m, contexts, cache=cache, paged=paged)
    engine.run(tokens, positions, slots)
    r = run_schedule(interp, _schedule(m, contexts, 7, cache=cache), tokens, positions, slots)
    assert torch.equal(r.hidden, engine.buffers.hidden[:m]) and torch.equal(r.logits, engine.buffers.logits[:m])
    assert _same_cache(engine, interp, range(CFG.num_hidden_layers))


def test_one_layer_without_the_head_is_the_engines_layer(packed):
    m, contexts = 3, (1, 63, 130)
    (engine, interp), tokens, positions, slots = _models(packed["int4"], m, contexts)
    pos, slt = torch.tensor(positions, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32)
    want = engine.layer(0, engine.packed.embed[torch.tensor(tokens)], pos, slt)
    r = run_schedule(interp, _schedule(m, contexts, 7, layers=1, head=False), tokens, positions, slots)
    assert r.logits is None and torch.equal(r.hidden, want)
    assert _same_cache(engine, interp, [0])


def test_split_attention_is_the_engines_within_one_bf16_step(packed):
    """Per layer, the merged split partials against the engine's attention (EmulatedOps.attention, one softmax)
    on the same QKV output and cache: equal but for float32 rounding crossing a BF16 boundary."""
    m, contexts = 8, (1, 2, 63, 64, 65, 100, 129, 130)
    (interp, ref), tokens, positions, slots = _models(packed["int4"], m, contexts)
    s = _schedule(m, contexts, 7, splits=5)
    r = run_schedule(interp, s, tokens, positions, slots)
    pos, slt = torch.tensor(positions, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32)
    for layer in range(CFG.num_hidden_layers):
        want = torch.empty(m, CFG.num_attention_heads, CFG.head_dim, dtype=torch.bfloat16)
        ref.ops.attention(r.buffers[("qkv", layer)], pos, slt, ref.cache, layer, ref.rope, want)
        got, want = r.buffers[("attn", layer)].float(), want.view(m, -1).float()
        assert ((got - want).abs() <= want.abs() * BF16_STEP).all()
        assert (got == want).float().mean() > 0.99
    assert _same_cache(interp, ref, range(CFG.num_hidden_layers))   # the same rows, written head by head


def test_interleavings_give_identical_results(packed):
    m, contexts = 3, (63, 64, 130)
    s = _schedule(m, contexts, 7, splits=4)
    (a, b, c), tokens, positions, slots = _models(packed["int4"], m, contexts, n=3)
    runs = [run_schedule(model, s, tokens, positions, slots, order=o) for model, o in
            zip((a, b, c), ("round-robin", 1, 2))]
    assert len({tuple(r.order) for r in runs}) == 3, "three different interleavings"
    for r, model in zip(runs[1:], (b, c)):
        assert torch.equal(r.hidden, runs[0].hidden) and torch.equal(r.logits, runs[0].logits)
        assert _same_cache(a, model, range(CFG.num_hidden_layers))


def test_a_partials_tokens_need_no_split_count():
    """The table holds (split, splits holding tiles), not the split count: ceil(tiles / active) is the count's
    ceil(tiles / splits) for every count, so a kernel locates a partial's tokens from the table and the context."""
    for tiles in range(1, 300):
        for splits in range(1, 70):
            per = -(-tiles // splits)
            assert split_tiles(tiles * 32, 32, -(-tiles // per)) == per
    s = _schedule(8, (1, 2, 63, 64, 65, 100, 129, 130), 7, splits=3)
    for t in s.graph.tasks:
        if t.kind == "attn_partial":
            ctx = s.graph.contexts[t.args[0]]
            assert split_tiles(ctx, 32, t.args[3]) == -(-(-(-ctx // 32)) // 3)
    with pytest.raises(ValueError, match="11 splits cannot hold the 100 32-token tiles"):
        split_tiles(3200, 32, 11)


def _table(packed, m=1, contexts=(63,), ctas=1, splits=None):
    s = _schedule(m, contexts, ctas, splits)
    (model,), tokens, positions, slots = _models(packed["int4"], m, contexts, n=1)
    return s, ps.task_table(s), model, tokens, positions, slots


def _run(table, s, model, tokens, positions, slots, order="round-robin"):
    return run_task_table(model, table, len(s.graph.counters), tokens, positions, slots, order=order)


def test_a_consumer_before_its_producer_on_one_cta_is_a_deadlock(packed):
    s, table, model, *inputs = _table(packed)
    n = int((table[0, :, F["kind"]] >= 0).sum())
    qkv = next(j for j in range(n) if ps.KINDS[int(table[0, j, F["kind"]])] == "qkv")
    order = [qkv] + [j for j in range(table.shape[1]) if j != qkv]
    with pytest.raises(ps.Deadlock, match=r"1 of 1 CTAs wait forever.*\n  CTA 0 runs L0 qkv\[0:16\], waiting on "
                                          r"counter \d+ \(0 of 1\)") as err:
        _run(table[:, order], s, model, *inputs)
    assert err.value.cycle == [(0, "L0 qkv[0:16]")]


def test_a_missing_wait_reads_before_the_write(packed):
    s, table, model, *inputs = _table(packed)
    kinds = table[0, :, F["kind"]]
    qkv = next(j for j in range(len(kinds)) if ps.KINDS[int(kinds[j])] == "qkv")
    bad = table[:, [qkv] + [j for j in range(table.shape[1]) if j != qkv]].clone()
    bad[0, 0, F["wait0"]] = -1   # the QKV block no longer waits for the row factor queued behind it
    with pytest.raises(ReadBeforeWrite, match=r"L0 qkv\[0:16\] reads rf0\[0:1, 0:1\] before it is written"):
        _run(bad, s, model, *inputs)
    # many CTAs, no CTA out of order: O blocks that do not wait for attention run too early under some order
    s, table, model, *inputs = _table(packed, 3, (63, 64, 130), 264, splits=4)
    o = table[:, :, F["kind"]] == ps.KINDS.index("o")
    table[..., F["wait0"]][o] = -1
    with pytest.raises(ReadBeforeWrite, match=r"L0 o\[\d+:\d+\] reads attn0"):
        _run(table, s, model, *inputs)


def test_a_table_missing_tasks_is_caught(packed):
    s, table, model, *inputs = _table(packed, 1, (63,), 7)
    lm = table[:, :, F["kind"]] == ps.KINDS.index("lm_head")
    c, j = map(int, lm.nonzero()[-1])
    dropped = torch.cat([table[c, :j], table[c, j + 1:], table[c, -1:]])   # the list's last LM head block removed
    with pytest.raises(AssertionError, match=r"ran to its end with \d+ elements of logits2 unwritten"):
        _run(torch.cat([table[:c], dropped[None], table[c + 1:]]), s, model, *inputs)
    down = (table[:, :, F["kind"]] == ps.KINDS.index("down")).nonzero()[0]
    table[down[0], down[1], F["signal0"]] = -1   # a down block that never counts: the next row factor waits
    with pytest.raises(ps.Deadlock, match=r"L\d row_factor, waiting on counter \d+ \(\d+ of \d+\)"):
        _run(table, s, model, *inputs)


def test_bad_input_is_named(packed):
    s, table, model, tokens, positions, slots = _table(packed)
    with pytest.raises(ValueError, match=r"built for contexts \(63,\), the inputs have \(64,\)"):
        run_schedule(model, s, tokens, [63], slots)
    with pytest.raises(ValueError, match="a task table is int"):
        _run(table[0], s, model, tokens, positions, slots)
    with pytest.raises(ValueError, match="no end row"):
        _run(table[:, :-1], s, model, tokens, positions, slots)
    with pytest.raises(ValueError, match=r"(wait|signal)\d = \d+ outside the 2 counters"):
        run_task_table(model, table, 2, tokens, positions, slots)
    with pytest.raises(ValueError, match="one position and one slot per token"):
        _run(table, s, model, tokens, positions + [3], slots)
    with pytest.raises(ValueError, match="slots must be distinct"):
        _run(table, s, model, [1, 2], [62, 62], [0, 0])
    with pytest.raises(ValueError, match="order must be"):
        _run(table, s, model, tokens, positions, slots, order="random")
    kind = table[0, :, F["kind"]].tolist()
    bad = table.clone()
    bad[0, kind.index(ps.KINDS.index("qkv")), F["layer"]] = 2
    with pytest.raises(ValueError, match=r"L2 qkv\[0:16\]\): layer outside 0..1 \(the model has 2\)"):
        _run(bad, s, model, tokens, positions, slots)
    bad = table.clone()
    bad[0, kind.index(ps.KINDS.index("lm_head")), F["layer"]] = 1
    with pytest.raises(ValueError, match=r"L1 lm_head\[0:128\]: the LM head is layer 2 of this table"):
        _run(bad, s, model, tokens, positions, slots)
    with pytest.raises(ValueError, match="the bf16 cache's attention 16: build it with cache='bf16'"):
        run_schedule(DecodeModel(packed["int4"], "bf16", max_batch=8, capacity=256, backend="emulated",
                                 device="cpu"), s, tokens, positions, slots)
    other = ps.make_schedule(CFG.replace(intermediate_size=512), 1, 63, layers=2, head=True, ctas=1)
    with pytest.raises(ValueError, match="another model config"):
        run_schedule(model, other, tokens, positions, slots)


RING_CASES = [   # M, contexts, CTAs, splits
    (1, (130,), 7, 4),
    (1, (63,), 132, None),
    (3, (63, 64, 130), 7, 4),
    (8, (1, 2, 63, 64, 65, 100, 129, 130), 264, 3),
    (8, (130,) * 8, 13, 5),
]


@pytest.mark.parametrize("m,contexts,ctas,splits", RING_CASES)
def test_the_ring_protocol_computes_the_same_step(packed, m, contexts, ctas, splits):
    """decode/persistent_ring.py skips the wait of a projection task that follows one of its kind on the CTA (its
    rows are still staged) and holds a CTA's signals over a run of tasks signalling the same counters. Interpreted so,
    under three interleavings: no read before a write, no deadlock, the counters at the
    same totals, and the step bit for bit the plain protocol's. (The interpreter runs the tables with row-factor
    tasks; the kernel form only drops those, which wait and signal like any other task.)"""
    from futx.engine.persistent import check_ring_waits

    s = _schedule(m, contexts, ctas, splits)
    check_ring_waits(ps.task_table(s))
    models, tokens, positions, slots = _models(packed["int4"], m, contexts, n=4)
    plain = run_schedule(models[0], s, tokens, positions, slots)
    for model, order in zip(models[1:], ("round-robin", 5, 6)):
        r = run_schedule(model, s, tokens, positions, slots, order=order, ring=True)
        assert torch.equal(r.hidden, plain.hidden) and r.counters == plain.counters
        assert _same_cache(models[0], model, range(CFG.num_hidden_layers))
    skipped = sum(1 for lst in _lists_of(s) for a, b in zip(lst, lst[1:])
                  if a.kind == b.kind and a.layer == b.layer and a.kind in ps.PROJECTIONS)
    assert skipped > 0 or ctas >= 132   # the shortcut is exercised (not where every CTA runs a task or two)


def _lists_of(s):
    return [[s.graph.tasks[i] for i in lst] for lst in s.lists]
