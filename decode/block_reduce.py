"""A value combined over all threads of a CTA (the row kernels: RMSNorm row factor, per-row FP8 scale)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory as cmem
from cutlass import Float32


@cute.jit
def block_reduce(v, combine, tid, warps: int):
    """`combine` of a float32 over the CTA's threads: a butterfly inside each warp, then the warps' values in warp
    order (a fixed order: deterministic), exchanged through `warps` floats of shared memory. Every thread gets the
    result."""
    part = cmem.SmemAllocator().allocate_tensor(Float32, cute.make_layout((warps,)), byte_alignment=16)
    for s in (16, 8, 4, 2, 1):
        v = combine(v, cute.arch.shuffle_sync_bfly(v, offset=s))
    if tid % 32 == 0:
        part[tid // 32] = v
    cute.arch.sync_threads()
    total = part[0]
    for w in cutlass.range_constexpr(1, warps):
        total = combine(total, part[w])
    return total
