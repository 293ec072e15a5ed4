"""Register dequantization shared by the decode kernels: where each lane's weight bytes live, how they
become finished `mma.sync.m16n8k16` A fragments, and which activation values pair with them.

Both kernels compute D[16 output channels, 8 tokens] = W[16, 16] @ X^T[16, 8] per MMA ("swap AB": the
weights are the A operand, so one weight tile serves 8 tokens and M = 1 wastes nothing but MMA slots).
A *block* is 16 output channels x 64 reduction elements; each lane reads it with 16-byte loads and
turns it into the A operands of 4 MMAs (one per k16 step). The k order inside an MMA is ours to pick as
long as A and B agree lane by lane, so each format names the activation pairs its lanes need (and which
activation row, `x_lane_row`, the lane addresses: kernels clamp it to the last real token):

* INT4 (`futx.quant.layouts`): fragment order; lane 4g+t needs X[16j + 2t (+8) ...], exactly what
  `ldmatrix` delivers from a natural activation row.
* BF16 / E4M3 (natural [N, K] rows): lane 4g+t reads 16 contiguous k of rows g and g+8 and needs the
  activations X[16t .. 16t+15] of the same k: two 16-byte shared loads (E4M3 pairs bytes (0,2), (1,3),
  so its activation pairs are byte-permuted to match).

All INT4 index math comes from `layouts`; nothing here restates it.
"""

from __future__ import annotations

import struct

from cutlass import Int64

from futx.quant import layouts
from . import ptx

LAY = layouts.INT4_WEIGHT
BLOCK_N = LAY.block_n          # output channels per block (two n8 halves of the MMA)
BLOCK_K = LAY.block_k          # reduction elements per block
WORDS = LAY.words_per_lane     # k16 steps per block = MMAs per block per token group
LANE_BYTES = 16                # one 16-byte load
LANE_K = BLOCK_K // 4          # natural-layout formats: k per lane quad member (t) per block row
assert WORDS * 4 == LANE_BYTES and BLOCK_K == layouts.MMA_K * WORDS and BLOCK_N == 2 * layouts.MMA_N


def bf16_bits(x: float) -> int:
    """The 16-bit pattern of bf16(x) (x must be exactly representable)."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    assert bits & 0xFFFF == 0, f"{x} is not exactly representable in bf16"
    return bits >> 16


def bf16_pair(x: float) -> int:
    b = bf16_bits(x)
    return (b << 16) | b


# A-operand register of m16n8k16 fed by each INT4 pair (a0: rows g, k low; a1: rows g+8, k low;
# a2: rows g, k high; a3: rows g+8, k high), from the layout's own (n8 half, B register) of the pair.
def _a_slot(pair: int) -> int:
    half, breg, _ = LAY.pair_coord(0, 0, pair)
    return half + 2 * breg


INT4_A_ORDER = tuple(sorted(range(WORDS), key=_a_slot))  # pairs in a0..a3 order
assert sorted(_a_slot(p) for p in range(WORDS)) == [0, 1, 2, 3]
INT4_SHIFT = 4  # bits between consecutive pairs of a word (nibble p sits at bits 4p)


def ldsm_k_offset(matrix: int) -> int:
    """k offset (within a block) of the 8x8 activation matrix that feeds B register matrix % 2 of k16
    step matrix // 2; lane 0 of the B fragment holds its first column."""
    k_in_tile, _ = layouts.b_fragment_coord(0, matrix % 2, 0)
    return layouts.MMA_K * (matrix // 2) + k_in_tile


# The 8 matrices of a block sit at equally spaced k, so a lane's ldmatrix row address is affine in
# its matrix index (lane // 8) and the second .x4 is a fixed offset from the first.
LDSM_K_STEP = ldsm_k_offset(1) - ldsm_k_offset(0)
assert all(ldsm_k_offset(m) == m * LDSM_K_STEP for m in range(2 * WORDS))


class Int4Format:
    """Packed INT4 [N/16, K/64, 32, 4] int32 + float16 group scales [N/16, K/G, 16].

    `fold`: the MMA A operands keep the biased values 128 + nibble (no per-register FMA); the kernel
    subtracts `LAY.bias` * (sum of the group's activations) once per group instead."""

    name = "int4"
    loads_per_block = 1
    x_frags = "ldsm"
    grouped = True
    bias = LAY.bias

    def __init__(self, group_size: int, fold: bool = False):
        LAY.check_shape(BLOCK_N, group_size, group_size)
        self.group_size = group_size
        self.blocks_per_group = group_size // BLOCK_K
        self.fold = fold

    def weight_bytes(self, n: int, k: int) -> int:
        return n * k // 2

    def consts(self, ops=ptx):
        # Packed-bf16 operands have no immediate form: keep them in registers once.
        if self.fold:
            return (ops.const_b32(LAY.bf16_128_pair),)
        return (ops.const_b32(LAY.bf16_128_pair), ops.const_b32(bf16_pair(1.0)), ops.const_b32(bf16_pair(-LAY.bias)))

    def lane_base(self, w_base, nb, lane, k, i64=Int64):
        """Byte address of this lane's 16 bytes of block (nb, 0)."""
        kb = k // BLOCK_K
        return w_base + (i64(nb) * kb * layouts.WARP + i64(lane)) * LANE_BYTES

    def block_stride(self, k) -> int:
        return LAY.block_bytes

    def load_offsets(self, k, i64=Int64) -> tuple:
        return (0,)

    def a_operands(self, regs, consts, ops=ptx) -> list:
        """One 16-byte load (4 words) -> A operands of the block's 4 MMAs, in k16 order."""
        magic = consts[0]
        out = []
        for word in regs:
            v = []
            for pair in range(WORDS):
                shifted = word if pair == 0 else word >> (INT4_SHIFT * pair)
                r = ops.lop3(shifted, ops.imm(LAY.pair_mask), magic, (0xF0 & 0xCC) | 0xAA)  # (a & b) | c
                v.append(r if self.fold else ops.fma_bf16x2(r, consts[1], consts[2]))
            out.append(tuple(v[p] for p in INT4_A_ORDER))
        return out

    @staticmethod
    def x_lane_row(lane):
        """Token row this lane hands to ldmatrix: row lane % 8 of matrix lane // 8."""
        return lane % 8

    @staticmethod
    def x_lane_col(lane):
        return (lane // 8) * (LDSM_K_STEP * 2)

    @classmethod
    def x_lane_offset(cls, lane, row_stride):
        """Byte offset of that row's first matrix column in an activation tile with rows = tokens."""
        return cls.x_lane_row(lane) * row_stride + cls.x_lane_col(lane)

    X_LOAD_OFFSETS = (0, ldsm_k_offset(4) * 2)  # two ldmatrix.x4: matrices 0-3, 4-7

    def b_operands(self, xr, ops=ptx) -> list:
        """8 ldmatrix registers (matrices 0..7 of the block) -> (b0, b1) per k16 step."""
        return [(xr[2 * j], xr[2 * j + 1]) for j in range(WORDS)]

    # group scales: lane 4g+t needs channels g and g+8 of its n-block
    def scale_addrs(self, s_base, nb, group, n_groups, g, i64=Int64) -> tuple:
        row = (i64(nb) * n_groups + group) * BLOCK_N + g
        return s_base + row * 2, s_base + (row + layouts.MMA_N) * 2


class _NaturalActivations:
    """Activation addressing of the natural-row formats (BF16, E4M3): lane 4g+t reads X[token g][16t ..
    16t+15] with two 16-byte shared loads."""

    @staticmethod
    def x_lane_row(lane):
        return lane // 4

    @staticmethod
    def x_lane_col(lane):
        return (lane % 4) * (LANE_K * 2)

    @classmethod
    def x_lane_offset(cls, lane, row_stride):
        """Byte offset of X[token g][LANE_K * t] (16 contiguous k, read with two 16-byte loads)."""
        return cls.x_lane_row(lane) * row_stride + cls.x_lane_col(lane)

    X_LOAD_OFFSETS = (0, LANE_BYTES)


class E4M3Format(_NaturalActivations):
    """E4M3 [N, K] (bytes) + one float32 scale per output channel [N]."""

    name = "e4m3"
    fold = False
    loads_per_block = 2
    x_frags = "lds"
    grouped = False
    BIAS = bf16_pair(2.0 ** 120)  # bf16 exponent bias 127 minus e4m3 bias 7

    def weight_bytes(self, n: int, k: int) -> int:
        return n * k

    def consts(self, ops=ptx):
        return (ops.const_b32(self.BIAS),)

    def lane_base(self, w_base, nb, lane, k, i64=Int64):
        g, t = lane // 4, lane % 4
        return w_base + (i64(nb) * BLOCK_N + g) * k + t * LANE_K

    def block_stride(self, k) -> int:
        return BLOCK_K

    def load_offsets(self, k, i64=Int64) -> tuple:
        return (0, i64(layouts.MMA_N) * k)  # rows g and g + 8

    @staticmethod
    def _to_bf16(q, bias, ops) -> tuple:
        """4 e4m3 bytes (b0..b3) -> bf16x2 (b0, b2), (b1, b3): sign stays, exponent+mantissa move
        down 4 bits into bf16 position (an exact value * 2^-120), then one multiply by 2^120."""
        sign = ops.imm(0x80008000)
        hi = ops.lop3(q, sign, (q >> 4) & ops.imm(0x07F007F0), 0xEA)          # bytes 1, 3: (a & b) | c
        q8 = q << 8
        lo = ops.lop3(q8, sign, (q8 >> 4) & ops.imm(0x07F007F0), 0xEA)        # bytes 0, 2
        return ops.mul_bf16x2(lo, bias), ops.mul_bf16x2(hi, bias)

    def a_operands(self, regs, consts, ops=ptx) -> list:
        (bias,) = consts
        row_g, row_g8 = regs[0:4], regs[4:8]
        out = []
        for m in range(WORDS):
            lo0, hi0 = self._to_bf16(row_g[m], bias, ops)
            lo8, hi8 = self._to_bf16(row_g8[m], bias, ops)
            out.append((lo0, lo8, hi0, hi8))
        return out

    def b_operands(self, xr, ops=ptx) -> list:
        """X[16t .. 16t+15] as 8 natural pairs -> the (even, even+2), (odd, odd+2) pairs E4M3 uses."""
        return [(ops.prmt(xr[2 * m], xr[2 * m + 1], 0x5410), ops.prmt(xr[2 * m], xr[2 * m + 1], 0x7632))
                for m in range(WORDS)]


class BF16Format(_NaturalActivations):
    """BF16 [N, K], no scale."""

    name = "bf16"
    fold = False
    loads_per_block = 4
    x_frags = "lds"
    grouped = False

    def weight_bytes(self, n: int, k: int) -> int:
        return 2 * n * k

    def consts(self, ops=ptx):
        return ()

    def lane_base(self, w_base, nb, lane, k, i64=Int64):
        g, t = lane // 4, lane % 4
        return w_base + ((i64(nb) * BLOCK_N + g) * k + t * LANE_K) * 2

    def block_stride(self, k) -> int:
        return 2 * BLOCK_K

    def load_offsets(self, k, i64=Int64) -> tuple:
        row8 = i64(layouts.MMA_N) * k * 2
        return (0, LANE_BYTES, row8, row8 + LANE_BYTES)

    def a_operands(self, regs, consts, ops=ptx) -> list:
        p, q = regs[0:8], regs[8:16]  # 8 k-pairs of row g, of row g + 8
        return [(p[2 * j], q[2 * j], p[2 * j + 1], q[2 * j + 1]) for j in range(WORDS)]

    def b_operands(self, xr, ops=ptx) -> list:
        return [(xr[2 * j], xr[2 * j + 1]) for j in range(WORDS)]


def make_format(fmt: str, group_size: int = 128, fold: bool = False):
    if fmt == "int4":
        return Int4Format(group_size, fold)
    if fmt == "e4m3":
        return E4M3Format()
    if fmt == "bf16":
        return BF16Format()
    raise ValueError(f"unknown decode weight format {fmt!r} (int4, e4m3, bf16)")
