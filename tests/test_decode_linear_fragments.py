"""CPU check of the decode kernels' fragment geometry: the exact code in `decode/dequant.py` (addresses,
register dequantization, activation pairing) runs on a numpy model of 32 lanes with emulated 16-byte
loads, ldmatrix and mma.m16n8k16, and must reproduce dequant(W) @ x bit-for-bit in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("cutlass")

from decode import dequant  # noqa: E402
from futx.quant import fp8, int4  # noqa: E402

from lane_emulator import LANES, OPS, ld16, ldsm_x4, mma  # noqa: E402,I001


def emulate(fmt, w_bytes: np.ndarray, x: torch.Tensor, n: int, k: int, scales=None, group=None):
    """D[n, tokens] as the kernels compute it, one 16-row block at a time, 8 tokens per MMA."""
    m = x.shape[0]
    x8 = torch.zeros(8, k, dtype=torch.bfloat16)
    x8[:m] = x
    row_stride = k * 2
    xmem = x8.view(torch.uint8).numpy().reshape(-1).copy()
    out = np.zeros((n, 8))
    consts = fmt.consts(OPS)
    for nb in range(n // 16):
        base = fmt.lane_base(0, nb, LANES, k, i64=np.int64)
        acc = np.zeros((16, 8))
        for kb in range(k // 64):
            regs = []
            for off in fmt.load_offsets(k, i64=int):
                regs += ld16(w_bytes, base + kb * fmt.block_stride(k) + off)
            xaddr = fmt.x_lane_offset(LANES, row_stride) + kb * 128
            load = ldsm_x4 if fmt.x_frags == "ldsm" else ld16
            xr = sum((load(xmem, xaddr + off) for off in fmt.X_LOAD_OFFSETS), ())
            part = np.zeros((16, 8))
            for a, b in zip(fmt.a_operands(regs, consts, OPS), fmt.b_operands(xr, OPS)):
                part = mma(a, b, part)
            if fmt.fold:  # the kernel's correction: -bias * (activation sums from an all-ones MMA)
                ones = (np.full(32, OPS.imm(dequant.bf16_pair(1.0)), dtype=np.int32),) * 4
                sums = np.zeros((16, 8))
                for b in fmt.b_operands(xr, OPS):
                    sums = mma(ones, b, sums)
                part = part - fmt.bias * sums
            if fmt.grouped:
                grp = kb * 64 // group
                lo, hi = fmt.scale_addrs(0, nb, grp, k // group, np.arange(8), i64=int)
                s = scales.reshape(-1)[np.concatenate([lo, hi]) // 2].astype(np.float64)
                part = part * s[:, None]
            acc += part
        out[nb * 16:(nb + 1) * 16] = acc
    return out[:, :m].T


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("group", [64, 128])
def test_int4_fragments_match_reference(group, fold, seeded):
    n, k, m = 32, 256, 3
    w = torch.randn(n, k, generator=seeded)
    x = torch.randn(m, k, generator=seeded).to(torch.bfloat16)
    q = int4.quantize_int4(w, group)
    mem = q.packed.numpy().view(np.uint8).reshape(-1)
    got = emulate(dequant.Int4Format(group, fold), mem, x, n, k, q.scales.float().numpy(), group)
    ref = x.double() @ q.dequantize(torch.float64).T
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-12, atol=1e-12)


def test_e4m3_fragments_match_reference(seeded):
    n, k, m = 32, 192, 5
    w = torch.randn(n, k, generator=seeded)
    w[0, :7] = torch.tensor([1e-6, -3e-5, 2e-4, 448.0, -448.0, 0.0, -0.0])  # subnormals, extremes, zeros
    x = torch.randn(m, k, generator=seeded).to(torch.bfloat16)
    q = fp8.quantize_e4m3_weight(w)
    mem = q.data.view(torch.uint8).numpy().reshape(-1)
    got = emulate(dequant.E4M3Format(), mem, x, n, k)
    ref = x.double() @ q.data.double().T  # per-channel scale is applied in the epilogue
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-12, atol=1e-12)


def test_bf16_fragments_match_reference(seeded):
    n, k, m = 32, 128, 8
    w = torch.randn(n, k, generator=seeded).to(torch.bfloat16)
    x = torch.randn(m, k, generator=seeded).to(torch.bfloat16)
    mem = w.view(torch.uint8).numpy().reshape(-1)
    got = emulate(dequant.BF16Format(), mem, x, n, k)
    np.testing.assert_allclose(got, (x.double() @ w.double().T).numpy(), rtol=1e-12, atol=1e-12)


def test_int4_a_operand_order_comes_from_the_layout():
    # pair 0 -> a0 (rows g, k low), pair 2 -> a1 (rows g+8), pair 1 -> a2 (k high), pair 3 -> a3
    assert dequant.INT4_A_ORDER == (0, 2, 1, 3)
