"""Prefill GEMM + epilogue policies on the GPU, against a float64 reference of the same math.

Every shipped (operand dtype, chain, variant), and the tuning space's variants (coop 128x256, stagger,
cluster 1, raster group 16) on the plain and scale chains, run through `futx.ops.prefill.gemm` (AOT or
JIT), with M not a multiple of
the tile (incl. 1 and odd M), N and K not multiples of the tile, outputs poisoned with NaN before the
launch. FP8 outputs must be within E4M3 rounding of the reference; delayed scaling is exercised over
several calls; the gate/up + SwiGLU policies run once at the real 8B shape; the QKV policies (RoPE +
KV-cache placement, head_dim 128 and 64) run on a packed batch of requests of different lengths.
Pingpong (the default schedule) runs every epilogue kind -- plain, scales, SwiGLU (interleaved and
split), residual (also in place), RMS partials, FP8 delayed store, QKV -- on problems with more tiles
than CTAs, so that both consumer warpgroups take turns (small problems give each CTA one tile, which
warpgroup 0 alone computes).

E4M3 x E4M3 accumulation is "fast accumulation" (like cuBLAS `use_fast_accum=True`): the tensor core
adds each 32-wide k-block to the accumulator keeping ~14 significant bits, truncating, so the GEMM
error grows with K and with the magnitude of the running sum. `reference` returns a per-element bound
for it (`fast_acc_bound`) that the checks add to the output rounding tolerance.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from futx.runtime.catalog.prefill import SHIPPED, TUNING, VARIANTS as SHIPPED_VARIANTS, Variant, chain_of

pytestmark = pytest.mark.gpu

E4M3_MAX = 448.0


def _is_qkv(pol):
    return "k_cache" in chain_of(pol).writes()


def _is_split(pol):
    pair = chain_of(pol).pair
    return pair is not None and pair.layout == "split"


def _arg_names(pol):
    return [x.name for x in chain_of(pol).args()]


# every shipped chain at every shipped variant (QKV chains have their own test), and the tuning space on the
# plain/scale chains (the benchmarks' candidates; compiled on demand, or built by scripts/tuning_space.py)
VARIANTS = ([(ab, pol, v) for ab, names in SHIPPED.items() for pol in names for v in SHIPPED_VARIANTS
             if not _is_qkv(pol)]
            + [(ab, pol, v) for ab, pol in (("e4m3", "scale_bf16"), ("bf16", "bf16")) for v in TUNING])


def _ids(v):
    return f"{v[0]}.{v[1]}.{v[2]}"


@pytest.fixture(autouse=True)
def watchdog():
    """A hung kernel must not hang the GPU run: dump the traceback and exit after 180 s."""
    import faulthandler

    faulthandler.dump_traceback_later(180, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def prefill():
    import futx.ops  # noqa: F401  (registers torch.ops.futx.*)
    from futx.ops import prefill as mod

    return mod


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _n_for(pol: str) -> int:
    if _is_split(pol):
        return 768          # I = 384: a multiple of 128 and of 64, not of 256
    if chain_of(pol).n_ratio == 2:
        return 800          # I = 400: not a multiple of any tile width
    return 784              # 3 x 256 + 16


def make_inputs(ab, pol, m, n, k, seed, tile_n=256, amp=1.0, integer=False):
    """Operands and every tensor the policy may take (unused ones are dropped by the caller).

    integer=True: operands are small integers (|v| <= 3), so every partial sum of a K <= 8192 GEMM is
    an integer far below 2^14 and even fast accumulation is exact: the test then checks the epilogue
    at full precision at any K."""
    g = _gen(seed)
    info = chain_of(pol)
    dt = torch.float8_e4m3fn if ab == "e4m3" else torch.bfloat16
    if integer:
        a = torch.randint(-3, 4, (m, k), device="cuda", generator=g).float().mul(amp).to(dt)
        w = torch.randint(-3, 4, (n, k), device="cuda", generator=g).float().to(dt)
    else:
        a = (torch.randn(m, k, device="cuda", generator=g) * (2.0 if ab == "e4m3" else 0.5) * amp).to(dt)
        w = (torch.randn(n, k, device="cuda", generator=g) * (2.0 if ab == "e4m3" else 0.5)).to(dt)
    n_out = n // info.n_ratio
    t = -(-n_out // (tile_n // info.n_ratio))
    full = dict(
        a_scale=torch.rand(m, device="cuda", generator=g) * 0.02 + 0.005,
        b_scale=torch.rand(n, device="cuda", generator=g) * 0.02 + 0.005,
        rho=torch.rand(m, device="cuda", generator=g) + 0.5,
        residual=torch.randn(m, n_out, device="cuda", generator=g).bfloat16(),
        scale=torch.tensor([0.05], device="cuda"),
        amax=torch.zeros(1, device="cuda"),
        saturated=torch.zeros(1, device="cuda", dtype=torch.int32),
        sumsq=torch.full((t, m), float("nan"), device="cuda"),
    )
    for x in info.args():
        if x.shape == (1,) and x.name == "a_scale":
            full["a_scale"] = torch.tensor([0.0123], device="cuda")
    return a, w, {x.name: full[x.name] for x in info.args() if x.name in full}


def fast_acc_bound(a, w):
    """Bound on |GEMM error| per element for E4M3 fast accumulation (0 for BF16, exact FP32 adds).

    Each of the K/32 k-block additions truncates to ~14 significant bits of the larger of the running
    sum and the block sum, biased toward zero, so the error grows ~linearly in K/32 times the running
    magnitude (~ |final| + a random-walk term sqrt(sum_k (a_k w_k)^2)). 2^-12 per block is 4x the
    truncation step: a margin for the unknown details, still far below what an indexing or scale
    bug produces.
    """
    if a.dtype != torch.float8_e4m3fn:
        return torch.zeros(a.shape[0], w.shape[0], dtype=torch.float64, device=a.device)
    ad, wd = a.double(), w.double()
    run = (ad @ wd.T).abs() + 2.0 * ((ad * ad) @ (wd * wd).T).sqrt()
    return run * (a.shape[1] / 32) * 2.0 ** -12


def reference(a, w, pol, tensors, n_out):
    """float64 GEMM + policy math (before output rounding) -> (value, error bound of the GEMM's
    fast accumulation propagated through the policy), both [M, n_out]."""
    info = chain_of(pol)
    x = a.double() @ w.double().T
    e = fast_acc_bound(a, w)
    names = set(_arg_names(pol))
    for name, shape in (("a_scale", (-1, 1)), ("b_scale", (1, -1)), ("rho", (-1, 1))):
        if name in names:   # a_scale: [M] per row or [1] per tensor
            f = tensors[name].double().reshape(shape)
            x, e = x * f, e * f.abs()
    if info.n_ratio == 2:
        if _is_split(pol):
            i = x.shape[1] // 2
            (gate, up), (eg, eu) = (x[:, :i], x[:, i:]), (e[:, :i], e[:, i:])
        else:
            (gate, up), (eg, eu) = (x[:, 0::2], x[:, 1::2]), (e[:, 0::2], e[:, 1::2])
        sig = torch.sigmoid(gate)
        x = gate * sig * up
        e = (sig * (1 + gate * (1 - sig))).abs() * up.abs() * eg + (gate * sig).abs() * eu + eg * eu
    if "residual" in names:
        x = x + tensors["residual"].double()
    assert x.shape[1] == n_out
    return x, e


def poison(out):
    if out.dtype == torch.float8_e4m3fn:
        out.view(torch.uint8).fill_(0x7F)   # E4M3 NaN
    else:
        out.fill_(float("nan"))


def assert_bf16_close(out, ref, what, acc_err=0.0):
    assert not torch.isnan(out).any(), f"{what}: NaN left in the output (unwritten elements?)"
    err = (out.double() - ref).abs()
    tol = 0.01 * ref.abs() + 0.004 * ref.abs().max() + 1e-6 + acc_err
    bad = err > tol
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} of {ref.numel()} elements off; first {idx}: "
                             f"got {[float(out[i, j]) for i, j in idx]}, want {[float(ref[i, j]) for i, j in idx]}")


def assert_fp8_close(out, ref, scale, what, acc_err=0.0):
    q = out.float().double()
    assert not torch.isnan(q).any(), f"{what}: NaN left in the FP8 output"
    x = (ref / scale).clamp(-E4M3_MAX, E4M3_MAX)
    # E4M3: 3 mantissa bits -> half-ulp relative 1/16; subnormal spacing 2^-9; the GEMM's fast
    # accumulation (acc_err, in the units of ref); slack for SiLU's approximate exp2/rcp
    tol = x.abs() / 16 * 1.05 + 2.0 ** -9 + 0.01 * x.abs() + 1e-3 * x.abs().max() + acc_err / scale
    bad = (q - x).abs() > tol
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} of {x.numel()} FP8 elements off; first {idx}: "
                             f"got {[float(q[i, j]) for i, j in idx]}, want {[float(x[i, j]) for i, j in idx]}")


@pytest.mark.parametrize("variant", VARIANTS, ids=[_ids(v) for v in VARIANTS])
@pytest.mark.parametrize("m", [1, 77, 300])
def test_variant_matches_float64_reference(prefill, variant, m):
    ab, pol, name = variant
    tile_n = Variant.parse(name).tile_n
    info = chain_of(pol)
    n, k = _n_for(pol), 528       # K: 4 full k-tiles of 128 + a 16-wide tail
    a, w, tensors = make_inputs(ab, pol, m, n, k, seed=m * 7 + tile_n, tile_n=tile_n)
    n_out = n // info.n_ratio
    ref, acc_err = reference(a, w, pol, tensors, n_out)
    if info.out == "e4m3":   # use the E4M3 range: the largest output lands at ~300 (no saturation)
        tensors["scale"].fill_(float(ref.abs().max()) / 300.0)
    out = torch.empty(m, n_out, device="cuda", dtype=torch.float8_e4m3fn if info.out == "e4m3" else torch.bfloat16)
    poison(out)
    prefill.gemm(a, w, pol, out=out, variant=name, **tensors)
    torch.cuda.synchronize()
    check_result(out, ref, acc_err, pol, tensors, tile_n, f"{ab}.{pol}.{name} M={m}")


def check_result(out, ref, acc_err, pol, tensors, tile_n, what):
    """Output against the float64 reference; FP8: amax and saturation count; RMS: the sumsq partials."""
    info = chain_of(pol)
    n_out = out.shape[1]
    if info.out == "e4m3":
        scale = float(tensors["scale"])
        assert_fp8_close(out, ref, scale, what, acc_err)
        amax_ref = float(ref.abs().max())
        assert math.isclose(float(tensors["amax"]), amax_ref, rel_tol=0.01), (what, float(tensors["amax"]), amax_ref)
        sat_ref = int(((ref / scale).abs() > E4M3_MAX).sum())
        assert abs(int(tensors["saturated"]) - sat_ref) <= max(2, sat_ref // 100), (what, int(tensors["saturated"]), sat_ref)
    else:
        assert_bf16_close(out, ref, what, acc_err)
    if "sumsq" in tensors:
        t = tensors["sumsq"]
        assert not torch.isnan(t).any(), f"{what}: sumsq partials not all written"
        tile_out = tile_n // info.n_ratio
        want = torch.stack([(out.double()[:, j:j + tile_out] ** 2).sum(1) for j in range(0, n_out, tile_out)])
        torch.testing.assert_close(t.double(), want, rtol=1e-4, atol=1e-3)


MANY = [("e4m3", "scale_bf16", "n256"), ("e4m3", "scale_bf16", "n256.pp"), ("bf16", "bf16", "n256"),
        ("bf16", "bf16", "n256.pp"), ("e4m3", "scale_rho_swiglu_fp8", "n128"),
        ("e4m3", "scale_rho_swiglu_fp8", "n256.pp"), ("bf16", "rho_swiglu_bf16", "n128"),
        # the raster / cluster experiments (18 pingpong cluster rows: one group of 16 + a group of 2)
        ("e4m3", "scale_bf16", "n256.pp.g16"), ("e4m3", "scale_bf16", "n256.pp.c1"),
        # 2x2 clusters (A multicast too): 17 tile columns, so the last cluster column's second CTA lies right of N
        ("e4m3", "scale_bf16", "n256.pp.c2x2"), ("e4m3", "scale_res_rms_bf16", "n256.pp.c2x2"),
        ("bf16", "bf16", "n256.c2x2"), ("e4m3", "scale_rho_swiglu_split_fp8", "n256.pp.c2x2"),
        # pingpong with every other epilogue kind, both warpgroups busy (QKV: test_qkv_rope_and_cache_placement)
        ("e4m3", "scale_fp8", "n256.pp"), ("e4m3", "scale_rho_swiglu_split_fp8", "n256.pp"),
        ("e4m3", "scale_res_bf16", "n256.pp"), ("e4m3", "scale_res_rms_bf16", "n256.pp"),
        ("e4m3", "scale_res_rms_bf16", "n128"), ("e4m3", "scalet_res_rms_bf16", "n256.pp"),
        ("bf16", "res_bf16", "n256.pp"), ("bf16", "swiglu_split_bf16", "n256.pp")]


@pytest.mark.parametrize("ab,pol,variant", MANY, ids=[_ids(v) for v in MANY])
def test_many_tiles_and_raster_groups(prefill, ab, pol, variant):
    """9 cluster rows (> one raster group of 8), 17+ tile columns, several persistent waves (pingpong:
    an odd number of tiles per CTA, so the warpgroups' turn-taking ends unevenly)."""
    info = chain_of(pol)
    m, n, k = 2 * 128 * 9 - 50, 4096 + 256 * info.n_ratio, 1024
    tile_n = Variant.parse(variant).tile_n
    a, w, tensors = make_inputs(ab, pol, m, n, k, seed=5, tile_n=tile_n)
    ref, acc_err = reference(a, w, pol, tensors, n // info.n_ratio)
    if info.out == "e4m3":
        tensors["scale"].fill_(float(ref.abs().max()) / 300.0)
    out = prefill.gemm(a, w, pol, variant=variant, **tensors)
    torch.cuda.synchronize()
    check_result(out, ref, acc_err, pol, tensors, tile_n, f"{ab}.{pol}.{variant} many tiles")


SWIGLU_8B = [(ab, pol, v) for ab, pol in (("bf16", "rho_swiglu_bf16"), ("e4m3", "scale_rho_swiglu_fp8"))
             for v in SHIPPED_VARIANTS]


@pytest.mark.parametrize("ab,pol,variant", SWIGLU_8B, ids=[_ids(v) for v in SWIGLU_8B])
def test_swiglu_at_8b_gate_up_shape(prefill, ab, pol, variant):
    """Gate/up + SwiGLU at the benchmark's real shape (M=2048, K=4096, 2I=28672: 112 tile columns, 32
    k-tiles, 14 persistent waves), with integer operands so that even fast accumulation is exact and
    the full output is checked at BF16/E4M3 rounding precision. Note the math: the RMSNorm factor rho
    scales the GEMM rows *before* SiLU, silu(rho g) * (rho u), since rho belongs to the normalized input."""
    m, k, n = 2048, 4096, 28672
    a, w, tensors = make_inputs(ab, pol, m, n, k, seed=8, integer=True)
    ref = torch.cat([reference(a[r:r + 512], w, pol, {nm: (t[r:r + 512] if nm in ("a_scale", "rho") else t)
                                                          for nm, t in tensors.items()}, n // 2)[0]
                     for r in range(0, m, 512)])
    if chain_of(pol).out == "e4m3":
        tensors["scale"].fill_(float(ref.abs().max()) / 300.0)
    out = prefill.gemm(a, w, pol, variant=variant, **tensors)
    torch.cuda.synchronize()
    if chain_of(pol).out == "e4m3":
        assert_fp8_close(out, ref, float(tensors["scale"]), f"8B gate/up {pol}.{variant}")
    else:
        assert_bf16_close(out, ref, f"8B gate/up {pol}.{variant}")


@pytest.mark.parametrize("variant", SHIPPED_VARIANTS)
def test_delayed_fp8_scaling_over_calls(prefill, variant):
    """Call t quantizes with the scale from call t-1's amax; a jump in range saturates once, then adapts.
    (M x N = 1333 x 2048: more pingpong tiles than CTAs, so both warpgroups publish amax partials.)"""
    pol, m, n, k = "scale_rho_swiglu_fp8", 1333, 2048, 512
    amps = [1.0, 1.0, 8.0, 8.0]
    scale = torch.ones(1, device="cuda")            # first call: initial scale 1.0
    amax = torch.zeros(1, device="cuda")
    sat = torch.zeros(1, device="cuda", dtype=torch.int32)
    history = []
    for t, amp in enumerate(amps):
        a, w, tensors = make_inputs("e4m3", pol, m, n, k, seed=11, amp=amp)
        tensors.update(scale=scale.clone(), amax=amax.zero_(), saturated=sat.zero_())
        out = prefill.gemm(a, w, pol, variant=variant, **tensors)
        torch.cuda.synchronize()
        ref, acc_err = reference(a, w, pol, tensors, n // 2)
        used = float(tensors["scale"])
        # call 2's stale scale puts the unclamped values at ~64x the E4M3 range: the fast-accumulation
        # error of the small outputs then scales with their large gate/up partners (acc_err)
        assert_fp8_close(out, ref, used, f"call {t}", acc_err)
        assert math.isclose(float(amax), float(ref.abs().max()), rel_tol=0.01)
        history.append((used, float(amax), int(sat), float(out.float().abs().max())))
        scale = torch.where(amax > 0, amax / E4M3_MAX, scale)   # the delayed-scaling update, on device
    (s0, a0, n0, q0), (s1, a1, n1, q1), (s2, a2, n2, q2), (s3, a3, n3, q3) = history
    # (<= 2: the element at exactly amax may land one float32 ulp above 448)
    assert s1 == pytest.approx(a0 / E4M3_MAX) and n1 <= 2 and q1 > 0.9 * E4M3_MAX, history  # full range
    assert n2 > 100 and q2 == E4M3_MAX, history      # stale scale after the 8x jump: clamps, counted
    assert n3 <= 2 and q3 > 0.9 * E4M3_MAX, history  # adapted


@pytest.mark.parametrize("m,n", [(200, 512), (2000, 2048)])      # 2000 x 2048: 128 pingpong tiles
@pytest.mark.parametrize("variant", SHIPPED_VARIANTS)
def test_residual_in_place(prefill, variant, m, n):
    """D may alias the residual stream (X1 = X + O Wo^T written over X)."""
    k = 256
    a, w, tensors = make_inputs("e4m3", "scale_res_bf16", m, n, k, seed=3)
    x = tensors["residual"]
    ref, acc_err = reference(a, w, "scale_res_bf16", tensors, n)
    prefill.gemm(a, w, "scale_res_bf16", out=x, variant=variant, **tensors)
    torch.cuda.synchronize()
    assert_bf16_close(x, ref, f"in-place residual {variant}", acc_err)


@pytest.mark.parametrize("m,h", [(130, 1024), (1100, 2048)])     # 1100 x 2048: 72 pingpong tiles
@pytest.mark.parametrize("variant", SHIPPED_VARIANTS)
def test_rms_partials_give_rho(prefill, variant, m, h):
    k = 256
    a, w, tensors = make_inputs("e4m3", "scale_res_rms_bf16", m, h, k, seed=4, tile_n=Variant.parse(variant).tile_n)
    out = prefill.gemm(a, w, "scale_res_rms_bf16", variant=variant, **tensors)
    rho = prefill.rms_rho(tensors["sumsq"], h, 1e-5)
    want = torch.rsqrt((out.double() ** 2).mean(1) + 1e-5)
    torch.testing.assert_close(rho.double(), want, rtol=1e-5, atol=0)


def test_empty_m_is_a_no_op(prefill):
    a = torch.empty(0, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 256, device="cuda").bfloat16()
    assert prefill.gemm(a, w, "bf16").shape == (0, 512)


def test_bad_inputs_raise_before_launch(prefill):
    a = torch.randn(64, 256, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(512, 256, device="cuda").to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="dtype"):
        prefill.gemm(a, w.bfloat16(), "bf16")
    with pytest.raises(ValueError, match="multiple of 16"):
        prefill.gemm(a[:, :200].contiguous(), w[:, :200].contiguous(), "bf16")
    with pytest.raises(ValueError, match="needs 'b_scale'"):
        prefill.gemm(a, w, "scale_bf16", a_scale=torch.ones(64, device="cuda"))
    with pytest.raises(ValueError, match="shape"):
        prefill.gemm(a, w, "scale_bf16", a_scale=torch.ones(63, device="cuda"), b_scale=torch.ones(512, device="cuda"))
    with pytest.raises(ValueError, match="contiguous"):
        prefill.gemm(a, torch.randn(256, 512, device="cuda").to(torch.float8_e4m3fn).T, "bf16")
    with pytest.raises(ValueError, match="CUDA"):
        prefill.gemm(a.cpu(), w.cpu(), "bf16", out=torch.empty(64, 512, dtype=torch.bfloat16))


def test_cuda_graph_replay(prefill):
    a, w, tensors = make_inputs("e4m3", "scale_bf16", 512, 1024, 512, seed=9)
    out = prefill.gemm(a, w, "scale_bf16", **tensors)   # load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        prefill.gemm(a, w, "scale_bf16", out=out, **tensors)
    torch.cuda.current_stream().wait_stream(stream)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, acc_err = reference(a, w, "scale_bf16", tensors, 1024)
    assert_bf16_close(out, ref, "graph replay", acc_err)


# split-K (coop kernels): every epilogue kind at 128x128, and the coop 128x256 tuning variant
SPLIT = [("bf16", "bf16", "n128"), ("e4m3", "scale_bf16", "n128"), ("e4m3", "scale_rho_swiglu_fp8", "n128"),
         ("e4m3", "scale_rho_swiglu_split_fp8", "n128"), ("bf16", "swiglu_split_bf16", "n128"),
         ("e4m3", "scale_res_rms_bf16", "n128"), ("bf16", "res_bf16", "n128"), ("e4m3", "scale_fp8", "n128"),
         ("e4m3", "scale_bf16", "n256")]


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("m", [1, 300, 1100])
@pytest.mark.parametrize("ab,pol,variant", SPLIT, ids=[_ids(v) for v in SPLIT])
def test_split_k_matches_reference_and_repeats_bitwise(prefill, ab, pol, variant, m, splits):
    """K = 1040: 9 E4M3 / 17 BF16 k-tiles with a 16-wide tail, split unevenly (5 splits of 9: 1-2 k-tiles
    each). M = 1100: more units than CTAs, so CTAs walk several units and reduce some of them. A second call
    must be bitwise equal (the reduction sums the partials in split order) and leave the counters at zero."""
    tile_n = Variant.parse(variant).tile_n
    _split_twice_and_check(prefill, ab, pol, variant, m, _n_for(pol), splits, seed=m + splits, tile_n=tile_n)


def _split_twice_and_check(prefill, ab, pol, variant, m, n, splits, seed, tile_n):
    """Two calls with `splits` at K = 1040: the second against the float64 reference, bitwise equal to the
    first (the partials are summed in split order), and the arrival counters back at zero."""
    from futx.ops import split_counters

    info = chain_of(pol)
    a, w, tensors = make_inputs(ab, pol, m, n, 1040, seed=seed, tile_n=tile_n)
    ref, acc_err = reference(a, w, pol, tensors, n // info.n_ratio)
    if info.out == "e4m3":
        tensors["scale"].fill_(float(ref.abs().max()) / 300.0)
    outs = []
    for _ in range(2):
        for name in ("amax", "saturated"):
            if name in tensors:
                tensors[name].zero_()
        if "sumsq" in tensors:
            tensors["sumsq"].fill_(float("nan"))
        out = torch.empty(m, n // info.n_ratio, device="cuda",
                          dtype=torch.float8_e4m3fn if info.out == "e4m3" else torch.bfloat16)
        poison(out)
        prefill.gemm(a, w, pol, out=out, variant=variant, splits=splits, **tensors)
        torch.cuda.synchronize()
        outs.append(out)
    check_result(outs[1], ref, acc_err, pol, tensors, tile_n, f"{ab}.{pol}.{variant} M={m} splits={splits}")
    assert torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8)), "split-K result changed between calls"
    assert int(split_counters.counters(a.device).abs().sum()) == 0, "arrival counters not reset"


@pytest.mark.parametrize("ab,pol", [("bf16", "bf16"), ("e4m3", "scale_res_rms_bf16"), ("e4m3", "scale_rho_swiglu_fp8")])
@pytest.mark.parametrize("splits", [2, 3])
def test_split_k_on_the_last_partial_wave(prefill, ab, pol, splits):
    """More cluster tiles than clusters (M = 1100: 5 cluster rows x 17+ columns of 128 > 66 clusters on an
    H200): the full wave runs whole tiles, the remaining tiles are split (futx/prefill/mainloop.py `unit`)."""
    n = 2048 + 32 * chain_of(pol).n_ratio
    _split_twice_and_check(prefill, ab, pol, "n128", 1100, n, splits, seed=splits, tile_n=128)


@pytest.mark.parametrize("ab,pol", [("bf16", "bf16"), ("e4m3", "scale_res_rms_bf16")])
def test_split_k_with_2x2_clusters(prefill, ab, pol):
    """Split-K on the coop 2x2-cluster kernel (tuning space): the workspace and counters are per CTA tile of a
    cluster of 4; 9 tile columns of 256, so one cluster column is half right of N."""
    _split_twice_and_check(prefill, ab, pol, "n256.c2x2", 300, 2048 + 256, 3, seed=23, tile_n=256)


def test_cluster_slots():
    """Clusters of 1 or 2 CTAs use every SM; clusters of 4 fit whole into the GPCs, so at most every SM."""
    from futx.hardware import cluster_slots, sm_count

    sms = sm_count(0)
    assert cluster_slots(0, 1) == cluster_slots(0, 2) == sms
    four = cluster_slots(0, 4)
    assert four % 4 == 0 and sms - 4 * 8 <= four <= sms, (four, sms)   # <= 3 idle SMs in each of ~8 GPCs


def test_split_k_in_a_cuda_graph(prefill):
    """Replays reuse the workspace and the self-resetting counters: bitwise equal to the eager call."""
    a, w, tensors = make_inputs("bf16", "bf16", 300, 1024, 2048, seed=19)
    eager = prefill.gemm(a, w, "bf16", variant="n128", splits=4)
    out = torch.empty_like(eager)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        prefill.gemm(a, w, "bf16", out=out, variant="n128", splits=4)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_split_k_rejects_bad_counts(prefill):
    a = torch.randn(64, 512, device="cuda").bfloat16()
    w = torch.randn(256, 512, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="coop kernels only"):
        prefill.gemm(a, w, "bf16", variant="n256.pp", splits=2)
    with pytest.raises(ValueError, match="splits"):
        prefill.gemm(a, w, "bf16", variant="n128", splits=0)
    with pytest.raises(ValueError, match="splits"):
        prefill.gemm(a, w, "bf16", variant="n128", splits=99)


def test_composed_chain_from_readme(prefill):
    """epilogues/README.md's worked example (BiasAdd), composed at call time: compiled on first use, or
    loaded from `futx build --chain prefill_user_policy:scale_bias_bf16` (what scripts/gpu/stage.sh builds)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import prefill_user_policy as user

    a, w, tensors = make_inputs("e4m3", "scale_bf16", 100, 512, 256, seed=21)
    bias = torch.randn(512, device="cuda")
    out = prefill.gemm(a, w, chain=user.scale_bias_bf16(), bias=bias, **tensors)
    ref, acc_err = reference(a, w, "scale_bf16", tensors, 512)
    assert_bf16_close(out, ref + bias.double(), "composed chain", acc_err)


# ---- QKV projection: RoPE + direct KV-cache placement (paper 3.2.1) ---------------------------------
# (operand dtype, variant, layer preset): head_dim 128 (8B) and 64 (1B, the qkv64 policy)
QKV = [(ab, v, layer) for ab, layer in (("e4m3", "layer-8b"), ("bf16", "layer-8b"), ("e4m3", "layer-1b"), ("bf16", "layer-1b"))
       for v in SHIPPED_VARIANTS]


def _qkv_problem(ab, seed=31, layer="layer-8b"):
    """A layer's QKV shape (8B: K=4096, 32 Q + 8 KV heads of 128; 1B: K=2048, 32 + 8 heads of 64) on a
    packed batch of 4 requests of different lengths, start positions and cache slots; integer operands
    (exact GEMM even with fast accumulation). 768 rows: more tiles than CTAs in every schedule."""
    from futx.config import preset
    from futx.kvcache import KVCache
    from futx.reference.batch import PackedBatch

    cfg = preset(layer)
    hq, hkv, hd, k = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    batch = PackedBatch.from_lengths([300, 17, 1, 450], start_positions=[0, 5, 1000, 64], slots=[2, 0, 3, 1],
                                     device="cuda")
    m, n = batch.num_rows, (hq + 2 * hkv) * hd
    pol = f"scale_rho_qkv{hd}_bf16" if ab == "e4m3" else f"rho_qkv{hd}_bf16"
    a, w, t = make_inputs(ab, pol, m, n, k, seed=seed, integer=True)
    cache = KVCache(cfg, slots=5, capacity=1536, dtype=torch.bfloat16, device="cuda")
    return cfg, batch, a, w, t, cache


def _qkv_reference(cfg, batch, a, w, t):
    """float64: scales and rho, then futx.rope on Q and K (float64 angles) -> q, k, v [M, heads, hd]."""
    from futx.rope import apply_rope, cos_sin

    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = a.double() @ w.double().T
    if "a_scale" in t:
        x = x * t["a_scale"].double()[:, None] * t["b_scale"].double()[None, :]
    x = x * t["rho"].double()[:, None]
    m = x.shape[0]
    q, k, v = x[:, : hq * hd].view(m, hq, hd), x[:, hq * hd : (hq + hkv) * hd].view(m, hkv, hd), x[:, (hq + hkv) * hd :]
    cos, sin = cos_sin(cfg, batch.row_position, torch.float64)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.reshape(m, hkv, hd)


@pytest.mark.parametrize("ab,variant,layer", QKV, ids=[f"{ab}.{v}.{layer}" for ab, v, layer in QKV])
def test_qkv_rope_and_cache_placement(prefill, ab, variant, layer):
    _check_qkv(prefill, ab, variant, layer)


@pytest.mark.parametrize("ab,layer,splits", [("e4m3", "layer-8b", 3), ("bf16", "layer-1b", 2)])
def test_qkv_with_split_k(prefill, ab, layer, splits):
    """RoPE and the cache writes run once per tile, in the CTA that reduces the split partials."""
    _check_qkv(prefill, ab, "n128", layer, splits)


def _check_qkv(prefill, ab, variant, layer, splits=None):
    from futx.rope import inv_freq

    cfg, batch, a, w, t, cache = _qkv_problem(ab, layer=layer)
    scales = dict(a_scale=t["a_scale"], b_scale=t["b_scale"]) if ab == "e4m3" else {}
    q = prefill.qkv(a, w, cache.k[0], cache.v[0], batch.row_slot.int(), batch.row_position.int(),
                    inv_freq(cfg).float().cuda(), rho=t["rho"], variant=variant, splits=splits, **scales)
    torch.cuda.synchronize()
    q_ref, k_ref, v_ref = _qkv_reference(cfg, batch, a, w, t)
    m, hd = a.shape[0], cfg.head_dim
    assert q.shape == (m, cfg.num_attention_heads, hd) and q.dtype == torch.bfloat16
    assert_bf16_close(q.reshape(m, -1), q_ref.reshape(m, -1), f"{ab}.{variant} Q")
    # the cache through its own addressing: every (slot, head, position) row of the batch, nothing else
    heads = torch.arange(cfg.num_key_value_heads, device="cuda")
    rows = (cache.offset(batch.row_slot[:, None], heads[None, :], batch.row_position[:, None], 0) // hd).reshape(-1)
    want = {}
    for name, x in (("K", k_ref), ("V", v_ref)):
        want[name] = torch.full(cache.k[0].shape, float("nan"), dtype=torch.float64, device="cuda")
        want[name].view(-1, hd)[rows] = x.reshape(-1, hd)
    for name, got, ref in (("K", cache.k[0], want["K"]), ("V", cache.v[0], want["V"])):
        written = ~torch.isnan(got)
        assert torch.equal(written, ~torch.isnan(ref)), f"{ab}.{variant} {name}: cache rows written outside the batch"
        assert_bf16_close(got[written].view(-1, hd), ref[written].view(-1, hd), f"{ab}.{variant} {name} cache")


def test_qkv_rejects_positions_beyond_capacity(prefill):
    from futx.rope import inv_freq

    cfg, batch, a, w, t, cache = _qkv_problem("e4m3")
    pos = batch.row_position.int()
    pos[-1] = 1536                                 # one past the capacity
    with pytest.raises(ValueError, match="KV cache overflow"):
        prefill.qkv(a, w, cache.k[0], cache.v[0], batch.row_slot.int(), pos, inv_freq(cfg).float().cuda(),
                    rho=t["rho"], a_scale=t["a_scale"], b_scale=t["b_scale"])
    with pytest.raises(ValueError, match="need N = Hq"):        # w one half-head short
        prefill.qkv(a, w[:-64].contiguous(), cache.k[0], cache.v[0], batch.row_slot.int(), batch.row_position.int(),
                    inv_freq(cfg).float().cuda(), rho=t["rho"], a_scale=t["a_scale"], b_scale=t["b_scale"][:-64])
