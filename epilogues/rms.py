"""RmsPartials: per-row sums of squares of this tile's output, for the next RMSNorm.

    sumsq[t, m] = sum over the output columns of tile t of round(out[m, c])**2

`round` is the dtype of D (BF16), so the partials describe exactly the stored residual stream.
One FP32 per (output tile, row), written without atomics (deterministic); the consumer reduces over
t (futx.ops.rms_rho) and applies rho = (sum / H + eps)^-1/2 in the next GEMM's ScaleRestore.
Tile t covers output columns [t * out_tile_n, (t + 1) * out_tile_n) (out_tile_n = 256, 128 after a pair).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from epilogues.base import Arg, Policy
from epilogues.dsl import cutlass, cute, Float32


class RmsState(NamedTuple):
    """Per-thread state of RmsPartials."""

    ctx: Any
    sumsq: Any         # [tiles, M] FP32 partials (written)
    acc: Any           # registers: this tile's sums of the thread's two rows


class RmsPartials(Policy):
    kind = "map"
    name = "rms"
    args = (Arg("sumsq", "f32", ("t", "m"), writes=True),)

    def setup(self, ctx, sumsq):
        acc = cute.make_rmem_tensor((2,), Float32)
        return RmsState(ctx, sumsq, acc)

    @cute.jit
    def begin_tile(self, state, tile):
        state.acc[0] = Float32(0.0)
        state.acc[1] = Float32(0.0)

    @cute.jit
    def visit(self, state, frag):
        for i in cutlass.range_constexpr(frag.size):
            r, c = frag.coord(i)
            v = frag.vals[i].to(state.ctx.d_dtype).to(Float32)
            sq = v * v if state.ctx.col_ok(c) else Float32(0.0)
            state.acc[frag.row_slot(i)] = state.acc[frag.row_slot(i)] + sq

    @cute.jit
    def end_tile(self, state, tile):
        # the 4 lanes of a quad share a row: reduce over them, lane q == 0 writes
        ctx, sumsq = state.ctx, state.sumsq   # names, not `state`, inside the runtime `if` below
        for slot in cutlass.range_constexpr(2):
            s = state.acc[slot]
            s = s + cute.arch.shuffle_sync_bfly(s, offset=1)
            s = s + cute.arch.shuffle_sync_bfly(s, offset=2)
            r = tile.row0 + ctx.thread_row(slot)
            if cute.arch.lane_idx() % 4 == 0 and r < ctx.m:
                sumsq[tile.out_col0 // ctx.out_tile_n, r] = s
