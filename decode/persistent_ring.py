"""The persistent decode layer with its weights streamed apart from the math (issue 29): one launch per layer runs
the layer's tasks (decode.persistent_schedule.task_table, 1..8 rows) as decode/persistent_layer.py does, but a
producer warp copies every projection task's packed weights into a shared-memory ring ahead of the consumer warps,
across task boundaries and without waiting on any counter.

Why (docs/persistent.md, measured on the H200): the tile GEMV body keeps its weights in its warps' registers, so one
8-warp CTA per SM has a third of the standalone launches' bytes in flight and streams half their bandwidth. Here the
bytes in flight are the ring's (`stages` x 8 KB per SM, whatever the consumers' registers), and the weights of task
j + 1 land while task j computes, waits on its counter, or runs attention.

CTA anatomy (288 threads, one CTA per SM):

  warp 8        producer: one lane walks the CTA's task list of this layer; for each projection task (16 weight rows
                = one n-block, K / 1024 stages) it waits for a free stage (its *empty* mbarrier), then copies the
                stage's 8 units of packed weights (8 KB, contiguous in the packed order: an n-block's units are
                consecutive) and their group scales (256 B) with two bulk copies completing on the stage's *full*
                mbarrier. Weights never depend on another task, so it never waits on a counter.
  warps 0-7     consumers: the task loop of decode/persistent_layer.py (counters, attention partials and combines
                on decode/attention.py's bodies), meeting at a named barrier the producer never joins. A projection
                task stages the activation row(s) (warp w its units w, w + 8, ...: the ones it multiplies; rows wider
                than the body a chunk of whole stages at a time), then per stage warp w takes unit w: its two
                16-byte words and two scales from the stage, releases the stage (every thread arrives once its own
                reads are issued: each releases only what it read), expands and multiplies them as the tile GEMV
                does (decode/dequant.py, decode/stream.py: the same MMAs per unit; with several rows B column j is
                row j), the group scale folded per unit. The warps' partials meet in
                shared memory, the RMSNorm row factor (QKV, gate/up) scales the sums and the fused epilogue (store,
                SwiGLU, residual) writes the n-block's outputs.

Both sides count the ring's stages in the same order (the task list's projection stages), so stage i is slot
i % stages in phase (i / stages) % 2 for both. Every projection's K must be a multiple of 1024 (whole stages:
decode.persistent_host.ring_k_misfit). The outputs equal the tile GEMV's up to float32 summation order (a warp's units
are strided, not a contiguous share).
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from decode import persistent_loop as loop
from decode import ptx, stream
from decode.attention import AttnTensors, DecodeAttention
from decode.attn_plan import AttnPlan
from decode.gemv_tile import WARP, GemvTile
from decode.gemv_layout import TOKENS
from decode.persistent_layer import ATTN, PROJ, LayerCall, check_task_plan
from decode.persistent_host import (RING_CONSUMER_WARPS, RING_PIECES, RING_RED_BUFS, RING_ROW_BYTES,
                                    RING_STAGE_BYTES, RING_STAGE_K, RING_STAGE_SCALE_BYTES, RING_STAGE_UNITS,
                                    TRACE_FIELDS, layer_plan, ring_chunk_stages, ring_kernel_stages, ring_lane_at,
                                    ring_per_warp, ring_piece_offset, ring_red_bytes, ring_regions, ring_row_stride,
                                    ring_scales_at, ring_ss_bytes, ring_threads, ring_unit_scales_at,
                                    ring_weights_at)

CONSUMERS = RING_CONSUMER_WARPS * WARP   # threads of the consumers' named barrier
PRODUCER_WARP = RING_CONSUMER_WARPS
EPILOGUE_WARP = RING_CONSUMER_WARPS + 1   # the epilogue-warp variant's
STAGE_W = RING_STAGE_BYTES          # a stage's weights
STAGE_S = RING_STAGE_SCALE_BYTES    # its scales
F = loop.F
TRACE = {n: i for i, n in enumerate(TRACE_FIELDS)}
assert RING_ROW_BYTES % 16 == 0   # copied as 16-byte pieces


@cute.jit
def _stamp(trace: Optional[cute.Tensor], cta, j, field: int, tid) -> None:
    """trace[cta, j, field] = the global timer, by thread `tid` 0 (no trace: nothing)."""
    if cutlass.const_expr(trace is not None):
        if tid == 0:
            ptx.stg_i64(trace.iterator.toint() + Int64(cute.crd2idx((cta, j, field), trace.layout)) * 8,
                        ptx.globaltimer())


def _is_projection(kind):
    """Whether a table row's kind is one of the four projections (the tasks that take ring stages)."""
    return (kind == PROJ["qkv"]) | (kind == PROJ["o"]) | (kind == PROJ["gate_up"]) | (kind == PROJ["down"])


def _next_slot(slot, phase, stages: int):
    """The ring stage after (slot, phase): the next slot, the phase flipped where the ring wraps."""
    wrap = slot == stages - 1
    return cutlass.select_(wrap, Int32(0), slot + 1), phase ^ cutlass.select_(wrap, Int32(1), Int32(0))


class _PartialWait:
    """An attention partial's counter wait, run by DecodeAttention.partial once the task's first cache tiles are
    requested (the `early_tiles` variant: partial's `early_wait`), with the trace's ready stamp after it."""

    def __init__(self, counters, idx, target, tidx, trace, cta, j):
        self.args, self.stamp = (counters, idx, target, tidx), (trace, cta, j)

    def __call__(self) -> None:
        counters, idx, target, tidx = self.args
        loop.wait(counters, idx, target, tidx, CONSUMERS)
        trace, cta, j = self.stamp
        _stamp(trace, cta, j, TRACE["ready"], tidx)


class ConsumerAttention(DecodeAttention):
    """decode/attention.py's bodies on the consumer warps: their CTA barriers leave the producer warp out."""

    def _sync(self) -> None:
        loop.cta_sync(CONSUMERS)


class RingProjection(GemvTile):
    """A projection task on the consumer warps, reading its weights from the ring (the tile GEMV's unit arithmetic,
    its partials' sum, RMSNorm factor and epilogues)."""

    def __init__(self, epilogue: str, norm: bool, stages: int, body_bytes: int, tokens: int = 1,
                 lookahead: bool = False, red_bufs: int = 1, group: int = 1, no_math: bool = False):
        super().__init__(epilogue, RING_CONSUMER_WARPS, tokens=tokens)
        if group < 1 or (group > 1 and lookahead):
            raise ValueError("a stage group is 1 or more stages, and not with the lookahead loop")
        self.norm, self.lookahead, self.group = norm, lookahead, group
        self.no_math = no_math   # diagnostic: the stages waited for and released, their units not multiplied
        self.stages, self.body_bytes = stages, body_bytes
        self.red_bufs = red_bufs   # > 1: the partials go to the epilogue warp through that many buffers
        self.per = ring_per_warp(tokens)   # token columns of a warp's partials and sums of squares
        self.r = ring_regions(stages, tokens, red_bufs)

    def _xs_lane(self, xs, lane, m, row_stride, mn=cutlass.min):
        """The lane's ldmatrix row address of the first block of a chunk's staged rows (`mn`: min on the values
        given; the CPU emulation passes numpy's)."""
        fmt = self.fmt
        if cutlass.const_expr(self.tokens > 1):
            # B column j of every MMA is row j (columns past the last row repeat it and are never stored)
            return xs + mn(fmt.x_lane_row(lane), m - 1) * row_stride + fmt.x_lane_col(lane)
        return xs + fmt.x_lane_offset(lane, 0)   # M = 1: every B column holds the row

    @cute.jit
    def _stage_chunk(self, x: cute.Tensor, xs, ss_out, st0, st1, warp, lane, row_stride, first):
        """This warp's units of stages [st0, st1) of the row(s) (units w, w + 8, ...: the ones it multiplies) ->
        shared memory (stage st0's at the body's start, row r at r * row_stride), where only it reads them; `norm`:
        their sums of squares per row into ss_out[warp][row] (`first`: set, else added: a task's later chunks)."""
        x_base = x.iterator.toint()
        k = x.shape[1]
        per = self.per
        n = (st1 - st0) * RING_PIECES
        for row in cutlass.range(x.shape[0], unroll=1):
            for c in cutlass.range(lane, n, WARP, unroll=1):
                off = ring_piece_offset(c, warp)
                src = x_base + Int64(row) * (k * 2) + Int64(st0) * (RING_STAGE_K * 2) + Int64(off)
                ptx.cp_async_16(xs + row * row_stride + off, src)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_warp()
        if cutlass.const_expr(self.norm):
            for row in cutlass.range(x.shape[0], unroll=1):
                ss = Float32(0.0)
                for c in cutlass.range(lane, n, WARP, unroll=1):
                    ss = self._add_squares(ss, ptx.lds_v4(xs + row * row_stride + ring_piece_offset(c, warp)))
                if not first:
                    if lane == 0:   # the earlier chunks' sum, which lane 0 stored
                        ss = ss + ptx.lds_f32(ss_out + (warp * per + row) * 4)
                self._store_warp_sum(ss, ss_out + (warp * per + row) * 4, lane)

    def _stage_math(self, acc, cur, st_in_chunk, warp, xs_lane, consts):
        """acc += the warp's unit of a stage (its registers `cur`) times its activations: the unit is
        st_in_chunk x 8 + warp units into the staged chunk (ring_piece_offset's place)."""
        if cutlass.const_expr(self.no_math):
            return acc
        u = st_in_chunk * RING_STAGE_UNITS + warp
        b_ops = [[self._x_frags(xs_lane, u * self.bpu + b)] for b in range(self.bpu)]
        (acc,) = stream.mma_unit(self.fmt, self.bpu, cur, b_ops, [acc], Int32(1), consts)
        return acc

    @cute.jit
    def _stages_ahead(self, acc, st0, st1, slot, phase, bars, w_lane, s_warp, xs_lane, warp, lane, consts):
        """Stages [st0, st1) of a chunk one stage ahead (`lookahead`): the next stage's words are read before this
        one's math, so their wait and shared-load latency hide behind it. A stage is released after the next one is
        read (past the chunk's last stage the read repeats the current one, which is still held), so no lane reads a
        slot the producer may be refilling. Returns (acc, slot, phase) after the chunk."""
        g = lane // 4
        cute.arch.mbarrier_wait(bars + slot, phase)
        cur = self._ring_read(w_lane + slot * STAGE_W, s_warp + slot * STAGE_S, g)
        for st in cutlass.range(st0, st1, unroll=2):   # two stages per trip: `cur = nxt` without moves
            more = st + 1 < st1
            nslot, nphase = _next_slot(slot, phase, self.stages)
            if more:
                cute.arch.mbarrier_wait(bars + nslot, nphase)
            rslot = cutlass.select_(more, nslot, slot)
            nxt = self._ring_read(w_lane + rslot * STAGE_W, s_warp + rslot * STAGE_S, g)
            cute.arch.mbarrier_arrive(bars + self.stages + slot)   # this thread's reads of it (and the next) issued
            slot, phase = nslot, nphase
            acc = self._stage_math(acc, cur, st - st0, warp, xs_lane, consts)
            cur = nxt
        return acc, slot, phase

    def _stage_group(self, acc, st, slot, phase, bars, w_lane, s_warp, xs_lane, warp, lane, consts):
        """`group` stages from chunk stage st on (traced inline, straight-line code): every stage's wait, then all
        their reads, their releases, then all their math, so the units' expansions and MMA chains (independent until
        each one's fold into acc, added in stage order: the sums are the one-stage loop's bit for bit) share one basic
        block, where ptxas interleaves them; a warp's unit per stage is otherwise one serial latency chain."""
        g = lane // 4
        at = []
        for _ in range(self.group):
            at.append((slot, phase))
            slot, phase = _next_slot(slot, phase, self.stages)
        for s, p in at:
            cute.arch.mbarrier_wait(bars + s, p)
        curs = [self._ring_read(w_lane + s * STAGE_W, s_warp + s * STAGE_S, g) for s, _ in at]
        for s, _ in at:
            cute.arch.mbarrier_arrive(bars + self.stages + s)   # this thread's reads of it issued
        for q, cur in enumerate(curs):
            acc = self._stage_math(acc, cur, st + q, warp, xs_lane, consts)
        return acc, slot, phase

    @cute.jit
    def task(self, x: cute.Tensor, r, y: cute.Tensor, eps, nb, base, bars, i0, tid, staged, seq=None):
        """n-block nb of y = x @ W^T (+ epilogue), once the task's wait has passed; its stages are the ring's i0,
        i0 + 1, ...; returns the stage after its last. The input rows are staged `ring_chunk_stages` stages at a time
        (one chunk unless the rows are too wide for the body). `staged`: the CTA's previous task was of the same kind
        (every task of a kind reads the same rows), so a one-chunk input (and its sums of squares) is still there.
        With the epilogue warp (`red_bufs` > 1) the partials go to it as the CTA's seq-th projection task, and this
        returns (the stage after the last, seq + 1)."""
        fmt = self.fmt
        warp = tid // WARP
        lane = tid % WARP
        g = lane // 4
        k = x.shape[1]
        m = x.shape[0]
        n_st = k // RING_STAGE_K
        xs = base + self.r["body"]
        chunk = ring_chunk_stages(Int32(self.body_bytes), m, self.tokens)
        n_chunks = (n_st + chunk - 1) // chunk
        row_stride = ring_row_stride(chunk, n_st, cutlass.min)
        # one row: the residual of this thread's output column, requested now (its latency hides behind the stages)
        cols = 16 // self.epi.rows_per_output
        at = Int64(nb) * cols + tid
        res = Float32(0.0)
        if cutlass.const_expr(self.epi.residual and self.tokens == 1 and self.red_bufs == 1):
            if tid < cols:
                res = ptx.ldg_cg_bf16_to_f32(r.iterator.toint() + at * 2)

        xs_lane = self._xs_lane(xs, lane, m, row_stride)
        consts = fmt.consts()
        w_lane = base + self.r["weights"] + ring_lane_at(warp, lane)
        s_warp = base + self.r["scales"] + ring_unit_scales_at(warp)
        acc = (Float32(0.0),) * 4
        slot = i0 % self.stages          # the ring's stage i0 + st: slot and phase stepped along, not divided out
        phase = (i0 // self.stages) % 2
        for ch in cutlass.range(n_chunks, unroll=1):
            st0 = ch * chunk
            st1 = cutlass.min(n_st, st0 + chunk)
            if (n_chunks > 1) | (not staged):   # the warp's own units: it alone reads them
                self._stage_chunk(x, xs, base + self.r["ss"], st0, st1, warp, lane, row_stride, ch == 0)
            if cutlass.const_expr(self.lookahead):
                acc, slot, phase = self._stages_ahead(acc, st0, st1, slot, phase, bars, w_lane, s_warp, xs_lane,
                                                      warp, lane, consts)
            else:
                tail = st0
                if cutlass.const_expr(self.group > 1):
                    groups = (st1 - st0) // self.group
                    for q in cutlass.range(groups, unroll=1):
                        acc, slot, phase = self._stage_group(acc, q * self.group, slot, phase, bars, w_lane, s_warp,
                                                             xs_lane, warp, lane, consts)
                    tail = st0 + groups * self.group   # a chunk's last stages short of a group: one at a time
                for st in cutlass.range(tail, st1, unroll=1):
                    cute.arch.mbarrier_wait(bars + slot, phase)
                    cur = self._ring_read(w_lane + slot * STAGE_W, s_warp + slot * STAGE_S, g)
                    cute.arch.mbarrier_arrive(bars + self.stages + slot)   # this thread's reads of it issued
                    slot, phase = _next_slot(slot, phase, self.stages)
                    acc = self._stage_math(acc, cur, st - st0, warp, xs_lane, consts)
            cute.arch.sync_warp()   # the warp's reads of this chunk done before it stages the next over it

        if cutlass.const_expr(self.red_bufs > 1):
            self._hand_off(acc, base, bars, seq, warp, lane)
            return i0 + n_st, seq + 1
        red = base + self.r["red"]
        self._store_partials(red, acc, warp, lane)
        if cutlass.const_expr(self.tokens > 1):
            # the tile GEMV's multi-token epilogue (threads take the (token, column) pairs, per-row norm factors)
            loop.cta_sync(CONSUMERS)
            self._epilogue_rows(tid, nb, red, base + self.r["ss"], r, y, m, k, eps)
            return i0 + n_st
        loop.cta_sync(CONSUMERS)
        if tid < cols:   # output column tid of the n-block
            sums = tuple(self._row_sum(red, row) for row in self.epi.rows(tid))
            if cutlass.const_expr(self.norm):
                factor = self._norm_factor(base + self.r["ss"], k, eps)
                sums = tuple(v * factor for v in sums)
            ptx.stg_bf16(y.iterator.toint() + at * 2, self.epi.finish(sums, lambda: res))
        return i0 + n_st

    @cute.jit
    def _store_partials(self, red, acc, warp, lane) -> None:
        """The warp's accumulator -> red[warp]: rows g and g + 8 of the n-block; several rows: token columns 2t and
        2t + 1 -> red[warp][row][token]; one row: every B column holds the row, so the lanes with t = 0 store."""
        g = lane // 4
        if cutlass.const_expr(self.tokens > 1):
            t2 = (lane % 4) * 2
            ptx.sts_f32x2(red + ((warp * 16 + g) * TOKENS + t2) * 4, acc[0], acc[1])
            ptx.sts_f32x2(red + ((warp * 16 + g + 8) * TOKENS + t2) * 4, acc[2], acc[3])
        else:
            if lane % 4 == 0:
                ptx.sts_f32(red + (warp * 16 + g) * 4, acc[0])
                ptx.sts_f32(red + (warp * 16 + g + 8) * 4, acc[2])

    def _red_at(self, base, bars, seq):
        """The partial buffer of the CTA's seq-th projection task: (its partials, its sums of squares, its full
        mbarrier, its empty mbarrier, the phase of this use)."""
        b = seq % self.red_bufs
        rb = bars + self.r["red_bars"] // 8
        return (base + self.r["red"] + b * ring_red_bytes(self.tokens),
                base + self.r["red_ss"] + b * ring_ss_bytes(self.tokens),
                rb + b, rb + self.red_bufs + b, (seq // self.red_bufs) % 2)

    @cute.jit
    def _hand_off(self, acc, base, bars, seq, warp, lane) -> None:
        """The warp's partials (and, `norm`, its sums of squares of the staged rows) -> the task's buffer, once the
        epilogue warp has finished that buffer's previous task; then every thread arrives for its own writes."""
        red, red_ss, full, empty, phase = self._red_at(base, bars, seq)
        cute.arch.mbarrier_wait(empty, phase ^ 1)
        self._store_partials(red, acc, warp, lane)
        if cutlass.const_expr(self.norm):
            if lane < self.per:   # lane 0 stored them at staging; the chunk loop's warp sync ordered that
                at = (warp * self.per + lane) * 4
                ptx.sts_f32(red_ss + at, ptx.lds_f32(base + self.r["ss"] + at))
        cute.arch.mbarrier_arrive(full)

    @cute.jit
    def finish(self, x: cute.Tensor, r, y: cute.Tensor, eps, nb, base, bars, seq, lane) -> None:
        """The epilogue warp: n-block nb's outputs from the CTA's seq-th projection task's partials (once all 256
        consumer threads have handed them on), then the buffer released."""
        red, red_ss, full, empty, phase = self._red_at(base, bars, seq)
        k = x.shape[1]
        cute.arch.mbarrier_wait(full, phase)
        if cutlass.const_expr(self.tokens > 1):
            self._epilogue_rows(lane, nb, red, red_ss, r, y, x.shape[0], k, eps, threads=WARP)
        else:
            # (GemvTile._epilogue restated: calling it computes the factor on every lane, other SASS, which the
            # bit-for-bit GPU test of `.ew` has not run on yet)
            cols = 16 // self.epi.rows_per_output
            if lane < cols:
                sums = tuple(self._row_sum(red, row) for row in self.epi.rows(lane))
                factor = self._norm_factor(red_ss, k, eps) if cutlass.const_expr(self.norm) else None
                self._finish(sums, Int64(nb) * cols + lane, r, y.iterator.toint(), factor)
        cute.arch.mbarrier_arrive(empty)   # this thread's reads of the buffer done


class RingLayer(LayerCall):
    """A decode layer (INT4 g128 weights, a contiguous INT4 or E4M3 cache mirror by `plan`) as one launch with a
    producer warp streaming the projections' weights, for one row (`tokens` = 1) or 1..8 (`tokens` = TOKENS); the
    arguments are decode/persistent_layer.py's PersistentLayer's (LayerCall). `stages`: the ring's depth (0: as many
    as fit beside the attention bodies' scratch); `trace`: the task trace variant (futx.engine.persistent_trace);
    `lookahead` (tuning space): the consumers read each stage one stage ahead of its math; `epilogue_warp` (tuning
    space): a tenth warp finishes every projection task from the partials the consumers hand it (through
    RING_RED_BUFS buffers), so the consumers' projection tasks end without a CTA barrier; `group` (tuning space): the
    consumers wait for, read and multiply that many stages at a time (RingProjection._stage_group); `early_tiles`
    (tuning space): an attention partial requests its first cache tiles before its counter wait (the new row's
    position zero-filled and its tile requested again once written: the decode step's dependent launch, rule E5, in a
    task), so their HBM latency passes while the QKV tasks it waits for finish; `no_math` (diagnostic, wrong
    outputs): the consumers take and release every stage without its arithmetic, so the layer runs at what the
    stream, the dependencies and attention allow."""

    def __init__(self, plan: AttnPlan, stages: int = 0, trace: bool = False, tokens: int = 1, lookahead: bool = False,
                 epilogue_warp: bool = False, group: int = 1, no_math: bool = False, early_tiles: bool = False):
        check_task_plan(plan, RING_CONSUMER_WARPS)
        self.early_tiles = early_tiles
        self.att = ConsumerAttention(plan)
        self.trace = trace
        # the ring beside the body: the attention scratch, where a projection stages its input in chunks
        self.body = plan.smem_bytes
        self.red_bufs = RING_RED_BUFS if epilogue_warp else 1
        self.stages = stages or ring_kernel_stages(self.body, tokens, self.red_bufs)
        self.tokens, self.epilogue_warp = tokens, epilogue_warp
        self.r = ring_regions(self.stages, tokens, self.red_bufs)
        if ring_chunk_stages(self.body, TOKENS if tokens > 1 else 1, tokens) < 1:
            raise ValueError("the body cannot hold one stage of every row")
        if group > self.stages:
            raise ValueError(f"a group of {group} stages needs a ring of as many, not {self.stages}")
        proj = dict(stages=self.stages, body_bytes=self.body, tokens=tokens, lookahead=lookahead,
                    red_bufs=self.red_bufs, group=group, no_math=no_math)
        self.qkv = RingProjection("store", True, **proj)
        self.o = RingProjection("residual", False, **proj)
        self.gate_up = RingProjection("swiglu", True, **proj)
        self.down = RingProjection("residual", False, **proj)

    @cute.jit
    def _launch(self, table, starts, layer, counters, h, w_qkv, s_qkv, qkv, attn, w_o, s_o, hmid, w_gu, s_gu, act, w_d,
                s_d, t: AttnTensors, eps, scale_log2, trace, stream):
        if cutlass.const_expr((trace is not None) != self.trace):
            raise ValueError("a traced ring layer takes the trace buffer, an untraced one None")
        self.kernel(table, starts, layer, counters, h, w_qkv, s_qkv, qkv, attn, w_o, s_o, hmid, w_gu, s_gu, act, w_d,
                    s_d, t, eps, scale_log2, trace).launch(
            grid=(table.shape[0], 1, 1), block=(ring_threads(self.epilogue_warp), 1, 1),
            smem=self.r["body"] + self.body, stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, table: cute.Tensor, starts: cute.Tensor, layer: Int32, counters: cute.Tensor, h: cute.Tensor,
               w_qkv: cute.Tensor, s_qkv: cute.Tensor, qkv: cute.Tensor, attn: cute.Tensor, w_o: cute.Tensor,
               s_o: cute.Tensor, hmid: cute.Tensor, w_gu: cute.Tensor, s_gu: cute.Tensor, act: cute.Tensor,
               w_d: cute.Tensor, s_d: cute.Tensor, t: AttnTensors, eps: Float32, scale_log2: Float32,
               trace: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # the next layer's launch may start now (its CTAs take each SM as this launch's CTA there exits)
        cute.arch.griddepcontrol_launch_dependents()
        bars = cute.arch.get_dyn_smem(cutlass.Int64, alignment=1024)
        base = ptx.smem_addr(bars)
        S = self.stages
        if tidx == 0:
            for s in cutlass.range_constexpr(S):
                cute.arch.mbarrier_init(bars + s, 1)                          # full: the producer's arrive + bytes
                cute.arch.mbarrier_init(bars + S + s, CONSUMERS)    # empty: one arrive per consumer thread
            if cutlass.const_expr(self.epilogue_warp):
                rb = bars + self.r["red_bars"] // 8
                for s in cutlass.range_constexpr(self.red_bufs):
                    cute.arch.mbarrier_init(rb + s, CONSUMERS)                     # full: every consumer thread
                    cute.arch.mbarrier_init(rb + self.red_bufs + s, WARP)          # empty: the epilogue warp
            cute.arch.mbarrier_init_fence()
        cute.arch.barrier()   # the only barrier of the whole block: the mbarriers are ready
        if warp == PRODUCER_WARP:
            if tidx % WARP == 0:
                self._produce(table, starts, layer, cta, h, w_qkv, s_qkv, attn, w_o, s_o, hmid, w_gu, s_gu, act,
                              w_d, s_d, base, bars, trace)
        elif warp == EPILOGUE_WARP:
            if cutlass.const_expr(self.epilogue_warp):
                self._epilogues(table, starts, layer, cta, tidx % WARP, counters, h, qkv, attn, hmid, act, eps, base,
                                bars, trace)
        else:
            if cutlass.const_expr(self.epilogue_warp):
                self._consume_handing_off(table, starts, layer, cta, tidx, counters, h, qkv, attn, hmid, act, t, eps,
                                          scale_log2, base, bars, trace)
            else:
                self._consume(table, starts, layer, cta, tidx, counters, h, qkv, attn, hmid, act, t, eps, scale_log2,
                              base, bars, trace)

    @cute.jit
    def _produce(self, table, starts, layer, cta, h, w_qkv, s_qkv, attn, w_o, s_o, hmid, w_gu, s_gu, act, w_d, s_d,
                 base, bars, trace):
        """One lane: every projection task's stages of this CTA's list, in order, into the ring."""
        S = self.stages
        slot, phase = Int32(0), Int32(0)   # the ring's next stage
        for j in cutlass.range(starts[cta, layer], starts[cta, layer + 1], unroll=1):
            kind = table[cta, j, F["kind"]]
            is_qkv, is_o = kind == PROJ["qkv"], kind == PROJ["o"]
            is_gu, is_d = kind == PROJ["gate_up"], kind == PROJ["down"]
            k = cutlass.select_(is_qkv, h.shape[1], cutlass.select_(is_o, attn.shape[1],
                                cutlass.select_(is_gu, hmid.shape[1], act.shape[1])))
            w = cutlass.select_(is_qkv, w_qkv.iterator.toint(), cutlass.select_(is_o, w_o.iterator.toint(),
                                cutlass.select_(is_gu, w_gu.iterator.toint(), w_d.iterator.toint())))
            s = cutlass.select_(is_qkv, s_qkv.iterator.toint(), cutlass.select_(is_o, s_o.iterator.toint(),
                                cutlass.select_(is_gu, s_gu.iterator.toint(), s_d.iterator.toint())))
            n_st = cutlass.select_(is_qkv | is_o | is_gu | is_d, k // RING_STAGE_K, 0)
            nb = Int64(table[cta, j, F["a0"]] // 16)
            k64 = Int64(k)
            for st in cutlass.range(n_st, unroll=1):
                full = bars + slot
                cute.arch.mbarrier_wait(bars + S + slot, phase ^ 1)   # a fresh slot passes at once
                cute.arch.mbarrier_arrive_and_expect_tx(full, STAGE_W + STAGE_S)
                f = ptx.smem_addr(full)
                ptx.cp_async_bulk_g2s(base + self.r["weights"] + slot * STAGE_W,
                                      w + ring_weights_at(nb, k64, Int64(st)), STAGE_W, f)
                ptx.cp_async_bulk_g2s(base + self.r["scales"] + slot * STAGE_S,
                                      s + ring_scales_at(nb, k64, Int64(st)), STAGE_S, f)
                if st == 0:   # the task's first stage is on its way
                    _stamp(trace, cta, j, TRACE["issued"], Int32(0))
                slot, phase = _next_slot(slot, phase, S)

    @cute.jit
    def _copy_row(self, table: cute.Tensor, cta, j, rows_at, tidx) -> None:
        """Threads 0..2: table row j of this CTA (48 bytes) -> the row buffer of j's parity, by cp.async (committed;
        waited for before the barrier that ends the task)."""
        if tidx < RING_ROW_BYTES // 16:
            src = table.iterator.toint() + Int64(cute.crd2idx((cta, j, 0), table.layout)) * 4 + tidx * 16
            ptx.cp_async_16(rows_at + (j % 2) * RING_ROW_BYTES + tidx * 16, src)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _consume(self, table, starts, layer, cta, tidx, counters, h, qkv, attn, hmid, act, t, eps, scale_log2, base,
                 bars, trace):
        """The consumer warps' task loop (decode/persistent_layer.py's, at the consumers' barrier)."""
        if layer == 0:   # the step's first layer reads the rows the launch before it wrote
            cute.arch.griddepcontrol_wait()
        body = base + self.r["body"]
        nsplit = t.ws_o.shape[2]
        i = Int32(0)   # the ring's next stage
        staged = Int32(-1)   # the kind of the projection whose row the body holds (-1: none, or attention scratch)
        pending = Int32(0)   # tasks done whose signals are held (see below)
        end = starts[cta, layer + 1]
        # the task rows in shared memory, double-buffered: row j + 1 is copied while task j runs, so reading a task's
        # fields never waits for L2 (the acquire at a wait empties L1)
        rows_at = base + self.r["rows"]
        j0 = starts[cta, layer]
        self._copy_row(table, cta, j0, rows_at, tidx)
        cute.arch.cp_async_wait_group(0)
        loop.cta_sync(CONSUMERS)
        for j in cutlass.range(j0, end, unroll=1):
            cur = rows_at + (j % 2) * RING_ROW_BYTES
            nxt_row = rows_at + ((j + 1) % 2) * RING_ROW_BYTES
            self._copy_row(table, cta, j + 1, rows_at, tidx)   # (row `end` exists: the next layer's, or END)
            kind = ptx.lds_i32(cur + F["kind"] * 4)
            wait0, target0 = ptx.lds_i32(cur + F["wait0"] * 4), ptx.lds_i32(cur + F["target0"] * 4)
            a0, a1, a2 = (ptx.lds_i32(cur + F[f] * 4) for f in ("a0", "a1", "a2"))
            nb = a0 // 16
            _stamp(trace, cta, j, TRACE["start"], tidx)
            # a projection of the kind whose row is staged: the CTA's previous task, of the same kind, passed the
            # same wait (one counter and target per kind and layer: futx.engine.persistent.check_ring_waits)
            again = staged == kind
            early_wait = None   # (the early_tiles variant: a partial waits once its first tiles are requested)
            if cutlass.const_expr(self.early_tiles):
                early_wait = _PartialWait(counters, wait0, target0, tidx, trace, cta, j)
                if (staged != kind) & (kind != ATTN["attn_partial"]):
                    loop.wait(counters, wait0, target0, tidx, CONSUMERS)
            else:
                if not again:
                    loop.wait(counters, wait0, target0, tidx, CONSUMERS)
            _stamp(trace, cta, j, TRACE["ready"], tidx)
            if kind == ATTN["attn_partial"]:   # (row, KV head, split)
                self.att.partial(t, scale_log2, a2, a1, a0, nsplit, body, tidx, False, early_wait)
            elif kind == ATTN["attn_combine"]:   # (row, KV head)
                self.att.combine(t, a1, a0, nsplit, tidx)
            elif kind == PROJ["qkv"]:
                i = self.qkv.task(h, None, qkv, eps, nb, base, bars, i, tidx, again)
            elif kind == PROJ["o"]:
                i = self.o.task(attn, h, hmid, eps, nb, base, bars, i, tidx, again)
            elif kind == PROJ["gate_up"]:
                i = self.gate_up.task(hmid, None, act, eps, nb, base, bars, i, tidx, again)
            elif kind == PROJ["down"]:
                i = self.down.task(act, hmid, h, eps, nb, base, bars, i, tidx, again)
            # (row factors, fused into QKV and gate/up, are not in the kernel form's tables: they would only wait)
            is_proj = _is_projection(kind)
            staged = cutlass.select_(is_proj, kind, Int32(-1))
            # this row's last reads before the barrier: after it, the next task's copy may overwrite this buffer
            sig0, sig1 = ptx.lds_i32(cur + F["signal0"] * 4), ptx.lds_i32(cur + F["signal1"] * 4)
            cute.arch.cp_async_wait_group(0)   # the next row landed (copied by this thread, if any)
            loop.cta_sync(CONSUMERS)   # the task's writes and shared-memory reads done by every consumer
            _stamp(trace, cta, j, TRACE["end"], tidx)
            # one release per run of tasks signalling the same counters: a waiter's target is all of a counter's
            # producers in the layer, so holding a task's count until the run's last task delays no waiter, and
            # saves the release fences between them (the next row's buffer is rewritten only after the next
            # task's barrier)
            pending = pending + 1
            more = j + 1 < end
            same = (more & (ptx.lds_i32(nxt_row + F["signal0"] * 4) == sig0)
                    & (ptx.lds_i32(nxt_row + F["signal1"] * 4) == sig1))
            if not same:
                loop.signal(counters, sig0, tidx, pending)
                loop.signal(counters, sig1, tidx, pending)
                pending = Int32(0)

    @cute.jit
    def _consume_handing_off(self, table, starts, layer, cta, tidx, counters, h, qkv, attn, hmid, act, t, eps,
                             scale_log2, base, bars, trace):
        """The consumers' task loop with the epilogue warp: a projection task hands its partials on and the warps go
        straight to the next task (no CTA barrier; each warp stages and reads only its own units); they meet only at
        a counter wait (a new kind) and around attention, whose scratch overlaps the staged rows. Attention tasks
        signal their counters themselves, projection tasks leave it to the epilogue warp."""
        if layer == 0:   # the step's first layer reads the rows the launch before it wrote
            cute.arch.griddepcontrol_wait()
        body = base + self.r["body"]
        nsplit = t.ws_o.shape[2]
        i = Int32(0)     # the ring's next stage
        seq = Int32(0)   # projection tasks handed on so far
        staged = Int32(-1)
        for j in cutlass.range(starts[cta, layer], starts[cta, layer + 1], unroll=1):
            kind = table[cta, j, F["kind"]]
            a0 = table[cta, j, F["a0"]]
            nb = a0 // 16
            _stamp(trace, cta, j, TRACE["start"], tidx)
            is_proj = _is_projection(kind)
            if not is_proj:
                loop.cta_sync(CONSUMERS)   # every warp done reading the staged rows before attention's scratch
            early_wait = None   # (the early_tiles variant: a partial waits once its first tiles are requested)
            if cutlass.const_expr(self.early_tiles):
                wait0, target0 = table[cta, j, F["wait0"]], table[cta, j, F["target0"]]
                early_wait = _PartialWait(counters, wait0, target0, tidx, trace, cta, j)
                if (staged != kind) & (kind != ATTN["attn_partial"]):
                    loop.wait(counters, wait0, target0, tidx, CONSUMERS)
            else:
                if staged != kind:
                    loop.wait(counters, table[cta, j, F["wait0"]], table[cta, j, F["target0"]], tidx, CONSUMERS)
            _stamp(trace, cta, j, TRACE["ready"], tidx)
            again = staged == kind
            if kind == ATTN["attn_partial"]:   # (row, KV head, split)
                self.att.partial(t, scale_log2, table[cta, j, F["a2"]], table[cta, j, F["a1"]], a0, nsplit, body,
                                 tidx, False, early_wait)
            elif kind == ATTN["attn_combine"]:   # (row, KV head)
                self.att.combine(t, table[cta, j, F["a1"]], a0, nsplit, tidx)
            elif kind == PROJ["qkv"]:
                i, seq = self.qkv.task(h, None, qkv, eps, nb, base, bars, i, tidx, again, seq)
            elif kind == PROJ["o"]:
                i, seq = self.o.task(attn, h, hmid, eps, nb, base, bars, i, tidx, again, seq)
            elif kind == PROJ["gate_up"]:
                i, seq = self.gate_up.task(hmid, None, act, eps, nb, base, bars, i, tidx, again, seq)
            elif kind == PROJ["down"]:
                i, seq = self.down.task(act, hmid, h, eps, nb, base, bars, i, tidx, again, seq)
            if not is_proj:
                loop.cta_sync(CONSUMERS)   # attention's writes and scratch reads done by every consumer
                _stamp(trace, cta, j, TRACE["end"], tidx)
                loop.signal(counters, table[cta, j, F["signal0"]], tidx)
                loop.signal(counters, table[cta, j, F["signal1"]], tidx)
            staged = cutlass.select_(is_proj, kind, Int32(-1))

    @cute.jit
    def _epilogues(self, table, starts, layer, cta, lane, counters, h, qkv, attn, hmid, act, eps, base, bars, trace):
        """The epilogue warp: each projection task of the CTA's list in order, finished from its partials; one
        release-add per run of tasks signalling the same counters (as the routed loop holds them)."""
        seq = Int32(0)
        pending = Int32(0)
        end = starts[cta, layer + 1]
        for j in cutlass.range(starts[cta, layer], end, unroll=1):
            kind = table[cta, j, F["kind"]]
            if _is_projection(kind):
                nb = table[cta, j, F["a0"]] // 16
                if kind == PROJ["qkv"]:
                    self.qkv.finish(h, None, qkv, eps, nb, base, bars, seq, lane)
                elif kind == PROJ["o"]:
                    self.o.finish(attn, h, hmid, eps, nb, base, bars, seq, lane)
                elif kind == PROJ["gate_up"]:
                    self.gate_up.finish(hmid, None, act, eps, nb, base, bars, seq, lane)
                else:
                    self.down.finish(act, hmid, h, eps, nb, base, bars, seq, lane)
                seq = seq + 1
                cute.arch.sync_warp()   # every lane's stores done before lane 0 releases them
                _stamp(trace, cta, j, TRACE["end"], lane)
                pending = pending + 1
                sig0, sig1 = table[cta, j, F["signal0"]], table[cta, j, F["signal1"]]
                # (row `end` exists: the next layer's, or END)
                same = ((j + 1 < end) & _is_projection(table[cta, j + 1, F["kind"]])
                        & (table[cta, j + 1, F["signal0"]] == sig0) & (table[cta, j + 1, F["signal1"]] == sig1))
                if not same:
                    loop.signal(counters, sig0, lane, pending)
                    loop.signal(counters, sig1, lane, pending)
                    pending = Int32(0)


def compile_target(cache: str = "int4", head_dim: int = 128, stages: int = 0, trace: bool = False, tokens: int = 1,
                   lookahead: bool = False, epilogue_warp: bool = False, group: int = 1, no_math: bool = False,
                   early_tiles: bool = False):
    """Registry factory (futx/runtime/catalog/persistent.py, `decode.persistent.ring.*`): (jit callable, fake
    arguments) of the ring layer for one cache format and head dim, one row (`tokens` = 1) or 1..8 (`tokens` = 8: the
    multi-token MMA columns, rows as the shared memory fits); the arguments are the persistent layer's, with `trace`
    the task trace int64 [CTAs, table rows, len(TRACE_FIELDS)] instead of None; `stages`, `lookahead`, `group` and
    `epilogue_warp`, `early_tiles`: the tuning space's variants (scripts/tuning_space.py); `no_math`: its diagnostic
    one."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    from decode import persistent_layer

    _, args = persistent_layer.compile_target(cache, head_dim, tokens=tokens)
    if trace:
        c, r = cute.sym_int(), cute.sym_int()
        buf = make_fake_compact_tensor(Int64, (c, r, len(TRACE_FIELDS)), stride_order=(2, 1, 0), assumed_align=8)
        args = (*args[:-2], buf, args[-1])
    return RingLayer(layer_plan(cache, head_dim), stages, trace, tokens, lookahead, epilogue_warp, group,
                     no_math, early_tiles), args
