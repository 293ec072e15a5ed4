"""The decode step's attention as a programmatic dependent launch (`decode.attn.*.qkv*.pdl`, AttnPlan.pdl) on the GPU.

Its arithmetic is the plain entry's; only the launch and the order of its first copies differ (the first tiles are
requested before griddepcontrol.wait with the new row's position zero-filled, and that tile again once the row is
written). So every case asserts bit equality with the plain kernel:
  * the op on the same cache contents: outputs and every cache tensor afterwards, contiguous and paged, the
    mirror-only twin, contexts where the new row's tile is each prologue stage of its warp or past it, split counts
    that move it, NaN-poisoned outputs;
  * the engine's step with rule E5 on (KernelOps.pdl_attention_rows) against the same step with it off, eager and
    as CUDA graphs: here the kernel before it is the QKV projection, a PDL kernel that releases its dependents before
    its output is written, so a read of q or of the new row before the wait would show.
"""

from __future__ import annotations

import pytest
import torch

import paged_cache as pc
from test_decode_attention_paged_gpu import PagedCase, da  # noqa: F401

pytestmark = pytest.mark.gpu
ENGINE_CACHES = [("int4", True), ("e4m3", False), ("bf16", False)]
# 32-token tiles (INT4, and E4M3 at d64), 16 (E4M3 at d128, BF16): 1 / 2 / 3 tiles, a tile's last row, the next's
# first, and long contexts whose last tile lands on different warps and ring stages as the split count changes
CONTEXT_SETS = {"short": (1, 16, 17, 32, 33, 63, 64, 65), "long": (1025, 4097, 129, 300, 8191)}


def _run_both(case, paged: bool, **kw):
    """(plain output, pdl output) from the same cache contents; afterwards the case's caches hold what the pdl run
    stored, checked against what the plain run stored."""
    cache = case.paged if paged else case.contig
    saved = {n: t.clone() for n, t in pc.tensors(cache).items()}
    want = case.run(paged, **kw)
    stored = {n: t.clone() for n, t in pc.tensors(cache).items()}
    for n, t in pc.tensors(cache).items():
        t.copy_(saved[n])
    got = case.run(paged, pdl=True, **kw)
    for n, t in pc.tensors(cache).items():
        assert pc.same_bits(t, stored[n]), f"{n}: the dependent launch stored other bytes"
    return want, got


def _same(got, want):
    assert not torch.isnan(want).any() and not torch.isnan(got).any()
    assert torch.equal(got, want), f"max difference {float((got.float() - want.float()).abs().max())}"


@pytest.mark.parametrize("fmt,rotate", ENGINE_CACHES, ids=lambda x: str(x))
@pytest.mark.parametrize("contexts", list(CONTEXT_SETS))
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_pdl_entry_equals_the_plain_entry(da, fmt, rotate, contexts, paged):  # noqa: F811
    """The 8B head shape (the twins are built for head dim 128: catalog PDL_HEAD_DIMS)."""
    case = PagedCase(da, fmt, rotate, 128, CONTEXT_SETS[contexts], "8B", seed=len(contexts), fused=True)
    for splits in (0, 1, 2, 5):
        want, got = _run_both(case, paged, num_splits=splits)
        _same(got, want)
        if paged:   # and the paged cache holds the contiguous one's contents (the contiguous kernel run too)
            _same(got, case.run(False, num_splits=splits))
            case.check_caches()


@pytest.mark.parametrize("fmt,rotate", [("int4", True), ("e4m3", False)], ids=lambda x: str(x))
def test_pdl_mirror_only_twin_equals_the_plain_one(da, fmt, rotate):  # noqa: F811
    case = PagedCase(da, fmt, rotate, 128, (1, 33, 1025, 4097), fused=True)
    full = case.paged
    main = torch.full((2, *full.k_cache.shape[1:]), float("nan"), dtype=torch.bfloat16, device="cuda")
    case.paged = da.DecodeCache(fmt, main, main.clone(), full.k_mirror, full.k_scale, full.v_mirror, full.v_scale)
    _same(*reversed(_run_both(case, True, check_positions_on_host=False)))
    assert torch.isnan(case.paged.k_cache).all() and torch.isnan(case.paged.v_cache).all()


def _model(weights, cf, rows, batch, splits=0):
    from futx.engine import DecodeModel, pack_model

    m = DecodeModel(pack_model(weights, "int4", progress=False), cf, max_batch=batch, capacity=1200,
                    backend="kernels", device="cuda")
    m.cache.randomize(3)   # every model the same history, never zeros
    m.ops.pdl_attention_rows = rows
    m.ops.attention_splits = splits
    return m


def _check_steps(cf, batch, splits=0):
    """Six steps of a 3-layer model from the same cache, plain attention vs the dependent launch (eager, graphs):
    equal bit for bit. Behind the real QKV projection, the only place a read before griddepcontrol.wait shows."""
    from futx.checkpoint.synthetic import random_weights, tiny_config
    from futx.engine.graphs import GraphSteps

    cfg = tiny_config(hidden_size=256, intermediate_size=384, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=128, num_hidden_layers=3, vocab_size=512)
    w = random_weights(cfg, seed=11, std=0.05).to(device="cuda")
    toks = torch.randint(0, 512, (batch, 6), generator=torch.Generator().manual_seed(5))
    starts = [0, 31, 1023, 64, 95, 500, 7, 1100][:batch]
    hidden = []
    for rows, graphs in ((0, False), (8, False), (8, True)):
        m = _model(w, cf, rows, batch, splits)
        g = GraphSteps(m, buckets=[batch]) if graphs else None
        out = []
        for s in range(toks.shape[1]):
            args = (toks[:, s].tolist(), [p + s for p in starts], list(range(batch)))
            if g is None:
                m.step(m.load_inputs(*args))
            else:
                g.run(*args)
            out.append(m.buffers.hidden[:batch].clone())
        hidden.append(torch.stack(out))
    assert torch.isfinite(hidden[0]).all()
    # the rule really chose the twin (else the equalities below would hold trivially)
    from futx.runtime.catalog.decode_attention import qkv_key
    from futx.runtime.loader import kernel_origin

    assert kernel_origin(qkv_key(cf, 128, cf == "int4", pdl=True)) is not None
    assert torch.equal(hidden[1], hidden[0]), "eager step with the dependent attention launch differs"
    assert torch.equal(hidden[2], hidden[0]), "graph replay with the dependent attention launch differs"


@pytest.mark.parametrize("cf", ["int4", "e4m3", "bf16"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_step_with_pdl_attention_equals_the_plain_step(cf, batch):
    _check_steps(cf, batch)


@pytest.mark.parametrize("cf", ["int4", "e4m3"])
@pytest.mark.parametrize("splits", [1, 5])
def test_step_with_pdl_attention_at_fixed_splits(cf, splits):
    """One split (every tile of a row in one CTA's prologue and loop) and five (the new row's tile in either
    prologue stage at some of the contexts), behind the real QKV projection."""
    _check_steps(cf, 3, splits)
