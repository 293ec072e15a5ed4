"""The INT4-only cache (`--cache-main none`, futx.paging staging pages) on the CPU: the layout's index spaces,
EngineCache's smaller main copy and its page moves, and the scheduler on the emulated decode engine: the same
greedy tokens as the cache with a main copy on every page (prefills on staging pages, decode on mirror-only
pages), with chunked prompts, prefix hits, preemption, and every page and staging page back at the end."""

import pytest
import torch

from futx.engine import DecodeModel
from futx.engine.cache import EngineCache
from futx.engine.prefill import PrefillModel, pack_prefill
from futx.paging import PageLayout
from futx.serve import SamplingParams, Scheduler
from futx.serve.engines import DecodeEngine

from test_serve_paged import CFG, P, Tok, all_pages_back, packed, prompts_of, run, weights  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


def staged_engine(packed, weights, slots, capacity, pages, staging, fmt="int4"):  # noqa: F811
    model = DecodeModel(packed, fmt, max_batch=slots, capacity=capacity, backend="emulated", device="cpu",
                        pages=pages, staging=staging)
    pm = PrefillModel(pack_prefill(weights, "bf16"), model.cache, "emulated")
    return DecodeEngine(model, None, None, pm)


def full_engine(packed, weights, slots, capacity, pages, fmt="int4"):  # noqa: F811
    return staged_engine(packed, weights, slots, capacity, pages, 0, fmt)


def all_staging_back(sched):
    assert sched.staging.free_count == sched.staging.total
    sched.staging.check()
    assert not any(h.staging for h in sched._live)


def test_layout_index_spaces():
    lay = PageLayout.for_capacity(P, pages=10, slots=3, capacity=3 * P, staging=4)
    assert (lay.scratch_page, lay.first_page, lay.main_pages(), lay.storage_pages()) == (4, 5, 5, 15)
    assert list(lay.staging_ids()) == [0, 1, 2, 3] and list(lay.page_ids()) == list(range(5, 15))
    assert int(lay.new_table().unique()) == 4                     # unowned entries: the scratch page
    plain = PageLayout.for_capacity(P, pages=10, slots=3, capacity=3 * P)
    assert (plain.scratch_page, plain.first_page, plain.main_pages(), plain.storage_pages()) == (10, 0, 11, 11)
    with pytest.raises(ValueError, match="staging pages cannot prefill one request"):
        PageLayout.for_capacity(P, pages=10, slots=3, capacity=3 * P, staging=2)
    with pytest.raises(ValueError, match="staging"):
        PageLayout.for_capacity(P, pages=10, slots=3, capacity=3 * P, staging=-1)


def test_engine_cache_holds_the_main_copy_of_staging_pages_only():
    lay = PageLayout.for_capacity(P, pages=6, slots=2, capacity=2 * P, staging=2)
    cache = EngineCache(CFG, "int4", 2, 2 * P, "cpu", layout=lay)
    c = cache.layers[0]
    assert c.k_cache.shape[0] == 3 and c.k_scale.shape[0] == 9 and c.k_mirror.shape[0] == 9
    per, whole = EngineCache.page_bytes(CFG, "int4", P, main=False), EngineCache.page_bytes(CFG, "int4", P)
    assert cache.nbytes() == 9 * per + 3 * (whole - per)         # mirrors of every page, main copies of 3
    with pytest.raises(ValueError, match="needs a mirror"):
        EngineCache(CFG, "bf16", 2, 2 * P, "cpu", layout=lay)
    # rows on a mirror-only page: mirror written, no main copy touched; copy_pages moves mirror rows
    cache.set_pages(0, [3])
    k = torch.randn(2, CFG.num_key_value_heads, CFG.head_dim)
    before = c.k_cache.clone()
    cache.write_rows(0, torch.tensor([0, 0]), torch.tensor([5, 6]), k, k)
    assert torch.equal(c.k_cache, before)
    got = cache.read(0, 0, 7)[0][:, 5:7]
    cache.copy_pages([3], [4])
    cache.set_pages(0, [4])
    assert torch.equal(cache.read(0, 0, 7)[0][:, 5:7], got)
    with pytest.raises(ValueError, match="copy_pages"):
        cache.copy_pages([3], [99])


@pytest.mark.parametrize("fmt", ("int4", "e4m3"))
def test_int4_only_gives_the_tokens_of_the_full_cache(packed, weights, fmt):  # noqa: F811
    from futx.engine import pack_model

    pk = packed if fmt == "int4" else pack_model(weights, "int4", progress=False)
    prompts = prompts_of((300, 140, 20, 129), seed=4)
    want = run(Scheduler(full_engine(pk, weights, 2, 3 * P, 8, fmt), Tok(), prefill_chunk=100), prompts,
               (12, 12, 12, 12))
    sched = Scheduler(staged_engine(pk, weights, 2, 3 * P, 8, 3, fmt), Tok(), prefill_chunk=100)
    assert run(sched, prompts, (12, 12, 12, 12)) == want           # chunked prompts, two requests at once
    all_pages_back(sched)
    all_staging_back(sched)


def test_a_cached_prefix_is_staged_and_changes_nothing_but_the_prefill(packed, weights):  # noqa: F811
    system = prompts_of((2 * P,), seed=7)[0]
    prompts = prompts_of((30, 5, 140), seed=1, prefix=system)
    cold = Scheduler(staged_engine(packed, weights, 2, 4 * P, 12, 4), Tok(), prefill_chunk=200, prefix_cache=False)
    want = [run(cold, [p], [6])[0] for p in prompts]
    sched = Scheduler(staged_engine(packed, weights, 2, 4 * P, 12, 4), Tok(), prefill_chunk=200)
    got = [run(sched, [p], [6])[0] for p in prompts]
    assert sched.prefix_hits == 2 and sched.prefill_tokens == cold.prefill_tokens - 2 * 2 * P
    # the hits' prefills attend to the prefix through the mirror (dequantized: stage below), the cold runs' to its
    # BF16 main copy: the first prompt (no hit) and the short one agree; the 140-token prefill over the INT4
    # prefix leaves this random tiny model's greedy path (its logits are tested in test_stage_...)
    assert got[:2] == want[:2] and [len(g) for g in got] == [6, 6, 6]
    all_pages_back(sched)
    all_staging_back(sched)


def test_stage_dequantizes_the_prefix_into_the_staging_main_copy(packed, weights):  # noqa: F811
    eng = staged_engine(packed, weights, 2, 3 * P, 6, 3)
    cache = eng.model.cache
    shared = [7, 9]                                    # cached mirror-only pages of positions [0, 2P)
    cache.set_pages(1, shared)
    g = torch.Generator().manual_seed(3)
    for i in range(CFG.num_hidden_layers):            # mirror rows (and the emulation's kept values) as written
        k, v = (torch.randn(2 * P, CFG.num_key_value_heads, CFG.head_dim, generator=g) for _ in range(2))
        cache.write_rows(i, torch.ones(2 * P, dtype=torch.long), torch.arange(2 * P), k, v)
    want = [cache.read(i, 1, 2 * P) for i in range(CFG.num_hidden_layers)]
    mirror = [t.clone() for c in cache.layers for t in (c.k_mirror, c.k_scale)]
    n = 2 * P - 5
    eng.stage(1, shared, [2, 0, 1], n)
    assert cache.table[1, :3].tolist() == [2, 0, 1]
    for i, (k, v) in enumerate(want):
        lc = cache.layers[i]
        for main, w in ((lc.k_cache, k), (lc.v_cache, v)):   # the main copy: what decode reads
            assert torch.equal(torch.cat([main[2], main[0]], dim=1)[:, :n], w[:, :n].to(torch.bfloat16))
    # the prefix's mirror stays on its shared pages (no copy to the staging pages: nothing reads it there)
    assert all(torch.equal(a, b) for a, b in zip(mirror, (t for c in cache.layers for t in (c.k_mirror, c.k_scale))))
    # unstage: rows past the attached prefix to the request's own pages; the prefix reads as before
    eng.unstage(1, [2, 0, 1], shared + [8], keep=2)
    assert cache.table[1, :3].tolist() == [7, 9, 8]
    for i, (k, v) in enumerate(want):
        got_k, got_v = cache.read(i, 1, 2 * P)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_int4_key_values_equal_the_layout_unpack():
    """paged_kv's gather-based key unpacking (the stage's) against futx.quant.layouts' definition."""
    from futx.engine.paged_kv import int4_key_values
    from futx.quant import layouts

    g = torch.Generator().manual_seed(8)
    for d in (64, 128):
        blocks = torch.randint(0, 256, (3, 2, 5, 32, d // 8), generator=g, dtype=torch.uint8)
        assert torch.equal(int4_key_values(blocks), layouts.unpack_int4_keys(blocks).float())


def test_preemption_and_waiting_for_staging_pages(packed, weights):  # noqa: F811
    prompts = prompts_of((200, 180, 150, 60), seed=9)
    want = run(Scheduler(full_engine(packed, weights, 3, 3 * P, 24), Tok(), prefill_chunk=64), prompts,
               (100, 100, 100, 100))
    # 5 mirror-only pages for 4 requests of 2-3 pages each, 3 staging pages (one long prompt at a time)
    # without the prefix cache a preempted request is recomputed exactly as it first ran: the same tokens
    sched = Scheduler(staged_engine(packed, weights, 3, 3 * P, 5, 3), Tok(), prefill_chunk=64, prefix_cache=False)
    assert run(sched, prompts, (100, 100, 100, 100)) == want
    assert sched.preemptions > 0
    all_pages_back(sched)
    all_staging_back(sched)
    # with it, its prefilled pages come back from the cache (attended through the mirror): it completes
    sched = Scheduler(staged_engine(packed, weights, 3, 3 * P, 5, 3), Tok(), prefill_chunk=64)
    got = run(sched, prompts, (100, 100, 100, 100))
    assert sched.preemptions > 0 and sched.prefix_hits == 0 and got[0] == want[0]
    all_pages_back(sched)
    all_staging_back(sched)


def test_speculative_decoding_on_the_int4_only_cache(packed, weights):  # noqa: F811
    """Verify steps write their blocks' rows to mirror-only pages (no main copy there): the same greedy tokens as
    speculative decoding on the cache with a main copy on every page, which are plain greedy decoding's."""
    from futx.speculative.ngram import NgramDrafter

    def engine(staging):
        model = DecodeModel(packed, "int4", max_batch=2, capacity=3 * P, backend="emulated", device="cpu", pages=8,
                            staging=staging, max_rows=2 * 4)
        return DecodeEngine(model, None, None, PrefillModel(pack_prefill(weights, "bf16"), model.cache, "emulated"))
    loop = [5, 6, 7, 8] * 40                              # repetitive: prompt lookup finds drafts
    prompts = [loop[:150], prompts_of((60,), seed=3)[0]]
    want = run(Scheduler(engine(0), Tok(), prefill_chunk=64, drafter=NgramDrafter(), num_draft=3), prompts, (30, 30))
    sched = Scheduler(engine(6), Tok(), prefill_chunk=64, drafter=NgramDrafter(), num_draft=3)
    assert run(sched, prompts, (30, 30)) == want
    assert sched.acceptance.summary()["verifications"] > 0
    all_pages_back(sched)
    all_staging_back(sched)


@pytest.mark.parametrize("fmt", ("int4", "bf16"))
def test_ppl_prefill_context_through_the_mirror(packed, weights, fmt):  # noqa: F811
    """futx ppl --prefill-context: two prefill chunks, the second reading the first from the main copy or
    through the mirror; a BF16 cache has no mirror, so both read the same bytes there."""
    from futx.engine.perplexity import evaluate_engine

    windows = torch.randint(0, CFG.vocab_size, (3, 64), generator=torch.Generator().manual_seed(2))
    res = {}
    for ctx in (None, "main", "mirror"):
        model = DecodeModel(packed, fmt, max_batch=4, capacity=64, backend="emulated", device="cpu")
        pm = PrefillModel(pack_prefill(weights, "bf16"), model.cache, "emulated")
        res[ctx] = evaluate_engine(model, windows, "serving", weights, prefill_model=pm, prefill_context=ctx).mean_nll
    assert res["main"] == pytest.approx(res[None], rel=1e-4)          # chunking itself changes ~nothing
    if fmt == "bf16":
        assert res["mirror"] == res["main"]
    else:
        assert res["mirror"] != res["main"] and res["mirror"] == pytest.approx(res["main"], rel=0.05)
    with pytest.raises(ValueError, match="prefill_context"):
        evaluate_engine(model, windows, "serving", weights, prefill_model=pm, prefill_context="both")


def test_requests_leaving_mid_prefill_give_their_staging_pages_back(packed, weights):  # noqa: F811
    """Cancelled, preempted or failed while still on staging pages: pages and staging pages come back, nothing of
    theirs is published (their own pages hold nothing yet), and the others finish as on the full cache."""
    system = prompts_of((P,), seed=5)[0]
    prompts = prompts_of((250, 200, 90), seed=6, prefix=system)
    sched = Scheduler(staged_engine(packed, weights, 3, 4 * P, 12, 8), Tok(), prefill_chunk=64)
    hs = [sched.submit(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts]
    sched.tick()                                       # all three admitted, the first chunk of the first prefilled
    assert all(h.staging for h in hs) and len(sched.prefix) == 0
    hs[0].cancel()
    sched._preempt(hs[1])                              # back to the queue, recomputed from the start
    sched.run_until_idle()
    assert hs[0].finish_reason == "cancelled" and hs[1].finish_reason == hs[2].finish_reason == "length"
    assert len(hs[1].output) == len(hs[2].output) == 8
    all_pages_back(sched)
    all_staging_back(sched)


def test_a_failed_stage_fails_the_request_and_keeps_serving(packed, weights, monkeypatch):  # noqa: F811
    eng = staged_engine(packed, weights, 2, 2 * P, 6, 2)
    sched = Scheduler(eng, Tok(), prefill_chunk=64)
    real = eng.stage
    calls = []

    def flaky(*a):
        calls.append(a)
        if len(calls) == 1:
            raise RuntimeError("device copy failed")
        return real(*a)
    monkeypatch.setattr(eng, "stage", flaky)
    bad, good = (sched.submit(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in prompts_of((40, 30)))
    sched.run_until_idle()
    assert bad.finish_reason == "error" and "device copy failed" in bad.error
    assert good.finish_reason == "length" and len(good.output) == 4
    all_pages_back(sched)
    all_staging_back(sched)


def test_main_from_mirror_through_the_block_table():
    """A paged cache's main copy <- what decode attention reads (futx.engine.paged_kv.dequantize_slot); a staged
    cache has no main copy of its pages and refuses."""
    lay = PageLayout.for_capacity(P, pages=4, slots=2, capacity=2 * P)
    cache = EngineCache(CFG, "int4", 2, 2 * P, "cpu", layout=lay)
    cache.set_pages(1, [3, 0])
    g = torch.Generator().manual_seed(4)
    k, v = (torch.randn(P + 9, CFG.num_key_value_heads, CFG.head_dim, generator=g) for _ in range(2))
    cache.write_rows(0, torch.ones(P + 9, dtype=torch.long), torch.arange(P + 9), k, v)
    cache.main_from_mirror(1, P + 9)
    want_k, want_v = cache.read(0, 1, P + 9)
    lc = cache.layers[0]
    got_k = torch.cat([lc.k_cache[3], lc.k_cache[0]], dim=1)[:, :P + 9]
    got_v = torch.cat([lc.v_cache[3], lc.v_cache[0]], dim=1)[:, :P + 9]
    assert torch.equal(got_k, want_k.to(torch.bfloat16)) and torch.equal(got_v, want_v.to(torch.bfloat16))
    staged = EngineCache(CFG, "int4", 2, 2 * P, "cpu", layout=PageLayout.for_capacity(P, 4, 2, 2 * P, staging=2))
    with pytest.raises(ValueError, match="staging pages"):
        staged.main_from_mirror(1, 5)


def test_main_rows_op_refuses_cpu_tensors_before_any_launch():
    """futx::main_rows_ (the stage on the kernels) checks its inputs on the host; its GPU test is
    tests/test_main_rows_gpu.py."""
    from futx.ops.main_rows import main_rows

    lay = PageLayout.for_capacity(P, pages=4, slots=2, capacity=2 * P, staging=2)
    c = EngineCache(CFG, "int4", 2, 2 * P, "cpu", layout=lay).layers[0]
    rows = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA device"):
        main_rows("int4", c.k_cache, c.v_cache, c.k_mirror, c.k_scale, c.v_mirror, c.v_scale, rows, rows, rows, rows)
