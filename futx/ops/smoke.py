"""`futx::axpy_` — the runtime self-test kernel as a torch custom op (a template for real ops)."""

from __future__ import annotations

import torch

from futx.ops import checks
from futx.ops.registration import futx_op
from futx.runtime import get_kernel


@futx_op("axpy_", mutates_args=("y",))
def axpy_(x: torch.Tensor, y: torch.Tensor, alpha: float) -> None:
    """y += alpha * x for flat, contiguous bf16 CUDA tensors of equal length."""
    checks.cuda("x", x)
    checks.cuda("y", y, x.device)
    checks.dtype("x", x, torch.bfloat16)
    checks.dtype("y", y, torch.bfloat16)
    checks.shape("y", y, (x.numel(),))
    checks.shape("x", x, (y.numel(),))
    checks.contiguous("x", x)
    checks.contiguous("y", y)
    checks.aligned("x", x)
    checks.aligned("y", y)
    get_kernel("smoke.axpy.bf16")(x, y, float(alpha))


@axpy_.register_fake
def _(x, y, alpha):
    return None
