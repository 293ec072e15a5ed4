"""The new K/V rows of a QKV projection output written into the cache by one kernel: RoPE on the key
(decode.rope_warp), the BF16 main copy and the decode mirror (decode.mirror_row), exactly the bytes the decode
attention kernel stores for its own new row. The verify step of speculative decoding writes a block's rows this
way before its attention runs (futx.engine.backends.KernelOps.attention_block, "kernel"), one launch instead of
the torch glue's RoPE, stores and mirror kernel.

Row m of qkv [M, Hq + 2 Hkv, D] is position positions[m] (RoPE's angle) stored at (row_slot[m], row_pos[m]) of
the cache tensors (a paged cache: the page and in-page row of futx.paging.locate). Grid (M, Hkv), 64 threads: one
warp the key row, one the value row. Every size but the head dim is a runtime value. mirror_only: the mirror row
alone (the INT4-only cache, whose main copy holds only staging pages: futx.paging), as decode attention's `.mo`
twin stores it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint8

from decode import mirror_row, rope_warp

THREADS = 64


class QkvRows:
    def __init__(self, fmt: str, head_dim: int, rotate: bool, mirror_only: bool = False):
        if fmt not in ("int4", "e4m3") or head_dim not in (64, 128):
            raise ValueError(f"qkv rows: format {fmt!r}, head_dim {head_dim} (int4 | e4m3, 64 | 128)")
        self.fmt, self.head_dim, self.rotate, self.mirror_only = fmt, head_dim, rotate, mirror_only

    @cute.jit
    def __call__(self, qkv: cute.Tensor, rope: cute.Tensor, positions: cute.Tensor, row_slot: cute.Tensor,
                 row_pos: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor, k_mirror: cute.Tensor,
                 k_scale: cute.Tensor, v_mirror: cute.Tensor, v_scale: cute.Tensor, stream):
        self.kernel(qkv, rope, positions, row_slot, row_pos, k_cache, v_cache, k_mirror, k_scale, v_mirror,
                    v_scale).launch(grid=(row_slot.shape[0], k_cache.shape[1], 1), block=(THREADS, 1, 1),
                                    stream=stream)

    @cute.kernel
    def kernel(self, qkv: cute.Tensor, rope: cute.Tensor, positions: cute.Tensor, row_slot: cute.Tensor,
               row_pos: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor, k_mirror: cute.Tensor,
               k_scale: cute.Tensor, v_mirror: cute.Tensor, v_scale: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, kvh, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        n = self.head_dim // 32
        hkv = k_cache.shape[1]
        hq = qkv.shape[1] - 2 * hkv
        slot = row_slot[row]
        pos = row_pos[row]
        kw = dict(fmt=self.fmt, rotate=self.rotate, head_dim=self.head_dim)
        if warp == 0:
            x = [qkv[row, hq + kvh, lane * n + i].to(Float32) for i in range(n)]
            x = rope_warp.rope(x, rope, positions[row], lane, self.head_dim)
            if cutlass.const_expr(not self.mirror_only):
                for i in cutlass.range_constexpr(n):
                    k_cache[slot, kvh, pos, lane * n + i] = x[i].to(BFloat16)
            mirror_row.store_row(x, k_mirror, k_scale, slot, kvh, pos, lane, is_key=True, **kw)
        else:
            x = [qkv[row, hq + hkv + kvh, lane * n + i].to(Float32) for i in range(n)]
            if cutlass.const_expr(not self.mirror_only):
                for i in cutlass.range_constexpr(n):
                    v_cache[slot, kvh, pos, lane * n + i] = x[i].to(BFloat16)
            mirror_row.store_row(x, v_mirror, v_scale, slot, kvh, pos, lane, is_key=False, **kw)


def compile_target(fmt: str = "int4", head_dim: int = 128, rotate: bool = True, mirror_only: bool = False):
    """Registry factory: (jit callable, fake arguments); rows, heads, slots (pages; the main copy's own extent when
    mirror_only), capacity and the RoPE table's length dynamic."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    def t(dtype, shape, align=16):
        return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))),
                                        assumed_align=align)

    d = head_dim
    s, hkv, c, c8, m, ht, r = (cute.sym_int() for _ in range(7))
    sm = cute.sym_int() if mirror_only else s
    if fmt == "int4":
        km, vm = t(Uint8, (s, hkv, c8, 32, d // 8)), t(Uint8, (s, hkv, c, d // 2))
    else:
        km, vm = t(Uint8, (s, hkv, c, d)), t(Uint8, (s, hkv, c, d))
    args = (t(BFloat16, (m, ht, d)), t(Float32, (r, d)), t(Int32, (m,), 4), t(Int32, (m,), 4), t(Int32, (m,), 4),
            t(BFloat16, (sm, hkv, c, d)), t(BFloat16, (sm, hkv, c, d)), km, t(Float32, (s, hkv, c)), vm,
            t(Float32, (s, hkv, c)), make_fake_stream(use_tvm_ffi_env_stream=True))
    return QkvRows(fmt, head_dim, rotate, mirror_only), args
