"""Rotate-half RoPE of one row held by a warp: lane l holds channels [l n, l n + n) (n = D / 32), so channel c's
partner c +- D/2 sits in lane l ^ 16 at the same index. float32 math with the cos | sin table row of the position,
each result rounded to bf16 (as an unfused RoPE stores q and k). The one definition the decode attention kernel
(query and new key) and the block-rows writer (decode.qkv_rows) trace.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32


def rope(x: list, mRope: cute.Tensor, pos, lane, head_dim: int) -> list:
    """x: this lane's n Float32 channels; mRope [positions, D] f32 (cos of the D/2 angles, then their sin)."""
    n = len(x)
    half = head_dim // 2
    first = lane < 16
    out = []
    for i in range(n):
        partner = cute.arch.shuffle_sync_bfly(x[i], offset=16)
        j = (lane % 16) * n + i
        y = x[i] * mRope[pos, j] + cutlass.select_(first, -partner, partner) * mRope[pos, half + j]
        out.append(y.to(BFloat16).to(Float32))
    return out
