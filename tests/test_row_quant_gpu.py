"""futx's per-row E4M3 quantization kernel (futx.ops.row_quant, futx/prefill/row_quant.py) on a Hopper GPU: bit for bit
futx.engine.prefill.quantize_rows (scales and E4M3 bytes) on random rows with outliers, all-zero rows, ties at
the E4M3 rounding boundaries, odd row counts and the prefill block's widths; bad inputs raise before the launch.

    python -m pytest -m gpu -q tests/test_row_quant_gpu.py
"""

import pytest
import torch

from futx.engine.prefill import quantize_rows

pytestmark = pytest.mark.gpu

# 16-byte rows (K % 8 == 0) and the element-by-element path (K = 4, 12)
SHAPES = [(1, 64), (3, 4096), (17, 576), (31, 14336), (512, 4096), (2, 4), (5, 12)]


@pytest.mark.parametrize("m,k", SHAPES, ids=[f"{m}x{k}" for m, k in SHAPES])
def test_kernel_equals_torch(m, k):
    from futx.ops.row_quant import quantize_rows_e4m3

    g = torch.Generator(device="cuda").manual_seed(m * 7 + k)
    x = torch.randn(m, k, generator=g, device="cuda") * torch.rand(m, 1, generator=g, device="cuda") * 4
    x[0, k // 2] = 300.0                                   # an outlier row
    if m > 2:
        x[1].zero_()                                       # scale 1, zero bytes
        x[2, : min(k, 8)] = torch.tensor([448.0, 152.0, -7.75, 0.5, 1.0625, -3.0, 0.0, 2.0], device="cuda")[: min(k, 8)]
    x = x.to(torch.bfloat16)
    q = torch.full((m, k), 0x5A, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)   # poisoned
    s = torch.full((m,), float("nan"), device="cuda")
    got_q, got_s = quantize_rows_e4m3(x, q, s)
    want_q, want_s = quantize_rows(x)
    torch.cuda.synchronize()
    assert torch.equal(got_s, want_s)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


def test_bad_inputs_raise_before_launch():
    from futx.ops.row_quant import quantize_rows_e4m3

    x = torch.zeros(4, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises((TypeError, ValueError), match="x"):
        quantize_rows_e4m3(x.float())
    with pytest.raises(ValueError, match="K"):
        quantize_rows_e4m3(torch.zeros(4, 66, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="scale"):
        quantize_rows_e4m3(x, scale=torch.zeros(3, device="cuda"))
    with pytest.raises(ValueError, match="contiguous"):
        quantize_rows_e4m3(x.t())
    q, s = quantize_rows_e4m3(x[:0])                      # M = 0 launches nothing
    assert q.shape == (0, 64) and s.shape == (0,)
