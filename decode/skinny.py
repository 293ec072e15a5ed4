"""Decode projection for up to M = 64 rows (used where the GEMV's resident activations do not fit):
y[M, N] = x[M, K] @ W[N, K]^T.

A CTA of `WARPS` warps owns `WARPS * NB_PER_WARP` 16-channel n-blocks (decode.plan.TILE_N) and one K
range (split-K across CTAs along grid y when the n-tiles alone cannot fill the SMs). All its warps walk
the same units in lock step through a multi-stage cp.async ring in shared memory, one stage per unit: the
activation rows (rows = tokens, padded to the 8-token groups of the MMA), each warp's packed weights and
group scales. Weights expand in registers into the A operands of `mma.sync` (`dequant.py`). Each warp keeps one float32 accumulator per
(n-block, 8-token group). With split-K, every CTA writes its partial tile to a float32 workspace; the
last CTA of a tile (a self-resetting arrival counter) sums the partials in split order, so results are
deterministic, and runs the fused epilogue.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from . import epilogue as epi
from . import ptx, split_arrival, stream
from .dequant import BLOCK_K, BLOCK_N, LANE_BYTES, make_format
from .plan import SKINNY_NB_PER_WARP as NB_PER_WARP
from .plan import SKINNY_WARPS as WARPS
from futx.quant import layouts

WARP = layouts.WARP
TOKENS = layouts.MMA_N        # tokens per MMA (the B operand's n)
ROW_PAD = 16                  # bytes: staggers activation rows across shared-memory banks
REDUCES = ("global", "cluster")   # split-K: through a float32 workspace and arrival counters, or a thread-block
                                  # cluster per tile reducing through distributed shared memory


class Skinny:
    launch_hints: dict = {}   # extra launch attributes (occupancy) of a subclass

    def __init__(self, fmt: str, group_size: int = 128, epilogue: str = "store", m_tiles: int = 4,
                 stages: int = 0, warps: int = WARPS, nb_per_warp: int = NB_PER_WARP, chains: int = 0,
                 reduce: str = "global"):
        if reduce not in REDUCES:
            raise ValueError(f"reduce must be one of {REDUCES}, got {reduce!r}")
        self.cluster = reduce == "cluster"
        self.fmt = make_format(fmt, group_size)
        self.chains = chains  # MMA accumulation chains per token group (stream.mma_unit; 0: its default)
        self.epi = epi.make(epilogue)
        self.m_tiles, self.warps, self.nbw = m_tiles, warps, nb_per_warp
        self.bpu, self.unit_k = stream.units_of(self.fmt)
        self.lanes_bytes = self.fmt.loads_per_block * self.bpu * layouts.WARP * LANE_BYTES  # per n-block/unit
        self.row_bytes = self.unit_k * 2 + ROW_PAD
        self.x_bytes = self.x_tile_bytes()
        self.w_bytes = warps * nb_per_warp * self.lanes_bytes
        self.s_bytes = warps * nb_per_warp * 2 * BLOCK_N if self.fmt.grouped else 0
        self.stage_bytes = self.x_bytes + self.w_bytes + self.s_bytes
        # ~100 KB of stages per CTA, two CTAs per SM: (stages - 1) units of weights in flight per CTA
        # (>= 33 KB per SM covers 4.4 TB/s x ~1 us)
        self.stages = stages or max(3, min(8, 100 * 1024 // self.stage_bytes))
        self.tile_n = warps * nb_per_warp * BLOCK_N
        self.reduce_batch = 2 if m_tiles == 4 else 4  # split-K partials loaded together (registers)

    def x_tile_bytes(self) -> int:
        """Bytes of one unit's activation tile in a ring slot."""
        return self.m_tiles * TOKENS * self.row_bytes

    def partial_bytes(self) -> int:
        """The CTA's float32 accumulator fragments (cluster split-K), [warp][n-block][token group][lane][4]."""
        return self.warps * self.nbw * self.m_tiles * WARP * 16

    def smem_bytes(self) -> int:
        # + the split-K "last CTA" flag; the cluster split-K's partials reuse the ring
        return max(self.stages * self.stage_bytes + 16, self.partial_bytes() if self.cluster else 0)

    # ---- host side ---------------------------------------------------------------------------
    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, s: Optional[cute.Tensor], r: Optional[cute.Tensor],
                 y: cute.Tensor, ws: cute.Tensor, counters: cute.Tensor, split: Int32, stream_):
        n = self.epi.weight_rows(y.shape[1])
        n_tiles = (n + self.tile_n - 1) // self.tile_n
        hints = dict(self.launch_hints)
        if cutlass.const_expr(self.cluster):
            hints["cluster"] = (1, split, 1)   # a tile's K ranges: one cluster (split <= CLUSTER_MAX)
        self.kernel(x, w, s, r, y, ws, counters, split).launch(
            grid=(n_tiles, split, 1), block=(WARP * self.warps, 1, 1), smem=self.smem_bytes(), stream=stream_,
            use_pdl=True, **hints)

    # ---- device side -------------------------------------------------------------------------
    def _x_chunk(self, row, ch):
        """Byte offset in a slot of 16-byte chunk `ch` of token row `row` (padded rows for ldmatrix)."""
        return row * self.row_bytes + ch * LANE_BYTES

    @cute.jit
    def _stage(self, x_base: Int64, m, k, u, slot: Int32, tid, wheres, nb_ok):
        """cp.async unit u into one ring slot: the activation tile (`_stage_x`), each warp's weights (every lane
        its own 16-byte pieces, read back by the same lane) and group scales."""
        self._stage_x(x_base, m, k, u, slot, tid)
        self._stage_w(k, u, slot, tid, wheres, nb_ok)

    @cute.jit
    def _stage_x(self, x_base: Int64, m, k, u, slot: Int32, tid):
        """cp.async unit u's activation tile into `slot`: the M token rows, then zeros up to the token bucket (the
        MMA columns past M are never stored). Zero-filled, not copies of row M - 1: every CTA reads the same tile at
        about the same time, and copies made row M - 1's L2 sectors take up to 8x the requests of the others."""
        chunks = self.unit_k * 2 // LANE_BYTES
        threads = WARP * self.warps
        for c in cutlass.range_constexpr((self.m_tiles * TOKENS * chunks + threads - 1) // threads):
            idx = tid + c * threads
            row, ch = idx // chunks, idx % chunks
            if idx < self.m_tiles * TOKENS * chunks:
                src = x_base + (Int64(cutlass.min(row, m - 1)) * k + u * self.unit_k) * 2 + ch * LANE_BYTES
                real = cutlass.select_(row < m, Int32(LANE_BYTES), Int32(0))   # bytes read; the rest zero-filled
                ptx.cp_async_16_zfill(slot + self._x_chunk(row, ch), src, real)

    @cute.jit
    def _stage_w(self, k, u, slot: Int32, tid, wheres, nb_ok):
        """cp.async each warp's weights and group scales of unit u into `slot`."""
        warp, lane = tid // WARP, tid % WARP
        lpb = self.fmt.loads_per_block
        for i in cutlass.range_constexpr(self.nbw):
            lane_base, offsets, k_, s_base, nb, n_units, g = wheres[i]
            dst = self._w_slot(slot, warp, i) + lane * LANE_BYTES
            if nb_ok[i] != 0:
                for b in cutlass.range_constexpr(self.bpu):
                    addr = lane_base + Int64(u * self.bpu + b) * self.fmt.block_stride(k)
                    for li in cutlass.range_constexpr(lpb):
                        ptx.cp_async_16(dst + (b * lpb + li) * WARP * LANE_BYTES, addr + offsets[li])
                if cutlass.const_expr(self.fmt.grouped):
                    if lane < 2:  # the n-block's 16 scales of group u: 32 contiguous bytes
                        src = s_base + ((Int64(nb) * n_units + u) * BLOCK_N) * 2 + lane * LANE_BYTES
                        ptx.cp_async_16(self._s_slot(slot, warp, i) + lane * LANE_BYTES, src)

    def _w_slot(self, slot, warp, i):
        return slot + self.x_bytes + (warp * self.nbw + i) * self.lanes_bytes

    def _s_slot(self, slot, warp, i):
        return slot + self.x_bytes + self.w_bytes + (warp * self.nbw + i) * (2 * BLOCK_N)

    def _read_weights(self, slot, warp, lane, i) -> tuple:
        """This lane's weight words (and its two scales) of n-block i from the slot."""
        fmt = self.fmt
        dst = self._w_slot(slot, warp, i) + lane * LANE_BYTES
        regs = []
        for p in range(self.bpu * fmt.loads_per_block):
            regs += list(ptx.lds_v4(dst + p * WARP * LANE_BYTES))
        if cutlass.const_expr(fmt.grouped):
            sc = self._s_slot(slot, warp, i)
            g = lane // 4
            regs += [ptx.lds_f16_to_f32(sc + g * 2), ptx.lds_f16_to_f32(sc + (g + layouts.MMA_N) * 2)]
        return tuple(regs)

    def _x_frags(self, xs_lane: Int32, b) -> list:
        """B operands of block b of the unit in the slot, per 8-token group."""
        load = ptx.ldsm_x4 if cutlass.const_expr(self.fmt.x_frags == "ldsm") else ptx.lds_v4
        out = []
        for mt in range(self.m_tiles):
            addr = xs_lane + mt * TOKENS * self.row_bytes + b * (BLOCK_K * 2)
            out.append(self.fmt.b_operands(sum((load(addr + off) for off in self.fmt.X_LOAD_OFFSETS), ())))
        return out

    @cute.kernel
    def kernel(self, x: cute.Tensor, w: cute.Tensor, s: Optional[cute.Tensor], r: Optional[cute.Tensor],
               y: cute.Tensor, ws: cute.Tensor, counters: cute.Tensor, split: Int32):
        fmt, NBW = self.fmt, self.nbw
        tid, _, _ = cute.arch.thread_idx()
        tile, sy, _ = cute.arch.block_idx()
        warp = tid // WARP
        lane = tid % WARP
        g = lane // 4
        m = x.shape[0]
        k = x.shape[1]
        n = self.epi.weight_rows(y.shape[1])
        n_blocks = n // BLOCK_N
        n_units = k // self.unit_k
        ua = sy * n_units // split
        ub = (sy + 1) * n_units // split

        s_base = Int64(0)
        if cutlass.const_expr(fmt.grouped):
            s_base = s.iterator.toint()
        w_base = w.iterator.toint()
        offsets = fmt.load_offsets(k)
        consts = fmt.consts()
        nb0 = tile * (self.warps * NBW) + warp * NBW
        wheres, nb_ok = [], []
        for i in cutlass.range_constexpr(NBW):
            nb = cutlass.min(nb0 + i, n_blocks - 1)
            wheres.append((fmt.lane_base(w_base, nb, lane, k), offsets, k, s_base, nb, n_units, g))
            nb_ok.append(Int32(nb0 + i < n_blocks))

        # 1-2. the ring and the main loop (it waits for the previous kernel: PDL)
        xs = ptx.smem_addr(cute.arch.get_dyn_smem(cutlass.Int8, alignment=16))
        accs = self._mainloop(x.iterator.toint(), m, k, ua, ub, xs, tid, warp, lane, wheres, nb_ok, consts)
        cute.arch.griddepcontrol_launch_dependents()

        # 3. epilogue, directly or through the split-K workspace
        if split == 1:
            self._epilogue(accs, nb0, lane, n_blocks, m, s, r, y)
        elif cutlass.const_expr(self.cluster):
            self._cluster_k(accs, nb0, warp, lane, n_blocks, m, s, r, y, split, sy, xs)
        else:
            self._split_k(accs, nb0, lane, n_blocks, m, n, s, r, y, ws, counters, split, tile, sy, tid, xs)

    @cute.jit
    def _mainloop(self, x_base, m, k, ua, ub, xs, tid, warp, lane, wheres, nb_ok, consts):
        """Units [ua, ub) through the ring: (SX - 1) stages in flight, one consumed per step. Returns the
        accumulators, per n-block of the warp and 8-token group, in the m16n8 C fragment order. Everything
        waits for the previous kernel (PDL overlaps only the launch)."""
        fmt, SX, NBW = self.fmt, self.stages, self.nbw
        cute.arch.griddepcontrol_wait()
        for st in cutlass.range_constexpr(SX - 1):
            if ua + st < ub:
                self._stage(x_base, m, k, ua + st, xs + st * self.stage_bytes, tid, wheres, nb_ok)
            cute.arch.cp_async_commit_group()
        xs_lane = fmt.x_lane_offset(lane, self.row_bytes)
        accs = [[(Float32(0.0),) * 4 for _ in range(self.m_tiles)] for _ in range(NBW)]
        for u in cutlass.range(ua, ub, unroll=1):
            cute.arch.cp_async_wait_group(SX - 2)
            cute.arch.sync_threads()  # stage u visible to all; stage u - 1 consumed by all
            ahead = u + SX - 1
            if ahead < ub:
                self._stage(x_base, m, k, ahead, xs + ((ahead - ua) % SX) * self.stage_bytes, tid, wheres, nb_ok)
            cute.arch.cp_async_commit_group()
            slot = xs + ((u - ua) % SX) * self.stage_bytes
            b_ops = [self._x_frags(slot + xs_lane, b) for b in range(self.bpu)]
            for i in cutlass.range_constexpr(NBW):
                accs[i] = stream.mma_unit(fmt, self.bpu, self._read_weights(slot, warp, lane, i), b_ops, accs[i],
                                          nb_ok[i], consts, chains=self.chains)
        return accs

    # ---- epilogue ----------------------------------------------------------------------------
    def _cta_sync(self):
        """The barrier of the threads that run the epilogue (here: the whole CTA)."""
        cute.arch.sync_threads()

    def _split_flag(self, xs):
        """Shared address of the split-K "this CTA reduces" flag (after the ring)."""
        return xs + self.stages * self.stage_bytes

    @cute.jit
    def _split_k(self, accs, nb0, lane, n_blocks, m, n, s, r, y, ws, counters, split, tile, sy, tid, xs):
        mpad = self.m_tiles * TOKENS
        g, t = lane // 4, lane % 4
        ws_base = ws.iterator.toint()
        for i in cutlass.range_constexpr(self.nbw):
            for mt in cutlass.range_constexpr(self.m_tiles):
                for h in cutlass.range_constexpr(2):
                    row = (nb0 + i) * BLOCK_N + g + h * layouts.MMA_N
                    addr = ws_base + ((Int64(sy) * n + row) * mpad + mt * TOKENS + 2 * t) * 4
                    if nb0 + i < n_blocks:
                        ptx.stg_f32x2(addr, accs[i][mt][2 * h], accs[i][mt][2 * h + 1])
        cute.arch.fence_acq_rel_gpu()
        self._cta_sync()
        flag = self._split_flag(xs)
        if tid == 0:
            ptx.sts_f32(flag, Float32(split_arrival.arrive(counters.iterator + tile, split)))
        self._cta_sync()
        if ptx.lds_f32(flag) != Float32(0.0):
            cute.arch.fence_acq_rel_gpu()
            total = [[(Float32(0.0),) * 4 for _ in range(self.m_tiles)] for _ in range(self.nbw)]
            # `reduce_batch` splits' loads are issued before any add: one L2 latency per batch, not per split
            for sp0 in cutlass.range(0, split, self.reduce_batch, unroll=1):
                batch = []
                for q in cutlass.range_constexpr(self.reduce_batch):
                    sp = cutlass.min(sp0 + q, split - 1)
                    for i in cutlass.range_constexpr(self.nbw):
                        for mt in cutlass.range_constexpr(self.m_tiles):
                            for h in cutlass.range_constexpr(2):
                                row = cutlass.min((nb0 + i) * BLOCK_N, n - BLOCK_N) + g + h * layouts.MMA_N
                                addr = ws_base + ((Int64(sp) * n + row) * mpad + mt * TOKENS + 2 * t) * 4
                                batch.append(ptx.ldg_cg_f32x2(addr))
                at = 0
                for q in cutlass.range_constexpr(self.reduce_batch):
                    keep = sp0 + q < split
                    for i in cutlass.range_constexpr(self.nbw):
                        for mt in cutlass.range_constexpr(self.m_tiles):
                            vals = batch[at] + batch[at + 1]
                            at += 2
                            total[i][mt] = tuple(a + cutlass.select_(keep, b, Float32(0.0))
                                                 for a, b in zip(total[i][mt], vals))
            self._epilogue(total, nb0, lane, n_blocks, m, s, r, y)

    @cute.jit
    def _cluster_k(self, accs, nb0, warp, lane, n_blocks, m, s, r, y, split, sy, xs):
        """Cluster split-K: the tile's `split` CTAs (one cluster) publish their accumulator fragments in their own
        shared memory; each fragment set (warp, n-block, token group) is summed over the CTAs in rank order
        (deterministic) by one CTA (set index mod split), reading its peers' shared memory, which finishes it.
        No workspace, counter or fence: two cluster barriers."""
        cute.arch.sync_threads()   # every warp is done with the ring the partials overwrite
        sets = []
        for i in cutlass.range_constexpr(self.nbw):
            for mt in cutlass.range_constexpr(self.m_tiles):
                idx = (warp * self.nbw + i) * self.m_tiles + mt
                at = xs + idx * (WARP * 16) + lane * 16
                ptx.sts_f32x4(at, *accs[i][mt])
                sets.append((idx, at))
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        zero = Float32(0.0)
        total = [[(zero,) * 4 for _ in range(self.m_tiles)] for _ in range(self.nbw)]
        mine = [[Int32(0)] * self.m_tiles for _ in range(self.nbw)]
        for i in cutlass.range_constexpr(self.nbw):
            for mt in cutlass.range_constexpr(self.m_tiles):
                idx, at = sets[i * self.m_tiles + mt]
                own = idx % split == sy
                mine[i][mt] = Int32(own)
                acc = (zero,) * 4
                if own:
                    for q in cutlass.range(split, unroll=1):
                        v = ptx.ld_cluster_f32x4(ptx.mapa(at, q))
                        acc = tuple(a + b for a, b in zip(acc, v))
                total[i][mt] = acc
        self._epilogue(total, nb0, lane, n_blocks, m, s, r, y, mine)
        cute.arch.cluster_arrive()   # peers may still read this CTA's partials
        cute.arch.cluster_wait()

    @cute.jit
    def _epilogue(self, accs, nb0, lane, n_blocks, m, s, r, y, mine=None):
        """Fragment (n-block i, token group mt): c0, c1 = rows g, tokens 2t, 2t+1; c2, c3 = row g+8. `mine`
        (cluster split-K): per (n-block, token group), whether this CTA stores that fragment set."""
        g, t = lane // 4, lane % 4
        y_base = y.iterator.toint()
        ldy = y.shape[1]
        for i in cutlass.range_constexpr(self.nbw):
            nb = nb0 + i
            row0 = Int64(cutlass.min(nb, n_blocks - 1)) * BLOCK_N + g
            sc = (Float32(1.0), Float32(1.0))
            if cutlass.const_expr(self.fmt.name == "e4m3"):
                s_base = s.iterator.toint()
                sc = (ptx.ldg_f32(s_base + row0 * 4), ptx.ldg_f32(s_base + (row0 + layouts.MMA_N) * 4))
            for mt in cutlass.range_constexpr(self.m_tiles):
                v = accs[i][mt]
                v = (v[0] * sc[0], v[1] * sc[0], v[2] * sc[1], v[3] * sc[1])
                others = self.epi.partners(v)  # the rows of an output held by other lanes (SwiGLU: up)
                for q in cutlass.range_constexpr(4):
                    tok = mt * TOKENS + 2 * t + q % 2
                    col = self.epi.out_col(row0 + (q // 2) * layouts.MMA_N)
                    keep = self.epi.owner(nb < n_blocks, g) & (tok < m)
                    if cutlass.const_expr(mine is not None):
                        keep = keep & (mine[i][mt] != 0)
                    if keep:
                        sums = (v[q],) if cutlass.const_expr(others is None) else (v[q], others[q])
                        val = self.epi.finish(sums, lambda: ptx.ldg_bf16_to_f32(
                            r.iterator.toint() + (Int64(tok) * ldy + col) * 2))
                        ptx.stg_bf16(y_base + (Int64(tok) * ldy + col) * 2, val)
