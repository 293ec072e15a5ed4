"""CPU check of the decode kernels' fragment geometry: the exact code in `decode/dequant.py` (addresses,
register dequantization, activation pairing) runs on a numpy model of 32 lanes with emulated 16-byte
loads, ldmatrix and mma.m16n8k16, and must reproduce dequant(W) @ x bit-for-bit in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("cutlass")

from decode import dequant  # noqa: E402
from futx.quant import fp8, int4, layouts  # noqa: E402

LANES = np.arange(32)


# ---- a numpy stand-in for decode.ptx: registers are int32 arrays with one entry per lane --------
def _halves(r):
    u = np.asarray(r).astype(np.int64) & 0xFFFFFFFF
    return (u & 0xFFFF), (u >> 16)


def _bf16_to_f64(bits):
    return torch.from_numpy(np.asarray(bits, dtype=np.int64).astype(np.int16)).view(torch.bfloat16).double().numpy()


def _f64_to_bf16_bits(x):
    return torch.from_numpy(np.asarray(x, dtype=np.float64)).to(torch.bfloat16).view(torch.int16).numpy().astype(
        np.int64) & 0xFFFF


def _pack(lo, hi):
    return ((np.asarray(hi, dtype=np.int64) << 16) | np.asarray(lo, dtype=np.int64)).astype(np.uint32).view(np.int32)


class NpOps:
    @staticmethod
    def imm(v):
        return np.int32(np.uint32(v & 0xFFFFFFFF).view(np.int32))

    const_b32 = imm

    @staticmethod
    def lop3(a, b, c, lut):
        a, b, c = (np.asarray(v, dtype=np.int32) for v in (a, b, c))
        out = np.zeros(np.broadcast(a, b, c).shape, dtype=np.int32)
        for i in range(8):
            if lut >> i & 1:
                out |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
        return out

    @staticmethod
    def _packed(fn, *regs):
        lows, highs = zip(*(_halves(r) for r in regs))
        lo = fn(*(_bf16_to_f64(v) for v in lows))
        hi = fn(*(_bf16_to_f64(v) for v in highs))
        return _pack(_f64_to_bf16_bits(lo), _f64_to_bf16_bits(hi))

    def fma_bf16x2(self, a, b, c):
        return self._packed(lambda x, y, z: x * y + z, a, b, c)

    def mul_bf16x2(self, a, b):
        return self._packed(lambda x, y: x * y, a, b)

    @staticmethod
    def prmt(a, b, selector):
        src = (np.asarray(b).astype(np.int64) & 0xFFFFFFFF) << 32 | (np.asarray(a).astype(np.int64) & 0xFFFFFFFF)
        out = np.zeros_like(src)
        for i in range(4):
            idx = (selector >> (4 * i)) & 7
            out |= ((src >> (8 * idx)) & 0xFF) << (8 * i)
        return out.astype(np.uint32).view(np.int32)


OPS = NpOps()


def ld16(mem: np.ndarray, addr) -> tuple:
    """16-byte load per lane from a byte array: 4 int32 words per lane."""
    words = np.stack([mem[a:a + 16].view(np.int32) for a in np.asarray(addr)])
    return tuple(words[:, i] for i in range(4))


def ldsm_x4(mem: np.ndarray, addr) -> tuple:
    """ldmatrix .x4: lane 8i+r addresses row r of matrix i; lane 4g+t gets row g, bytes 4t..4t+3."""
    addr = np.asarray(addr)
    out = []
    for i in range(4):
        rows = addr[8 * i:8 * i + 8]
        out.append(np.array([mem[rows[l // 4] + 4 * (l % 4):][:4].view(np.int32)[0] for l in LANES]))
    return tuple(out)


def mma(a, b, c):
    """m16n8k16 row.col, bf16 inputs, exact (float64) accumulation into c [16, 8]."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for l in LANES:
        g, t = l // 4, l % 4
        for reg, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            lo, hi = _halves(a[reg][l])
            A[row, col], A[row, col + 1] = _bf16_to_f64(lo), _bf16_to_f64(hi)
        for reg in range(2):
            k, n = layouts.b_fragment_coord(l, reg, 0)
            lo, hi = _halves(b[reg][l])
            B[k, n], B[k + 1, n] = _bf16_to_f64(lo), _bf16_to_f64(hi)
    return c + A @ B


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
