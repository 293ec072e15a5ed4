"""Prefill GEMM + epilogue policies on the GPU, against a float64 reference of the same math.

Every shipped (operand dtype, policy, tile width) runs through `futx.ops.prefill.gemm` (AOT or JIT),
with M not a multiple of the tile (incl. 1 and odd M), N and K not multiples of the tile, outputs
poisoned with NaN before the launch. FP8 outputs must be within E4M3 rounding of the reference;
delayed scaling is exercised over several calls.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from futx.runtime.catalog.prefill import POLICIES, _SHIPPED

pytestmark = pytest.mark.gpu

E4M3_MAX = 448.0
VARIANTS = [(ab, pol, w) for ab, table in _SHIPPED.items() for pol, ws in table.items() for w in ws]


def _ids(v):
    return f"{v[0]}.{v[1]}.n{v[2]}"


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
    info = POLICIES[pol]
    if info.split:
        return 768          # I = 384: a multiple of 128 and of 64, not of 256
    if info.n_ratio == 2:
        return 800          # I = 400: not a multiple of any tile width
    return 784              # 3 x 256 + 16


def make_inputs(ab, pol, m, n, k, seed, tile_n=256, amp=1.0):
    """Operands and every tensor the policy may take (unused ones are dropped by the caller)."""
    g = _gen(seed)
    info = POLICIES[pol]
    dt = torch.float8_e4m3fn if ab == "e4m3" else torch.bfloat16
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
    for name, _, shape in info.args:
        if shape == (1,) and name == "a_scale":
            full["a_scale"] = torch.tensor([0.0123], device="cuda")
    return a, w, {name: full[name] for name, _, _ in info.args}


def reference(a, w, pol, tensors, n_out):
    """float64 GEMM + policy math (before output rounding); returns (value, info)."""
    info = POLICIES[pol]
    x = a.double() @ w.double().T
    names = {name for name, _, _ in info.args}
    if "a_scale" in names:
        x = x * tensors["a_scale"].double().reshape(-1, 1)   # [M] per row or [1] per tensor
    if "b_scale" in names:
        x = x * tensors["b_scale"].double()[None, :]
    if "rho" in names:
        x = x * tensors["rho"].double()[:, None]
    if info.n_ratio == 2:
        if info.split:
            i = x.shape[1] // 2
            gate, up = x[:, :i], x[:, i:]
        else:
            gate, up = x[:, 0::2], x[:, 1::2]
        x = gate * torch.sigmoid(gate) * up
    if "residual" in names:
        x = x + tensors["residual"].double()
    assert x.shape[1] == n_out
    return x


def poison(out):
    if out.dtype == torch.float8_e4m3fn:
        out.view(torch.uint8).fill_(0x7F)   # E4M3 NaN
    else:
        out.fill_(float("nan"))


def assert_bf16_close(out, ref, what):
    assert not torch.isnan(out).any(), f"{what}: NaN left in the output (unwritten elements?)"
    err = (out.double() - ref).abs()
    tol = 0.01 * ref.abs() + 0.004 * ref.abs().max() + 1e-6
    bad = err > tol
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} of {ref.numel()} elements off; first {idx}: "
                             f"got {[float(out[i, j]) for i, j in idx]}, want {[float(ref[i, j]) for i, j in idx]}")


def assert_fp8_close(out, ref, scale, what):
    q = out.float().double()
    assert not torch.isnan(q).any(), f"{what}: NaN left in the FP8 output"
    x = (ref / scale).clamp(-E4M3_MAX, E4M3_MAX)
    # E4M3: 3 mantissa bits -> half-ulp relative 1/16; subnormal spacing 2^-9; + accumulation slack
    tol = x.abs() / 16 * 1.05 + 2.0 ** -9 + 0.01 * x.abs() + 1e-3 * x.abs().max()
    bad = (q - x).abs() > tol
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} of {x.numel()} FP8 elements off; first {idx}: "
                             f"got {[float(q[i, j]) for i, j in idx]}, want {[float(x[i, j]) for i, j in idx]}")


@pytest.mark.parametrize("variant", VARIANTS, ids=[_ids(v) for v in VARIANTS])
@pytest.mark.parametrize("m", [1, 77, 300])
def test_variant_matches_float64_reference(prefill, variant, m):
    ab, pol, tile_n = variant
    info = POLICIES[pol]
    n, k = _n_for(pol), 528       # K: 4 full k-tiles of 128 + a 16-wide tail
    a, w, tensors = make_inputs(ab, pol, m, n, k, seed=m * 7 + tile_n, tile_n=tile_n)
    n_out = n // info.n_ratio
    ref = reference(a, w, pol, tensors, n_out)
    if info.out == "e4m3":   # use the E4M3 range: the largest output lands at ~300 (no saturation)
        tensors["scale"].fill_(float(ref.abs().max()) / 300.0)
    out = torch.empty(m, n_out, device="cuda", dtype=torch.float8_e4m3fn if info.out == "e4m3" else torch.bfloat16)
    poison(out)
    prefill.gemm(a, w, pol, out=out, tile_n=tile_n, **tensors)
    torch.cuda.synchronize()
    what = f"{ab}.{pol}.n{tile_n} M={m}"
    if info.out == "e4m3":
        scale = float(tensors["scale"])
        assert_fp8_close(out, ref, scale, what)
        amax_ref = float(ref.abs().max())
        assert math.isclose(float(tensors["amax"]), amax_ref, rel_tol=0.01), (what, float(tensors["amax"]), amax_ref)
        sat_ref = int(((ref / scale).abs() > E4M3_MAX).sum())
        assert abs(int(tensors["saturated"]) - sat_ref) <= max(2, sat_ref // 100), (what, int(tensors["saturated"]), sat_ref)
    else:
        assert_bf16_close(out, ref, what)
    if "sumsq" in tensors:
        t = tensors["sumsq"]
        assert not torch.isnan(t).any(), f"{what}: sumsq partials not all written"
        tile_out = tile_n // info.n_ratio
        want = torch.stack([(out.double()[:, j:j + tile_out] ** 2).sum(1) for j in range(0, n_out, tile_out)])
        torch.testing.assert_close(t.double(), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("ab,pol", [("e4m3", "scale_bf16"), ("bf16", "bf16"), ("e4m3", "scale_rho_swiglu_fp8")])
def test_many_tiles_and_raster_groups(prefill, ab, pol):
    """9 cluster rows (> one raster group of 8), 17+ tile columns, several persistent waves."""
    info = POLICIES[pol]
    m, n, k = 2 * 128 * 9 - 50, 4096 + 256 * info.n_ratio, 1024
    a, w, tensors = make_inputs(ab, pol, m, n, k, seed=5)
    ref = reference(a, w, pol, tensors, n // info.n_ratio)
    if info.out == "e4m3":
        tensors["scale"].fill_(float(ref.abs().max()) / 300.0)
    out = prefill.gemm(a, w, pol, tile_n=256, **tensors)
    torch.cuda.synchronize()
    if info.out == "e4m3":
        assert_fp8_close(out, ref, float(tensors["scale"]), pol)
    else:
        assert_bf16_close(out, ref, pol)


def test_delayed_fp8_scaling_over_calls(prefill):
    """Call t quantizes with the scale from call t-1's amax; a jump in range saturates once, then adapts."""
    pol, m, n, k = "scale_rho_swiglu_fp8", 333, 1024, 512
    amps = [1.0, 1.0, 8.0, 8.0]
    scale = torch.ones(1, device="cuda")            # first call: initial scale 1.0
    amax = torch.zeros(1, device="cuda")
    sat = torch.zeros(1, device="cuda", dtype=torch.int32)
    history = []
    for t, amp in enumerate(amps):
        a, w, tensors = make_inputs("e4m3", pol, m, n, k, seed=11, amp=amp)
        tensors.update(scale=scale.clone(), amax=amax.zero_(), saturated=sat.zero_())
        out = prefill.gemm(a, w, pol, **tensors)
        torch.cuda.synchronize()
        ref = reference(a, w, pol, tensors, n // 2)
        used = float(tensors["scale"])
        assert_fp8_close(out, ref, used, f"call {t}")
        assert math.isclose(float(amax), float(ref.abs().max()), rel_tol=0.01)
        history.append((used, float(amax), int(sat), float(out.float().abs().max())))
        scale = torch.where(amax > 0, amax / E4M3_MAX, scale)   # the delayed-scaling update, on device
    (s0, a0, n0, q0), (s1, a1, n1, q1), (s2, a2, n2, q2), (s3, a3, n3, q3) = history
    # (<= 2: the element at exactly amax may land one float32 ulp above 448)
    assert s1 == pytest.approx(a0 / E4M3_MAX) and n1 <= 2 and q1 > 0.9 * E4M3_MAX, history  # full range
    assert n2 > 100 and q2 == E4M3_MAX, history      # stale scale after the 8x jump: clamps, counted
    assert n3 <= 2 and q3 > 0.9 * E4M3_MAX, history  # adapted


def test_residual_in_place(prefill):
    """D may alias the residual stream (X1 = X + O Wo^T written over X)."""
    m, n, k = 200, 512, 256
    a, w, tensors = make_inputs("e4m3", "scale_res_bf16", m, n, k, seed=3)
    x = tensors["residual"]
    ref = reference(a, w, "scale_res_bf16", tensors, n)
    prefill.gemm(a, w, "scale_res_bf16", out=x, **tensors)
    torch.cuda.synchronize()
    assert_bf16_close(x, ref, "in-place residual")


def test_rms_partials_give_rho(prefill):
    m, h, k = 130, 1024, 256
    a, w, tensors = make_inputs("e4m3", "scale_res_rms_bf16", m, h, k, seed=4)
    out = prefill.gemm(a, w, "scale_res_rms_bf16", tile_n=256, **tensors)
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
    assert_bf16_close(out, reference(a, w, "scale_bf16", tensors, 1024), "graph replay")


@pytest.mark.skipif(os.environ.get("FUTX_KERNELS") == "aot", reason="a user policy compiles on first use (JIT)")
def test_user_policy_from_readme(prefill):
    """epilogues/README.md's worked example (BiasAdd), registered and run like a shipped policy."""
    import sys
    from pathlib import Path

    from futx.runtime.catalog.prefill import POLICIES, PolicyInfo, register_policy

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if "scale_bias_bf16" not in POLICIES:
        register_policy("scale_bias_bf16",
                        PolicyInfo(args=(("a_scale", "f32", ("m",)), ("b_scale", "f32", ("n",)),
                                         ("bias", "f32", ("n",))), out="bf16"),
                        chain="prefill_user_policy:scale_bias_bf16")
    a, w, tensors = make_inputs("e4m3", "scale_bf16", 100, 512, 256, seed=21)
    bias = torch.randn(512, device="cuda")
    out = prefill.gemm(a, w, "scale_bias_bf16", bias=bias, **tensors)
    ref = reference(a, w, "scale_bf16", tensors, 512) + bias.double()
    assert_bf16_close(out, ref, "user policy")
