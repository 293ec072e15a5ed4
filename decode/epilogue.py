"""Fused epilogues of the decode projections (compile-time choice, applied to float32 results).

    store     y = acc                                   (QKV)
    residual  y = acc + r,  r [M, N] bf16               (O and down: the residual stream)
    swiglu    h = silu(acc[:, 2j]) * acc[:, 2j + 1]     (gate/up with interleaved rows: row 2j is gate j,
              h [M, N/2]                                  row 2j + 1 is up j, as CODA's linear_swiglu)

One class per epilogue; a kernel picks its instance once, at construction (`make`), and calls its hooks
where it finishes an output: which weight rows make an output column (`rows`), how their sums and the
kernel-supplied residual loader become the stored value (`finish`), and, for kernels whose MMA fragments
hold the rows of one output in different lanes, how to gather them (`partners`, `owner`). A new epilogue
is one more class in EPILOGUES; the kernels stay as they are.
"""

from __future__ import annotations

import math

import cutlass.cute as cute
from cutlass import Float32

from . import ptx

LOG2E = 1.0 / math.log(2.0)


def silu_mul(gate: Float32, up: Float32) -> Float32:
    """silu(gate) * up = gate * up / (1 + exp(-gate)), float32 with approximate exp2/rcp."""
    e = cute.arch.exp2(gate * Float32(-LOG2E))
    return gate * up * cute.arch.rcp_approx(e + Float32(1.0))


class Store:
    """y[:, n] = the sum of weight row n."""

    name = "store"
    rows_per_output = 1   # weight rows that make one output column
    residual = False      # whether the kernel takes r [M, N] and stages it

    def out_features(self, n: int) -> int:
        """Output columns of n weight rows (host)."""
        return n // self.rows_per_output

    def weight_rows(self, cols):
        """Weight rows (N) from the output's column count (y.shape[1], host or device)."""
        return cols

    def rows(self, col):
        """The weight rows whose sums make output column `col`, in `finish` order (an iterable)."""
        return (col,)

    def finish(self, sums: tuple, residual) -> Float32:
        """The value stored for an output from its rows' sums; `residual()` loads r at that output
        (called only by epilogues with `residual`)."""
        return sums[0]

    # MMA-fragment kernels (decode/skinny.py): lane 4g + t holds rows g and g + 8 of an n-block
    def partners(self, frag: tuple):
        """The other rows of each fragment element's output, gathered from other lanes (None: none)."""
        return None

    def owner(self, cond, g):
        """`cond` restricted to the lanes that store the outputs of their rows."""
        return cond

    def out_col(self, row):
        """Output column of weight row `row` (a row the owning lane holds)."""
        return row


class Residual(Store):
    """y[:, n] = the sum of weight row n + r[:, n]."""

    name = "residual"
    residual = True

    def finish(self, sums: tuple, residual) -> Float32:
        return sums[0] + residual()


class SwiGLU(Store):
    """h[:, j] = silu(sum of row 2j) * (sum of row 2j + 1)."""

    name = "swiglu"
    rows_per_output = 2

    def weight_rows(self, cols):
        return cols * 2

    def rows(self, col):
        # lazily: each row index is computed right before its sum (the order the kernels emit)
        yield 2 * col
        yield 2 * col + 1

    def finish(self, sums: tuple, residual) -> Float32:
        return silu_mul(sums[0], sums[1])

    def partners(self, frag: tuple):
        # row 2j (gate j) sits in lane 4g + t with g even, row 2j + 1 (up j) in the next quad
        return tuple(ptx.shfl_xor_f32(e, 4) for e in frag)

    def owner(self, cond, g):
        return cond & (g % 2 == 0)

    def out_col(self, row):
        return row // 2


EPILOGUES = {cls.name: cls for cls in (Store, Residual, SwiGLU)}


def make(epilogue: str) -> Store:
    """The epilogue object of a registry name ("store", "residual", "swiglu")."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"unknown decode epilogue {epilogue!r}; known: {', '.join(EPILOGUES)}")
    return EPILOGUES[epilogue]()


def out_features(n: int, epilogue: str) -> int:
    return make(epilogue).out_features(n)
