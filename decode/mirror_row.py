"""One warp stores one K or V row in the decode mirror: Hadamard rotation (INT4), per-row scale amax / qmax
(IEEE division), quantization (INT4: round half to even, clamp to [-7, 7]; E4M3: cvt.rn) and the packed order
of futx.quant.layouts. This is the kernels' definition of a mirror row, which futx.quant.kv_mirror mirrors in
torch (tests tie the two). Used by the decode attention kernel for its new row and by decode.mirror_rows for
rows a prefill wrote.

Plain Python traced into the caller's kernel (straight-line code, no dynamic `if`), like hadamard_warp.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8

from decode import hadamard_warp as hw
from decode import ptx
from decode.attn_plan import QMAX, int4_key_pair_slot


def warp_max(x):
    for s in (16, 8, 4, 2, 1):
        x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=s))
    return x


def store_row(x: list, mMir: cute.Tensor, mScale: cute.Tensor, slot, kvh, pos, lane, *, fmt: str, rotate: bool,
              head_dim: int, is_key: bool) -> None:
    """x: this lane's n = D / 32 Float32 channels [n * lane, n * lane + n) of the row (slot, kvh, pos).
    The scale is stored by every lane (one address, one value)."""
    n = len(x)
    c0 = lane * n
    if rotate:
        x = hw.rotate(x, lane, head_dim)
    amax = Float32(0.0)
    for v in x:
        amax = cute.arch.fmax(amax, cute.math.absf(v))
    amax = warp_max(amax)
    scale = ptx.div_rn(amax, Float32(QMAX[fmt]))
    live = scale > Float32(0.0)
    safe = cutlass.select_(live, scale, Float32(1.0))
    if fmt == "int4":
        q = []
        for v in x:
            r = ptx.rint_s32(ptx.div_rn(v, safe))
            r = cutlass.max(cutlass.min(r, Int32(7)), Int32(-7))
            q.append(cutlass.select_(live, r, Int32(0)))
        for e in range(n // 2):
            byte = Uint8((q[2 * e] & 0xF) | ((q[2 * e + 1] & 0xF) << 4))
            if is_key:
                quad, sb = int4_key_pair_slot(c0 + 2 * e)
                mMir[slot, kvh, pos // 8, 4 * (pos % 8) + quad, sb] = byte
            else:
                mMir[slot, kvh, pos, c0 // 2 + e] = byte
    else:
        y = [cutlass.select_(live, ptx.div_rn(v, safe), Float32(0.0)) for v in x]
        y = y + [Float32(0.0)] * (4 - n)
        word = ptx.f32x4_to_e4m3x4(y[0], y[1], y[2], y[3])
        for i in range(n):
            mMir[slot, kvh, pos, c0 + i] = Uint8((word >> (8 * i)) & 0xFF)
    mScale[slot, kvh, pos] = scale
