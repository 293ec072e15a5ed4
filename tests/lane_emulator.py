"""A numpy model of one warp for CPU checks of the decode kernels' fragment code (decode/dequant.py and the bodies
that call it): registers are int32 arrays with one entry per lane; 16-byte loads, ldmatrix and mma.m16n8k16 are
emulated exactly (float64 accumulation), and `NpOps` stands in for decode.ptx's register operations."""

from __future__ import annotations

import numpy as np
import torch

from futx.quant import layouts

LANES = np.arange(32)


# ---- a numpy stand-in for decode.ptx: registers are int32 arrays with one entry per lane --------
def halves(r):
    u = np.asarray(r).astype(np.int64) & 0xFFFFFFFF
    return (u & 0xFFFF), (u >> 16)


def bf16_to_f64(bits):
    return torch.from_numpy(np.asarray(bits, dtype=np.int64).astype(np.int16)).view(torch.bfloat16).double().numpy()


def f64_to_bf16_bits(x):
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
        lows, highs = zip(*(halves(r) for r in regs))
        lo = fn(*(bf16_to_f64(v) for v in lows))
        hi = fn(*(bf16_to_f64(v) for v in highs))
        return _pack(f64_to_bf16_bits(lo), f64_to_bf16_bits(hi))

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
            lo, hi = halves(a[reg][l])
            A[row, col], A[row, col + 1] = bf16_to_f64(lo), bf16_to_f64(hi)
        for reg in range(2):
            k, n = layouts.b_fragment_coord(l, reg, 0)
            lo, hi = halves(b[reg][l])
            B[k, n], B[k + 1, n] = bf16_to_f64(lo), bf16_to_f64(hi)
    return c + A @ B
