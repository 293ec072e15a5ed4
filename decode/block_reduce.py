"""A value combined over all threads of a CTA (the row kernels: RMSNorm row factor, per-row FP8 scale)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def block_reduce(v, combine, part: cute.Tensor, tid, warps: int):
    """`combine` over the CTA's threads: a butterfly inside each warp, then the warps' values in warp order
    (a fixed order: deterministic). Every thread gets the result. `part`: `warps` float32 in shared memory."""
    for s in (16, 8, 4, 2, 1):
        v = combine(v, cute.arch.shuffle_sync_bfly(v, offset=s))
    if tid % 32 == 0:
        part[tid // 32] = v
    cute.arch.sync_threads()
    total = part[0]
    for w in cutlass.range_constexpr(1, warps):
        total = combine(total, part[w])
    return total
