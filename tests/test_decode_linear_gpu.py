"""Decode projections on the GPU against the simulated-quantization reference (dequant(W) @ x in
float32), through the futx ops (AOT artifacts or JIT), on fresh random data with NaN-poisoned outputs
and split-K workspaces. Shapes: the 1B/8B/70B layer projections and SmolLM2-135M (K = 576, G = 64)."""

from __future__ import annotations

import dataclasses
import functools
import zlib

import pytest
import torch

from futx.config import preset

pytestmark = pytest.mark.gpu

M_VALUES = (1, 2, 3, 8, 16, 31, 32, 33, 64)
SHAPES = [(name, proj, *preset(name).projection_shapes()[proj])
          for name in ("layer-1b", "layer-8b", "layer-70b", "smollm2-135m")
          for proj in ("qkv", "o", "gate_up", "down")]


def _group(name: str) -> int:
    return 64 if name.startswith("smollm2") else 128


@pytest.fixture(scope="module", autouse=True)
def _exact_reference():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import futx.ops  # noqa: F401  (registers torch.ops.futx.*)


@pytest.fixture(scope="module", autouse=True)
def _tuning_space():
    """The design variants these tests also run (INT4 GEMV bucket 16, nofold/r2, tile p1/p3/p4/rolling, skinny
    s3/s4; attention table/s2/vlut/w6v/fx) are not in the package registry: register scripts/tuning_space.py."""
    from tuning import tuning_space

    tuning_space().register()


@functools.lru_cache(maxsize=1)
def _weights(fmt: str, n: int, k: int, group: int, seed: int):
    """Random stored weights (any bit pattern the format allows) and their float32 dequantization,
    computed from the layout's own index map (the single source of truth)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if fmt == "int4":
        packed = torch.randint(-2**31, 2**31 - 1, (n // 16, k // 64, 32, 4), dtype=torch.int32, device="cuda",
                               generator=gen)
        scales = (torch.rand(n // 16, k // group, 16, device="cuda", generator=gen) * 0.02 + 1e-3).half()
        return (packed, scales), _dequant_int4(packed, scales, group)
    if fmt == "e4m3":
        raw = torch.randint(0, 256, (n, k), dtype=torch.uint8, device="cuda", generator=gen)
        raw = torch.where((raw & 0x7F) == 0x7F, raw ^ 1, raw)  # no NaN encodings
        data = raw.view(torch.float8_e4m3fn)
        scale = torch.rand(n, device="cuda", generator=gen) * 1e-3 + 1e-5
        return (data, scale), data.float() * scale[:, None]
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    return (w,), w.float()


def _dequant_int4(packed, scales, group):
    """float32 [N, K] on the GPU from the layout's own index map (layouts.unpack_int4_weight does the
    same on the CPU; this keeps the 70B matrices on the device)."""
    from futx.quant import layouts

    lay = layouts.INT4_WEIGHT
    nb, kb = packed.shape[:2]
    src = torch.from_numpy(layouts.weight_block_source().copy()).reshape(-1).cuda()
    shifts = 4 * torch.arange(lay.nibbles_per_word, device="cuda")
    nibs = ((packed.long() & 0xFFFFFFFF).unsqueeze(-1) >> shifts) & 0xF
    blocks = torch.empty(nb, kb, lay.block_n * lay.block_k, dtype=torch.uint8, device="cuda")
    blocks[:, :, src] = nibs.reshape(nb, kb, -1).to(torch.uint8)
    del nibs
    q = blocks.view(nb, kb, lay.block_n, lay.block_k).permute(0, 2, 1, 3).reshape(nb * lay.block_n, kb * lay.block_k)
    s = layouts.unpack_weight_scales(scales).float().repeat_interleave(group, dim=1)
    return (q.float() - lay.offset) * s


def _inputs(m, k, n, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    r = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    return x, r


def _reference(x, w_ref, epilogue, r):
    """x . dequant(W)^T (and the epilogue) in float64."""
    y = x.double() @ w_ref.double().T
    if epilogue == "residual":
        return y + r.double()
    if epilogue == "swiglu":
        g, u = y[:, 0::2], y[:, 1::2]
        return torch.nn.functional.silu(g) * u
    return y


def _run(fmt, stored, x, group, epilogue, r, split=None, kernel="auto", variant="", tiles=None, warps=None):
    """One launch with a NaN-poisoned output and split-K workspace."""
    from futx.ops.decode_linear import run_variant

    w, s = stored[0], (stored[1] if len(stored) > 1 else None)
    n = r.shape[1]
    out = torch.full((x.shape[0], n // 2 if epilogue == "swiglu" else n), float("nan"), dtype=torch.bfloat16,
                     device="cuda")
    ws = torch.full((max(32 * n, 512 * 2 * 128) * 64,), float("nan"), device="cuda")   # stream-K: 2 tiles per CTA
    return run_variant(fmt, x, w, s, group, epilogue, r if epilogue == "residual" else None, kernel, variant,
                       tiles, split, out=out, workspace=ws, warps=warps)


def _check(y, want, what):
    assert not torch.isnan(y).any(), f"{what}: NaN in the output (an element was never written)"
    scale = want.abs().max().item() + 1e-6
    err = (y.float() - want).abs()
    bad = err > 4e-3 * want.abs() + 2e-3 * scale
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements off, max err {err.max().item():.3g} "
                           f"(ref max {scale:.3g}) at {tuple(bad.nonzero()[0].tolist())}")


@pytest.mark.parametrize("fmt", ["int4", "e4m3", "bf16"])
@pytest.mark.parametrize("name,proj,n,k", SHAPES, ids=[f"{s[0]}-{s[1]}" for s in SHAPES])
def test_projection_matches_simulated_quantization(name, proj, n, k, fmt):
    group = _group(name)
    stored, w_ref = _weights(fmt, n, k, group, zlib.crc32(f"{name}/{proj}/{fmt}".encode()) % 10_000)
    epilogue = {"o": "residual", "down": "residual", "gate_up": "swiglu"}.get(proj, "store")
    for m in M_VALUES:
        x, r = _inputs(m, k, n, m)
        y = _run(fmt, stored, x, group, epilogue, r)
        torch.cuda.synchronize()
        _check(y, _reference(x, w_ref, epilogue, r), f"{name} {proj} {fmt} M={m} {epilogue}")


@pytest.mark.parametrize("epilogue", ["store", "residual", "swiglu"])
@pytest.mark.parametrize("fmt", ["int4", "e4m3", "bf16"])
def test_every_epilogue(fmt, epilogue):
    n, k = 4096, 4096
    stored, w_ref = _weights(fmt, n, k, 128, 7)
    for m in (1, 5, 16, 32, 47, 64):
        x, r = _inputs(m, k, n, 100 + m)
        y = _run(fmt, stored, x, 128, epilogue, r)
        torch.cuda.synchronize()
        _check(y, _reference(x, w_ref, epilogue, r), f"{fmt} {epilogue} M={m}")


@pytest.mark.parametrize("split", [1, 2, 3, 7, 32])
def test_split_k_is_exact_and_leaves_counters_zero(split):
    from futx.ops import split_counters

    n, k = 2048, 4096
    stored, w_ref = _weights("int4", n, k, 128, 11)
    x, r = _inputs(20, k, n, 3)
    y = _run("int4", stored, x, 128, "store", r, split=split, kernel="skinny")
    y2 = _run("int4", stored, x, 128, "store", r, split=split, kernel="skinny")
    torch.cuda.synchronize()
    _check(y, _reference(x, w_ref, "store", r), f"split={split}")
    assert torch.equal(y, y2), "split-K result is not deterministic"
    assert int(split_counters.counters(x.device).abs().sum()) == 0, "arrival counters were not reset"


@pytest.mark.parametrize("fmt,group,variant", [("int4", 128, "rww"), ("int4", 128, "rww1"), ("int4", 128, "rwwb"),
                                               ("int4", 64, "rww"), ("e4m3", 128, "rww"), ("bf16", 128, "rww")])
@pytest.mark.parametrize("split", [1, 3, 7])
def test_64_row_bucket(fmt, group, variant, split):
    """The 64-row bucket (register-weights skinny kernel for every format, P16) at odd M, split K deterministic."""
    from futx.ops import split_counters

    n, k = 2096, 4096
    stored, w_ref = _weights(fmt, n, k, group, 13 + split)
    for m, epilogue in ((33, "store"), (50, "residual"), (63, "swiglu"), (64, "store")):
        x, r = _inputs(m, k, n, m + split)
        y = _run(fmt, stored, x, group, epilogue, r, kernel="skinny", variant=variant, split=split)
        y2 = _run(fmt, stored, x, group, epilogue, r, kernel="skinny", variant=variant, split=split)
        torch.cuda.synchronize()
        _check(y, _reference(x, w_ref, epilogue, r), f"{fmt} g{group} {variant} M={m} split={split} {epilogue}")
        assert torch.equal(y, y2), "split-K result is not deterministic"
    assert int(split_counters.counters(x.device).abs().sum()) == 0, "arrival counters were not reset"


# GEMV geometry: a short last CTA (N/16 = 131 blocks), K shorter than the 16 warps (units < warps: fewer
# warps, several output passes per round), uneven K shares (17 units), group 64 with 9 units
GEMV_CASES = [(2096, 4096, 128, 1), (2096, 4096, 128, 3), (2096, 4096, 128, 7), (512, 256, 128, None),
              (1024, 2176, 128, None), (576, 576, 64, None)]


@pytest.mark.parametrize("fmt", ["int4", "e4m3", "bf16"])
@pytest.mark.parametrize("n,k,group,tiles", GEMV_CASES, ids=[f"{c[0]}x{c[1]}g{c[2]}t{c[3]}" for c in GEMV_CASES])
def test_gemv_geometry(fmt, n, k, group, tiles):
    stored, w_ref = _weights(fmt, n, k, group, n + k + (tiles or 0))
    for epilogue in ("store", "residual", "swiglu"):
        for m in (1, 5, 8, 16):
            x, r = _inputs(m, k, n, 40 + m)
            y = _run(fmt, stored, x, group, epilogue, r, kernel="gemv", tiles=tiles)
            torch.cuda.synchronize()
            _check(y, _reference(x, w_ref, epilogue, r), f"gemv {fmt} {n}x{k} tiles={tiles} M={m} {epilogue}")


# tile GEMV (INT4 M = 1): one n-block, K of one unit (most warps have no share), 17 units (uneven shares),
# the 8B shapes (QKV, down)
TILE_CASES = [(16, 128), (2096, 2176), (6144, 4096), (4096, 14336)]


# the warp counts only the fill rule picks (decode.plan.TILE_FILL_WARPS beyond 4 and 8; tests/test_decode_linear.py
# ties the two lists), with batches of 2 and the long-K batches of 3
FILL_WARPS = (6, 12, 16)
TILE_RUNS = ([(w, v) for w in (4, 8) for v in ("", "rolling", "p1", "p3", "p4", "ring4", "ring8", "fold")]
             + [(w, v) for w in FILL_WARPS for v in ("", "p3")])


@pytest.mark.parametrize("warps,variant", TILE_RUNS, ids=[f"w{w}-{v or 'batch'}" for w, v in TILE_RUNS])
@pytest.mark.parametrize("n,k", TILE_CASES, ids=[f"{c[0]}x{c[1]}" for c in TILE_CASES])
def test_tile_gemv(n, k, warps, variant):
    """The one-tile-per-CTA M = 1 GEMV (the plan's INT4 M = 1 default) in both warp counts, as measured
    (batch prefetch) and with the tuning-space pipelines, and at the fill rule's warp counts (uneven K shares: 32
    units over 6 or 12 warps, 17 over 16, one unit where most warps have none), every epilogue. The shared-memory
    ring feeds the same MMAs in the same order as the batch pipeline, so its output is bitwise the batch
    pipeline's."""
    stored, w_ref = _weights("int4", n, k, 128, n + k + warps)
    x, r = _inputs(1, k, n, 7)
    for epilogue in ("store", "residual", "swiglu"):
        y = _run("int4", stored, x, 128, epilogue, r, kernel="tile", variant=variant, warps=warps)
        torch.cuda.synchronize()
        _check(y, _reference(x, w_ref, epilogue, r), f"tile w{warps} {variant or 'batch'} {n}x{k} {epilogue}")
        if variant.startswith("ring"):
            base = _run("int4", stored, x, 128, epilogue, r, kernel="tile", warps=warps)
            assert torch.equal(y, base), f"ring {variant} w{warps} {n}x{k} {epilogue} != batch pipeline"


@pytest.mark.parametrize("warps", FILL_WARPS)
@pytest.mark.parametrize("n,k", TILE_CASES, ids=[f"{c[0]}x{c[1]}" for c in TILE_CASES])
def test_tile_gemv_fill_warps_norm(n, k, warps):
    """The fused-norm M = 1 tile GEMV (store, SwiGLU) at the fill rule's warp counts against the float reference."""
    from decode import plan
    from futx.ops.decode_linear import _launch
    from futx.runtime import get_kernel

    stored, w_ref = _weights("int4", n, k, 128, n + k + warps)
    x, _ = _inputs(1, k, n, 9)
    xs, eps = (x.float() * 3.0).bfloat16(), 1e-5
    for epilogue in ("store", "swiglu"):
        choice = plan.choose("int4", 128, epilogue, 1, n, k, kernel="tile", warps=warps, norm=True)
        y = _launch((choice, get_kernel(choice.key)), epilogue, xs, *stored, None, n, eps=eps)
        torch.cuda.synchronize()
        want = xs.float() @ w_ref.T * torch.rsqrt(xs.float().pow(2).mean(1, keepdim=True) + eps)
        want = torch.nn.functional.silu(want[:, 0::2]) * want[:, 1::2] if epilogue == "swiglu" else want
        _check(y, want, f"tile w{warps} norm {n}x{k} {epilogue}")


# n-blocks per CTA: one n-block (a grid of one CTA, most warps without a share at K = 128), 131 n-blocks (no count
# divides it: the last CTA holds fewer) over 17 units, the 8B QKV and down, the 8B gate/up
NBLOCK_CASES = [(16, 128), (2096, 2176), (6144, 4096), (4096, 14336), (28672, 4096)]


@pytest.mark.parametrize("nblocks", [2, 3, 4])
@pytest.mark.parametrize("n,k", NBLOCK_CASES, ids=[f"{c[0]}x{c[1]}" for c in NBLOCK_CASES])
def test_tile_gemv_nblocks_is_bitwise_one_block_per_cta(n, k, nblocks):
    """The M = 1 tile GEMV with several consecutive n-blocks per CTA runs each n-block's units through the same MMAs
    in the same order as one n-block per CTA, so every output is bitwise the one-block kernel's: both warp counts,
    every epilogue, batches of 2 and 3 units, the fused norm (store, SwiGLU); NaN-poisoned outputs, and the float
    reference once per case."""
    from decode import plan
    from futx.ops.decode_linear import _launch
    from futx.runtime import get_kernel

    stored, w_ref = _weights("int4", n, k, 128, n + k + nblocks)
    x, r = _inputs(1, k, n, 13)
    eps = 1e-5
    for warps in (4, 8):
        for epilogue in ("store", "residual", "swiglu"):
            for variant, norm in (("", False), ("p3", False), ("", True)):
                if norm and epilogue == "residual":
                    continue
                xi = (x.float() * 3.0).bfloat16() if norm else x
                ri = r if epilogue == "residual" else None
                outs = []
                for nb in (nblocks, 1):
                    choice = plan.choose("int4", 128, epilogue, 1, n, k, kernel="tile", warps=warps, variant=variant,
                                         norm=norm, nblocks=nb)
                    assert choice.key.endswith(f".nb{nblocks}") == (nb > 1), choice.key
                    out = torch.full((1, n // 2 if epilogue == "swiglu" else n), float("nan"), dtype=torch.bfloat16,
                                     device="cuda")
                    outs.append(_launch((choice, get_kernel(choice.key)), epilogue, xi, *stored, ri, n, out,
                                        eps=eps if norm else None))
                torch.cuda.synchronize()
                what = f"tile nb{nblocks} w{warps} {variant or 'batch'}{' norm' if norm else ''} {n}x{k} {epilogue}"
                assert not torch.isnan(outs[0]).any(), f"{what}: an output was never written"
                assert torch.equal(outs[0], outs[1]), f"{what}: != one n-block per CTA"
                if variant == "" and not norm and warps == 4:
                    _check(outs[0], _reference(x, w_ref, epilogue, r), what)


# the multi-token tile GEMV (1 < M <= 8): one n-block with one unit, 17 units over uneven warp shares, the 8B QKV
# and down (K = 14336: its rows fit up to M = 7)
MULTI_CASES = [(16, 128), (2096, 2176), (6144, 4096), (4096, 14336)]


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("n,k", MULTI_CASES, ids=[f"{c[0]}x{c[1]}" for c in MULTI_CASES])
def test_multi_token_tile_gemv(n, k, warps):
    """The multi-token tile GEMV at odd M, every epilogue, against the float reference; each token's row is
    bitwise the M = 1 kernel's on that row alone (MMA columns are independent, same order of sums); rows past M
    of the output buffer are never written."""
    from decode import plan
    from futx.ops.decode_linear import run_variant

    stored, w_ref = _weights("int4", n, k, 128, n + k + warps)
    for m in (2, 3, 5, 8):
        if not plan.tile_fits(k, warps, False, "", m):
            continue
        x, r = _inputs(m, k, n, 5 + m)
        for epilogue in ("store", "residual", "swiglu"):
            width = n // 2 if epilogue == "swiglu" else n
            buf = torch.full((m + 1, width), float("nan"), dtype=torch.bfloat16, device="cuda")
            y = run_variant("int4", x, stored[0], stored[1], 128, epilogue, r if epilogue == "residual" else None,
                            "tile", out=buf[:m], warps=warps)
            torch.cuda.synchronize()
            what = f"tile M={m} w{warps} {n}x{k} {epilogue}"
            _check(y, _reference(x, w_ref, epilogue, r), what)
            assert torch.isnan(buf[m]).all(), f"{what}: wrote past row M"
            for i in (0, m - 1):
                one = _run("int4", stored, x[i:i + 1].contiguous(), 128, epilogue, r[i:i + 1].contiguous(),
                           kernel="tile", warps=warps)
                assert torch.equal(y[i:i + 1], one), f"{what}: row {i} != the M = 1 kernel on it"


@pytest.mark.parametrize("nblocks", [2, 3, 5, 8, 16])
@pytest.mark.parametrize("n,k", NBLOCK_CASES, ids=[f"{c[0]}x{c[1]}" for c in NBLOCK_CASES])
def test_multi_token_nblocks_is_bitwise_one_block_per_cta(n, k, nblocks):
    """The multi-token tile GEMV with several n-blocks per CTA: every token's outputs bitwise the one-block kernel's
    (same units, MMAs and order per n-block), at odd M, both warp counts, every epilogue and the fused norm;
    NaN-poisoned outputs, nothing written past row M."""
    from decode import plan
    from futx.ops.decode_linear import _launch
    from futx.runtime import get_kernel

    stored, w_ref = _weights("int4", n, k, 128, n + k + 7 * nblocks)
    for m in (2, 3, 8):
        x, r = _inputs(m, k, n, 17 + m)
        for warps in (4, 8):
            if not plan.tile_fits(k, warps, True, "", m, nblocks):
                continue
            for epilogue, norm in (("store", False), ("residual", False), ("swiglu", False), ("store", True),
                                   ("swiglu", True)):
                xi = (x.float() * 3.0).bfloat16() if norm else x
                width = n // 2 if epilogue == "swiglu" else n
                outs = []
                for nb in (nblocks, 1):
                    choice = plan.choose("int4", 128, epilogue, m, n, k, kernel="tile", warps=warps, norm=norm,
                                         nblocks=nb)
                    buf = torch.full((m + 1, width), float("nan"), dtype=torch.bfloat16, device="cuda")
                    _launch((choice, get_kernel(choice.key)), epilogue, xi, *stored,
                            r if epilogue == "residual" else None, n, buf[:m], eps=1e-5 if norm else None)
                    outs.append(buf)
                torch.cuda.synchronize()
                what = f"tile M={m} nb{nblocks} w{warps}{' norm' if norm else ''} {n}x{k} {epilogue}"
                assert not torch.isnan(outs[0][:m]).any(), f"{what}: an output was never written"
                assert torch.isnan(outs[0][m]).all(), f"{what}: wrote past row M"
                assert torch.equal(outs[0][:m], outs[1][:m]), f"{what}: != one n-block per CTA"
                if warps == 8 and not norm:
                    _check(outs[0][:m], _reference(x, w_ref, epilogue, r), what)


# the fused norm on the multi-token tile GEMV where the router sends it (small grids): the 8B QKV, 17 units over
# uneven warp shares with SwiGLU, one n-block with one unit
MULTI_NORM_CASES = [(6144, 4096, "store"), (2096, 2176, "swiglu"), (16, 128, "store")]


@pytest.mark.parametrize("n,k,epilogue", MULTI_NORM_CASES, ids=[f"{c[0]}x{c[1]}-{c[2]}" for c in MULTI_NORM_CASES])
def test_multi_token_norm_linear_routed(n, k, epilogue):
    """Routed to the multi-token tile GEMV (routing rule P12), the fused-norm projection at M = 2..8 scales each
    token's outputs by its own row factor, and a CUDA graph of it replays the eager result; with the rule switched
    off (route_tile_variant(max_m=1), how the engine benchmark times the old rule) the row factor is its own
    kernel again."""
    from decode import plan
    from futx.ops.decode_linear import decode_norm_linear_int4

    eps = 1e-5
    stored, w_ref = _weights("int4", n, k, 128, n + k)
    for m in (2, 5, 8):
        assert plan.fuses_norm("int4", 128, epilogue, m, n, k), f"M={m} not routed to the fused kernel"
        x, _ = _inputs(m, k, n, 17 + m)
        x = (x.float() * 3.0).bfloat16()
        x[1] *= 0.01  # rows of different scale: a factor shared across tokens would be caught
        y = decode_norm_linear_int4(x, *stored, 128, epilogue, eps)
        torch.cuda.synchronize()
        factor = torch.rsqrt(x.float().pow(2).mean(1, keepdim=True) + eps)
        want = x.float() @ w_ref.T * factor
        want = torch.nn.functional.silu(want[:, 0::2]) * want[:, 1::2] if epilogue == "swiglu" else want
        _check(y, want, f"norm_linear M={m} {n}x{k} {epilogue}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g = decode_norm_linear_int4(x, *stored, 128, epilogue, eps)
    g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g, y), "graph replay != eager"
    plan.route_tile_variant("", max_m=1)
    try:
        assert not plan.fuses_norm("int4", 128, epilogue, 8, n, k)
        off = decode_norm_linear_int4(x, *stored, 128, epilogue, eps)
        torch.cuda.synchronize()
        _check(off, want, f"norm_linear M=8 {n}x{k} {epilogue}, multi-token tile off")
    finally:
        plan.route_tile_variant("")


# split-K tile GEMV: 17 units in 2-4 uneven ranges, the 8B down (routed: 3 splits) and the 70B down
SPLIT_CASES = [(2096, 2176), (4096, 14336), (8192, 28672)]


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("n,k", SPLIT_CASES, ids=[f"{c[0]}x{c[1]}" for c in SPLIT_CASES])
def test_tile_gemv_split_k(n, k, warps):
    """Split-K of the M = 1 tile GEMV (residual epilogue): every count matches the float64 reference, repeats
    bitwise (partials summed in split order), leaves the arrival counters at zero, and replays in a CUDA graph."""
    from futx.ops import split_counters

    stored, w_ref = _weights("int4", n, k, 128, n + k + warps)
    x, r = _inputs(1, k, n, 11)
    want = _reference(x, w_ref, "residual", r)
    for sp in (1, 2, 3, 4):
        y = _run("int4", stored, x, 128, "residual", r, split=sp, kernel="tile", warps=warps)
        again = _run("int4", stored, x, 128, "residual", r, split=sp, kernel="tile", warps=warps)
        torch.cuda.synchronize()
        _check(y, want, f"tile split {sp} w{warps} {n}x{k}")
        assert torch.equal(y, again), f"split {sp}: a second call differs (non-deterministic reduction or stale counters)"
    assert not split_counters.counters(x.device)[: n // 16].any(), "arrival counters not reset"
    from futx.ops.decode_linear import run_variant

    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(4 * n, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_variant("int4", x, stored[0], stored[1], 128, "residual", r, "tile", split=3, out=out, workspace=ws,
                    warps=warps)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    eager = _run("int4", stored, x, 128, "residual", r, split=3, kernel="tile", warps=warps)
    assert torch.equal(out, eager), "split 3 in a CUDA graph differs from the eager call"


@pytest.mark.parametrize("epilogue", ["store", "residual", "swiglu"])
def test_design_variants_match(epilogue):
    """Tuning-space GEMV variants (no fold; scales converted at the load as in run 2) at M = 1 and 8;
    the skinny kernel on shapes the GEMV serves."""
    n, k = 4096, 14336
    stored, w_ref = _weights("int4", n, k, 128, 5)
    for m, variant in ((1, "nofold"), (1, "r2"), (8, "nofold"), (8, "r2")):
        x, r = _inputs(m, k // 2, n, m)  # K / 2: eight rows fit in shared memory
        sub = _weights("int4", n, k // 2, 128, 6)
        y = _run("int4", sub[0], x, 128, epilogue, r, kernel="gemv", variant=variant)
        torch.cuda.synchronize()
        _check(y, _reference(x, sub[1], epilogue, r), f"gemv {variant} M={m} {epilogue}")
    x, r = _inputs(1, k, n, 1)
    for variant in ("nofold", "r2"):
        y = _run("int4", stored, x, 128, epilogue, r, kernel="gemv", variant=variant)
        torch.cuda.synchronize()
        _check(y, _reference(x, w_ref, epilogue, r), f"gemv {variant} {epilogue}")
    for m in (2, 16):
        x, r = _inputs(m, k, n, m)
        y = _run("int4", stored, x, 128, epilogue, r, kernel="skinny")
        torch.cuda.synchronize()
        _check(y, _reference(x, w_ref, epilogue, r), f"skinny M={m} {epilogue}")


@pytest.mark.parametrize("variant", ["s3", "s4", "c2"])
@pytest.mark.parametrize("epilogue", ["store", "residual", "swiglu"])
def test_skinny_ring_variants(variant, epilogue):
    """Tuning-space INT4 skinny variants with shorter rings (more CTAs per SM, larger split), at odd M in
    both token buckets, on the 8B down shape (split K) and a gate/up-like shape."""
    for (n, k), seed in (((4096, 14336), 11), ((2048, 4096), 12)):
        stored, w_ref = _weights("int4", n, k, 128, seed)
        for m in (9, 13, 31):
            x, r = _inputs(m, k, n, m + seed)
            y = _run("int4", stored, x, 128, epilogue, r, kernel="skinny", variant=variant)
            torch.cuda.synchronize()
            _check(y, _reference(x, w_ref, epilogue, r), f"skinny {variant} M={m} {n}x{k} {epilogue}")


# the register-weights skinny kernel: the 8B down shape (split K), a partial last 128-channel tile (N/16 = 131) with
# 17 units (odd batches), the 8B QKV shape
RW_CASES = [(4096, 14336), (2096, 2176), (6144, 4096)]


@pytest.mark.parametrize("variant", ["rw", "rw1", "rw4", "rwc", "rw1c"])
@pytest.mark.parametrize("epilogue", ["store", "residual", "swiglu"])
@pytest.mark.parametrize("n,k", RW_CASES, ids=[f"{c[0]}x{c[1]}" for c in RW_CASES])
def test_skinny_register_weights(n, k, epilogue, variant):
    """The skinny kernel with the weights streamed into registers (variants "rw", "rw1", "rw4"; "rwc", "rw1c" with the
    cluster split-K) at odd M in both token buckets and several splits: the same units, MMAs and order (and split
    partials summed in split order) as the ring skinny kernel, so bitwise its output, and close to the float64
    reference."""
    stored, w_ref = _weights("int4", n, k, 128, n + k)
    for m, split in ((2, 1), (3, 3), (9, 2), (16, 5), (17, 1), (31, 7), (32, 4)):
        x, r = _inputs(m, k, n, m + n)
        y = _run("int4", stored, x, 128, epilogue, r, kernel="skinny", variant=variant, split=split)
        base = _run("int4", stored, x, 128, epilogue, r, kernel="skinny", split=split)
        torch.cuda.synchronize()
        _check(y, _reference(x, w_ref, epilogue, r), f"skinny {variant} M={m} {n}x{k} split {split} {epilogue}")
        assert torch.equal(y, base), f"skinny {variant} M={m} {n}x{k} split {split} {epilogue}: not bitwise the ring's"


# the wgmma skinny kernel: the 8B down shape (split K), a partial last 128-channel tile (N/16 = 131), group 64
# with K = 576 (9 units: uneven splits) and the 8B QKV shape
WG_CASES = [(4096, 14336, 128), (2096, 4096, 128), (576, 576, 64), (1536, 576, 64), (6144, 4096, 128)]


@pytest.mark.parametrize("variant", ["wg", "wgo", "rwg", "rwgo"])
@pytest.mark.parametrize("epilogue", ["store", "residual", "swiglu"])
@pytest.mark.parametrize("n,k,group", WG_CASES, ids=[f"{c[0]}x{c[1]}g{c[2]}" for c in WG_CASES])
def test_skinny_wgmma(n, k, group, epilogue, variant):
    """The skinny kernel on warpgroup MMA (variants "wg", "wgo"; "rwg", "rwgo" with the weights streamed into registers)
    at odd M in both token buckets."""
    stored, w_ref = _weights("int4", n, k, group, n + k + group)
    for m in (2, 3, 9, 16, 17, 31, 32):
        x, r = _inputs(m, k, n, m + n)
        y = _run("int4", stored, x, group, epilogue, r, kernel="skinny", variant=variant)
        torch.cuda.synchronize()
        _check(y, _reference(x, w_ref, epilogue, r), f"skinny {variant} M={m} {n}x{k} g{group} {epilogue}")


@pytest.mark.parametrize("variant", ["wg", "wgo", "rwg", "rwgo"])
@pytest.mark.parametrize("split", [1, 2, 3, 7, 32])
def test_skinny_wgmma_split_k(split, variant):
    from futx.ops import split_counters

    n, k = 2048, 4096
    stored, w_ref = _weights("int4", n, k, 128, 11)
    x, r = _inputs(20, k, n, 3)
    y = _run("int4", stored, x, 128, "store", r, split=split, kernel="skinny", variant=variant)
    y2 = _run("int4", stored, x, 128, "store", r, split=split, kernel="skinny", variant=variant)
    torch.cuda.synchronize()
    _check(y, _reference(x, w_ref, "store", r), f"{variant} split={split}")
    assert torch.equal(y, y2), "split-K result is not deterministic"
    assert int(split_counters.counters(x.device).abs().sum()) == 0, "arrival counters were not reset"


# the warp-specialized wgmma kernel ("ws", decode/skinny_ws.py): the 8B down (split K, 112 units), a partial last
# 128-channel tile (N/16 = 131), the 8B QKV and a 2-unit K (a ring longer than the work)
WS_CASES = [(4096, 14336), (2096, 4096), (6144, 4096), (1024, 256)]
WS_M = (2, 8, 9, 16, 17, 31, 32, 33, 50, 63, 64)   # every token bucket, partly and wholly filled


@pytest.mark.parametrize("variant", ["ws", "wsk", "wst", "wskt"])
@pytest.mark.parametrize("epilogue", ["store", "residual", "swiglu"])
@pytest.mark.parametrize("n,k", WS_CASES, ids=[f"{c[0]}x{c[1]}" for c in WS_CASES])
def test_skinny_ws(n, k, epilogue, variant):
    """The warp-specialized kernel (grid and stream-K schedules) against float64 x @ dequant(W)^T at odd M in every
    token bucket, the split the rule picks, NaN-poisoned outputs."""
    _ws_sweep("int4", n, k, epilogue, variant, WS_M, "skinny")


def _ws_sweep(fmt, n, k, epilogue, variant, ms, label):
    """The skinny kernel `variant` on fmt weights [n, k] at each M of `ms`, against float64 x @ dequant(W)^T."""
    stored, w_ref = _weights(fmt, n, k, 128, n + k)
    for m in ms:
        x, r = _inputs(m, k, n, m + n)
        y = _run(fmt, stored, x, 128, epilogue, r, kernel="skinny", variant=variant)
        torch.cuda.synchronize()
        _check(y, _reference(x, w_ref, epilogue, r), f"{label} {variant} M={m} {n}x{k} {epilogue}")


@pytest.mark.parametrize("variant", ["wsk", "wskt"])
@pytest.mark.parametrize("m", [16, 32, 64])
@pytest.mark.parametrize("ctas", [1, 5, 37, 132, 512])
def test_skinny_ws_stream_k(ctas, m, variant):
    """Stream-K with any CTA count (1: every tile whole in one CTA; 512: one unit per CTA, a tile summed from 32
    partials): exact, deterministic, the arrival counters left zero."""
    from futx.ops import split_counters

    n, k = 2048, 4096   # 16 tiles x 32 units
    stored, w_ref = _weights("int4", n, k, 128, 12)
    x, r = _inputs(m - 5, k, n, 4)
    y = _run("int4", stored, x, 128, "swiglu", r, split=ctas, kernel="skinny", variant=variant)
    y2 = _run("int4", stored, x, 128, "swiglu", r, split=ctas, kernel="skinny", variant=variant)
    torch.cuda.synchronize()
    _check(y, _reference(x, w_ref, "swiglu", r), f"{variant} M={m - 5} ctas={ctas}")
    assert torch.equal(y, y2), "stream-K result is not deterministic"
    assert int(split_counters.counters(x.device).abs().sum()) == 0, "arrival counters were not reset"


@pytest.mark.parametrize("m", [16, 32, 64])
@pytest.mark.parametrize("split", [1, 2, 3, 7, 32])
def test_skinny_ws_split_k(split, m):
    """Every split count (32: one unit per CTA) is exact, deterministic and leaves the arrival counters zero."""
    from futx.ops import split_counters

    n, k = 2048, 4096
    stored, w_ref = _weights("int4", n, k, 128, 11)
    x, r = _inputs(m - 3, k, n, 3)
    y = _run("int4", stored, x, 128, "residual", r, split=split, kernel="skinny", variant="ws")
    y2 = _run("int4", stored, x, 128, "residual", r, split=split, kernel="skinny", variant="ws")
    torch.cuda.synchronize()
    _check(y, _reference(x, w_ref, "residual", r), f"ws M={m - 3} split={split}")
    assert torch.equal(y, y2), "split-K result is not deterministic"
    assert int(split_counters.counters(x.device).abs().sum()) == 0, "arrival counters were not reset"


@pytest.mark.parametrize("fmt,m", [("int4", 24), ("e4m3", 40)])
def test_skinny_ws_chain_respects_the_dependency(fmt, m):
    """PDL: the warp-specialized kernels (INT4 and E4M3) request their first weights before they wait for the previous
    kernel; their activations must still be the previous kernel's finished output (a chain into NaN-poisoned
    buffers, both schedules alternating with the routed kernel)."""
    from futx.ops.decode_linear import run_variant

    k = 2048
    stored, w_ref = _weights(fmt, k, k, 128, 9)
    x = torch.randn(m, k, device="cuda").bfloat16()
    y, want = x, x.float()
    for i in range(6):
        o = torch.full((m, k), float("nan"), dtype=torch.bfloat16, device="cuda")
        y = run_variant(fmt, y, stored[0], stored[1], 128, out=o, kernel=("skinny", "auto", "skinny")[i % 3],
                        variant=("ws", "", "wsk")[i % 3])
        want = (want @ w_ref.T).bfloat16().float()
    torch.cuda.synchronize()
    assert not torch.isnan(y).any(), "a kernel read its input before the previous kernel wrote it"
    err = (y.float() - want).abs().max().item()
    assert err <= 5e-2 * want.abs().max().item(), f"chained projections off by {err:.3g}"


# the warp-specialized kernel on E4M3 weights (decode/skinny_ws_e4m3.py, 64-k units): K a multiple of 64 but not of
# 128 (4160: 65 units, 1344: 21), a partial last 128-channel tile (N/16 = 131 and 65), the 8B QKV, one unit (K = 64)
E4M3_WS_CASES = [(2096, 4160), (6144, 4096), (1040, 1344), (400, 64)]
E4M3_WS_M = (8, 9, 16, 17, 31, 33, 63, 64)   # every token bucket, partly and wholly filled


@pytest.mark.parametrize("variant", ["ws", "wsk"])
@pytest.mark.parametrize("epilogue", ["store", "residual", "swiglu"])
@pytest.mark.parametrize("n,k", E4M3_WS_CASES, ids=[f"{c[0]}x{c[1]}" for c in E4M3_WS_CASES])
def test_e4m3_ws(n, k, epilogue, variant):
    """The E4M3 warp-specialized kernel (grid and stream-K schedules, the split the rule picks) against float64
    x @ dequant(W)^T (every e4m3 bit pattern but NaN, per-channel scales) at odd M in every token bucket, NaN-poisoned
    outputs."""
    _ws_sweep("e4m3", n, k, epilogue, variant, E4M3_WS_M, "e4m3")


# (M, variant, split); ws 65 at M = 17 only: its [split][N][64] workspace at M = 64 exceeds _run's
E4M3_WS_SPLITS = [(m, v, sp) for m in (17, 64)
                  for v, splits in (("ws", (1, 2, 3, 7, 33, 65)), ("wsk", (1, 5, 37, 132, 512)))
                  for sp in splits if (m, v, sp) != (64, "ws", 65)]


@pytest.mark.parametrize("m,variant,split", E4M3_WS_SPLITS)
def test_e4m3_ws_split_k(m, variant, split):
    """Every split count of both schedules (ws 65: one unit per CTA; wsk 1: every tile whole in one CTA, 512: tiles
    summed from up to 31 partials) is exact, deterministic and leaves the arrival counters zero."""
    from futx.ops import split_counters

    n, k = 2096, 4160   # 17 tiles (the last partial) x 65 units
    stored, w_ref = _weights("e4m3", n, k, 128, 13)
    x, r = _inputs(m, k, n, 5)
    epilogue = "residual" if variant == "ws" else "swiglu"
    y = _run("e4m3", stored, x, 128, epilogue, r, split=split, kernel="skinny", variant=variant)
    y2 = _run("e4m3", stored, x, 128, epilogue, r, split=split, kernel="skinny", variant=variant)
    torch.cuda.synchronize()
    _check(y, _reference(x, w_ref, epilogue, r), f"e4m3 {variant} M={m} split={split}")
    assert torch.equal(y, y2), "split-K result is not deterministic"
    assert int(split_counters.counters(x.device).abs().sum()) == 0, "arrival counters were not reset"


# the fused-RMSNorm tile GEMV (M = 1): the 8B QKV and gate/up, the 70B QKV (K = 8192), one n-block with one unit,
# 17 units over 4 warps (uneven shares) and the SwiGLU epilogue
NORM_CASES = [(6144, 4096, "store"), (28672, 4096, "swiglu"), (10240, 8192, "store"), (16, 128, "store"),
              (2096, 2176, "swiglu")]


@pytest.mark.parametrize("n,k,epilogue", NORM_CASES, ids=[f"{c[0]}x{c[1]}-{c[2]}" for c in NORM_CASES])
def test_norm_linear_matches_row_factor_then_projection(n, k, epilogue):
    """decode_norm_linear_int4 at M = 1 (one launch: the outputs scaled by the row factor) against the float
    reference rsqrt(mean(x^2) + eps) * (x @ W) and against the row-factor kernel followed by the projection (which
    rounds the normalized row to bf16 first). At M = 3 it is either the fused multi-token tile GEMV (where
    decode.plan.fuses_norm: small grids) or exactly those two kernels."""
    from decode import plan
    from futx.ops.decode_linear import decode_linear_int4, decode_norm_linear_int4
    from futx.ops.rms_rows import rms_rows

    eps = 1e-5
    stored, w_ref = _weights("int4", n, k, 128, n + k)
    for m in (1, 3):
        x, r = _inputs(m, k, n, 7 + m)
        x = (x.float() * 3.0).bfloat16()
        y = decode_norm_linear_int4(x, *stored, 128, epilogue, eps)
        two = decode_linear_int4(rms_rows(x, eps), *stored, 128, epilogue)
        torch.cuda.synchronize()
        factor = torch.rsqrt(x.float().pow(2).mean(1, keepdim=True) + eps)
        fused = plan.fuses_norm("int4", 128, epilogue, m, n, k)
        if fused:
            want = x.float() @ w_ref.T * factor
            want = torch.nn.functional.silu(want[:, 0::2]) * want[:, 1::2] if epilogue == "swiglu" else want
        else:
            want = _reference((x.float() * factor).bfloat16(), w_ref, epilogue, r)
        _check(y, want, f"norm_linear M={m} {n}x{k} {epilogue}")
        if fused:
            scale = two.float().abs().max().item()
            assert (y.float() - two.float()).abs().max().item() <= 1e-2 * scale, "fused norm != row factor + GEMV"
        else:
            assert torch.equal(y, two), "M > 1 must run the row-factor kernel and the routed projection"


@pytest.mark.parametrize("variant", ["ring4", "ring8", "fold"])
def test_routed_tile_variant_in_the_fused_norm_and_a_pdl_chain(variant):
    """With the router pointed at a tile GEMV tuning variant (decode.plan.route_tile_variant, how the engine
    benchmark times it): the fused-norm projection equals the shipped kernel's bits (ring: same MMAs in the same
    order) or its values (fold: one bias correction per unit instead of one per weight), and a chain of
    back-to-back launches into NaN-poisoned buffers (weights requested before the PDL wait) reads finished
    inputs."""
    from decode import plan
    from futx.ops.decode_linear import decode_linear_int4, decode_norm_linear_int4, run_variant

    eps = 1e-5
    cases = [(n, k, e) for n, k, e in NORM_CASES] + [(4096, 14336, "residual")]
    want = {}
    for routed in ("", variant):
        plan.route_tile_variant(routed)
        try:
            for n, k, epilogue in cases:
                stored, _ = _weights("int4", n, k, 128, n + k)
                x, r = _inputs(1, k, n, 3)
                y = (decode_linear_int4(x, *stored, 128, epilogue, r) if epilogue == "residual"
                     else decode_norm_linear_int4((x.float() * 3.0).bfloat16(), *stored, 128, epilogue, eps))
                torch.cuda.synchronize()
                if routed and variant.startswith("ring"):
                    assert torch.equal(y, want[(n, k, epilogue)]), f"routed {variant} {n}x{k} {epilogue}"
                elif routed:
                    ref = want[(n, k, epilogue)].float()
                    err = (y.float() - ref).abs().max().item()
                    assert err <= 1e-2 * ref.abs().max().item(), f"routed {variant} {n}x{k} {epilogue}: {err:.3g}"
                want[(n, k, epilogue)] = y
            if routed:
                k = 4096
                stored, w_ref = _weights("int4", k, k, 128, 11)
                y = torch.randn(1, k, device="cuda").bfloat16()
                want_chain = y.float()
                for _ in range(6):
                    o = torch.full((1, k), float("nan"), dtype=torch.bfloat16, device="cuda")
                    y = run_variant("int4", y, stored[0], stored[1], 128, out=o)
                    want_chain = (want_chain @ w_ref.T).bfloat16().float()
                torch.cuda.synchronize()
                assert not torch.isnan(y).any()
                err = (y.float() - want_chain).abs().max().item()
                assert err <= 5e-2 * want_chain.abs().max().item(), f"chained ring projections off by {err:.3g}"
        finally:
            plan.route_tile_variant("")


def test_norm_linear_rejects_bad_inputs():
    from futx.ops.decode_linear import decode_norm_linear_int4

    stored, _ = _weights("int4", 256, 256, 128, 5)
    x = torch.randn(1, 256, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="epilogue"):
        decode_norm_linear_int4(x, *stored, 128, "residual", 1e-5)
    with pytest.raises(ValueError, match="eps"):
        decode_norm_linear_int4(x, *stored, 128, "store", float("nan"))
    with pytest.raises(ValueError, match="K"):
        decode_norm_linear_int4(torch.randn(1, 128, device="cuda").bfloat16(), *stored, 128, "store", 1e-5)


def test_back_to_back_launches_respect_the_dependency():
    """PDL: each kernel may start before the previous one ends; it must still read the previous kernel's
    finished output (a chain of projections into NaN-poisoned buffers, one synchronize at the end), also
    when a kernel without PDL (the tile GEMV) precedes or follows one with it."""
    from futx.ops.decode_linear import run_variant

    k = 2048
    stored, w_ref = _weights("int4", k, k, 128, 9)
    x = torch.randn(1, k, device="cuda").bfloat16()
    outs = [torch.full((1, k), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(6)]
    y, want = x, x.float()
    for i, o in enumerate(outs):  # tile GEMV (no PDL) and persistent GEMV (PDL) alternating
        y = run_variant("int4", y, stored[0], stored[1], 128, out=o, kernel=("tile", "gemv")[i % 2])
        want = (want @ w_ref.T).bfloat16().float()
    torch.cuda.synchronize()
    assert not torch.isnan(y).any(), "a kernel read its input before the previous kernel wrote it"
    err = (y.float() - want).abs().max().item()
    assert err <= 5e-2 * want.abs().max().item(), f"chained projections off by {err:.3g}"


def test_public_ops_and_cuda_graph():
    from futx.ops.decode_linear import decode_linear
    from futx.quant.int4 import quantize_int4

    n, k = 1024, 2048
    q = quantize_int4(torch.randn(n, k) * 0.02, 128)  # the library's quantizer and packer
    q = dataclasses.replace(q, packed=q.packed.cuda(), scales=q.scales.cuda())
    w_ref = _dequant_cuda(q)
    x = torch.randn(4, k, device="cuda").bfloat16()
    y = decode_linear(x, q)
    _check(y, x.float() @ w_ref.T, "decode_linear op")
    y1 = torch.ops.futx.decode_linear_int4(x[:1], q.packed, q.scales, 128)
    _check(y1, x[:1].float() @ w_ref.T, "decode_linear_int4 M=1")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        yg = torch.ops.futx.decode_linear_int4(x, q.packed, q.scales, 128)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, y)


def _dequant_cuda(q):
    return _dequant_int4(q.packed, q.scales, q.group_size)


def test_bad_inputs_raise_before_launch():
    ops = torch.ops.futx
    packed = torch.zeros(64, 64, 32, 4, dtype=torch.int32, device="cuda")
    scales = torch.ones(64, 32, 16, dtype=torch.float16, device="cuda")
    x = torch.zeros(2, 4096, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="M"):
        ops.decode_linear_int4(torch.zeros(65, 4096, dtype=torch.bfloat16, device="cuda"), packed, scales, 128)
    with pytest.raises(TypeError, match="dtype"):
        ops.decode_linear_int4(x.float(), packed, scales, 128)
    with pytest.raises(ValueError, match="K"):
        ops.decode_linear_int4(x[:, :2048], packed, scales, 128)
    with pytest.raises(ValueError, match="group size"):
        ops.decode_linear_int4(x, packed, torch.ones(64, 16, 16, dtype=torch.float16, device="cuda"), 256)
    with pytest.raises(ValueError, match="scales"):
        ops.decode_linear_int4(x, packed, scales[:, :16], 128)
    with pytest.raises(ValueError, match="residual"):
        ops.decode_linear_int4(x, packed, scales, 128, "residual", None)
    with pytest.raises(ValueError, match="CUDA"):
        ops.decode_linear_int4(x.cpu(), packed, scales, 128)
    with pytest.raises(ValueError, match="boundary"):
        xx = torch.zeros(2 * 4096 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(2, 4096)
        ops.decode_linear_int4(xx, packed, scales, 128)


def test_validated_signature_still_checks_alignment():
    """The ops validate a call signature (dtypes, devices, shapes, strides) once; a later call with the same
    signature still rejects a misaligned pointer before launch, and an aligned one gives the same result."""
    ops = torch.ops.futx
    (packed, scales), _ = _weights("int4", 256, 512, 128, 3)
    buf = torch.randn(2 * 512 + 8, device="cuda").bfloat16()
    x = buf[:1024].view(2, 512)
    y = ops.decode_linear_int4(x, packed, scales, 128)
    with pytest.raises(ValueError, match="boundary"):
        ops.decode_linear_int4(buf[1:1025].view(2, 512), packed, scales, 128)
    assert torch.equal(ops.decode_linear_int4(x.clone(), packed, scales, 128), y)
