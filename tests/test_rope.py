"""RoPE: Llama-3.1 scaling against the published formula; rotate-half against a complex-number rotation."""

import math

import pytest
import torch

from futx.config import RopeScaling, preset
from futx.rope import apply_rope, base_inv_freq, cos_sin, inv_freq, llama3_scale


def published_llama3_scaling(freqs, factor, low, high, old_len):
    """Meta's apply_scaling for Llama 3.1 (scalar loop, as published)."""
    low_wavelen, high_wavelen = old_len / low, old_len / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def test_base_frequencies():
    f = base_inv_freq(128, 500000.0)
    expect = [500000.0 ** (-(2 * i) / 128) for i in range(64)]
    assert torch.allclose(f, torch.tensor(expect, dtype=torch.float64), rtol=1e-15, atol=0)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "layer-405b"])
def test_llama31_scaling_matches_published_formula(name):
    cfg = preset(name)
    s = cfg.rope_scaling
    base = base_inv_freq(cfg.head_dim, cfg.rope_theta)
    expect = published_llama3_scaling(base.tolist(), s.factor, s.low_freq_factor, s.high_freq_factor,
                                      s.original_max_position_embeddings)
    got = inv_freq(cfg)
    assert torch.allclose(got, torch.tensor(expect, dtype=torch.float64), rtol=1e-14, atol=0)
    # All three regimes occur for Llama-3.1-8B: kept, divided by 8, and interpolated.
    ratio = (base / got).tolist()
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(8.0)
    assert any(1.0 < r < 8.0 for r in ratio)


def test_scaling_rejects_bad_factors():
    with pytest.raises(ValueError, match="high_freq_factor"):
        llama3_scale(base_inv_freq(8, 1e4), RopeScaling(high_freq_factor=1.0, low_freq_factor=1.0))
    with pytest.raises(ValueError, match="even"):
        base_inv_freq(7, 1e4)


def test_rotate_half_equals_complex_rotation(seeded):
    cfg = preset("smollm2-135m")
    d = cfg.head_dim
    positions = torch.tensor([0, 1, 7, 1000, 8191])
    x = torch.randn(5, 3, d, generator=seeded, dtype=torch.float64)
    cos, sin = cos_sin(cfg, positions, torch.float64)
    got = apply_rope(x, cos, sin)
    # Channel i and i + D/2 form the complex number x_i + j x_{i+D/2}, rotated by position * freq_i.
    z = torch.complex(x[..., : d // 2], x[..., d // 2:])
    angle = positions.double()[:, None] * inv_freq(cfg)[None, :]
    rz = z * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    expect = torch.cat([rz.real, rz.imag], dim=-1)
    assert torch.allclose(got, expect, rtol=0, atol=1e-12)


def test_rope_bad_inputs():
    cfg = preset("smollm2-135m")
    with pytest.raises(ValueError, match="integer"):
        cos_sin(cfg, torch.tensor([0.0, 1.0]))
    cos, sin = cos_sin(cfg, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="apply_rope expects"):
        apply_rope(torch.randn(3, 2, cfg.head_dim), cos, sin)
