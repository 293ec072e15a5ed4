"""M = 1 decode projection of INT4 group-128 weights, one 16-channel output tile per CTA:
y[1, N] = x[1, K] @ W[N, K]^T; with `tokens` = 8 the same kernel for 1..8 rows (y[M, N] = x[M, K] @ W^T).

The router sends every INT4 g128 projection at M = 1 here where the activation row fits in shared memory
(docs/routing.md P1: faster than the persistent GEMV at M = 1 on the 8B and 70B layers; numbers in
docs/results-decode-linear.md). Its format is fixed
(decode.plan.TILE_FORMATS); `warps` is 8 for K > 8192 or a grid of at most 3 CTAs per SM, 4 otherwise (P3).

One CTA of `warps` warps per 16-channel n-block (grid = N / 16; several CTAs share an SM); its warps split
K into equal shares. Each warp streams its share of the packed weights straight into registers, expands
them in registers into finished MMA operands (`dequant.py`) and accumulates each group in its own float32
fragment, applying the group scale before adding it to the running sum (one MMA chain, the nibble bias
subtracted by one packed FMA per register). The activation row is staged once in shared memory (each warp
copies the part it reads), where `ldmatrix` gathers the pairs the fragment order needs. Warps combine
their partial sums through shared memory; the fused epilogue writes the 16 outputs.

`pipeline`:
* "batch" (routed): batches of `prefetch` units, 2 by default (P2: smaller batches mean fewer registers
  and more warps per SM; 1, 3 and 4 units measured slower); batch b + 1 is requested before batch b is
  consumed. The loop-carried copy of the next batch's registers (and its scale conversions) sits at the end
  of the loop body, so each batch waits for the next one's loads there: one batch of loads is in flight
  while a batch computes.
* "rolling" (tuning space, measured slower, P2): a `2 * prefetch`-unit rolling register prefetch, step i
  consumes position i and refills its registers with position i + depth, group scales kept as float16 bits
  until used: no load is waited for in the block that issues it.
* "ring" (tuning space, measured slower, P10): each warp streams its share through a shared-memory ring of
  `prefetch` units with cp.async (the share's group scales copied once), so the bytes in flight are not
  bounded by registers and the whole ring is requested before the PDL wait; a lane reads back only the bytes
  it copied, so its own `cp.async.wait_group` orders them.
`fold` (tuning space, measured slower, P10): the A operands keep 128 + nibble and each unit's partial is
corrected by -136 x the unit's activation sum (computed once per CTA from the staged row), instead of one
bf16x2 FMA per weight register.
`GemvTileSplit` (tuning space, measured slower, P11): split-K over the CTAs of a tile, the last one reducing.
`tokens` = 8 (the multi-token kernel, routed for 2..8 rows of small-grid projections, P12): the M rows are staged
(X_ROW_PAD apart, so the 8 ldmatrix rows hit different banks) and B column j of every MMA is token j instead of a
copy of the one row (columns past M repeat the last row and are never stored): the same MMAs and dequantization
per weight as at M = 1, M times the staged bytes, partials reduced per (row, token), each token normalized by its
own row factor (`norm`).
`nblocks` > 1 (n-blocks per CTA; routed for the multi-token kernel on grids larger than one wave, P13; at M = 1
tuning space, measured slower, P14): each CTA takes `nblocks` consecutive n-blocks, stages the row(s) once, and each
warp streams its K share of n-block 0, then of n-block 1, ... as one sequence of batches (loads run ahead across the
n-block boundaries), storing its partial per n-block; one barrier, then the epilogue of every n-block. Each n-block
sees the same units, MMAs and order as with one n-block per CTA, so the outputs are bitwise the same.
PDL: launched as a programmatic dependent; the first batch of weights (and scales) is requested before
`griddepcontrol.wait`, the activation row and the residual are read after it, so the weight stream can start
while the previous kernel runs. It signals its own
dependents after its K loop: signalling at the start measured slower (docs/routing.md E1).
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from . import epilogue as epi
from . import ptx, split_arrival, stream
from .dequant import BLOCK_K, BLOCK_N, LANE_BYTES, make_format
from .gemv_layout import TOKENS, UNIT_BYTES, UNIT_SCALE_BYTES, X_ROW_PAD, tile_share_units, tile_slice_k, tile_smem
from futx.quant import layouts

WARP = layouts.WARP
PIPELINES = ("batch", "rolling", "ring")
FORMAT = ("int4", 128)   # the one format with a tile GEMV (decode.plan.TILE_FORMATS)
DEFAULT_PREFETCH = 2     # units per batch (docs/routing.md P2)


def smem_bytes(k: int, warps: int, norm: bool = False, ring: int = 0, fold: bool = False, split: bool = False,
               tokens: int = 1, rows=1, nblocks: int = 1, red_in_x: bool = False) -> int:
    """Dynamic shared memory of a launch (decode.gemv_layout.tile_smem, which the host's planner shares)."""
    return tile_smem(k, warps, norm, ring, fold, split, tokens, rows, nblocks, red_in_x, cutlass.max)["total"]


class GemvTile:
    norm = False   # GemvTileNorm: the RMSNorm row factor in the prologue
    split = False  # GemvTileSplit: split-K over the CTAs of a tile
    red_in_x = False   # multi-token: the warps' partials overwrite the staged rows (decode.gemv_layout.tile_smem)

    def __init__(self, epilogue: str = "store", warps: int = 4, prefetch: int = 0, pipeline: str = "batch",
                 fold: bool = False, tokens: int = 1, nblocks: int = 1):
        if pipeline not in PIPELINES:
            raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
        if tokens not in (1, TOKENS):
            raise ValueError(f"the tile GEMV takes 1 or {TOKENS} token columns, got {tokens}")
        if tokens > 1 and (fold or pipeline != "batch" or self.split):
            raise ValueError("the multi-token tile GEMV is the batch pipeline without the fold or split-K")
        if nblocks < 1 or (nblocks > 1 and (fold or pipeline != "batch" or self.split)):
            raise ValueError(f"n-blocks per CTA ({nblocks}) > 1 is the batch pipeline without the fold or split-K")
        self.tokens, self.nblocks = tokens, nblocks
        self.fmt = make_format(*FORMAT, fold=fold)
        self.epi = epi.make(epilogue)
        self.warps, self.pipeline = warps, pipeline
        self.raw = pipeline == "rolling"
        self.bpu, self.unit_k = stream.units_of(self.fmt)
        self.prefetch = prefetch or DEFAULT_PREFETCH
        self.depth = 2 * self.prefetch if pipeline == "rolling" else self.prefetch
        self.ring = self.prefetch if pipeline == "ring" else 0
        assert not self.ring or self.bpu * layouts.INT4_WEIGHT.block_bytes == UNIT_BYTES

    # ---- host side ---------------------------------------------------------------------------
    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, s: Optional[cute.Tensor], r: Optional[cute.Tensor],
                 y: cute.Tensor, stream):
        n_tiles, smem = self._shape(x, y)
        self.kernel(x, w, s, r, y).launch(grid=(n_tiles, 1, 1), block=(WARP * self.warps, 1, 1), smem=smem,
                                          stream=stream, use_pdl=True)

    def _shape(self, x, y):
        """(CTAs, dynamic shared-memory bytes) of a launch."""
        return ((self.epi.weight_rows(y.shape[1]) // BLOCK_N + self.nblocks - 1) // self.nblocks,
                smem_bytes(x.shape[1], self.warps, self.norm, self.ring, self.fmt.fold, tokens=self.tokens,
                           rows=x.shape[0], nblocks=self.nblocks, red_in_x=self.red_in_x))

    # ---- device side -------------------------------------------------------------------------
    # Where the tile runs and how it meets its producer and consumers: a launch of its own (its CTA's block index,
    # programmatic dependent launch); a task of the persistent decode layer overrides the four
    # (decode/persistent_layer.py: the task's n-block, its counters, a thread index the task loop cannot hoist).
    def _tile(self):
        nb, sy, _ = cute.arch.block_idx()
        return nb, sy

    def _thread(self):
        tid, _, _ = cute.arch.thread_idx()
        return tid

    def _wait_inputs(self) -> None:
        cute.arch.griddepcontrol_wait()

    def _release_dependents(self) -> None:
        cute.arch.griddepcontrol_launch_dependents()

    def _load(self, u, where) -> tuple:
        ub, lane_base, offsets, k, s_base, nb, n_units, g = where
        return stream.load_unit(self.fmt, self.bpu, lane_base, u, Int32(u < ub), offsets, k, s_base, nb, n_units, g,
                                self.raw)

    def _load_at(self, j, u, ua, n_valid, where) -> tuple:
        """n-blocks per CTA: unit u of the warp's share [ua, ...) of the CTA's n-block j (valid for j < n_valid);
        the CTA's n-blocks are consecutive in memory, so unit u of n-block j is unit j * n_units + u of the first."""
        ub, lane_base, offsets, k, s_base, nb, n_units, g = where
        return stream.load_unit(self.fmt, self.bpu, lane_base, j * n_units + ua + u, Int32(j < n_valid), offsets, k,
                                s_base, nb, n_units, g, self.raw)

    @staticmethod
    def _units_from(j, u, sh, count: int) -> list:
        """`count` consecutive (n-block, unit of the share) pairs of a warp's sequence from (j, u): the share's sh
        units of n-block 0, then of n-block 1, ..."""
        out = [(j, u)]
        for _ in range(count - 1):
            j0, u0 = out[-1]
            wrap = u0 + 1 >= sh
            out.append((j0 + Int32(wrap), cutlass.select_(wrap, Int32(0), u0 + 1)))
        return out

    def _ring_copy(self, slot: Int32, lane_base: Int64, u, valid, k) -> None:
        """Issue this lane's 16-byte pieces of unit u (one per block) into its ring slot."""
        for b in range(self.bpu):
            ptx.cp_async_stream_16(slot + b * (WARP * LANE_BYTES),
                                   lane_base + Int64(u * self.bpu + b) * self.fmt.block_stride(k), valid)

    def _ring_read(self, slot: Int32, sc_unit: Int32, g) -> tuple:
        """A unit's registers as `_load` returns them: the lane's words of each block, then the float32 scales of
        channels g and g + 8."""
        words = sum((ptx.lds_v4(slot + b * (WARP * LANE_BYTES)) for b in range(self.bpu)), ())
        return words + (ptx.lds_f16_to_f32(sc_unit + g * 2), ptx.lds_f16_to_f32(sc_unit + (g + layouts.MMA_N) * 2))

    def _x_frags(self, xs_lane: Int32, kb) -> list:
        """(b0, b1) per k16 step of block kb, from the staged activation row."""
        addr = xs_lane + kb * (BLOCK_K * 2)
        return self.fmt.b_operands(sum((ptx.ldsm_x4(addr + off) for off in self.fmt.X_LOAD_OFFSETS), ()))

    def _unit(self, acc, cur, u, valid, xs_lane, last, consts, s_u=None):
        uc = cutlass.min(u, last)
        b_ops = [[self._x_frags(xs_lane, uc * self.bpu + b)] for b in range(self.bpu)]
        sums = [(s_u, s_u)] if cutlass.const_expr(self.fmt.fold) else None  # every B column holds the row
        (acc,) = stream.mma_unit(self.fmt, self.bpu, cur, b_ops, [acc], valid, consts, sums, self.raw, chains=1)
        return acc

    def _sums_of(self, x_sums, u0, count: int, last) -> list:
        """fold: the activation sums of units u0 .. u0 + count - 1 (clamped), read where a batch starts so the
        shared loads are not waited for next to the MMAs that use them."""
        if cutlass.const_expr(not self.fmt.fold):
            return [None] * count
        return [ptx.lds_f32(x_sums + cutlass.min(u0 + i, last) * 4) for i in range(count)]

    @cute.jit
    def _row_stats(self, xs, ua, ub, warp, lane, ss_out, x_sums):
        """One pass over this warp's staged slice of the row: its sum of squares -> ss_out[warp] (`norm`) and
        each unit's activation sum -> x_sums[unit] (fold). Lanes 0-15 read unit ua + 2j, lanes 16-31
        unit ua + 2j + 1 (16 chunks of 8 values each); a unit past the share counts as zeros (its lanes read the
        share's first unit instead: another warp's may still be landing)."""
        chunks = self.unit_k * 2 // LANE_BYTES  # per unit (16)
        ss = Float32(0.0)
        for j in cutlass.range((ub - ua + 1) // 2, unroll=1):
            u = ua + 2 * j + lane // chunks
            words = ptx.lds_v4(xs + (cutlass.select_(u < ub, u, ua) * chunks + lane % chunks) * LANE_BYTES)
            s = Float32(0.0)
            for word in words:
                lo, hi = ptx.bf16x2_to_f32(word)
                lo = cutlass.select_(u < ub, lo, Float32(0.0))
                hi = cutlass.select_(u < ub, hi, Float32(0.0))
                s = s + lo + hi
                ss = ss + lo * lo + hi * hi
            if cutlass.const_expr(self.fmt.fold):
                for off in (8, 4, 2, 1):
                    s = s + cute.arch.shuffle_sync_bfly(s, offset=off)
                if lane % chunks == 0:
                    if u < ub:
                        ptx.sts_f32(x_sums + u * 4, s)
        if cutlass.const_expr(self.norm):
            for off in (16, 8, 4, 2, 1):
                ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=off)
            if lane == 0:
                ptx.sts_f32(ss_out + warp * 4, ss)
        cute.arch.sync_warp()

    @cute.jit
    def _rows_stats(self, xrow, row_stride, m, c0, c1, warp, lane, ss_out):
        """Multi-token `norm`: each staged row's sum of squares over this warp's chunks [c0, c1) of it ->
        ss_out[warp][row]."""
        for row in cutlass.range(m, unroll=1):
            ss = Float32(0.0)
            for c in cutlass.range(c0 + lane, c1, WARP, unroll=1):
                ss = self._add_squares(ss, ptx.lds_v4(xrow + row * row_stride + c * LANE_BYTES))
            self._store_warp_sum(ss, ss_out + (warp * TOKENS + row) * 4, lane)
        cute.arch.sync_warp()

    @staticmethod
    def _add_squares(ss, words) -> Float32:
        """ss + the squares of the bf16 pairs in `words`."""
        for word in words:
            lo, hi = ptx.bf16x2_to_f32(word)
            ss = ss + lo * lo + hi * hi
        return ss

    @cute.jit
    def _store_warp_sum(self, v, addr, lane) -> None:
        """The warp's sum of its lanes' v -> shared memory at addr (by lane 0)."""
        for off in (16, 8, 4, 2, 1):
            v = v + cute.arch.shuffle_sync_bfly(v, offset=off)
        if lane == 0:
            ptx.sts_f32(addr, v)

    @cute.jit
    def _epilogue_rows(self, tid, nb, red, ss, r, y, m, k, eps, n_valid=None, threads: cutlass.Constexpr = 0):
        """Multi-token: threads take the tile's (token, output column) pairs in turn; each sums its rows over the
        warps in warp order (`norm`: times the token's RMSNorm row factor) and finishes the output. `n_valid`:
        n-blocks per CTA, the (n-block, token, column) triples of n-blocks nb .. nb + n_valid - 1. `threads`: how
        many take part (0: the CTA's warps; the ring layer's epilogue warp: one warp)."""
        cols = BLOCK_N // self.epi.rows_per_output
        width = y.shape[1]
        y_base = y.iterator.toint()
        count = cols * m
        if cutlass.const_expr(n_valid is not None):
            count = n_valid * (cols * m)
        for i in cutlass.range(tid, count, threads or WARP * self.warps, unroll=1):
            red_j, nb_j, ij = red, nb, i
            if cutlass.const_expr(n_valid is not None):
                j = i // (cols * m)
                ij = i % (cols * m)
                red_j = red + j * (self.warps * BLOCK_N * TOKENS * 4)
                nb_j = nb + j
            tok = ij // cols
            col = ij % cols
            sums = tuple(self._row_sum(red_j, row * TOKENS + tok, TOKENS) for row in self.epi.rows(col))
            factor = self._norm_factor(ss, k, eps, tok, TOKENS) if cutlass.const_expr(self.norm) else None
            self._finish(sums, Int64(tok) * width + nb_j * cols + col, r, y_base, factor)

    @cute.kernel
    def kernel(self, x: cute.Tensor, w: cute.Tensor, s: Optional[cute.Tensor], r: Optional[cute.Tensor],
               y: cute.Tensor):
        self._body(x, w, s, r, y, None)

    @cute.jit
    def _body(self, x: cute.Tensor, w: cute.Tensor, s: Optional[cute.Tensor], r: Optional[cute.Tensor],
              y: cute.Tensor, eps, ws=None, counters=None, splits=None):
        fmt, W, P = self.fmt, self.warps, self.prefetch
        tid = self._thread()
        nb, sy = self._tile()
        warp = tid // WARP
        lane = tid % WARP
        g = lane // 4
        k = x.shape[1]
        n_units = k // self.unit_k
        ua = warp * n_units // W
        ub = (warp + 1) * n_units // W
        k_smem = k
        if cutlass.const_expr(self.split):
            # this CTA's units [cu0, cu1), the sy-th of `splits` ranges, shared by its warps
            cu0 = sy * n_units // splits
            cu1 = (sy + 1) * n_units // splits
            ua = cu0 + warp * (cu1 - cu0) // W
            ub = cu0 + (warp + 1) * (cu1 - cu0) // W
            k_smem = tile_slice_k(k, splits)

        # clamps the shared-memory reads of units past the share (predicated off, adding zero) to the warp's own
        # staged units: another warp's may still be landing (a benign race, but compute-sanitizer's racecheck
        # rightly reports it). An empty share reads nothing.
        last = ub - 1
        s_base = s.iterator.toint()
        nb0 = nb
        if cutlass.const_expr(self.nblocks > 1):
            # this CTA's n-blocks nb0 .. nb0 + n_valid - 1 (the last CTA's may be fewer)
            nb0 = nb * self.nblocks
            n_valid = cutlass.min(Int32(self.nblocks), self.epi.weight_rows(y.shape[1]) // BLOCK_N - nb0)
            sh = ub - ua
        lane_base = fmt.lane_base(w.iterator.toint(), nb0, lane, k)
        offsets = fmt.load_offsets(k)
        consts = fmt.consts()

        where = (ub, lane_base, offsets, k, s_base, nb0, n_units, g)
        D = self.depth
        xs = ptx.smem_addr(cute.arch.get_dyn_smem(cutlass.Int8, alignment=16))
        m = x.shape[0]
        regions = tile_smem(k_smem, W, self.norm, self.ring, self.fmt.fold, self.split, self.tokens, m,
                            self.nblocks, self.red_in_x, cutlass.max)
        chunks = self.unit_k * 2 // LANE_BYTES
        row_stride = k * 2 + X_ROW_PAD  # multi-token: bytes between staged rows
        # the staged row's origin: unit u of the row sits at xrow + u * unit bytes (a split CTA stages its slice)
        xrow = xs
        if cutlass.const_expr(self.split):
            xrow = xs - cu0 * (chunks * LANE_BYTES)
        x_sums = xs + regions["sums"]
        if cutlass.const_expr(self.ring > 0):
            share = tile_share_units(k, W)
            ring_lane = xs + regions["ring"] + warp * (D * UNIT_BYTES) + lane * LANE_BYTES
            sc_warp = xs + regions["scales"] + warp * (share * UNIT_SCALE_BYTES)

        # 1. weights first: they come from HBM, everything else from L2; they never depend on the previous
        #    kernel, so they are requested before waiting on it (PDL)
        if cutlass.const_expr(self.ring > 0):
            # the share's group scales (contiguous, 32 bytes per unit) travel in the first unit's group
            sc_src = s_base + (Int64(nb) * n_units + ua) * UNIT_SCALE_BYTES
            for c in cutlass.range(lane, (ub - ua) * (UNIT_SCALE_BYTES // LANE_BYTES), WARP, unroll=1):
                ptx.cp_async_stream_16(sc_warp + c * LANE_BYTES, sc_src + Int64(c) * LANE_BYTES, Int32(1))
            for i in cutlass.range_constexpr(D):
                self._ring_copy(ring_lane + i * UNIT_BYTES, lane_base, ua + i, Int32(ua + i < ub), k)
                cute.arch.cp_async_commit_group()
        elif cutlass.const_expr(self.nblocks > 1):
            bufs = tuple(self._load_at(j, u, ua, n_valid, where)
                         for j, u in self._units_from(Int32(0), Int32(0), sh, D))
        else:
            bufs = tuple(self._load(ua + i, where) for i in range(D))
        self._wait_inputs()

        # 2. this warp's slice of the activation row (multi-token: of every row) -> shared memory
        x_base = x.iterator.toint()
        if cutlass.const_expr(self.tokens > 1):
            for row in cutlass.range(m, unroll=1):
                for c in cutlass.range(ua * chunks + lane, ub * chunks, WARP, unroll=1):
                    ptx.cp_async_16(xrow + row * row_stride + c * LANE_BYTES,
                                    x_base + Int64(row) * (k * 2) + Int64(c) * LANE_BYTES)
        else:
            for c in cutlass.range(ua * chunks + lane, ub * chunks, WARP, unroll=1):
                if cutlass.const_expr(self.ring > 0):
                    # plain loads: a cp.async group here would make waiting for the row wait for the whole ring
                    ptx.sts128(xrow + c * LANE_BYTES, *ptx.ldg_v4(x_base + Int64(c) * LANE_BYTES))
                else:
                    ptx.cp_async_16(xrow + c * LANE_BYTES, x_base + Int64(c) * LANE_BYTES)
        if cutlass.const_expr(self.ring == 0):
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
        cute.arch.sync_warp()
        if cutlass.const_expr(self.tokens > 1):
            if cutlass.const_expr(self.norm):
                self._rows_stats(xrow, row_stride, m, ua * chunks, ub * chunks, warp, lane, xs + regions["ss"])
            # per-lane shared address of its activation fragments in block 0: B column j is token j (the
            # columns past the last token repeat it; their outputs are never stored)
            xs_lane = xrow + cutlass.min(Int32(fmt.x_lane_row(lane)), m - 1) * row_stride + fmt.x_lane_col(lane)
        else:
            if cutlass.const_expr(self.norm or self.fmt.fold):
                self._row_stats(xrow, ua, ub, warp, lane, xs + regions["ss"], x_sums)

            # per-lane shared address of its activation fragments in block 0 (M = 1: every token row is
            # the one activation row, so every B column holds x)
            xs_lane = xrow + fmt.x_lane_offset(lane, 0)

        # 3. stream. Units past the share are predicated off (no traffic) and add zero.
        acc = (Float32(0.0),) * 4
        n_iter = (ub - ua + D - 1) // D
        if cutlass.const_expr(self.nblocks > 1):
            self._stream_blocks(bufs, sh, ua, n_valid, where, xs_lane, last, consts, xs + regions["red"], warp, lane,
                                g)
        elif cutlass.const_expr(self.pipeline == "batch"):
            # batches of P units, batch b + 1 requested before batch b is consumed
            for it in cutlass.range(n_iter, unroll=1):
                u0 = ua + it * P
                sums = self._sums_of(x_sums, u0, P, last)
                nxt = tuple(self._load(u0 + P + i, where) for i in range(P))
                for i in cutlass.range_constexpr(P):
                    acc = self._unit(acc, bufs[i], u0 + i, Int32(u0 + i < ub), xs_lane, last, consts, sums[i])
                bufs = nxt
        elif cutlass.const_expr(self.pipeline == "rolling"):
            # rolling: step i consumes position i and refills its registers with position i + D
            for it in cutlass.range(n_iter, unroll=1):
                u0 = ua + it * D
                sums = self._sums_of(x_sums, u0, D, last)
                nxt = list(bufs)
                for i in cutlass.range_constexpr(D):
                    acc = self._unit(acc, bufs[i], u0 + i, Int32(u0 + i < ub), xs_lane, last, consts, sums[i])
                    nxt[i] = self._load(u0 + i + D, where)
                bufs = tuple(nxt)
        else:
            # ring: slot i holds units ua + i, ua + i + D, ...; a lane reads back only the bytes it copied, so
            # its own cp.async wait orders them (the scales, copied by a few lanes, are published by one
            # warp barrier once the first group has landed)
            cute.arch.cp_async_wait_group(D - 1)
            cute.arch.sync_warp()
            for it in cutlass.range(n_iter, unroll=1):
                u0 = ua + it * D
                for i in cutlass.range_constexpr(D):
                    u = u0 + i
                    slot = ring_lane + i * UNIT_BYTES
                    cute.arch.cp_async_wait_group(D - 1)
                    cur = self._ring_read(slot, sc_warp + (cutlass.min(u, ub - 1) - ua) * UNIT_SCALE_BYTES, g)
                    acc = self._unit(acc, cur, u, Int32(u < ub), xs_lane, last, consts,
                                     self._sums_of(x_sums, u, 1, last)[0])
                    self._ring_copy(slot, lane_base, u + D, Int32(u + D < ub), k)
                    cute.arch.cp_async_commit_group()

        self._release_dependents()
        red = xs + regions["red"]
        if cutlass.const_expr(self.nblocks > 1):
            cute.arch.sync_threads()
            if cutlass.const_expr(self.tokens > 1):
                self._epilogue_rows(tid, nb0, red, xs + regions["ss"], r, y, m, k, eps, n_valid)
            else:
                factor = None
                if cutlass.const_expr(self.norm):
                    factor = self._norm_factor(xs + regions["ss"], k, eps)
                self._epilogue_blocks(tid, nb0, n_valid, red, r, y, factor)
        elif cutlass.const_expr(self.tokens > 1):
            # 4. every lane's fragment: rows g and g + 8, token columns 2t and 2t + 1 -> red[warp][row][token]
            t2 = (lane % 4) * 2
            if cutlass.const_expr(self.red_in_x):
                cute.arch.sync_threads()   # every warp's ldmatrix reads of the rows done
            ptx.sts_f32x2(red + ((warp * BLOCK_N + g) * TOKENS + t2) * 4, acc[0], acc[1])
            ptx.sts_f32x2(red + ((warp * BLOCK_N + g + layouts.MMA_N) * TOKENS + t2) * 4, acc[2], acc[3])
            cute.arch.sync_threads()
            self._epilogue_rows(tid, nb, red, xs + regions["ss"], r, y, m, k, eps)
        else:
            # 4. combine the warps' partials (every B column holds x, so any lane with t = 0 has them)
            if lane % 4 == 0:
                ptx.sts_f32(red + (warp * BLOCK_N + g) * 4, acc[0])
                ptx.sts_f32(red + (warp * BLOCK_N + g + layouts.MMA_N) * 4, acc[2])
            cute.arch.sync_threads()
            factor = None
            if cutlass.const_expr(self.norm):
                factor = self._norm_factor(xs + regions["ss"], k, eps)
            if cutlass.const_expr(self.split):
                self._exchange(tid, nb, sy, red, xs + regions["xchg"], r, y, ws, counters, splits)
            else:
                self._epilogue(tid, nb, red, r, y, factor)

    @cute.jit
    def _stream_blocks(self, bufs, sh, ua, n_valid, where, xs_lane, last, consts, red, warp, lane, g):
        """n-blocks per CTA: the warp streams its K share of n-block 0, then of n-block 1, ... as one sequence of
        batches (the next batch requested before this one is consumed, across n-block boundaries); at the end of
        each n-block's share its partial goes to red[j][warp] and the accumulator restarts. A warp without a
        share writes zeros."""
        P = self.prefetch
        acc = (Float32(0.0),) * 4
        jc, uc = Int32(0), Int32(0)
        for it in cutlass.range((n_valid * sh + P - 1) // P, unroll=1):
            units = self._units_from(jc, uc, sh, 2 * P)   # this batch's units, then the next batch's
            cur = units[:P]
            jc, uc = units[P]
            nxt = tuple(self._load_at(j, u, ua, n_valid, where) for j, u in units[P:])
            for i in cutlass.range_constexpr(P):
                j, u = cur[i]
                acc = self._unit(acc, bufs[i], ua + u, Int32(j < n_valid), xs_lane, last, consts)
                end = (u == sh - 1) & (j < n_valid)
                if end:
                    self._store_partial(red, j, warp, lane, g, acc)
                acc = tuple(cutlass.select_(end, Float32(0.0), a) for a in acc)
            bufs = nxt
        if sh == 0:
            for j in cutlass.range(n_valid, unroll=1):
                self._store_partial(red, j, warp, lane, g, (Float32(0.0),) * 4)

    @cute.jit
    def _store_partial(self, red, j, warp, lane, g, acc):
        """A warp's partial sums of n-block j (rows g and g + 8) -> red[j][warp][16] (multi-token:
        red[j][warp][16][TOKENS], this lane's token columns 2t and 2t + 1)."""
        if cutlass.const_expr(self.tokens > 1):
            base = red + j * (self.warps * BLOCK_N * TOKENS * 4)
            t2 = (lane % 4) * 2
            ptx.sts_f32x2(base + ((warp * BLOCK_N + g) * TOKENS + t2) * 4, acc[0], acc[1])
            ptx.sts_f32x2(base + ((warp * BLOCK_N + g + layouts.MMA_N) * TOKENS + t2) * 4, acc[2], acc[3])
        else:
            if lane % 4 == 0:
                ptx.sts_f32(red + ((j * self.warps + warp) * BLOCK_N + g) * 4, acc[0])
                ptx.sts_f32(red + ((j * self.warps + warp) * BLOCK_N + g + layouts.MMA_N) * 4, acc[2])

    @cute.jit
    def _epilogue_blocks(self, tid, nb0, n_valid, red, r, y, factor):
        """n-blocks per CTA: threads take the (n-block, output column) pairs in turn (`_epilogue` per n-block)."""
        cols = BLOCK_N // self.epi.rows_per_output
        y_base = y.iterator.toint()
        for i in cutlass.range(tid, n_valid * cols, WARP * self.warps, unroll=1):
            j = i // cols
            col = i % cols
            red_j = red + j * (self.warps * BLOCK_N * 4)
            sums = tuple(self._row_sum(red_j, row) for row in self.epi.rows(col))
            self._finish(sums, Int64(nb0 + j) * cols + col, r, y_base, factor)

    @cute.jit
    def _exchange(self, tid, nb, sy, red, xchg, r, y, ws, counters, splits):
        """Split-K: write this CTA's 16 row sums to the workspace ([tile][split][16] float32), count the CTA on the
        tile's counter; the last to arrive sums the partials in split order (deterministic) and runs the
        epilogue (decode/split_arrival.py)."""
        ws_base = ws.iterator.toint()
        tile = Int64(nb) * splits
        if tid < BLOCK_N // 2:
            ptx.stg_f32x2(ws_base + ((tile + sy) * BLOCK_N + 2 * tid) * 4,
                          self._row_sum(red, 2 * tid), self._row_sum(red, 2 * tid + 1))
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        flag = xchg + BLOCK_N * 4
        if tid == 0:
            ptx.sts_f32(flag, Float32(split_arrival.arrive(counters.iterator + nb, splits)))
        cute.arch.sync_threads()
        if ptx.lds_f32(flag) != Float32(0.0):
            cute.arch.fence_acq_rel_gpu()
            if tid < BLOCK_N // 2:
                a0, a1 = Float32(0.0), Float32(0.0)
                for sp in cutlass.range(splits, unroll=1):
                    v0, v1 = ptx.ldg_cg_f32x2(ws_base + ((tile + sp) * BLOCK_N + 2 * tid) * 4)
                    a0, a1 = a0 + v0, a1 + v1
                ptx.sts_f32(xchg + (2 * tid) * 4, a0)
                ptx.sts_f32(xchg + (2 * tid + 1) * 4, a1)
            cute.arch.sync_threads()
            self._epilogue(tid, nb, red, r, y, None, xchg)

    def _norm_factor(self, ss: Int32, k, eps, tok=0, per_warp: int = 1) -> Float32:
        """RMSNorm row factor of token `tok` from the warps' sums of squares ss[warp][per_warp], in warp order."""
        total = ptx.lds_f32(ss + tok * 4)
        for wi in range(1, self.warps):
            total = total + ptx.lds_f32(ss + (wi * per_warp + tok) * 4)
        return cute.math.rsqrt(total / Float32(k) + eps)

    def _row_sum(self, red: Int32, row, per_warp: int = 1) -> Float32:
        """Sum over the warps of partial `row` of red[warp][BLOCK_N * per_warp]."""
        v = ptx.lds_f32(red + row * 4)
        for wi in range(1, self.warps):
            v = v + ptx.lds_f32(red + (wi * BLOCK_N * per_warp + row) * 4)
        return v

    def _finish(self, sums, at, r, y_base, factor) -> None:
        """Output element `at` of y from its summed rows: times the RMSNorm row factor (`norm`), the fused epilogue
        (its residual read at `at`), stored as bf16."""
        if cutlass.const_expr(self.norm):
            sums = tuple(v * factor for v in sums)
        v = self.epi.finish(sums, lambda: ptx.ldg_bf16_to_f32(r.iterator.toint() + at * 2))
        ptx.stg_bf16(y_base + at * 2, v)

    @cute.jit
    def _epilogue(self, tid, nb, red, r, y, factor=None, totals=None):
        """Thread tid < the tile's output columns finishes output column tid (`norm`: the row sums times the
        RMSNorm row factor first; `totals`: the split-K sums in shared memory instead of the warps' partials)."""
        cols = BLOCK_N // self.epi.rows_per_output
        if tid < cols:
            sums = tuple(self._row_sum(red, row) if totals is None else ptx.lds_f32(totals + row * 4)
                         for row in self.epi.rows(tid))
            self._finish(sums, Int64(nb) * cols + tid, r, y.iterator.toint(), factor)


class GemvTileNorm(GemvTile):
    """y = rsqrt(mean(x^2) + eps) * (x @ W^T) (+ epilogue): the decode step's RMSNorm row factor folded into
    the M = 1 projection that reads it (QKV, gate/up; the norm's gain is folded into W), so the step launches
    no row-factor kernel. Every warp sums the squares of the slice of the row it stages anyway; the factor
    scales the 16 outputs before the epilogue (routing rule E2). Scaling the outputs rather than the staged row
    needs no CTA barrier and no rewrite of the row before the K loop (measured: docs/routing.md E2); it
    differs from the row-factor kernel followed by the tile GEMV only in that the normalized row is not
    rounded to bf16 (the float32 product is the more exact one)."""

    norm = True

    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, s: Optional[cute.Tensor], r: Optional[cute.Tensor],
                 y: cute.Tensor, eps: Float32, stream):
        n_tiles, smem = self._shape(x, y)
        self.kernel_norm(x, w, s, r, y, eps).launch(grid=(n_tiles, 1, 1), block=(WARP * self.warps, 1, 1),
                                                    smem=smem, stream=stream, use_pdl=True)

    @cute.kernel
    def kernel_norm(self, x: cute.Tensor, w: cute.Tensor, s: Optional[cute.Tensor], r: Optional[cute.Tensor],
                    y: cute.Tensor, eps: Float32):
        self._body(x, w, s, r, y, eps)


class GemvTileSplit(GemvTile):
    """Split-K (tuning space, docs/routing.md P11): grid (N / 16, splits); the CTAs of a tile stream `splits` K
    ranges (each stages only its slice of the row), write their 16 row sums to a float32 workspace and count
    themselves on the tile's arrival counter; the last to arrive sums the partials in split order and runs the
    epilogue. Meant to fill the CTA slots the last wave of the down projections leaves empty; measured slower in
    the decode step (the fence / counter / read-back chain costs more than the balance gains)."""

    split = True

    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, s: Optional[cute.Tensor], r: Optional[cute.Tensor],
                 y: cute.Tensor, ws: cute.Tensor, counters: cute.Tensor, splits: Int32, stream):
        n_tiles = self.epi.weight_rows(y.shape[1]) // BLOCK_N
        smem = smem_bytes(tile_slice_k(x.shape[1], splits), self.warps, split=True)
        self.kernel_split(x, w, s, r, y, ws, counters, splits).launch(
            grid=(n_tiles, splits, 1), block=(WARP * self.warps, 1, 1), smem=smem, stream=stream, use_pdl=True)

    @cute.kernel
    def kernel_split(self, x: cute.Tensor, w: cute.Tensor, s: Optional[cute.Tensor], r: Optional[cute.Tensor],
                     y: cute.Tensor, ws: cute.Tensor, counters: cute.Tensor, splits: Int32):
        self._body(x, w, s, r, y, None, ws, counters, splits)


def compile_target(fmt: str = "int4", group_size: int = 128, epilogue: str = "store", warps: int = 4,
                   prefetch: int = 0, pipeline: str = "batch", norm: bool = False, fold: bool = False,
                   split: bool = False, tokens: int = 1, nblocks: int = 1):
    """Registry factory. `fmt` and `group_size` are registry parameters (decode.plan.tile_params) with the one
    value FORMAT. `norm`: the fused-RMSNorm variant, which takes eps (float32) before the stream. `fold`: the
    nibble bias as one correction per unit from the unit's activation sum. `split`: split-K, which takes the
    workspace, the arrival counters and the split count before the stream. `tokens` = 8: the multi-token kernel
    (1..8 rows, the B columns of the MMA being tokens instead of copies of the one row). `nblocks`: consecutive
    16-channel n-blocks per CTA (the grid is N / (16 * nblocks) CTAs)."""
    from .signature import fake_args, fake_split_args

    if (fmt, group_size) != FORMAT:
        raise ValueError(f"the tile GEMV serves {FORMAT} weights only, got {(fmt, group_size)}")
    args = fake_args(fmt, epilogue, m=1 if tokens == 1 else None)
    if split:
        if norm or fold or pipeline != "batch":
            raise ValueError("the split-K tile GEMV is the batch pipeline without the fused norm or the fold")
        return GemvTileSplit(epilogue, warps, prefetch, pipeline, fold, tokens), (*args[:-1], *fake_split_args(),
                                                                                 Int32(1), args[-1])
    if not norm:
        return GemvTile(epilogue, warps, prefetch, pipeline, fold, tokens, nblocks), args
    if epi.make(epilogue).residual:
        raise ValueError("the fused-norm tile GEMV has no residual epilogue (it serves QKV and gate/up)")
    return GemvTileNorm(epilogue, warps, prefetch, pipeline, fold, tokens, nblocks), (*args[:-1], Float32(1e-5),
                                                                                     args[-1])
