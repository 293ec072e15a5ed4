"""E4M3 weights and the delayed per-tensor scaling state."""

import pytest
import torch

from futx.quant import fp8


def test_e4m3_weight_per_channel(seeded):
    w = torch.randn(24, 80, generator=seeded) * torch.logspace(-3, 1, 24)[:, None]
    q = fp8.quantize_e4m3_weight(w)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.shape == (24,)
    assert torch.equal(q.scale, w.abs().amax(1) / 448)
    assert torch.equal(q.data.float().abs().amax(1), torch.full((24,), 448.0))
    # 3 mantissa bits: a normal value is within 2^-4 of itself; subnormals (|x| < 2^-6 * scale) within 2^-10
    err = (q.dequantize() - w).abs()
    bound = torch.maximum(w.abs() * 2 ** -4, q.scale[:, None] * 2 ** -10)
    assert (err <= bound * (1 + 1e-6)).all()


def test_e4m3_rounding_is_nearest(seeded):
    x = torch.randn(1000, generator=seeded) * 100
    y = fp8.to_e4m3(x).float()
    grid = torch.unique(fp8.to_e4m3(torch.linspace(-448, 448, 200001)).float())
    nearest = grid[(x[:, None] - grid[None, :]).abs().argmin(1)]
    assert torch.allclose((y - x).abs(), (nearest - x).abs())


def test_delayed_first_call_uses_initial_scale(seeded):
    st = fp8.DelayedScaleState(initial_amax=10.0)
    x = torch.randn(64, generator=seeded)
    data, scale = st.quantize(x)
    assert scale == 10.0 / 448 and torch.equal(data.float(), fp8.to_e4m3(x / scale).float())
    assert st.scale == float(x.abs().max()) / 448  # next call uses this call's amax


def test_delayed_uses_previous_amax(seeded):
    st = fp8.DelayedScaleState()
    x1, x2 = torch.randn(64, generator=seeded), torch.randn(64, generator=seeded) * 3
    st.quantize(x1)
    _, s2 = st.quantize(x2)
    assert s2 == float(x1.abs().max()) / 448
    assert st.saturated == int((x2.abs() / s2 > 448).sum()) > 0  # x2 has a 3x wider range


def test_all_zero_keeps_previous_scale(seeded):
    st = fp8.DelayedScaleState()
    st.quantize(torch.randn(8, generator=seeded))
    before = st.scale
    data, _ = st.quantize(torch.zeros(8))
    assert torch.all(data.float() == 0) and st.scale == before and st.scale > 0
    fresh = fp8.DelayedScaleState()
    fresh.quantize(torch.zeros(4))
    assert fresh.scale == 1.0  # initial scale survives an all-zero first tensor


def test_nan_raises_and_inf_is_counted(seeded):
    st = fp8.DelayedScaleState()
    x = torch.randn(8, generator=seeded)
    x[2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        st.quantize(x)
    assert st.calls == 0  # state untouched
    x[2] = float("inf")
    data, _ = st.quantize(x)
    assert float(data.float()[2]) == 448 and not torch.isnan(data.float()).any()
    assert st.saturated == 1 and st.nonfinite == 1
    assert st.scale == float(x[torch.isfinite(x)].abs().max()) / 448


def test_request_groups_are_independent(seeded):
    ds = fp8.DelayedScaling()
    ds.quantize("a", "down_in", torch.randn(8, generator=seeded) * 100)
    _, sb = ds.quantize("b", "down_in", torch.randn(8, generator=seeded))
    assert sb == 1.0 and ds.state("a").scale != ds.state("b").scale


def test_state_argument_errors():
    with pytest.raises(ValueError):
        fp8.DelayedScaleState(initial_amax=0.0)
    with pytest.raises(ValueError):
        fp8.DelayedScaleState(margin=0.5)
    with pytest.raises(ValueError, match="NaN or Inf"):
        fp8.quantize_e4m3_weight(torch.tensor([[1.0, float("inf")]]))
