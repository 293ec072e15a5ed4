"""`futx::rms_rows` — the decode step's RMSNorm row factor: y = bf16(x * rsqrt(mean(x^2) + eps)) per row; with `gain`
(bf16 [K]) the whole RMSNorm, y = bf16(that * gain), as futx.reference.rms_norm rounds it (the final norm)."""

from __future__ import annotations

from typing import Optional

import torch

from futx.ops import checks
from futx.ops.registration import futx_op
from futx.runtime import get_kernel


def _check(x: torch.Tensor, y: torch.Tensor, gain: Optional[torch.Tensor] = None) -> None:
    for name, t in (("x", x), ("y", y)) + ((("gain", gain),) if gain is not None else ()):
        checks.cuda(name, t, x.device if name != "x" else None)
        checks.dtype(name, t, torch.bfloat16)
        checks.contiguous(name, t)
        checks.aligned(name, t)
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"x must be 2-D [M, K] with M, K >= 1, got {list(x.shape)}")
    checks.shape("y", y, tuple(x.shape))
    if gain is not None:
        checks.shape("gain", gain, (x.shape[1],))


@futx_op("rms_rows_", mutates_args=("y",))
def rms_rows_(x: torch.Tensor, y: torch.Tensor, eps: float, gain: Optional[torch.Tensor] = None) -> None:
    """Writes y [M, K] bf16 from x [M, K] bf16 (contiguous, 16-byte aligned, same CUDA device); gain: bf16 [K]."""
    if gain is not None:
        _check(x, y, gain)
        get_kernel("engine.rms_rows.gain")(x, gain, y, float(eps))
        return
    if not (x.is_cuda and x.dtype is torch.bfloat16 and y.dtype is torch.bfloat16 and x.dim() == 2
            and y.shape == x.shape and y.device == x.device and x.is_contiguous() and y.is_contiguous()
            and not (x.data_ptr() | y.data_ptr()) % 16 and x.numel() > 0):
        _check(x, y)
    get_kernel("engine.rms_rows")(x, y, float(eps))


@rms_rows_.register_fake
def _(x, y, eps, gain=None):
    return None


def rms_rows(x: torch.Tensor, eps: float) -> torch.Tensor:
    y = torch.empty_like(x)
    rms_rows_(x, y, eps)
    return y
