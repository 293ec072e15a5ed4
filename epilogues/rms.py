"""RmsPartials: per-row sums of squares of this tile's output, for the next RMSNorm.

    sumsq[t, m] = sum over the output columns of tile t of round(out[m, c])**2

`round` is the dtype of D (BF16), so the partials describe exactly the stored residual stream.
One FP32 per (output tile, row), written without atomics (deterministic); the consumer reduces over
t (futx.ops.rms_rho) and applies rho = (sum / H + eps)^-1/2 in the next GEMM's ScaleRestore.
Tile t covers output columns [t * out_tile_n, (t + 1) * out_tile_n) (out_tile_n = 256, 128 after a pair).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from epilogues.base import Arg, Policy


class RmsPartials(Policy):
    kind = "map"
    name = "rms"
    args = (Arg("sumsq", "f32", ("t", "m"), writes=True),)

    def setup(self, ctx, sumsq):
        acc = cute.make_rmem_tensor((2,), Float32)
        return ctx, sumsq, acc

    @cute.jit
    def begin_tile(self, state, tile):
        ctx, sumsq, acc = state
        acc[0] = Float32(0.0)
        acc[1] = Float32(0.0)

    @cute.jit
    def visit(self, state, frag):
        ctx, sumsq, acc = state
        for i in cutlass.range_constexpr(frag.size):
            r, c = frag.coord(i)
            v = frag.vals[i].to(ctx.d_dtype).to(Float32)
            acc[frag.row_slot(i)] = acc[frag.row_slot(i)] + (v * v if ctx.col_ok(c) else Float32(0.0))

    @cute.jit
    def end_tile(self, state, tile):
        ctx, sumsq, acc = state
        # the 4 lanes of a quad share a row: reduce over them, lane q == 0 writes
        for slot in cutlass.range_constexpr(2):
            s = acc[slot]
            s = s + cute.arch.shuffle_sync_bfly(s, offset=1)
            s = s + cute.arch.shuffle_sync_bfly(s, offset=2)
            r = tile.row0 + ctx.thread_row(slot)
            if cute.arch.lane_idx() % 4 == 0 and r < ctx.m:
                sumsq[tile.out_col0 // ctx.out_tile_n, r] = s
