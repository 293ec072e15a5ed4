"""`futx::axpy_` — the runtime self-test kernel as a torch custom op (a template for real ops)."""

from __future__ import annotations

import torch

from futx.ops import checks
from futx.ops.registration import futx_op
from futx.runtime import get_kernel


@futx_op("axpy_", mutates_args=("y",))
def axpy_(x: torch.Tensor, y: torch.Tensor, alpha: float) -> None:
    """y += alpha * x for flat, contiguous bf16 CUDA tensors of equal length."""
    # One cheap combined test on the hot path; the itemised checks below only run to name a failure.
    if not (x.is_cuda and x.dtype is torch.bfloat16 and y.dtype is torch.bfloat16 and y.device == x.device
            and x.dim() == 1 and y.shape == x.shape and x.is_contiguous() and y.is_contiguous()
            and not (x.data_ptr() | y.data_ptr()) % 16):
        _explain(x, y)
    get_kernel("smoke.axpy.bf16")(x, y, float(alpha))


def _explain(x: torch.Tensor, y: torch.Tensor) -> None:
    checks.cuda("x", x)
    checks.cuda("y", y, x.device)
    checks.dtype("x", x, torch.bfloat16)
    checks.dtype("y", y, torch.bfloat16)
    checks.shape("x", x, (x.numel(),))
    checks.shape("y", y, (x.numel(),))
    checks.contiguous("x", x)
    checks.contiguous("y", y)
    checks.aligned("x", x)
    checks.aligned("y", y)
    raise AssertionError("unreachable: the fast check failed but no itemised check did")


@axpy_.register_fake
def _(x, y, alpha):
    return None
