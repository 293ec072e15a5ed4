"""1 <= M <= 16 decode projection: a persistent register-streaming kernel, y[M, N] = x[M, K] @ W[N, K]^T.

At most one CTA of `WARPS` warps per SM; CTA c owns `tiles` consecutive 16-channel n-blocks (the host
balances them so that every SM streams the same number of bytes). The warps split K: warp w owns the same
K share of every n-block, so it stages only its share of the M activation rows in shared memory, once.
Each warp streams one sequence of (n-block, unit) steps with a rolling register prefetch `depth` units
deep that runs across n-block boundaries: a warp's HBM stream never drains before the kernel's end.
Weights expand in registers into MMA A operands (`dequant.py`), activations come from `ldmatrix`.

A *round* is one n-block. At its end every warp writes its partial fragment to a shared slot (two slots,
by round parity), the warps meet at a named barrier, and a rotating group of threads sums the slot in warp
order (deterministic) and applies the fused epilogue. Residual and channel scales are prefetched into
shared memory at the start, so no round waits on global memory.

INT4 with `fold`: the A operands keep 128 + nibble (no per-register FMA); each group's partial is then
corrected by -136 * (sum of the group's activations), sums that an all-ones MMA computes once per unit.
The fold is INT4-only; the router enables it with one token group (docs/routing.md P4).
INT4 group scales travel as float16 bits and are converted where their unit is consumed (`raw_scales`):
converting them at the load (`raw_scales=False`, the tuning variant `r2`, measured slower: P4) makes every
step wait for the scale load it has just issued -- each step is its own basic block because of the
round-end branch -- so a warp streams one unit per memory latency instead of `depth`.
PDL (always on): weights and scales are requested before `griddepcontrol.wait` (they never depend on the
previous kernel and must not be written by it); activations and the residual are read after it.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from . import epilogue as epi
from . import ptx, stream
from .dequant import BLOCK_K, LANE_BYTES, WORDS, bf16_pair, make_format
from .gemv_layout import CHANNELS, TOKENS, GemvSmem
from .plan import GEMV_WARPS as WARPS
from futx.quant import layouts

WARP = layouts.WARP
BUFFER_REGS = {1: 50, 2: 30}   # prefetch registers per lane by token groups (128 registers at 16 warps)


class Gemv:
    def __init__(self, fmt: str, group_size: int = 128, epilogue: str = "store", m_tiles: int = 1,
                 fold: bool = False, raw_scales: bool = True):
        if fold and fmt != "int4":
            raise ValueError("the GEMV's fold is INT4-only")
        self.fmt = make_format(fmt, group_size, fold)
        self.epi = epi.make(epilogue)
        self.m_tiles, self.warps, self.raw_scales = m_tiles, WARPS, raw_scales
        self.m_pad = TOKENS * m_tiles
        self.bpu, self.unit_k = stream.units_of(self.fmt)
        unit_regs = 4 * self.fmt.loads_per_block * self.bpu + (2 if self.fmt.grouped else 0)
        self.depth = max(2, BUFFER_REGS[m_tiles] // unit_regs)
        self.smem = GemvSmem(self.unit_k, m_tiles, WARPS, self.fmt.fold, self.epi.residual, fmt == "e4m3")

    def _n_blocks(self, y):
        return self.epi.weight_rows(y.shape[1]) // CHANNELS

    # ---- host side ---------------------------------------------------------------------------
    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, s: Optional[cute.Tensor], r: Optional[cute.Tensor],
                 y: cute.Tensor, tiles: Int32, stream_):
        n_blocks = self._n_blocks(y)
        smem = self.smem.offsets(x.shape[0], x.shape[1] // self.unit_k, tiles)["total"]
        self.kernel(x, w, s, r, y, tiles).launch(grid=((n_blocks + tiles - 1) // tiles, 1, 1),
                                                 block=(WARP * self.warps, 1, 1), smem=smem, stream=stream_,
                                                 use_pdl=True)

    # ---- device side: pieces -----------------------------------------------------------------
    def _load(self, pos, valid, geo) -> tuple:
        """Weights (and group scales) of sequence position pos = (unit in share, tile) of this warp."""
        u, j = pos
        w_base, s_base, nb0, lane, k, units, sa = geo
        nb = nb0 + j
        return stream.load_unit(self.fmt, self.bpu, self.fmt.lane_base(w_base, nb, lane, k), sa + u, valid,
                                self.fmt.load_offsets(k), k, s_base, nb, units, lane // 4, self.raw_scales)

    @staticmethod
    def _advance(pos, uw):
        u1 = pos[0] + 1
        wrap = u1 == uw
        return cutlass.select_(wrap, Int32(0), u1), pos[1] + cutlass.select_(wrap, Int32(1), Int32(0))

    def _x_frags(self, lane_addr, unit, b) -> list:
        """(b0, b1) per k16 step of block b of a unit, from the staged activation rows."""
        addr = lane_addr + unit * (self.unit_k * 2) + b * (BLOCK_K * 2)
        load = ptx.ldsm_x4 if cutlass.const_expr(self.fmt.x_frags == "ldsm") else ptx.lds_v4
        return self.fmt.b_operands(sum((load(addr + off) for off in self.fmt.X_LOAD_OFFSETS), ()))

    @cute.jit
    def _stage_x(self, x_base: Int64, k, m, sa, sb, xs, x_row, lane):
        """cp.async this warp's K share of the m activation rows; only this warp reads it."""
        chunks = (sb - sa) * (self.unit_k * 2 // LANE_BYTES)
        col = sa * (self.unit_k * 2)
        for tok in cutlass.range(m, unroll=1):
            for c in cutlass.range(lane, chunks, WARP, unroll=1):
                ptx.cp_async_16(xs + tok * x_row + col + c * LANE_BYTES,
                                x_base + Int64(tok) * (k * 2) + col + c * LANE_BYTES)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_warp()

    @cute.jit
    def _x_sums(self, x_lane, sums, sa, uw, lane):
        """INT4 fold: per unit of the share and token column, the sum of its activations (an all-ones A
        operand turns every output row of the MMA into that sum), stored as sums[unit][token]."""
        ones = ptx.const_b32(bf16_pair(1.0))
        t = lane % 4
        for u in cutlass.range(uw, unroll=1):
            for mt in cutlass.range_constexpr(self.m_tiles):
                part = (Float32(0.0),) * 4
                for b in cutlass.range_constexpr(self.bpu):
                    frags = self._x_frags(x_lane[mt], sa + u, b)
                    for j in cutlass.range_constexpr(WORDS):
                        part = ptx.mma_16816((ones, ones, ones, ones), frags[j], part, "bf16")
                if lane < 4:
                    ptx.sts_f32x2(sums + ((sa + u) * self.m_pad + mt * TOKENS + 2 * t) * 4, part[0], part[1])
        cute.arch.sync_warp()

    @cute.jit
    def _stage_epilogue_inputs(self, r, s, n, m, nb0, tc, tiles, res_s, csc_s, tid, threads):
        """Residual rows and E4M3 channel scales of this CTA's tiles -> shared memory (cp.async)."""
        if cutlass.const_expr(self.epi.residual):
            per_tok = tc * (CHANNELS * 2 // LANE_BYTES)
            r_base = r.iterator.toint()
            for c in cutlass.range(tid, m * per_tok, threads, unroll=1):
                tok, ch = c // per_tok, c % per_tok
                ptx.cp_async_16(res_s + tok * (tiles * CHANNELS * 2) + ch * LANE_BYTES,
                                r_base + (Int64(tok) * n + nb0 * CHANNELS) * 2 + ch * LANE_BYTES)
        if cutlass.const_expr(self.fmt.name == "e4m3"):
            s_base = s.iterator.toint()
            for c in cutlass.range(tid, tc * (CHANNELS * 4 // LANE_BYTES), threads, unroll=1):
                ptx.cp_async_16(csc_s + c * LANE_BYTES, s_base + Int64(nb0) * (CHANNELS * 4) + c * LANE_BYTES)

    def _slot_sum(self, slot, row, tok, weff) -> Float32:
        """Sum of the warps' partials of one (channel, token), in warp order."""
        v = Float32(0.0)
        for wi in range(self.warps):
            p = ptx.lds_f32(slot + ((wi * CHANNELS + row) * self.m_pad + tok) * 4)
            v = v + cutlass.select_(wi < weff, p, Float32(0.0))
        return v

    def _channel(self, slot, row, tok, j, weff, csc_s) -> Float32:
        v = self._slot_sum(slot, row, tok, weff)
        if cutlass.const_expr(self.fmt.name == "e4m3"):
            v = v * ptx.lds_f32(csc_s + (j * CHANNELS + row) * 4)
        return v

    @cute.jit
    def _output(self, o, slot, j, out):
        """Output o of round (tile) j: sums, epilogue, store."""
        weff, nb0, tiles, res_s, csc_s, y_base, ldy = out
        cols = CHANNELS // self.epi.rows_per_output  # output columns of an n-block
        col, tok = o % cols, o // cols
        v = self.epi.finish(tuple(self._channel(slot, row, tok, j, weff, csc_s) for row in self.epi.rows(col)),
                            lambda: ptx.lds_bf16_to_f32(res_s + (tok * (tiles * CHANNELS) + j * CHANNELS + col) * 2))
        ptx.stg_bf16(y_base + (Int64(tok) * ldy + (nb0 + j) * cols + col) * 2, v)

    @cute.jit
    def _round_end(self, accs, j, slots, warp, lane, tid, n_out, out):
        """Publish this warp's partial of tile j; after the barrier a rotating group of threads finishes it.
        Slot j & 1 is rewritten at the end of round j + 2, after every thread has passed barrier j + 1,
        i.e. after the readers of round j are done."""
        weff = out[0]
        g, t = lane // 4, lane % 4
        slot = slots + (j & 1) * self.smem.slot_bytes
        mine = slot + warp * (CHANNELS * self.m_pad * 4)
        for mt in cutlass.range_constexpr(self.m_tiles):
            for h in cutlass.range_constexpr(2):  # c0, c1: row g, tokens 2t, 2t+1; c2, c3: row g + 8
                ptx.sts_f32x2(mine + ((g + 8 * h) * self.m_pad + mt * TOKENS + 2 * t) * 4,
                              accs[mt][2 * h], accs[mt][2 * h + 1])
        ptx.bar_sync(ptx.Barrier.GEMV_ROUND, weff * WARP)
        # the finishing group starts at warp j % 4 (spreads the work; no division)
        rot = tid - WARP * cutlass.select_(weff >= 4, j & 3, Int32(0))
        rot = cutlass.select_(rot < 0, rot + weff * WARP, rot)
        for o in cutlass.range(rot, n_out, weff * WARP, unroll=1):  # one pass unless K is tiny
            self._output(o, slot, j, out)

    # ---- device side: the kernel -------------------------------------------------------------
    @cute.kernel
    def kernel(self, x: cute.Tensor, w: cute.Tensor, s: Optional[cute.Tensor], r: Optional[cute.Tensor],
               y: cute.Tensor, tiles: Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = tid // WARP
        lane = tid % WARP
        n_blocks = self._n_blocks(y)
        units = x.shape[1] // self.unit_k
        weff = cutlass.min(units, self.warps)  # warps with a K share (all of them unless K is tiny)
        nb0 = cta * tiles
        tc = cutlass.min(tiles, n_blocks - nb0)
        sa = warp * units // weff
        uw = (warp + 1) * units // weff - sa
        if warp < weff:
            self._stream(x, w, s, r, y, tiles, tid, warp, lane, nb0, tc, weff, sa, uw)

    @cute.jit
    def _stream(self, x, w, s, r, y, tiles, tid, warp, lane, nb0, tc, weff, sa, uw):
        """The work of one warp with a K share."""
        fmt, D, MT = self.fmt, self.depth, self.m_tiles
        m = x.shape[0]
        k = x.shape[1]
        n = self._n_blocks(y) * CHANNELS
        units = k // self.unit_k
        n_pos = tc * uw
        n_out = m * (CHANNELS // self.epi.rows_per_output)
        s_base = Int64(0)
        if cutlass.const_expr(fmt.grouped):
            s_base = s.iterator.toint()
        geo = (w.iterator.toint(), s_base, nb0, lane, k, units, sa)
        consts = fmt.consts()

        # 1. weights first: the first `depth` units, before waiting on the previous kernel
        pos_f = (Int32(0), Int32(0))
        bufs = []
        for i in cutlass.range_constexpr(D):
            bufs.append(self._load(pos_f, Int32(i < n_pos), geo))
            pos_f = self._advance(pos_f, uw)
        bufs = tuple(bufs)
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()

        # 2. activations (this warp's share), residual / channel scales, activation sums
        base = ptx.smem_addr(cute.arch.get_dyn_smem(cutlass.Int8, alignment=16))
        off = self.smem.offsets(m, units, tiles)
        xs, sums = base + off["x"], base + off["sums"]
        res_s, csc_s = base + off["res"], base + off["csc"]
        x_row = self.smem.x_row(units)
        self._stage_epilogue_inputs(r, s, n, m, nb0, tc, tiles, res_s, csc_s, tid, weff * WARP)
        self._stage_x(x.iterator.toint(), k, m, sa, sa + uw, xs, x_row, lane)
        # per token group, the activation row this lane addresses (rows past M repeat row M - 1:
        # finite values in MMA columns that are never stored)
        x_lane = [xs + cutlass.min(mt * TOKENS + fmt.x_lane_row(lane), m - 1) * x_row + fmt.x_lane_col(lane)
                  for mt in range(MT)]
        if cutlass.const_expr(fmt.fold):
            self._x_sums(x_lane, sums, sa, uw, lane)
        out = (weff, nb0, tiles, res_s, csc_s, y.iterator.toint(), y.shape[1])

        # 3. stream: step i consumes position i and refills its registers with position i + depth
        t2 = 2 * (lane % 4)
        zero = Float32(0.0)
        accs = [(zero,) * 4 for _ in range(MT)]
        pos_c = (Int32(0), Int32(0))
        for it in cutlass.range((n_pos + D - 1) // D, unroll=1):
            nxt = list(bufs)
            for st in cutlass.range_constexpr(D):
                i = it * D + st
                valid = Int32(i < n_pos)
                unit = sa + pos_c[0]
                b_ops = [[self._x_frags(x_lane[mt], unit, b) for mt in range(MT)] for b in range(self.bpu)]
                sm = None
                if cutlass.const_expr(fmt.fold):
                    sm = [ptx.lds_f32x2(sums + (unit * self.m_pad + mt * TOKENS + t2) * 4) for mt in range(MT)]
                accs = stream.mma_unit(fmt, self.bpu, bufs[st], b_ops, accs, valid, consts, sm, self.raw_scales)
                nxt[st] = self._load(pos_f, Int32(i + D < n_pos), geo)
                pos_f = self._advance(pos_f, uw)
                r_end = (valid != 0) & (pos_c[0] == uw - 1)
                if r_end:
                    self._round_end(accs, pos_c[1], base + off["slots"], warp, lane, tid, n_out, out)
                accs = [tuple(cutlass.select_(r_end, zero, a) for a in acc) for acc in accs]
                pos_c = self._advance(pos_c, uw)
            bufs = tuple(nxt)


def compile_target(fmt: str = "int4", group_size: int = 128, epilogue: str = "store", m_tiles: int = 1,
                   warps: int = WARPS, fold: bool = False, pdl: bool = True, raw_scales: bool = True):
    """Registry factory. `warps` and `pdl` are registry parameters (decode.plan.gemv_params) with one value
    each, WARPS and True."""
    from .signature import fake_args

    if warps != WARPS or pdl is not True:
        raise ValueError(f"the GEMV runs {WARPS} warps with PDL, got warps={warps}, pdl={pdl}")
    x, w, s, r, y, stream_ = fake_args(fmt, epilogue)
    return Gemv(fmt, group_size, epilogue, m_tiles, fold, raw_scales), (x, w, s, r, y, Int32(1), stream_)
