"""The scheduler on paged caches (CPU: the reference model over futx.paged_kvcache, the emulated decode engine
over a paged EngineCache): paged = contiguous outputs, prefix-cache hits that skip the cached prefill, preemption
under a tiny pool (identical greedy outputs, every page back), refusal of what can never fit, no deadlock with
many requests on few pages, speculative rows, and the /metrics series."""

import random

import pytest
import torch

from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.engine import DecodeModel, pack_model
from futx.engine.prefill import PrefillModel, pack_prefill
from futx.paging import PageLayout
from futx.serve import RequestTooLong, SamplingParams, Scheduler
from futx.serve.engines import DecodeEngine, ReferenceEngine
from futx.serve.metrics import ServerMetrics
from futx.speculative.ngram import NgramDrafter

pytestmark = pytest.mark.usefixtures("single_thread")
CFG = tiny_config(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, num_hidden_layers=2, vocab_size=300)
P = 128


class Tok:
    """What the scheduler needs of a tokenizer (ids straight through: outputs are compared as ids)."""
    eos_ids = ()

    def decode(self, ids, skip_special=True):
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=11, std=0.3)


@pytest.fixture(scope="module")
def packed(weights):
    return pack_model(weights, "int4", progress=False)


def ref_engine(weights, slots, capacity, pages=None):
    lay = None if pages is None else PageLayout.for_capacity(P, pages, slots, capacity)
    return ReferenceEngine(weights, slots, capacity, lay)


def emu_engine(packed, weights, slots, capacity, pages=None, k=0):
    model = DecodeModel(packed, "int4", max_batch=slots, capacity=capacity, backend="emulated", device="cpu",
                        pages=pages, max_rows=slots * (k + 1))
    pm = PrefillModel(pack_prefill(weights, "bf16"), model.cache, "emulated")
    return DecodeEngine(model, None, None, pm)


def prompts_of(lengths, seed=0, prefix=()):
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(CFG.vocab_size) for _ in range(n)] for n in lengths]


def run(sched, prompts, max_tokens, ticks=10_000):
    hs = [sched.submit(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(prompts, max_tokens)]
    for _ in range(ticks):          # bounded: a deadlock fails here instead of hanging the suite
        if not (sched._waiting or sched._live):
            break
        sched.tick()
    assert not (sched._waiting or sched._live), "the scheduler stopped making progress"
    assert all(h.finish_reason == "length" for h in hs), [h.error for h in hs]
    return [h.output for h in hs]


def all_pages_back(sched):
    pool = sched.pool
    pool.check()
    held = sum(1 for r in pool.refs if r)
    assert held == (len(sched.prefix) if sched.prefix is not None else 0)   # only the prefix cache holds any
    assert sched.snapshot()["pages_free"] + sched.snapshot()["pages_cached"] == pool.total
    if sched.prefix is not None:
        sched.prefix.clear()
    assert pool.free_count == pool.total


def test_paged_reference_engine_equals_the_contiguous_one(weights):
    prompts = prompts_of((300, 140, 20))
    want = run(Scheduler(ref_engine(weights, 2, 384), Tok(), prefill_chunk=100), prompts, (10, 10, 10))
    sched = Scheduler(ref_engine(weights, 2, 384, pages=6), Tok(), prefill_chunk=100)
    assert run(sched, prompts, (10, 10, 10)) == want
    all_pages_back(sched)


@pytest.mark.parametrize("kind", ("reference", "emulated"))
def test_a_cached_prefix_is_not_prefilled_again_and_changes_nothing(weights, packed, kind):
    system = prompts_of((2 * P,), seed=7)[0]                # a shared 2-page "system prompt"
    prompts = prompts_of((30, 5, 140), seed=1, prefix=system)
    make = (lambda pages: ref_engine(weights, 2, 4 * P, pages)) if kind == "reference" else \
        (lambda pages: emu_engine(packed, weights, 2, 4 * P, pages))
    cold = Scheduler(make(12), Tok(), prefill_chunk=200, prefix_cache=False)
    want = [run(cold, [p], [6])[0] for p in prompts]
    sched = Scheduler(make(12), Tok(), prefill_chunk=200)
    got = [run(sched, [p], [6])[0] for p in prompts]           # one after the other: the first publishes
    assert got == want
    assert sched.prefix_hits == 2 and sched.prefix_hit_tokens == 2 * 2 * P
    assert sched.prefill_tokens == cold.prefill_tokens - 2 * 2 * P
    # the third prompt's own third page (positions 256..383, prefilled) was published too
    assert len(sched.prefix) == 3
    all_pages_back(sched)


def test_pages_are_shared_as_soon_as_their_prefill_completes(weights):
    system = prompts_of((2 * P,), seed=7)[0]
    a, b = prompts_of((50, 9), seed=3, prefix=system)
    cold = [run(Scheduler(ref_engine(weights, 2, 3 * P, 6), Tok(), prefix_cache=False), [p], [8])[0] for p in (a, b)]
    sched = Scheduler(ref_engine(weights, 2, 3 * P, 6), Tok(), prefill_chunk=300)
    ha = sched.submit(a, SamplingParams(max_tokens=8, ignore_eos=True))
    sched.tick()                                   # a's first chunk: both system pages prefilled and published
    assert len(sched.prefix) == 2 and not ha.done
    hb = sched.submit(b, SamplingParams(max_tokens=8, ignore_eos=True))
    sched.run_until_idle()
    assert hb.cached == 2 * P and [ha.output, hb.output] == cold
    all_pages_back(sched)


def test_preemption_under_a_tiny_pool_keeps_greedy_outputs_and_returns_every_page(weights):
    prompts = prompts_of((120, 110, 125, 100), seed=2)
    steps = (30, 40, 20, 35)                                  # each grows past its first page
    want = run(Scheduler(ref_engine(weights, 3, 2 * P), Tok(), prefill_chunk=64), prompts, steps)
    sched = Scheduler(ref_engine(weights, 3, 2 * P, pages=3), Tok(), prefill_chunk=64)
    assert run(sched, prompts, steps) == want
    assert sched.preemptions > 0
    all_pages_back(sched)


def test_preemption_on_the_emulated_engine_with_speculative_rows(weights, packed):
    prompts = prompts_of((120, 100, 90), seed=4)
    prompts = [p[:40] * 3 for p in prompts]                  # repeats: n-gram drafts get accepted
    steps = (20, 40, 30)
    want = run(Scheduler(emu_engine(packed, weights, 2, 2 * P), Tok(), prefill_chunk=64), prompts, steps)
    sched = Scheduler(emu_engine(packed, weights, 2, 2 * P, pages=3, k=3), Tok(), prefill_chunk=64,
                      drafter=NgramDrafter(), num_draft=3)
    assert run(sched, prompts, steps) == want
    assert sched.preemptions > 0 and sched.acceptance.summary()["verifications"] > 0
    all_pages_back(sched)


def test_a_request_that_can_never_fit_is_refused_up_front(weights):
    sched = Scheduler(ref_engine(weights, 2, 4 * P, pages=2), Tok())
    with pytest.raises(RequestTooLong, match=r"needs 3 pages of 128 positions; this server's cache has 2"):
        sched.submit([1] * 200, SamplingParams(max_tokens=100))
    sched.submit([1] * 200, SamplingParams(max_tokens=57))   # 256 positions: exactly every page
    with pytest.raises(ValueError, match="token budget"):
        Scheduler(ref_engine(weights, 2, 4 * P, pages=2), Tok(), token_budget=2)


def test_many_requests_on_few_pages_all_finish(weights):
    rng = random.Random(3)
    lengths = [rng.choice((3, 40, 130, 200)) for _ in range(12)]
    steps = [rng.randint(1, 50) for _ in lengths]
    prompts = prompts_of(lengths, seed=5, prefix=prompts_of((P,), seed=9)[0][:rng.choice((0, P))])
    want = run(Scheduler(ref_engine(weights, 4, 3 * P), Tok(), prefill_chunk=96), prompts, steps)
    sched = Scheduler(ref_engine(weights, 4, 3 * P, pages=4), Tok(), prefill_chunk=96, token_budget=100)
    assert run(sched, prompts, steps, ticks=3000) == want
    all_pages_back(sched)


def test_metrics_show_pages_prefix_hits_and_preemptions(weights):
    system = prompts_of((P,), seed=7)[0]
    sched = Scheduler(ref_engine(weights, 2, 3 * P, pages=4), Tok(), prefill_chunk=100)
    m = ServerMetrics(sched)
    text = m.render().decode()
    assert "futx_cache_pages_total 4.0" in text and "futx_cache_pages_free 4.0" in text
    run(sched, [system + [1, 2, 3]], [4])                       # publishes the system prompt's page
    run(sched, [system + [6] * 20, system + [7] * 10], [200, 200])   # both grow to 3 pages: one is preempted
    text = m.render().decode()
    for line in ("futx_cache_pages_total 4.0", "futx_prefix_cache_hits_total 2.0",
                 f"futx_prefix_cache_hit_tokens_total {2 * P}.0"):
        assert line in text, text
    gauge = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("futx_cache_pages")}
    assert gauge["futx_cache_pages_free"] + gauge["futx_cache_pages_cached"] == 4 and gauge["futx_cache_pages_cached"]
    rate = [ln for ln in text.splitlines() if ln.startswith("futx_prefix_cache_hit_rate ")][0]
    assert float(rate.split()[1]) == pytest.approx(2 * P / ((P + 3) + (P + 20) + (P + 10)))
    preempted = [ln for ln in text.splitlines() if ln.startswith("futx_preemptions_total ")][0]
    assert float(preempted.split()[1]) == sched.preemptions > 0
