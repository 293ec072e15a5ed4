"""INT4 projection weights: symmetric, one float16 scale per output channel and group of G inputs.

q = clamp(round(W / s), -8, 7) with s = fp16(amax_group / 7); the grid is stored as unsigned nibbles
q + 8 in the fragment order of `layouts.py`. Quantizing against the *stored* (fp16-rounded) scale
makes dequantization q * s exact in float32, so the simulated model and the kernels agree.
Any integer grid (round-to-nearest here, GPTQ in `gptq.py`) goes through the same `pack_int4`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import layouts
from .fp8 import ieee_div

QMIN, QMAX = -8, 7
FP16_MAX = 65504.0
DEFAULT_GROUP_SIZE = 128


@dataclass(frozen=True)
class Int4Weight:
    """A packed INT4 weight as the decode kernels read it."""

    packed: torch.Tensor  # int32 [N/16, K/64, 32, 4]
    scales: torch.Tensor  # float16 [N/16, K/G, 16]
    shape: tuple[int, int]  # (N, K)
    group_size: int

    def q(self) -> torch.Tensor:
        """Signed integer grid [N, K] (int8, values in [-8, 7])."""
        return unpack_int4(self)[0]

    def natural_scales(self) -> torch.Tensor:
        """Scales in natural order [N, K/G] (float16)."""
        return layouts.unpack_weight_scales(self.scales)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q, s = unpack_int4(self)
        return dequantize_grid(q, s, self.group_size).to(dtype)


def check_int4_shape(n: int, k: int, group_size: int) -> None:
    layouts.INT4_WEIGHT.check_shape(n, k, group_size)


def _check_input(w: torch.Tensor, group_size: int) -> None:
    if w.dim() != 2:
        raise ValueError(f"INT4 weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    check_int4_shape(*w.shape, group_size)
    if not torch.isfinite(w).all():
        raise ValueError("INT4 weight contains NaN or Inf")


def group_scales(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> torch.Tensor:
    """fp16 scales [N, K/G] = amax / 7 of each group (computed in float32, then rounded to fp16)."""
    _check_input(w, group_size)
    n, k = w.shape
    amax = w.float().abs().reshape(n, k // group_size, group_size).amax(dim=-1)
    scale = ieee_div(amax, QMAX)  # a true division (CUDA turns tensor / python scalar into x * (1/7))
    if float(scale.max()) > FP16_MAX:
        raise ValueError(f"INT4 weight: group amax {float(amax.max()):.4g} overflows the float16 scale")
    return scale.to(torch.float16)


def _expand(scales: torch.Tensor, group_size: int) -> torch.Tensor:
    return scales.float().repeat_interleave(group_size, dim=1)


def quantize_to_grid(w: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Round-to-nearest-even of W / s against given fp16 scales [N, K/G]; a zero scale gives q = 0."""
    s = _expand(scales, group_size)
    q = torch.where(s > 0, torch.round(w.float() / torch.where(s > 0, s, 1.0)), 0.0)
    return q.clamp(QMIN, QMAX).to(torch.int8)


def dequantize_grid(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """W = q * s in float32 (exact: a 4-bit integer times an 11-bit mantissa fits in 24 bits)."""
    return q.float() * _expand(scales, group_size)


def pack_int4(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Weight:
    """Pack a signed grid q [N, K] (values in [-8, 7]) and fp16 scales [N, K/G] in kernel order."""
    n, k = q.shape
    check_int4_shape(n, k, group_size)
    if tuple(scales.shape) != (n, k // group_size):
        raise ValueError(f"pack_int4: scales shape {tuple(scales.shape)} != {(n, k // group_size)}")
    if q.numel() and (int(q.min()) < QMIN or int(q.max()) > QMAX):
        raise ValueError(f"pack_int4: grid values must lie in [{QMIN}, {QMAX}]")
    packed = layouts.pack_int4_weight((q.to(torch.int16) + layouts.INT4_WEIGHT.offset).cpu())
    return Int4Weight(packed=packed, scales=layouts.pack_weight_scales(scales.cpu()),
                      shape=(n, k), group_size=group_size)


def unpack_int4(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact inverse of `pack_int4`: (q int8 [N, K], scales fp16 [N, K/G])."""
    q = layouts.unpack_int4_weight(w.packed).to(torch.int16) - layouts.INT4_WEIGHT.offset
    return q.to(torch.int8), layouts.unpack_weight_scales(w.scales)


def quantize_int4(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> Int4Weight:
    """Round-to-nearest INT4 with group-max scales (no clipping search: the paper found it worse)."""
    scales = group_scales(w, group_size)
    return pack_int4(quantize_to_grid(w, scales, group_size), scales, group_size)


def fake_quantize_int4(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> torch.Tensor:
    """dequant(quant(W)) in float32 without packing (same values as `quantize_int4(w).dequantize()`)."""
    scales = group_scales(w, group_size)
    return dequantize_grid(quantize_to_grid(w, scales, group_size), scales, group_size)
