"""Rule E7 on the CPU: the greedy argmax's op refuses what the kernel cannot take before any launch, `greedy` falls
back to torch.argmax where the kernel does not take the logits, both engine backends give torch.argmax's answer, and
the workspace holds a partial pair per CTA. GPU: tests/test_argmax_rows_gpu.py."""

from __future__ import annotations

import pytest
import torch

from decode.argmax_plan import CHUNK, THREADS, VEC, blocks_per_row
from futx.engine import backends


def test_geometry():
    assert CHUNK == THREADS * VEC and VEC == 8   # one 16-byte load of bf16 per thread
    assert blocks_per_row(1) == 1 and blocks_per_row(CHUNK) == 1 and blocks_per_row(CHUNK + 8) == 2
    assert blocks_per_row(128256) == 63


def test_routing_default():
    assert backends.ARGMAX_KERNEL is True   # routed: docs/routing.md E7
    assert backends.KernelOps.__dict__["argmax"] and backends.EmulatedOps.__dict__["argmax"]


def _logits_with_ties_and_nans():
    x = torch.randn(5, 64).to(torch.bfloat16)
    x[1, 40] = x[1, 3] = x[1].max() + 1   # a tie: the lower index
    x[2, 7] = float("nan")                 # a NaN is the largest
    x[2, 20] = float("nan")
    x[3] = float("-inf")                   # all equal
    x[4] = 0.0
    x[4, 9] = -0.0                         # -0 == +0: the first zero
    return x


def test_emulated_backend_and_cpu_fallback_are_torch_argmax():
    from futx.ops.argmax_rows import greedy

    x = _logits_with_ties_and_nans()
    want = torch.argmax(x, dim=-1)
    assert want.tolist()[1:5] == [3, 7, 0, 0]
    out = torch.full((5,), -1, dtype=torch.int64)
    backends.EmulatedOps().argmax(x, out)
    assert torch.equal(out, want)
    assert torch.equal(greedy(x), want)   # on the CPU: torch.argmax
    assert torch.equal(backends.greedy_tokens(x), want)


def test_supported_only_what_the_kernel_takes():
    from futx.ops.argmax_rows import supported

    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    assert not supported(x)   # not on a GPU
    assert not supported(torch.zeros(2, 64, dtype=torch.float32))


def test_the_op_checks_before_any_launch():
    import futx.ops  # noqa: F401  (registers torch.ops.futx.*)
    from futx.ops.argmax_rows import _check, argmax_rows_

    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises((ValueError, TypeError), match="CUDA|cuda"):
        argmax_rows_(x, torch.empty(2, dtype=torch.int64))
    if torch.cuda.is_available():
        xc = x.cuda()
        for bad_x, bad_out in ((xc[:, :60], None), (xc.float(), None), (xc.t(), None),
                               (xc, torch.empty(2, dtype=torch.int32)), (xc, torch.empty(3, dtype=torch.int64))):
            out = bad_out if bad_out is not None else torch.empty(bad_x.shape[0], dtype=torch.int64)
            with pytest.raises((ValueError, TypeError)):
                _check(bad_x, out.cuda())
