"""The INT4-only cache (`--cache-main none`) on the GPU:
  * decode attention's mirror-only twin (`decode.attn.*.qkv.p128.mo`) against the paged kernel: with the same
    mirror contents it gives the same output bit for bit and stores the same mirror rows, and it never touches
    the main copy (a NaN-poisoned tensor of 2 pages while the table points far past it);
  * the serving scheduler on the kernels (prefill kernels, CUDA graphs off and on): staged prefills then decode on
    mirror-only pages give the greedy tokens of the paged cache with a main copy on every page (no prefix cache,
    so every prefill attends to its own BF16 rows in both), with preemption, every page back at the end.
"""

from __future__ import annotations

import pytest
import torch

import paged_cache as pc
from test_decode_attention_paged_gpu import PagedCase, da  # noqa: F401

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fmt,rotate,shape", [("int4", True, "8B"), ("int4", True, "d64-g3"), ("e4m3", False, "8B"),
                                              ("e4m3", False, "d64-g3")])
@pytest.mark.parametrize("contexts", [(1, 129, 1025), (4097, 63, 64, 300)])
def test_mirror_only_kernel_equals_the_paged_kernel(da, fmt, rotate, shape, contexts):  # noqa: F811
    case = PagedCase(da, fmt, rotate, 128, contexts, shape, fused=True)
    saved = {n: t.clone() for n, t in pc.tensors(case.paged).items()}
    want = case.run(True)
    want_mirror = {n: t.clone() for n, t in pc.tensors(case.paged).items() if n not in ("k_cache", "v_cache")}
    for n, t in pc.tensors(case.paged).items():
        t.copy_(saved[n])
    full = case.paged
    main = torch.full((2, *full.k_cache.shape[1:]), float("nan"), dtype=torch.bfloat16, device="cuda")
    case.paged = da.DecodeCache(fmt, main, main.clone(), full.k_mirror, full.k_scale, full.v_mirror, full.v_scale)
    got = case.run(True, check_positions_on_host=False)   # (the host check's scratch page is the 2-page main's)
    assert not torch.isnan(want).any() and torch.equal(got, want)
    for n, t in pc.tensors(case.paged).items():
        if n in want_mirror:
            assert torch.equal(t.view(torch.uint8), want_mirror[n].view(torch.uint8)), n   # bits: NaN-poisoned rows
    assert torch.isnan(case.paged.k_cache).all() and torch.isnan(case.paged.v_cache).all()
    case.fused = False   # the unfused op has no mirror-only kernel: refused before any launch
    with pytest.raises(ValueError, match="mirror-only cache"):
        case.run(True, check_positions_on_host=False)


def _engine(weights, packed, fmt, pages, staging, graphs, rows=None):
    from futx.engine import DecodeModel
    from futx.engine.graphs import GraphSteps
    from futx.engine.prefill import PrefillModel, pack_prefill
    from futx.serve.engines import DecodeEngine

    model = DecodeModel(packed, fmt, max_batch=3, capacity=3 * 128, backend="kernels", device="cuda", pages=pages,
                        staging=staging, max_rows=rows)
    pm = PrefillModel(pack_prefill(weights, "bf16", device="cuda"), model.cache, "kernels")
    return DecodeEngine(model, GraphSteps(model) if graphs else None, None, pm)


@pytest.mark.parametrize("fmt", ("int4", "e4m3"))
@pytest.mark.parametrize("graphs", (False, True))
def test_int4_only_serving_gives_the_tokens_of_the_full_cache(fmt, graphs):
    from futx.checkpoint.synthetic import random_weights
    from futx.engine import pack_model
    from futx.serve import Scheduler

    from test_serve_paged import CFG, Tok, all_pages_back, prompts_of, run

    weights = random_weights(CFG, seed=11, std=0.3)
    packed = pack_model(weights, "int4", progress=False)
    prompts = prompts_of((200, 180, 150, 60, 5), seed=9)
    lens = (100,) * 5
    # the same pages (and staging pages for three whole requests, never the binding limit): both runs take the same
    # schedule, preemption included, so every step has the same rows and the kernels the same M
    want = run(Scheduler(_engine(weights, packed, fmt, 5, 0, graphs), Tok(), prefill_chunk=64,
                         prefix_cache=False), prompts, lens)
    sched = Scheduler(_engine(weights, packed, fmt, 5, 9, graphs), Tok(), prefill_chunk=64, prefix_cache=False)
    assert run(sched, prompts, lens) == want
    assert sched.preemptions > 0
    all_pages_back(sched)
    assert sched.staging.free_count == sched.staging.total


@pytest.mark.parametrize("fmt", ("int4", "e4m3"))
def test_speculative_serving_on_the_int4_only_cache(fmt):
    """Verify steps on the INT4-only cache (block rows by the `.mo` block-rows kernel, attention by the `.mo` twin)
    give the tokens of the same schedule on the cache with a main copy on every page (torch prewrite)."""
    from futx.checkpoint.synthetic import random_weights
    from futx.engine import pack_model
    from futx.serve import Scheduler
    from futx.speculative.ngram import NgramDrafter

    from test_serve_paged import CFG, Tok, all_pages_back, run

    weights = random_weights(CFG, seed=11, std=0.3)
    packed = pack_model(weights, "int4", progress=False)
    loop = [5, 6, 7, 8] * 60
    prompts = [loop[:200], [9, 10, 11] * 30, loop[:37]]
    spec = dict(prefill_chunk=64, prefix_cache=False, drafter=NgramDrafter(), num_draft=3)
    want = run(Scheduler(_engine(weights, packed, fmt, 9, 0, False, rows=12), Tok(), **spec), prompts, (40,) * 3)
    sched = Scheduler(_engine(weights, packed, fmt, 9, 9, False, rows=12), Tok(), **spec)
    assert run(sched, prompts, (40,) * 3) == want
    assert sched.acceptance.summary()["verifications"] > 0
    all_pages_back(sched)
