"""ScaleRestore: undo the quantization scales and apply the folded RMSNorm factor rho.

    C[m, n] = a[m] * b[n] * rho[m] * acc[m, n]        (each factor optional)

a: per-row activation scale (`row="vector"`, [M]) or one per-tensor scale (`row="tensor"`, [1]);
b: per-output-channel weight scale [N] (`col=True`); rho: RMSNorm row factor [M] (`rho=True`; the
gain is folded into the weights, futx.quant.fold). Acts on GEMM columns, i.e. before a SwiGLU step.

All loads are issued in `prefetch`, before the tile's mainloop: each thread fetches its two rows'
factors into registers, and the tile's threads (256 in the coop schedule, 128 in pingpong) fetch its
column scales (one or two each), which `begin_tile` publishes in shared memory for the subtiles to read.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from epilogues.base import Arg, Policy
from epilogues.dsl import cutlass, cute, Float32


class ScaleState(NamedTuple):
    ctx: Any
    a_scale: Any          # [M] or [1], or None
    b_scale: Any          # [N] or None
    rho: Any              # [M] or None
    row_factor: Any       # registers: this thread's two rows' a * rho
    col_pref: Any         # registers: its share of the tile's column scales, loaded before the mainloop
    smem: Any             # the tile's column scales, shared by its threads


class ScaleRestore(Policy):
    kind = "map"

    def __init__(self, row: str | None = "vector", col: bool = True, rho: bool = False):
        if row not in ("vector", "tensor", None):
            raise ValueError(f"row must be 'vector', 'tensor' or None, got {row!r}")
        if row is None and not col and not rho:
            raise ValueError("ScaleRestore with no row scale, column scale or rho does nothing")
        self.row, self.col, self.rho = row, col, rho
        args = []
        if row is not None:
            args.append(Arg("a_scale", "f32", ("m",) if row == "vector" else (1,)))
        if col:
            args.append(Arg("b_scale", "f32", ("n",)))
        if rho:
            args.append(Arg("rho", "f32", ("m",)))
        self.args = tuple(args)
        parts = ([] if row is None else ["a" if row == "vector" else "at"]) + (["b"] if col else []) + (["rho"] if rho else [])
        self.name = "scale_" + "".join(parts) if (row or col) else "rho"

    def smem_floats(self, tile_n: int) -> int:
        return tile_n if self.col else 0

    def setup(self, ctx, *tensors):
        it = iter(tensors)
        a_scale = next(it) if self.row is not None else None
        b_scale = next(it) if self.col else None
        rho = next(it) if self.rho else None
        row_factor = cute.make_rmem_tensor((2,), Float32)                     # this thread's two rows
        per_thread = -(-ctx.tile_n // ctx.epi_threads)
        col_pref = cute.make_rmem_tensor((per_thread,), Float32)              # its share of the columns
        return ScaleState(ctx, a_scale, b_scale, rho, row_factor, col_pref, ctx.smem())

    @cute.jit
    def prefetch(self, state, tile):
        ctx = state.ctx
        if cutlass.const_expr(self.row is not None or self.rho):
            for slot in cutlass.range_constexpr(2):
                r = ctx.row_clamp(tile.row0 + ctx.thread_row(slot))
                f = Float32(1.0)
                if cutlass.const_expr(self.row == "vector"):
                    f = state.a_scale[r]
                if cutlass.const_expr(self.row == "tensor"):
                    f = state.a_scale[0]
                if cutlass.const_expr(self.rho):
                    f = f * state.rho[r]
                state.row_factor[slot] = f
        if cutlass.const_expr(self.col):
            for k in cutlass.range_constexpr(cute.size(state.col_pref)):
                # threads past the tile width duplicate the last column (same value, benign)
                local = cutlass.min(ctx.epi_tid + k * ctx.epi_threads, ctx.tile_n - 1)
                state.col_pref[k] = state.b_scale[ctx.col_clamp(ctx.gemm_col(tile, local))]

    @cute.jit
    def begin_tile(self, state, tile):
        ctx = state.ctx
        if cutlass.const_expr(self.col):
            for k in cutlass.range_constexpr(cute.size(state.col_pref)):
                local = cutlass.min(ctx.epi_tid + k * ctx.epi_threads, ctx.tile_n - 1)
                state.smem[tile.parity, local] = state.col_pref[k]

    @cute.jit
    def visit(self, state, frag):
        for i in cutlass.range_constexpr(frag.size):
            v = frag.vals[i]
            if cutlass.const_expr(self.row is not None or self.rho):
                v = v * state.row_factor[frag.row_slot(i)]
            if cutlass.const_expr(self.col):
                _, c = frag.local(i)
                v = v * state.smem[frag.tile.parity, c]
            frag.vals[i] = v
