"""ResidualAdd: out = value + residual[row, col] (BF16 residual stream, shape of D).

Runs in output coordinates (after a pair step, if any). D may alias the residual (in-place update of
the residual stream): each element is read before it is written, by the same thread, and tiles do
not overlap. The residual of subtile 0 is loaded before the tile's mainloop and that of subtile j+1
while subtile j is processed, as 4-byte BF16 pairs (columns c, c+1 sit in one thread).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from epilogues.base import Arg, Policy
from epilogues.dsl import cutlass, cute, Float32


class ResidualState(NamedTuple):
    """Per-thread state of ResidualAdd."""

    ctx: Any
    residual: Any      # [M, n_out] BF16
    nxt: Any           # registers: the next subtile's residual values


class ResidualAdd(Policy):
    kind = "map"
    space = "out"
    name = "res"
    args = (Arg("residual", "bf16", ("m", "n_out")),)

    def setup(self, ctx, residual):
        nxt = cute.make_rmem_tensor((ctx.S,), cutlass.BFloat16)   # the next subtile's values
        return ResidualState(ctx, residual, nxt)

    @cute.jit
    def _load(self, state, tile, j: int):
        ctx = state.ctx
        width = state.residual.shape[1]
        for p in cutlass.range_constexpr(ctx.S // 2):
            r, c = ctx.out_coord(tile, j, 2 * p)  # values 2p, 2p+1: columns c, c+1 of row r
            off = ctx.row_clamp(r) * width + cutlass.min(c, width - 2)
            addr = (state.residual.iterator + off).toint()
            ptr = cute.make_ptr(cutlass.BFloat16, addr, cute.AddressSpace.gmem, assumed_align=4)
            pair = cute.make_tensor(ptr, cute.make_layout(2)).load()
            state.nxt[2 * p] = pair[0]
            state.nxt[2 * p + 1] = pair[1]

    @cute.jit
    def prefetch(self, state, tile):
        self._load(state, tile, 0)

    @cute.jit
    def visit(self, state, frag):
        cur = state.nxt.load()
        if cutlass.const_expr(frag.subtile + 1 < state.ctx.n_sub):
            self._load(state, frag.tile, frag.subtile + 1)
        for i in cutlass.range_constexpr(frag.size):
            frag.vals[i] = frag.vals[i] + cur[i].to(Float32)
