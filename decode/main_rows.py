"""The BF16 main copy of cache rows read back from the decode mirror: row m of the batch goes from mirror row
(src_slot[m], src_pos[m]) to main-copy row (dst_slot[m], dst_pos[m]); for each KV head one warp does the key, another
the value. The INT4-only cache's stage of a cached prefix (futx.engine.paged_kv.dequantize_pages_into): the
prefill then attends to the prefix as decode attention reads it.

`load_row` is the inverse of decode.mirror_row.store_row: the row's codes (INT4 signed nibbles in the layout's
order; E4M3 by cvt) times the row scale, then the Hadamard rotation undone (H is its own inverse) where the cache
rotates; rounded to BF16 on store. futx.engine.paged_kv computes the same in torch (the GPU test ties the two).

Grid (M, Hkv), 64 threads. Every size but the head dim is a runtime value; the main copy may hold fewer slots
(pages) than the mirror.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint8
from cutlass.cutlass_dsl import T, dsl_user_op

from decode import hadamard_warp as hw
from decode import ptx
from decode.attn_plan import int4_key_pair_slot

THREADS = 64


@dsl_user_op
def _mul_rn(a, b, *, loc=None, ip=None) -> Float32:
    """a * b rounded on its own. A plain multiply that feeds the butterfly's first add is fused into an FMA by
    ptxas, which rounds differently from torch's separate product and sum (the INT4 rows then miss the torch
    definition in the last bit); `.rn` forbids that fusion."""
    return Float32(ptx._asm(T.f32(), [ptx._f32(a, loc, ip), ptx._f32(b, loc, ip)], "mul.rn.f32 $0, $1, $2;",
                            "=f,f,f", False, loc, ip))


def _nibble(byte, shift: int):
    """The signed 4-bit code at bit `shift` of byte (two's complement: (x ^ 8) - 8), as Float32 (exact)."""
    return ((((byte >> shift) & 0xF) ^ 8) - 8).to(Float32)


def load_row(mMir: cute.Tensor, mScale: cute.Tensor, slot, kvh, pos, lane, *, fmt: str, rotate: bool,
             head_dim: int, is_key: bool) -> list:
    """This lane's n = D / 32 Float32 channels [n * lane, n * lane + n) of mirror row (slot, kvh, pos), as decode
    attention reads them (dequantized, rotation undone)."""
    n = head_dim // 32
    c0 = lane * n
    scale = mScale[slot, kvh, pos]
    if fmt == "int4":
        q = []
        for e in range(n // 2):
            if is_key:
                quad, sb = int4_key_pair_slot(c0 + 2 * e)
                byte = mMir[slot, kvh, pos // 8, 4 * (pos % 8) + quad, sb].to(Int32)
            else:
                byte = mMir[slot, kvh, pos, c0 // 2 + e].to(Int32)
            q += [_nibble(byte, 0), _nibble(byte, 4)]     # even channel in the low nibble
        x = [_mul_rn(v, scale) for v in q]
    else:
        word = Int32(0)
        for i in range(n):
            word = word | (mMir[slot, kvh, pos, c0 + i].to(Int32) << (8 * i))
        lo, hi = ptx.e4m3x4_to_f16x2x2(word)            # e4m3 -> f16 is exact, f16 -> f32 too
        halves = [lo, lo >> 16, hi, hi >> 16]             # h16_to_f32 reads the low half
        x = [ptx.h16_to_f32(h) * scale for h in halves[:n]]
    if rotate:
        x = hw.rotate(x, lane, head_dim)
    return x


class MainRows:
    def __init__(self, fmt: str, head_dim: int, rotate: bool):
        if fmt not in ("int4", "e4m3") or head_dim not in (64, 128):
            raise ValueError(f"main rows: format {fmt!r}, head_dim {head_dim} (int4 | e4m3, 64 | 128)")
        self.fmt, self.head_dim, self.rotate = fmt, head_dim, rotate

    @cute.jit
    def __call__(self, k_cache: cute.Tensor, v_cache: cute.Tensor, k_mirror: cute.Tensor, k_scale: cute.Tensor,
                 v_mirror: cute.Tensor, v_scale: cute.Tensor, src_slot: cute.Tensor, src_pos: cute.Tensor,
                 dst_slot: cute.Tensor, dst_pos: cute.Tensor, stream):
        self.kernel(k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale, src_slot, src_pos, dst_slot,
                    dst_pos).launch(grid=(src_slot.shape[0], k_cache.shape[1], 1), block=(THREADS, 1, 1),
                                    stream=stream)

    @cute.kernel
    def kernel(self, k_cache: cute.Tensor, v_cache: cute.Tensor, k_mirror: cute.Tensor, k_scale: cute.Tensor,
               v_mirror: cute.Tensor, v_scale: cute.Tensor, src_slot: cute.Tensor, src_pos: cute.Tensor,
               dst_slot: cute.Tensor, dst_pos: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, kvh, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        n = self.head_dim // 32
        ss, sp, ds, dp = src_slot[row], src_pos[row], dst_slot[row], dst_pos[row]
        kw = dict(fmt=self.fmt, rotate=self.rotate, head_dim=self.head_dim)
        if warp == 0:
            x = load_row(k_mirror, k_scale, ss, kvh, sp, lane, is_key=True, **kw)
            for i in cutlass.range_constexpr(n):
                k_cache[ds, kvh, dp, lane * n + i] = x[i].to(BFloat16)
        else:
            x = load_row(v_mirror, v_scale, ss, kvh, sp, lane, is_key=False, **kw)
            for i in cutlass.range_constexpr(n):
                v_cache[ds, kvh, dp, lane * n + i] = x[i].to(BFloat16)


def compile_target(fmt: str = "int4", head_dim: int = 128, rotate: bool = True):
    """Registry factory: (jit callable, fake arguments); main pages, mirror pages, KV heads, page size and rows
    dynamic."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    def t(dtype, shape, align=16):
        return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))),
                                        assumed_align=align)

    d = head_dim
    s, sm, hkv, c, c8, m = (cute.sym_int() for _ in range(6))
    if fmt == "int4":
        km, vm = t(Uint8, (sm, hkv, c8, 32, d // 8)), t(Uint8, (sm, hkv, c, d // 2))
    else:
        km, vm = t(Uint8, (sm, hkv, c, d)), t(Uint8, (sm, hkv, c, d))
    rows = [t(Int32, (m,), 4) for _ in range(4)]
    args = (t(BFloat16, (s, hkv, c, d)), t(BFloat16, (s, hkv, c, d)), km, t(Float32, (sm, hkv, c)), vm,
            t(Float32, (sm, hkv, c)), *rows, make_fake_stream(use_tvm_ffi_env_stream=True))
    return MainRows(fmt, head_dim, rotate), args
