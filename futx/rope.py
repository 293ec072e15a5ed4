"""Rotary position embedding in the Hugging Face (rotate-half) orientation, with Llama-3.1 scaling.

Channel i of a head (i < D/2) is rotated together with channel i + D/2 by the angle
position * inv_freq[i]. Angles are formed in float64 and only the finished cos/sin tables are cast to
the compute dtype, so long positions do not lose phase to float32 rounding.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from futx.config import LlamaConfig, RopeScaling


def base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """theta ** (-2i / D) for i in [0, D/2), float64."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    return 1.0 / (float(theta) ** exponents)


def llama3_scale(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama-3.1 frequency scaling (rope_type "llama3").

    Wavelengths shorter than original_max / high_freq_factor keep their frequency, those longer than
    original_max / low_freq_factor are divided by `factor`, and the band in between interpolates
    linearly in original_max / wavelength.
    """
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ValueError(
            f"rope scaling needs high_freq_factor > low_freq_factor, got {scaling.high_freq_factor} "
            f"<= {scaling.low_freq_factor}")
    old_len = float(scaling.original_max_position_embeddings)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / scaling.low_freq_factor, inv_freq / scaling.factor, interpolated)
    return torch.where(wavelen < old_len / scaling.high_freq_factor, inv_freq, out)


def inv_freq(config: LlamaConfig) -> torch.Tensor:
    """The model's per-pair rotation frequencies [D/2], float64, scaling applied."""
    freq = base_inv_freq(config.head_dim, config.rope_theta)
    return freq if config.rope_scaling is None else llama3_scale(freq, config.rope_scaling)


@lru_cache(maxsize=16)
def _inv_freq_on(config: LlamaConfig, device: str) -> torch.Tensor:
    """inv_freq(config) on `device`, made once: a host-to-device copy per forward would synchronise a GPU."""
    return inv_freq(config).to(device)


def cos_sin(config: LlamaConfig, positions: torch.Tensor, dtype: torch.dtype = torch.float32
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [M, D] for integer `positions` [M] (rotate-half: the D/2 angles twice)."""
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"positions must be an integer tensor, got {positions.dtype}")
    angles = positions.to(torch.float64)[:, None] * _inv_freq_on(config, str(positions.device))[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [M, heads, D] by tables [M, D] (computed in x's dtype)."""
    if x.dim() != 3 or cos.shape != (x.shape[0], x.shape[2]) or sin.shape != cos.shape:
        raise ValueError(f"apply_rope expects x [M, heads, D] and cos/sin [M, D]; got x {tuple(x.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    return x * cos + rotate_half(x) * sin
