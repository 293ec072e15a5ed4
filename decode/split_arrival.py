"""The split-K arrival of the kernels whose last CTA reduces the partials (decode skinny projections, the prefill
GEMM's coop schedule): after a CTA has written and fenced its partial tile, one of its threads counts the CTA on
the tile's counter (futx/ops/split_counters.py). The last of `splits` resets the counter for the next launch and
is the one that reduces.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def arrive(counter, splits) -> Int32:
    """1 in the last of the tile's `splits` CTAs to arrive, else 0 (one thread per CTA calls it)."""
    arrived = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
    last = Int32(0)
    if arrived == splits - 1:
        last = Int32(1)
        cute.arch.atomic_exch(counter, Int32(0), sem="relaxed", scope="gpu")  # ready for the next launch
    return last
