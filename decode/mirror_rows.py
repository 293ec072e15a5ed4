"""The decode mirror of cache rows that another kernel wrote into the BF16 main copy (the prefill's QKV
epilogue): row m of the batch is (row_slot[m], row_pos[m]); for each KV head one warp stores the key's mirror
row, another the value's, exactly as the decode attention kernel stores its own new rows (decode.mirror_row).

Grid (M, Hkv), 64 threads. Every size but the head dim is a runtime value.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint8

from decode import mirror_row

THREADS = 64


class MirrorRows:
    def __init__(self, fmt: str, head_dim: int, rotate: bool):
        if fmt not in ("int4", "e4m3") or head_dim % 64:
            raise ValueError(f"mirror rows: format {fmt!r}, head_dim {head_dim} (int4 | e4m3, a multiple of 64)")
        self.fmt, self.head_dim, self.rotate = fmt, head_dim, rotate

    @cute.jit
    def __call__(self, k_cache: cute.Tensor, v_cache: cute.Tensor, k_mirror: cute.Tensor, k_scale: cute.Tensor,
                 v_mirror: cute.Tensor, v_scale: cute.Tensor, row_slot: cute.Tensor, row_pos: cute.Tensor, stream):
        self.kernel(k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale, row_slot, row_pos).launch(
            grid=(row_slot.shape[0], k_cache.shape[1], 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, k_cache: cute.Tensor, v_cache: cute.Tensor, k_mirror: cute.Tensor, k_scale: cute.Tensor,
               v_mirror: cute.Tensor, v_scale: cute.Tensor, row_slot: cute.Tensor, row_pos: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, kvh, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        n = self.head_dim // 32
        slot = row_slot[row]
        pos = row_pos[row]
        kw = dict(fmt=self.fmt, rotate=self.rotate, head_dim=self.head_dim)
        if warp == 0:
            x = [k_cache[slot, kvh, pos, lane * n + i].to(Float32) for i in range(n)]
            mirror_row.store_row(x, k_mirror, k_scale, slot, kvh, pos, lane, is_key=True, **kw)
        else:
            x = [v_cache[slot, kvh, pos, lane * n + i].to(Float32) for i in range(n)]
            mirror_row.store_row(x, v_mirror, v_scale, slot, kvh, pos, lane, is_key=False, **kw)


def compile_target(fmt: str = "int4", head_dim: int = 128, rotate: bool = True):
    """Registry factory: (jit callable, fake arguments); slots, KV heads, capacity and rows dynamic."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    def t(dtype, shape, align=16):
        return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))),
                                        assumed_align=align)

    d = head_dim
    s, hkv, c, c8, m = (cute.sym_int() for _ in range(5))
    if fmt == "int4":
        km, vm = t(Uint8, (s, hkv, c8, 32, d // 8)), t(Uint8, (s, hkv, c, d // 2))
    else:
        km, vm = t(Uint8, (s, hkv, c, d)), t(Uint8, (s, hkv, c, d))
    args = (t(BFloat16, (s, hkv, c, d)), t(BFloat16, (s, hkv, c, d)), km, t(Float32, (s, hkv, c)), vm,
            t(Float32, (s, hkv, c)), t(Int32, (m,), 4), t(Int32, (m,), 4),
            make_fake_stream(use_tvm_ffi_env_stream=True))
    return MirrorRows(fmt, head_dim, rotate), args
