"""Rule E6 on the CPU: the engine's final norm is the reference RMSNorm on every backend until the kernel is routed;
the kernel op refuses what it cannot run before any launch. GPU: tests/test_engine_gpu.py
(test_rms_rows_with_gain_is_the_reference_rms_norm, test_step_with_the_final_norm_kernel)."""

from __future__ import annotations

import pytest
import torch

from futx.engine import backends
from futx.reference import rms_norm


def test_off_until_measured_and_the_emulated_backend_is_the_reference():
    assert backends.FINAL_NORM_KERNEL is False
    x = torch.randn(3, 64).to(torch.bfloat16)
    g = (torch.rand(64) + 0.5).to(torch.bfloat16)
    assert torch.equal(backends.EmulatedOps().final_norm(x, g, 1e-5), rms_norm(x, g, 1e-5))


def test_the_op_checks_its_gain_before_any_launch():
    import futx.ops  # noqa: F401
    from futx.ops.rms_rows import _check, rms_rows_

    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises((ValueError, TypeError), match="CUDA|cuda"):
        rms_rows_(x, torch.empty_like(x), 1e-5, torch.ones(64, dtype=torch.bfloat16))
    if torch.cuda.is_available():   # the shapes and dtypes, where tensors can live on a GPU
        xc = x.cuda()
        for bad in (torch.ones(63, dtype=torch.bfloat16), torch.ones(64, dtype=torch.float32)):
            with pytest.raises((ValueError, TypeError)):
                _check(xc, torch.empty_like(xc), bad.cuda())
