"""The skinny INT4 decode projection on warpgroup MMA (`wgmma`), for M up to 32 rows:
y[M, N] = x[M, K] @ W[N, K]^T.

The skinny kernel (skinny.py) with the tensor-core work moved from `mma.sync` to `wgmma.mma_async`: each
warpgroup owns 64 output channels (its 4 warps one 16-channel n-block each, two warpgroups per CTA: the same
128-channel tile, ring, split-K and epilogues as the skinny kernel). The weights stay the A operand and are
expanded in registers exactly as before: the four registers a lane makes from one packed word are its
m16n8k16 A fragment, which is also warp w's slice (rows 16w ..) of the m64nNk16 register A operand.
The activations are the B operand, read by the tensor cores straight from the ring slot through a matrix
descriptor (N = the padded tokens, K-major, 8 x 16-byte core matrices, no swizzle), so no `ldmatrix` and one
MMA instruction per k16 step for all tokens.

Per unit (one scale group) a warpgroup dequantizes its A operands, issues the unit's k16 steps into a float32
partial (the first with scale-d 0), waits for them and adds scale * partial to its accumulator, as the
other decode kernels do, so the result is theirs up to float32 summation order. `overlap` (variant "wgo")
issues two units into two partials before waiting, so one unit's MMAs run while the next is dequantized.

`SkinnyRegsWgmma` (variant "rwg") streams the weights into registers a batch ahead as the register-weights
skinny kernel does (skinny_regs.py), so the ring holds only the activation tiles, and runs each batch's units on
warpgroup MMA, unit i + 1 dequantized while unit i's MMAs run.

Tuning space only: correct (tests/test_decode_linear_gpu.py), but 1.2-2.1x slower per 8B/70B layer than the
shipped kernels at every measured M, and not for want of tensor-core time; docs/routing.md P8 has the
measurements. Built by the skinny registry factory (decode/skinny_dispatch.py, `mma="wgmma"`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import ptx
from .dequant import LANE_BYTES
from .skinny import TOKENS, Skinny
from .skinny_regs import SkinnyRegs
from futx.quant import layouts

WARP = layouts.WARP
WARPS, NB_PER_WARP = 8, 1      # two warpgroups x 4 warps x one n-block: a 128-channel tile
CORE = ptx.GMMA_CORE_BYTES     # 8 token rows x 16 bytes (8 k)


class WgmmaUnits:
    """What the wgmma skinny kernels share (a mixin before their Skinny base): the activation tile's layout in a
    ring slot (the B operand: token group j (8 rows) at j * sbo, k chunk c (8 k) at c * CORE, row r at 16 r) and one
    unit's MMAs into a float32 partial."""

    def x_tile_bytes(self) -> int:
        return self.m_tiles * TOKENS * self.unit_k * 2

    def _x_chunk(self, row, ch):
        return (row // TOKENS) * self._sbo() + ch * CORE + (row % TOKENS) * LANE_BYTES

    def _sbo(self) -> int:
        return self.unit_k * 2 // LANE_BYTES * CORE

    def _mma_unit(self, part, regs, x_slot, consts):
        """Dequantize a unit's weight registers and issue its k16 steps into `part` (the first with scale-d 0:
        `part` starts from zero), committed, not waited for. k16 step st reads k chunks 2 st, 2 st + 1."""
        a_ops = []
        for b in range(self.bpu):
            a_ops += self.fmt.a_operands(regs[4 * b:4 * b + 4], consts)
        ptx.wgmma_fence()
        for st in range(len(a_ops)):
            desc = ptx.gmma_desc(x_slot + 2 * st * CORE, CORE, self._sbo())
            part = ptx.wgmma_bf16_rs(part, a_ops[st], desc, Int32(1 if st else 0))
        ptx.wgmma_commit()
        return part

    def _fold(self, acc, part, s_lo, s_hi, keep):
        """acc += scale * part (after the wait that completed part's MMAs); returns (acc, part)."""
        part = tuple(ptx.reg_fence(v) for v in part)
        zero = Float32(0.0)
        return tuple(a + cutlass.select_(keep, (s_lo if e % 4 < 2 else s_hi) * p, zero)
                     for e, (a, p) in enumerate(zip(acc, part))), part


class SkinnyWgmma(WgmmaUnits, Skinny):
    def __init__(self, group_size: int = 128, epilogue: str = "store", m_tiles: int = 4, stages: int = 0,
                 overlap: bool = False):
        super().__init__("int4", group_size, epilogue, m_tiles, stages, warps=WARPS, nb_per_warp=NB_PER_WARP)
        self.overlap = overlap
        if overlap:   # two partials in flight need more registers: keep two CTAs (the split's assumption) per SM
            self.launch_hints = {"min_blocks_per_mp": 2, "preferred_smem_carveout": 100}
        if self.stages < 3:
            raise ValueError("the wgmma skinny kernel needs a ring of at least 3 stages")

    @cute.jit
    def _mainloop(self, x_base, m, k, ua, ub, xs, tid, warp, lane, wheres, nb_ok, consts):
        cute.arch.griddepcontrol_wait()
        lag = 1 if self.overlap else 0
        self._prologue(x_base, m, k, ua, ub, xs, tid, wheres, nb_ok, lag)
        zero = Float32(0.0)
        acc = (zero,) * (4 * self.m_tiles)
        valid = nb_ok[0] != 0
        if cutlass.const_expr(self.overlap):
            acc = self._loop_overlap(x_base, m, k, ua, ub, xs, tid, warp, lane, wheres, nb_ok, consts, acc, valid)
        else:
            part = (zero,) * (4 * self.m_tiles)
            for u in cutlass.range(ua, ub, unroll=1):
                part, s_lo, s_hi = self._issue(x_base, m, k, u, ua, ub, xs, tid, warp, lane, wheres, nb_ok, consts,
                                               part, 0)
                ptx.wgmma_wait(0)
                acc, part = self._fold(acc, part, s_lo, s_hi, valid)
        return [[tuple(acc[4 * mt:4 * mt + 4]) for mt in range(self.m_tiles)]]

    @cute.jit
    def _prologue(self, x_base, m, k, ua, ub, xs, tid, wheres, nb_ok, lag):
        """The ring's first SX - 1 - lag stages."""
        for st in cutlass.range_constexpr(self.stages - 1 - lag):
            if ua + st < ub:
                self._stage(x_base, m, k, ua + st, xs + st * self.stage_bytes, tid, wheres, nb_ok)
            cute.arch.cp_async_commit_group()

    @cute.jit
    def _issue(self, x_base, m, k, u, ua, ub, xs, tid, warp, lane, wheres, nb_ok, consts, part, lag):
        """One ring step: unit u's MMAs into `part`, committed, not waited for; returns the in-flight partial
        and unit u's two scales (channels g: d[4j], d[4j+1]; g + 8: d[4j+2], d[4j+3]). The slot refilled is
        unit u - 1 - lag's, whose MMAs every warpgroup has waited for before this step's barrier (lag 1: one
        unit may still be in flight when a step begins)."""
        SX = self.stages
        cute.arch.cp_async_wait_group(SX - 2 - lag)
        ptx.fence_proxy_async_shared()   # this thread's copies, visible to the tensor cores' reads
        cute.arch.sync_threads()          # stage u visible to all
        ahead = u + SX - 1 - lag
        if ahead < ub:
            self._stage(x_base, m, k, ahead, xs + ((ahead - ua) % SX) * self.stage_bytes, tid, wheres, nb_ok)
        cute.arch.cp_async_commit_group()
        slot = xs + ((u - ua) % SX) * self.stage_bytes
        regs = self._read_weights(slot, warp, lane, 0)
        return self._mma_unit(part, regs, slot, consts), regs[-2], regs[-1]

    @cute.jit
    def _loop_overlap(self, x_base, m, k, ua, ub, xs, tid, warp, lane, wheres, nb_ok, consts, acc, valid):
        """Two units per step into two partials: unit u + 1 is dequantized and issued while unit u's MMAs run;
        both are folded before the step ends (nothing in flight across the loop's back edge, where register
        copies would make ptxas serialize the MMAs). An odd count runs one extra unit on stale data, discarded."""
        zero = Float32(0.0)
        p0 = (zero,) * (4 * self.m_tiles)
        p1 = (zero,) * (4 * self.m_tiles)
        for u in cutlass.range(ua, ub, 2, unroll=1):
            p0, s0_lo, s0_hi = self._issue(x_base, m, k, u, ua, ub, xs, tid, warp, lane, wheres, nb_ok, consts, p0, 1)
            p1, s1_lo, s1_hi = self._issue(x_base, m, k, u + 1, ua, ub, xs, tid, warp, lane, wheres, nb_ok, consts,
                                           p1, 1)
            ptx.wgmma_wait(1)
            acc, p0 = self._fold(acc, p0, s0_lo, s0_hi, valid)
            ptx.wgmma_wait(0)
            acc, p1 = self._fold(acc, p1, s1_lo, s1_hi, valid & (u + 1 < ub))
        return acc


class SkinnyRegsWgmma(WgmmaUnits, SkinnyRegs):
    """Register weights (batches of `prefetch` units, skinny_regs.py) on warpgroup MMA: 8 warps of one n-block, two
    warpgroups of 64 channels."""
    tensor_cores_read_ring = True

    def __init__(self, group_size: int = 128, epilogue: str = "store", m_tiles: int = 4, stages: int = 0,
                 prefetch: int = 0, overlap: bool = False):
        super().__init__("int4", group_size, epilogue, m_tiles, stages, WARPS, NB_PER_WARP, prefetch)
        self.overlap = overlap
        if not overlap:
            # two CTAs (16 warps) per SM; with `overlap` two issued units' A registers stay live until their MMAs
            # complete: 147-169 registers, one CTA per SM (bounding it to 128 spills)
            self.launch_hints = {"min_blocks_per_mp": 2, "preferred_smem_carveout": 100}

    @cute.jit
    def _mainloop(self, x_base, m, k, ua, ub, xs, tid, warp, lane, wheres, nb_ok, consts):
        """Units [ua, ub) in batches (the weights of batch b + 1 requested into registers and the activations of batch
        b + stages - 1 into the ring before batch b runs). Each unit's MMAs are waited for before the next unit is
        dequantized, or with `overlap` unit i + 1 is dequantized and issued while unit i's MMAs run; every MMA of the
        batch is waited for before the next batch's barrier, which frees its slot."""
        P = self.prefetch
        cur = self._prologue(x_base, m, k, ua, ub, xs, tid, wheres, nb_ok)
        zero = Float32(0.0)
        acc = (zero,) * (4 * self.m_tiles)
        parts = [(zero,) * (4 * self.m_tiles) for _ in range(2 if self.overlap else 1)]
        for it in cutlass.range((ub - ua + P - 1) // P, unroll=1):
            u0 = ua + it * P
            nxt, slot = self._advance(x_base, m, k, it, ua, ub, xs, tid, wheres, nb_ok)
            folds = []   # (unit in the batch, partial) issued and not yet folded, oldest first
            for i in cutlass.range_constexpr(P):
                j = i % len(parts)
                parts[j] = self._mma_unit(parts[j], cur[i][0], slot + i * self.x_bytes, consts)
                folds.append((i, j))
                if cutlass.const_expr(len(folds) == len(parts) or i == P - 1):
                    for q in cutlass.range_constexpr(len(folds)):
                        ptx.wgmma_wait(len(folds) - 1 - q)
                        fi, fj = folds[q]
                        acc, parts[fj] = self._fold(acc, parts[fj], cur[fi][0][-2], cur[fi][0][-1],
                                                    (u0 + fi < ub) & (nb_ok[0] != 0))
                    folds = []
            cur = nxt
        return [[tuple(acc[4 * mt:4 * mt + 4]) for mt in range(self.m_tiles)]]
