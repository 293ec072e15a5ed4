"""Prefill attention on the GPU (torch.ops.futx.prefill_attention: AOT artifacts or JIT, whichever the
runtime finds), against the float64 reference of tests/test_prefill_attention.py.

Every case: fresh random q and caches (never zeros), every cache position a request does not own is NaN
(what futx's reference KVCache holds there: the kernel must neither read past a request's causal range
nor let masked NaN keys / values leak into valid rows), the output poisoned with NaN before the launch
(every row must be written), odd lengths, mixed packed batches with chunked-prefill starts, head dims 64
and 128, GQA groups 1..16 (3, 5, 6, 7, ... do not divide the kernel's 128-row tile: a tile holds 128 // G tokens
and its last rows stay idle; lengths straddle those tile sizes), SmolLM2-135M's shape (9 query heads over 3 KV
heads, head dim 64). Tolerance: P is rounded to BF16 before P V (like the reference model)
and O is stored in BF16, so |err| <= 2e-2 + 2e-2 |ref| on O ~ N(0, 1/len)-sized values.
"""

from __future__ import annotations


import pytest
import torch

from test_prefill_attention import make_case, reference

pytestmark = pytest.mark.gpu

DEV = "cuda"


@pytest.fixture(scope="module")
def attn():
    import futx.ops  # noqa: F401
    from futx.ops import prefill_attention as pa

    return pa.attention


def run_case(attn, lengths, starts, hq, hkv, d, seed=0, scale=None, slots=None):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, cu, st, sl = make_case(lengths, starts, hq, hkv, d, slots=slots, device=DEV, gen=gen)
    out = torch.full_like(q, float("nan"))
    attn(q, k, v, cu, st, sl, scale=scale, out=out)
    torch.cuda.synchronize()
    want = reference(q, k, v, cu, st, sl, scale)
    assert torch.isfinite(out).all(), f"non-finite rows: {(~torch.isfinite(out)).any(-1).any(-1).nonzero().flatten()[:16].tolist()}"
    err = (out.double() - want).abs()
    tol = 2e-2 + 2e-2 * want.abs()
    bad = err > tol
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} outside tolerance; max err {float(err.max()):.3g} at "
                           f"row {int(err.amax((1, 2)).argmax())}")
    return out


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("g", [1, 3, 4, 6, 8])
@pytest.mark.parametrize("n", [1, 17, 63, 64, 65, 300])
def test_single_request_lengths(attn, d, g, n):
    run_case(attn, [n], [0], 2 * g, 2, d, seed=n * 31 + g)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("g", [1, 3, 4, 6, 8])
def test_mixed_packed_batch_with_chunked_starts(attn, d, g):
    lengths = [1, 17, 63, 64, 65, 300, 129, 2]
    starts = [0, 5, 128, 0, 1000, 37, 64, 511]
    run_case(attn, lengths, starts, 4 * g, 4, d, seed=g + d, slots=[3, 0, 7, 2, 6, 1, 5, 4])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("g", range(1, 17))
def test_every_group_tile_boundaries_and_chunked_starts(attn, d, g):
    # lengths around the tile's T = 128 // G tokens (T - 1, T, T + 1, 2T + 1, 3T), odd, chunked starts
    t = 128 // g
    lengths = [t - 1 or 1, t, t + 1, 2 * t + 1, 1, 3 * t, 77]
    starts = [0, 5, 127, 128, 1000, 37, 255]
    run_case(attn, lengths, starts, 2 * g, 2, d, seed=100 * g + d, slots=[6, 0, 5, 1, 4, 2, 3])


def test_smollm2_shapes(attn):
    # SmolLM2-135M: 9 query heads over 3 KV heads (G = 3: 42 tokens per tile, rows 126, 127 idle), head dim 64;
    # a 2048-token prompt, chunks continuing earlier prefixes, single tokens
    run_case(attn, [2048, 517, 1, 43, 84], [0, 1500, 4000, 41, 126], 9, 3, 64, seed=9, slots=[4, 0, 3, 1, 2])


@pytest.mark.parametrize("d", [64, 128])
def test_llama_shapes_long_prefill(attn, d):
    # 32 q heads / 8 KV heads, one 2048-token prompt and a chunk continuing a 1500-token prefix
    run_case(attn, [2048, 700], [0, 1500], 32, 8, d, seed=3)


def test_explicit_scale_and_decode_like_rows(attn):
    # one new token per request (the op also serves decode-shaped batches), non-default scale
    run_case(attn, [1] * 9, [0, 1, 2, 127, 128, 129, 255, 256, 4000], 32, 8, 128, seed=5, scale=0.05)


def test_functional_op_and_empty_batch(attn):
    q, k, v, cu, st, sl = make_case([5, 3], [2, 0], 8, 2, 128, device=DEV)
    out = torch.ops.futx.prefill_attention(q, k, v, cu, st, sl, 0.0, True)
    torch.testing.assert_close(out.double(), reference(q, k, v, cu, st, sl), atol=2e-2, rtol=2e-2)
    empty = torch.empty(0, 8, 128, dtype=torch.bfloat16, device=DEV)
    zero = torch.zeros(2, dtype=torch.int32, device=DEV)
    assert attn(empty, k, v, zero, zero[:1], zero[:1]).shape == (0, 8, 128)


def test_cuda_graph_capture(attn):
    q, k, v, cu, st, sl = make_case([40, 90], [10, 0], 32, 8, 128, device=DEV)
    out = torch.full_like(q, float("nan"))
    attn(q, k, v, cu, st, sl, out=out)   # warm-up (loads / compiles the kernel)
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn(q, k, v, cu, st, sl, out=out)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.double(), reference(q, k, v, cu, st, sl), atol=2e-2, rtol=2e-2)


def test_range_errors_before_launch(attn):
    q, k, v, cu, st, sl = make_case([5, 3], [2, 0], 8, 2, 64, device=DEV)
    with pytest.raises(ValueError, match="overflow"):
        attn(q, k, v, cu, st + k.shape[2], sl)
    with pytest.raises(ValueError, match="slot out of range"):
        attn(q, k, v, cu, st, sl + 5)
