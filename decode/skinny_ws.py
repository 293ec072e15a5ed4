"""The INT4 decode projection for 9..64 rows as a warp-specialized mixed-input warpgroup GEMM (the Machete pattern):
y[M, N] = x[M, K] @ W[N, K]^T, INT4 group-128 weights in the packed fragment order (futx.quant.layouts).

CTA anatomy (288 threads, one CTA per SM):

  warp 8        producer: one thread streams the CTA's units (128 k each) into a `stages`-deep shared-memory
                ring, every stage tracked by a *full* mbarrier (transaction bytes) and an *empty* one (one arrive
                per consumer warp): the 8 n-blocks' packed weights (8 x 1 KB bulk copies, contiguous in the packed
                order) and group scales (8 x 32 B), and the unit's activation tile [tokens x 128 k] by TMA in the
                128-byte swizzle (rows past M arrive as zeros). The weights of the first ring are requested before
                the PDL wait: they never depend on the previous kernel.
  warps 0-7     consumers, two warpgroups of 64 output channels (warp w: n-block w, 16 channels). Per unit a lane
                reads its 32 bytes of packed weights (two 16-byte shared loads) and two scales, expands them in
                registers into the unit's 8 k16 A operands (exactly the other decode kernels' arithmetic: q - 8,
                exact in bf16) and issues 8 `wgmma` m64nTk16 (T = the token bucket, A from registers, B = the
                activation tile through a matrix descriptor) into a float32 partial, committed as one group.

Scales after accumulation, one unit behind: the partials alternate between two register sets, so unit u's MMAs
run while unit u + 1 is expanded and issued; only then (`wgmma.wait_group 1`) is unit u's partial folded into
the accumulator (acc += scale * partial) and its stage released. Nothing waits for the tensor cores inside a unit
and no CTA barrier runs in the loop: the consumers meet the producer only through the mbarriers. The outputs are
the other kernels' up to float32 summation order. The epilogues and the split-K exchange are the skinny
kernel's (decode/skinny.py), run by the 256 consumer threads.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

from futx.hardware import SMEM_PER_CTA
from futx.quant import layouts

from . import ptx, split_arrival, stream_k
from .dequant import BLOCK_K, BLOCK_N, LANE_BYTES
from .skinny import TOKENS, Skinny

WARP = layouts.WARP
CONSUMER_WARPS = 8                  # two warpgroups x 4 warps x one 16-channel n-block: the 128-channel tile
PRODUCER_WARP = CONSUMER_WARPS      # after the warpgroups (wgmma needs warpgroup-aligned warps)
# one producer warp, not a warpgroup (it needs one thread). Registers: 9 warps put 3 on some SM sub-partition, so ptxas
# allocates at most 168 per thread (as for 384 threads; setmaxnreg does not raise what it allocates against); the
# 64-token bucket fits in them by issuing a unit in two halves (`halves`), else ptxas serializes every wgmma
THREADS = WARP * (CONSUMER_WARPS + 1)
UNIT_K = 128                        # one group: the unit of the ring
UNIT_BYTES = BLOCK_N * UNIT_K // 2  # an n-block's packed weights of one unit (contiguous in the packed order)
UNIT_SCALE_BYTES = BLOCK_N * 2      # its 16 float16 scales (contiguous)
SWIZZLE_ROW = 128                   # bytes of one activation row in a 128-byte swizzle atom (64 bf16 of k)
SWIZZLE_ATOM = 8 * SWIZZLE_ROW      # 8 rows: the stride between 8-token groups (the descriptor's SBO)
K_STEPS = UNIT_K // layouts.MMA_K   # wgmma k16 steps per unit
MAX_STAGES = 12
SMEM_RESERVE = 2048                 # mbarriers, the split-K flag, alignment
SCHEDULES = ("grid", "stream")      # tiles x split CTAs, or persistent stream-K (the split = CTAs)


class SkinnyWs(Skinny):
    """`m_tiles` 8-token groups (the wgmma N = 8 * m_tiles); `stages`: ring depth (0: as many as fit, at most
    MAX_STAGES); `halves`: issue a unit's MMAs as two groups (None: for the 64-token bucket, see `_unit`);
    `weights_tma`: the producer loads a stage's weights and scales with one 2D TMA copy each (the tile's 8 n-block rows
    of the packed weights / scales seen as [N/16, K/64 * 128] int32 / [N/16, K/G * 16] float16), instead of 8 + 8 bulk
    copies."""

    def __init__(self, group_size: int = 128, epilogue: str = "store", m_tiles: int = 4, stages: int = 0,
                 halves: Optional[bool] = None, schedule: str = "grid", weights_tma: bool = False):
        if group_size != UNIT_K:
            raise ValueError(f"the warp-specialized skinny kernel serves INT4 group {UNIT_K}, got {group_size}")
        self.weights_tma = weights_tma   # one 2D TMA copy per stage for the weights, one for the scales
        self.halves = m_tiles == 8 if halves is None else halves   # a unit's MMAs as two groups (see _unit)
        self._setup("int4", group_size, epilogue, m_tiles, stages, schedule, CONSUMER_WARPS * UNIT_BYTES,
                    CONSUMER_WARPS * UNIT_SCALE_BYTES)
        assert self.unit_k == UNIT_K and self.bpu * BLOCK_K == UNIT_K

    def _setup(self, fmt: str, group_size: int, epilogue: str, m_tiles: int, stages: int, schedule: str,
               wt_bytes: int, sc_bytes: int):
        """What every weight format's kernel shares: the skinny base (format, epilogue, token groups), the schedule and
        the ring: a stage holds one unit (`self.unit_k` of k) of activations [tokens x unit_k] in 64-k halves of the
        128-byte swizzle, `wt_bytes` of the tile's weights and `sc_bytes` of its scales."""
        Skinny.__init__(self, fmt, group_size, epilogue, m_tiles, 3, warps=CONSUMER_WARPS, nb_per_warp=1)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.stream_k = schedule == "stream"
        self.tokens = m_tiles * TOKENS
        self.xs_bytes = self.tokens * self.unit_k * 2       # a unit's activation tile (swizzled 64-k halves)
        self.half_bytes = self.tokens * SWIZZLE_ROW         # one 64-k half: tokens rows of 128 bytes
        self.wt_bytes = wt_bytes
        self.sc_bytes = sc_bytes
        self.stage_bytes = self.xs_bytes + self.wt_bytes + self.sc_bytes
        self.stages = stages or min(MAX_STAGES, (SMEM_PER_CTA - SMEM_RESERVE) // self.stage_bytes)
        if not 2 <= self.stages <= MAX_STAGES or self.stages * self.stage_bytes + SMEM_RESERVE > SMEM_PER_CTA:
            raise ValueError(f"{self.stages} stages of {self.stage_bytes} bytes do not fit the shared memory")

    # ---- host side ---------------------------------------------------------------------------
    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, s: Optional[cute.Tensor], r: Optional[cute.Tensor],
                 y: cute.Tensor, ws: cute.Tensor, counters: cute.Tensor, split: Int32, stream_):
        n = self.epi.weight_rows(y.shape[1])
        n_tiles = (n + self.tile_n - 1) // self.tile_n
        # the activation ring: (tokens, unit k, stages), K-major in 128-byte swizzle atoms stacked along tokens first
        x_staged = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, self.tokens, self.unit_k), BFloat16,
                                                 self.stages)
        x_one = cute.slice_(x_staged, (None, None, 0))
        tma_x, g_x = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), x, x_one,
                                                 (self.tokens, self.unit_k))
        tmas = self._weight_atoms(w, s)
        w_elem = self.w_smem_type

        @cute.struct
        class Storage:
            sx: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(x_staged)], 1024]
            sw: cute.struct.Align[cute.struct.MemRange[w_elem, self.stages * self.wt_bytes * 8 // w_elem.width], 1024]
            ss: cute.struct.Align[cute.struct.MemRange[cutlass.Float16, max(8, self.stages * self.sc_bytes // 2)], 128]
            bars: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            flag: cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]

        self.storage = Storage
        grid = (split, 1, 1) if cutlass.const_expr(self.stream_k) else (n_tiles, split, 1)
        self.kernel(tma_x, g_x, x_staged, x, w, s, r, y, ws, counters, split, tmas).launch(
            grid=grid, block=(THREADS, 1, 1), smem=Storage.size_in_bytes(), stream=stream_,
            use_pdl=True)

    w_smem_type = Int32   # the element type of the weights' ring (its size in bytes is what counts)

    def _weight_atoms(self, w, s) -> tuple:
        """The TMA atoms of the weights (host side, passed to the kernel as `tmas`): with `weights_tma` (weights atom,
        its global tensor, scales atom, its global tensor), else none (bulk copies)."""
        if not self.weights_tma:
            return ()
        row = w.shape[1] * (WARP * 4)   # int32 of one n-block's packed row
        w2 = cute.make_tensor(w.iterator, cute.make_layout((w.shape[0], row), stride=(row, 1)))
        tma_w, g_w = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), w2, self._w_tile(),
                                                 (CONSUMER_WARPS, UNIT_BYTES // 4))
        srow = s.shape[1] * BLOCK_N
        s2 = cute.make_tensor(s.iterator, cute.make_layout((s.shape[0], srow), stride=(srow, 1)))
        tma_s, g_s = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), s2, self._s_tile(),
                                                 (CONSUMER_WARPS, BLOCK_N))
        return (tma_w, g_w, tma_s, g_s)

    def _w_tile(self):
        """A stage's weights: 8 n-block rows of one unit (256 int32 each), row after row."""
        return cute.make_layout((CONSUMER_WARPS, UNIT_BYTES // 4), stride=(UNIT_BYTES // 4, 1))

    def _s_tile(self):
        """A stage's scales: 8 n-block rows of 16 float16."""
        return cute.make_layout((CONSUMER_WARPS, BLOCK_N), stride=(BLOCK_N, 1))

    # ---- device side -------------------------------------------------------------------------
    def _cta_sync(self):
        """The split-K exchange's barrier: the 256 consumer threads (the producer warp has left)."""
        ptx.bar_sync(ptx.Barrier.WS_CONSUMERS, CONSUMER_WARPS * WARP)

    def _split_flag(self, flag):
        return flag

    @cute.kernel
    def kernel(self, tma_x: cute.CopyAtom, g_x: cute.Tensor, x_staged: cute.ComposedLayout, x: cute.Tensor,
               w: cute.Tensor, s: cute.Tensor, r: Optional[cute.Tensor], y: cute.Tensor, ws: cute.Tensor,
               counters: cute.Tensor, split: Int32, tmas: tuple):
        tid, _, _ = cute.arch.thread_idx()
        bx, sy, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tid % WARP
        m = x.shape[0]
        k = x.shape[1]
        n = self.epi.weight_rows(y.shape[1])
        n_blocks = n // BLOCK_N
        n_units = k // self.unit_k
        # this CTA's work: the (tile, unit) pairs [w0, w1) in tile-major order (pair w: tile w // n_units, unit
        # w % n_units); the grid schedule's tile bx and its split sy, or stream-K's even share of all pairs
        w0, w1 = self._share(bx, sy, split, n_blocks, n_units)
        if warp == PRODUCER_WARP:
            cpasync.prefetch_descriptor(tma_x)
            for atom in self._weight_atoms_of(tmas):
                cpasync.prefetch_descriptor(atom)

        storage = utils.SmemAllocator().allocate(self.storage)
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bars.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_WARPS),  # lane 0 of each warp
            tx_count=self.stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
        xs0 = ptx.smem_addr(storage.sx.data_ptr())
        ws0 = ptx.smem_addr(storage.sw.data_ptr())
        ss0 = ptx.smem_addr(storage.ss.data_ptr())

        if warp == PRODUCER_WARP:
            sx = storage.sx.get_tensor(x_staged.outer, swizzle=x_staged.inner)
            wt = self._weight_ring(storage, tmas)
            self._produce(ring, tma_x, g_x, sx, w, s, k, n_blocks, n_units, w0, w1, ws0, ss0, wt)
        else:
            cw = warp
            consts = self.fmt.consts()
            xs0_lo = ptx.gmma_desc_lo(xs0, LANE_BYTES)   # the activation ring's descriptor word (LBO unused: swizzled)
            flag = ptx.smem_addr(storage.flag.data_ptr())
            cute.arch.griddepcontrol_wait()   # r, y and the split-K workspace belong to the previous kernel until then
            if cutlass.const_expr(self.stream_k):
                t0 = w0 // n_units
                t1 = (w1 - 1) // n_units
                done = Int32(0)
                for t in cutlass.range(t0, t1 + 1, unroll=1):   # one segment per tile the share touches
                    a = cutlass.max(w0, t * n_units)
                    b = cutlass.min(w1, (t + 1) * n_units)
                    acc = self._consume(ring, xs0_lo, ws0, ss0, cw, lane, consts, done, b - a)
                    done = done + (b - a)
                    if t == t1:
                        cute.arch.griddepcontrol_launch_dependents()
                    nb0 = t * CONSUMER_WARPS + cw
                    if (b - a) == n_units:
                        self._epilogue(self._frags(acc), nb0, lane, n_blocks, m, s, r, y)
                    else:
                        self._stream_exchange(acc, t, bx, split, n_blocks, n_units, nb0, cw, lane, tid, m, s, r, y,
                                              ws, counters, flag)
            else:
                acc = self._consume(ring, xs0_lo, ws0, ss0, cw, lane, consts, Int32(0), w1 - w0)
                cute.arch.griddepcontrol_launch_dependents()
                nb0 = bx * CONSUMER_WARPS + cw
                if split == 1:
                    self._epilogue(self._frags(acc), nb0, lane, n_blocks, m, s, r, y)
                else:
                    self._split_k(self._frags(acc), nb0, lane, n_blocks, m, n, s, r, y, ws, counters, split, bx, sy,
                                  tid, flag)

    @cute.jit
    def _stream_exchange(self, acc, t, c, ctas, n_blocks, n_units, nb0, cw, lane, tid, m, s, r, y, ws, counters,
                         flag):
        """Stream-K: CTA c holds part of tile t. It writes its partial to its workspace slot (0: t is the first tile of
        its share, 1: the last; a tile split between CTAs is the last of one share and the first of the next, and
        only those are partial) and counts itself on the tile's counter; the last of the tile's CTAs to arrive sums
        every CTA's partial in CTA order, so the result does not depend on who finishes last, and runs the epilogue.
        Workspace: float32 [CTA][2][8 warps][token groups][32 lanes][4]; each warp instruction writes 512 bytes. The
        share arithmetic is decode/stream_k.py's."""
        pairs = (n_blocks + CONSUMER_WARPS - 1) // CONSUMER_WARPS * n_units
        frag = WARP * 16   # bytes of one (warp, token group) fragment set
        ws_base = ws.iterator.toint()
        mine = self._slot_addr(ws_base, c, t, pairs, ctas, n_units, cw, lane)
        for mt in cutlass.range_constexpr(self.m_tiles):
            ptx.stg_cg_f32x4(mine + mt * frag, acc[4 * mt], acc[4 * mt + 1], acc[4 * mt + 2], acc[4 * mt + 3])
        cute.arch.fence_acq_rel_gpu()
        self._cta_sync()
        first, last = stream_k.tile_ctas(t, n_units, ctas, pairs)   # the CTAs whose shares meet tile t
        if tid == 0:
            ptx.sts_f32(flag, Float32(split_arrival.arrive(counters.iterator + t, last - first + 1)))
        self._cta_sync()
        if ptx.lds_f32(flag) != Float32(0.0):
            cute.arch.fence_acq_rel_gpu()
            total = (Float32(0.0),) * (self.tokens // 2)
            for cta in cutlass.range(first, last + 1, unroll=1):
                src = self._slot_addr(ws_base, cta, t, pairs, ctas, n_units, cw, lane)
                parts = []
                for mt in cutlass.range_constexpr(self.m_tiles):
                    parts += list(ptx.ldg_cg_f32x4(src + mt * frag))
                total = tuple(a + b for a, b in zip(total, parts))
            self._epilogue(self._frags(total), nb0, lane, n_blocks, m, s, r, y)

    def _slot_addr(self, ws_base, cta, tile, pairs, ctas, n_units, cw, lane):
        """This lane's first fragment of CTA `cta`'s partial of `tile` in the stream-K workspace."""
        slot = cutlass.select_(tile == stream_k.first_tile(cta, n_units, ctas, pairs), Int32(0), Int32(1))
        return ws_base + (Int64(cta * 2 + slot) * CONSUMER_WARPS + cw) * (self.m_tiles * WARP * 16) + lane * 16

    def _frags(self, acc):
        """The accumulators as the skinny epilogue's [n-block][token group] fragments (one n-block per warp)."""
        return [[tuple(acc[4 * mt:4 * mt + 4]) for mt in range(self.m_tiles)]]

    def _share(self, bx, sy, split, n_blocks, n_units):
        """[w0, w1): the (tile, unit) pairs of CTA (bx, sy)."""
        if cutlass.const_expr(self.stream_k):
            pairs = (n_blocks + CONSUMER_WARPS - 1) // CONSUMER_WARPS * n_units
            return stream_k.start(bx, split, pairs), stream_k.start(bx + 1, split, pairs)
        base = bx * n_units
        return base + sy * n_units // split, base + (sy + 1) * n_units // split

    def _state(self, i, producer: bool = False):
        """The ring slot of the CTA's i-th unit: stage i % stages, in phase (i // stages) % 2 (the producer's phase
        flipped: it starts on empty slots)."""
        phase = (i // self.stages) % 2
        return pipeline.PipelineState(self.stages, Int32(i), Int32(i % self.stages),
                                      Int32(1 - phase if producer else phase))

    # ---- producer ----------------------------------------------------------------------------
    def _weight_atoms_of(self, tmas) -> tuple:
        """The TMA atoms among `tmas` (their descriptors are prefetched)."""
        return (tmas[0], tmas[2]) if self.weights_tma else ()

    def _weight_ring(self, storage, tmas):
        """What `_copy_weights` needs of the ring (with `weights_tma`: `_weight_tmas` over the ring's tensors)."""
        if not self.weights_tma:
            return None
        sw = storage.sw.get_tensor(cute.make_layout((self._w_tile().shape, self.stages),
                                                    stride=(self._w_tile().stride, self.wt_bytes // 4)))
        ss = storage.ss.get_tensor(cute.make_layout((self._s_tile().shape, self.stages),
                                                    stride=(self._s_tile().stride, self.sc_bytes // 2)))
        return self._weight_tmas(tmas, sw, ss)

    def _weight_tmas(self, tmas, sw, ss):
        """(weights atom, its (8 n-blocks, unit) tiles of global, of the ring; the same for the scales)."""
        tma_w, g_w, tma_s, g_s = tmas
        gw = cute.local_tile(g_w, (CONSUMER_WARPS, UNIT_BYTES // 4), (None, None))   # (8, 256, tiles, units)
        gs = cute.local_tile(g_s, (CONSUMER_WARPS, BLOCK_N), (None, None))           # (8, 16, tiles, units)
        tws, twg = cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sw, 0, 1),
                                         cute.group_modes(gw, 0, 2))
        tss, tsg = cpasync.tma_partition(tma_s, 0, cute.make_layout(1), cute.group_modes(ss, 0, 1),
                                         cute.group_modes(gs, 0, 2))
        return tma_w, twg, tws, tma_s, tsg, tss

    @cute.jit
    def _produce(self, ring, tma_x, g_x, sx, w, s, k, n_blocks, n_units, w0, w1, ws0, ss0, wt):
        """One warp (TMA issue and the barrier arrives elect their thread): pairs [w0, w1) into the ring."""
        g_units = cute.local_tile(g_x, (self.tokens, self.unit_k), (None, None))   # (tokens, unit k, 1, units)
        t_s, t_g = cpasync.tma_partition(tma_x, 0, cute.make_layout(1), cute.group_modes(sx, 0, 2),
                                         cute.group_modes(g_units, 0, 2))
        w_base = w.iterator.toint()
        s_base = s.iterator.toint()
        k_blocks = k // BLOCK_K
        first = cutlass.min(w1 - w0, self.stages)
        for i in cutlass.range(first, unroll=1):   # the first ring's weights, before the PDL wait
            st = self._state(i, producer=True)
            ring.producer_acquire(st)
            self._copy_weights(ring, st, w0 + i, w_base, s_base, k_blocks, n_units, n_blocks, ws0, ss0, wt)
        cute.arch.griddepcontrol_wait()
        for i in cutlass.range(first, unroll=1):   # ... and their activations, which may be the previous kernel's
            st = self._state(i, producer=True)
            cute.copy(tma_x, t_g[(None, 0, (w0 + i) % n_units)], t_s[(None, st.index)],
                      tma_bar_ptr=ring.producer_get_barrier(st))
        for i in cutlass.range(first, w1 - w0, unroll=1):
            st = self._state(i, producer=True)
            ring.producer_acquire(st)
            self._copy_weights(ring, st, w0 + i, w_base, s_base, k_blocks, n_units, n_blocks, ws0, ss0, wt)
            cute.copy(tma_x, t_g[(None, 0, (w0 + i) % n_units)], t_s[(None, st.index)],
                      tma_bar_ptr=ring.producer_get_barrier(st))

    @cute.jit
    def _copy_weights(self, ring, state, pair, w_base, s_base, k_blocks, n_units, n_blocks, ws0, ss0, wt):
        """The packed weights and scales of pair `pair` (its tile's 8 n-blocks, its unit) into the stage (n-blocks past
        N repeat the last one, or with `weights_tma` arrive as zeros: their outputs are never stored)."""
        tile = pair // n_units
        u = pair % n_units
        if cutlass.const_expr(self.weights_tma):
            tma_w, twg, tws, tma_s, tsg, tss = wt
            cute.copy(tma_w, twg[(None, tile, u)], tws[(None, state.index)],
                      tma_bar_ptr=ring.producer_get_barrier(state))
            cute.copy(tma_s, tsg[(None, tile, u)], tss[(None, state.index)],
                      tma_bar_ptr=ring.producer_get_barrier(state))
            return
        bar = ptx.smem_addr(ring.producer_get_barrier(state))
        w_dst = ws0 + state.index * self.wt_bytes
        s_dst = ss0 + state.index * self.sc_bytes
        with cute.arch.elect_one():
            for i in cutlass.range_constexpr(CONSUMER_WARPS):
                nb = Int64(cutlass.min(tile * CONSUMER_WARPS + i, n_blocks - 1))
                src = w_base + (nb * k_blocks + u * self.bpu) * layouts.INT4_WEIGHT.block_bytes
                ptx.cp_async_bulk_g2s(w_dst + i * UNIT_BYTES, src, UNIT_BYTES, bar)
                ptx.cp_async_bulk_g2s(s_dst + i * UNIT_SCALE_BYTES, s_base + (nb * n_units + u) * UNIT_SCALE_BYTES,
                                      UNIT_SCALE_BYTES, bar)

    # ---- consumers ---------------------------------------------------------------------------
    @cute.jit
    def _consume(self, ring, xs0_lo, ws0, ss0, cw, lane, consts, i0, count):
        """The CTA's units i0 .. i0 + count - 1 (count >= 1) for this warp's n-block; returns its accumulators (the
        m64nT C fragment of its 16 rows) with every unit's stage released."""
        zero = (Float32(0.0),) * (self.tokens // 2)
        no_scales = (Float32(0.0), Float32(0.0))
        acc = zero
        p0, s0, acc, p1 = self._unit(ring, i0, zero, acc, zero, no_scales, xs0_lo, ws0, ss0, cw, lane, consts, False)
        s1 = no_scales
        rest = count - 1
        for j in cutlass.range(rest // 2, unroll=1):   # two units per trip: the partials keep their registers
            i = i0 + 1 + 2 * j
            p1, s1, acc, p0 = self._unit(ring, i, p1, acc, p0, s0, xs0_lo, ws0, ss0, cw, lane, consts, True)
            p0, s0, acc, p1 = self._unit(ring, i + 1, p0, acc, p1, s1, xs0_lo, ws0, ss0, cw, lane, consts, True)
        last = i0 + count - 1
        if rest % 2 == 1:
            p1, s1, acc, p0 = self._unit(ring, last, p1, acc, p0, s0, xs0_lo, ws0, ss0, cw, lane, consts, True)
            acc, p1 = self._fold(acc, p1, s1, 0)
        else:
            acc, p0 = self._fold(acc, p0, s0, 0)
        ring.consumer_release(self._state(last))   # the last unit's stage (stream-K: the next segment streams on)
        return acc

    @cute.jit
    def _unit(self, ring, i, part, acc, prev, prev_scales, xs0_lo, ws0, ss0, cw, lane, consts, fold_prev: bool):
        """Wait for the CTA's i-th unit, expand this lane's weights and issue the unit's k16 steps into `part`
        (the first with scale-d 0); once the previous unit's MMAs have completed, fold its partial `prev` into `acc`
        and release its stage (`fold_prev`). Returns (part, this unit's scales of rows g and g + 8, acc, prev's
        registers for the unit after next).

        At most one unit's worth of k16 steps stays in flight across the fold. With `halves` (the 64-token bucket)
        the unit is issued as two groups of 4 steps, and the first half's MMAs are waited for before the second half
        is expanded, so only half a unit of A operands is live beside the in-flight half: 32 instead of 64
        registers, which keeps the 64-token kernel within the 168 registers ptxas allocates for 9 warps per CTA
        (without it ptxas serializes every wgmma there)."""
        ring.consumer_wait(self._state(i))
        stage = i % self.stages
        wl = ws0 + stage * self.wt_bytes + cw * UNIT_BYTES + lane * LANE_BYTES
        words = ptx.lds_v4(wl) + ptx.lds_v4(wl + layouts.INT4_WEIGHT.block_bytes)
        sl = ss0 + stage * self.sc_bytes + cw * UNIT_SCALE_BYTES
        g = lane // 4
        scales = (ptx.lds_f16_to_f32(sl + g * 2), ptx.lds_f16_to_f32(sl + (g + layouts.MMA_N) * 2))
        xs_lo = xs0_lo + stage * (self.xs_bytes >> 4)   # the stage's descriptor word (start address >> 4)
        if cutlass.const_expr(self.halves):
            part = self._mma(part, words[0:4], consts, xs_lo, 0)
            if cutlass.const_expr(fold_prev):
                acc, prev = self._fold(acc, prev, prev_scales, 1)
                ring.consumer_release(self._state(i - 1))
            part = self._mma(part, words[4:8], consts, xs_lo, 1)
            ptx.wgmma_wait(1)   # the first half's A registers are free for the next unit
        else:
            part = self._mma(part, words, consts, xs_lo, 0)
            if cutlass.const_expr(fold_prev):
                acc, prev = self._fold(acc, prev, prev_scales, 1)
                ring.consumer_release(self._state(i - 1))
        return part, scales, acc, prev

    @cute.jit
    def _mma(self, part, words, consts, xs_lo, first_step: int):
        """Expand `words` (one k16 step each, from `first_step` * 4 on) and issue their k16 steps into `part` as one
        committed group (step 0 of the unit with scale-d 0). `xs_lo`: the stage's descriptor word; a step's start is
        a constant offset from it (one add, no address math per MMA)."""
        a_ops = self.fmt.a_operands(words, consts)
        ptx.wgmma_fence()
        for i in cutlass.range_constexpr(len(words)):
            st = first_step * len(words) + i
            half, j = divmod(st, K_STEPS // 2)
            step = (half * self.half_bytes + j * (layouts.MMA_K * 2)) >> 4
            desc = ptx.gmma_desc_from_lo(xs_lo + step, SWIZZLE_ATOM, ptx.GMMA_SWIZZLE_128B)
            part = ptx.wgmma_bf16_rs(part, a_ops[i], desc, Int32(1 if st else 0))
        ptx.wgmma_commit()
        return part

    @cute.jit
    def _fold(self, acc, part, scales, pending: int):
        """Once at most `pending` groups are in flight (the partial's unit has completed): acc += scale * partial.
        Returns (acc, the partial's registers, reusable by the next unit's MMAs)."""
        ptx.wgmma_wait(pending)
        part = tuple(ptx.reg_fence(v) for v in part)
        acc = tuple(a + (scales[0] if e % 4 < 2 else scales[1]) * p for e, (a, p) in enumerate(zip(acc, part)))
        return acc, part


def make_target(group_size: int = 128, epilogue: str = "store", m_tiles: int = 4, stages: int = 0,
                   halves: Optional[bool] = None, schedule: str = "grid", weights_tma: bool = False):
    """The kernel and its fake arguments: decode.skinny_dispatch.compile_target (the registry factory) delegates
    here for mma="ws"."""
    from .signature import fake_args, fake_split_args

    op = SkinnyWs(group_size, epilogue, m_tiles, stages, halves, schedule, weights_tma)
    x, w, s, r, y, stream_ = fake_args("int4", epilogue)
    return op, (x, w, s, r, y, *fake_split_args(), Int32(1), stream_)
