"""StoreFP8: E4M3 output with delayed per-tensor scaling; also reports this call's amax.

    D = e4m3(saturate(v / scale))    scale: f32[1], derived from an *earlier* call's amax
                                      (same convention as futx.quant.fp8: v ~ D * scale)
    amax      = max(amax, max |v|)   f32[1], max-accumulated over valid outputs (caller zeroes it)
    saturated += #{|v / scale| > 448}  i32[1], clamped elements (a stale scale shows up here)

Delayed scaling lets every fragment be quantized and stored at once: no pass over the whole output
to find its maximum first. Everything stays on the device (no host sync); the scale state
(futx.quant.fp8) turns past amaxes into the next scale. NaN inputs stay NaN (cvt .satfinite) and
are ignored by the amax (fmax returns the other operand).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from epilogues.base import Arg, Policy
from epilogues.dsl import cutlass, cute, Float32, Int32

E4M3_MAX = 448.0


class Fp8State(NamedTuple):
    """Per-thread state of StoreFP8."""

    ctx: Any
    inv: Any           # 1 / scale
    amax: Any          # [1] FP32, max-accumulated (written)
    saturated: Any     # [1] int32 count (written)
    running: Any       # registers: this thread's amax
    clamped: Any       # registers: this thread's count of saturated values


class StoreFP8(Policy):
    kind = "store"
    out_dtype = "e4m3"
    name = "fp8"
    args = (
        Arg("scale", "f32", (1,)),
        Arg("amax", "f32", (1,), writes=True),
        Arg("saturated", "i32", (1,), writes=True),
    )

    @cute.jit
    def setup(self, ctx, scale, amax, saturated):
        running = cute.make_rmem_tensor((1,), Float32)
        running[0] = Float32(0.0)
        clamped = cute.make_rmem_tensor((1,), Int32)
        clamped[0] = Int32(0)
        inv = Float32(1.0) / scale[0]       # once per thread: exact, matches the reference
        return Fp8State(ctx, inv, amax, saturated, running, clamped)

    @cute.jit
    def convert(self, state, frag):
        m = state.running[0]
        n_sat = state.clamped[0]
        for i in cutlass.range_constexpr(frag.size):
            r, c = frag.coord(i)
            # rows/columns past M/N hold clamped-index garbage: keep them out of the statistics
            v = frag.vals[i] if state.ctx.in_bounds(r, c) else Float32(0.0)
            a = cute.arch.fmax(v, -v)
            m = cute.arch.fmax(m, a)
            n_sat += Int32(1) if a * state.inv > Float32(E4M3_MAX) else Int32(0)
            frag.vals[i] = frag.vals[i] * state.inv
        state.running[0] = m
        state.clamped[0] = n_sat
        return frag.vals.load().to(cutlass.Float8E4M3FN)   # cvt.rn.satfinite: clamps to +-448

    @cute.jit
    def finish(self, state):
        m = cute.arch.warp_reduction(state.running[0], lambda a, b: cute.arch.fmax(a, b))
        n_sat = cute.arch.warp_reduction(state.clamped[0], lambda a, b: a + b)
        if cute.arch.lane_idx() == 0:
            cute.arch.atomic_fmax(state.amax.iterator, m)
            if n_sat > 0:
                cute.arch.atomic_add(state.saturated.iterator, n_sat)
