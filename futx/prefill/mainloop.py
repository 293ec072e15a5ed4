"""The futx prefill GEMM: one persistent, warp-specialized TMA + WGMMA mainloop for Hopper (sm_90a).

    D = epilogue(A @ B^T)     A: (M, K) activations, B: (N, K) weights (nn.Linear layout), both K-major

Every prefill projection runs on this one kernel; what happens to the accumulators afterwards is decided
by an epilogue *policy chain* chosen at compile time (`epilogues/`). M, N and K are runtime values, so
one compiled variant serves every projection shape and every batch of tokens.

CTA anatomy (384 threads, one CTA per SM, `setmaxnreg` moves registers to the math warpgroups):

  warpgroup 0  producer   one warp issues TMA loads of A and B tiles into a `stages`-deep shared-memory
                          ring; each stage has a *full* mbarrier (TMA transaction bytes) and an *empty*
                          mbarrier (one arrive per consumer warp, sent to every CTA that shares the stage).
  warpgroups 1, 2         consumers: issue WGMMA from shared memory (k=32 per FP8 instruction, 16 per
                          BF16) on 64 x tile_n accumulators each (128 FP32 registers per thread at
                          tile_n=256), keep one k-tile of WGMMAs in flight before releasing a stage, then
                          run the epilogue on their 64 rows.

Two schedules of the consumers (`TileConfig.schedule`):

  coop       both warpgroups work on one 128 x tile_n CTA tile (rows 0-63 and 64-127). Least shared-
             memory and L2 traffic per FLOP (the weight tile is shared by 128 rows), but the tensor
             cores idle while both run the epilogue and while the last WGMMAs of a tile drain.
  pingpong   each warpgroup owns a whole 64 x tile_n tile; the CTA's tiles alternate between them and an
             ordered pair of named barriers lets one warpgroup issue its mainloop only after the other
             has issued all of its own, so the tensor cores always have one warpgroup's WGMMAs queued
             while the other runs its epilogue (CUTLASS's "pingpong" kernel schedule). Costs ~25% more
             shared-memory traffic per FLOP (B is loaded and read per 64 rows).
  stagger    coop tiles, but warpgroup 1 starts `STAGGER` k-tiles behind warpgroup 0 and the two never
             synchronize again (policy smem is per warpgroup), so at a tile's end one warpgroup's last
             k-tiles run on the tensor cores while the other runs its epilogue. The lead can be at most
             the ring depth; it settles where warpgroup 0 stops waiting for data (warpgroup 1 never
             waits: its stages were loaded for warpgroup 0).

Every chain ships as pingpong 64x256, coop 128x128 and pingpong 64x128 tiles (futx/runtime/catalog/prefill.py);
the variant rule and its measured reasons: docs/routing.md. The other schedules are the benchmarks' tuning space.

Persistence and L2: the grid is min(#cluster tiles, #SMs / cluster); each cluster walks the tile list
with stride gridDim.z. Tiles are ordered in groups of `group_m` cluster-rows: inside a group the
walk goes down M first and then along N, so the A rows of a group stay in L2 while every weight tile
is read by the whole group at about the same time.

Split-K (coop schedule, runtime `splits`): the full waves of cluster tiles run whole; each tile of the last,
partial wave (every tile when the launch is under one wave) becomes `splits` units with one K range each,
adjacent in the work order. After its mainloop a unit writes its float32 accumulators to a workspace and counts
itself on the tile's arrival counter; the last to arrive sums the partials in split order and runs the epilogue
(`exchange_partials`), so no CTA ever waits for another. The exchange costs ~5 us; when it pays is the rule's
call (futx/runtime/catalog/prefill.py `choose_plan`).

Cluster 2x1 along M: the two CTAs compute vertically adjacent tiles that use the same weight tile, so
each loads half of B and multicasts it to both (halves the L2->SM traffic for B). Cluster 2x2 (tuning
space, `cluster_n = 2`): the two CTAs of a cluster row also share their activation tile, each loading half
of A's rows and multicasting it along the row (halves the L2->SM traffic for A too).

The epilogue runs per consumer warpgroup on (64 x epi_n) subtiles: accumulator registers -> policy
chain (scales, SwiGLU, residual, amax, ...) -> converted fragment -> `stmatrix` into shared memory ->
TMA store, double-buffered so the store of subtile j overlaps the math of subtile j+1 and the last
stores of a tile overlap the next tile's mainloop. Policies issue their global loads (scales, ...)
*before* the tile's mainloop, so that latency hides behind the MMAs. While the consumers run the
epilogue, the producer already fills the ring with the next tile's stages.

FP8 accumulation is "fast accumulation" (every k-block accumulates into the same FP32 WGMMA
accumulator, like cuBLAS `use_fast_accum=True`: the tensor core keeps ~14 significant bits while it
adds a k-block's products); a two-level promotion would need a second 128-register accumulator per
thread that the 64 x 256 warpgroup tile cannot afford.

Tile rules (see `tile_config`): the paper's 128x256 CTA tile with K=128 (FP8) / 64 (BF16) per stage,
4 stages (4 x 48 KiB of A+B), cluster 2x1. Inputs must be 16-byte aligned along K and N (TMA).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from decode import ptx, split_arrival
from epilogues.base import Chain, Frag, Tile, resolve
from futx.hardware import SMEM_PER_CTA

AB_DTYPES = {"e4m3": cutlass.Float8E4M3FN, "bf16": cutlass.BFloat16}
STAGGER = 2   # k-tiles warpgroup 1 starts behind warpgroup 0 (stagger schedule; < stages)
SMEM_BYTES = SMEM_PER_CTA
THREADS_PER_WG = 128


class Barrier(IntEnum):
    """Named barrier ids (0 is the CTA-wide barrier)."""

    EPI_WG0 = 1     # a consumer warpgroup's epilogue: EPI_WG0 + cwg
    EPI_WG1 = 2
    EPI_TILE = 3    # both consumer warpgroups on one coop tile
    MMA_WG0 = 4     # pingpong turn of warpgroup 0 (MMA_WG0 + cwg); the stagger schedule's one-time gate
    MMA_WG1 = 5


@dataclass(frozen=True)
class TileConfig:
    """Static shape of one kernel variant. `tile_config` holds the rules; tests pin them."""

    tile_m: int = 128      # rows per CTA tile: 128 (coop, stagger: 64 per warpgroup) or 64 (pingpong)
    tile_n: int = 256
    tile_k: int = 128
    stages: int = 4
    cluster_m: int = 2
    cluster_n: int = 1     # CTAs per cluster along N: 2 shares the A tile (A multicast)
    group_m: int = 8       # cluster-rows per raster group (L2 reuse of A)
    epi_stages: int = 2    # smem buffers per consumer warpgroup for the TMA store
    schedule: str = "coop"

    @property
    def pingpong(self) -> bool:
        return self.schedule == "pingpong"

    @property
    def cluster_size(self) -> int:
        return self.cluster_m * self.cluster_n

    @property
    def split_k(self) -> bool:
        """coop kernels take a runtime split count (see `PrefillGemm.exchange_partials`)."""
        return self.schedule == "coop"

    @property
    def per_wg_policy_smem(self) -> bool:
        """The warpgroups run their epilogues at different times: no CTA-wide epilogue barrier."""
        return self.schedule != "coop"


def tile_config(ab: str, tile_n: int = 256, cluster_m: int = 2, schedule: str = "coop",
                group_m: int = 8, cluster_n: int = 1) -> TileConfig:
    """The tile rules.

    - Each consumer warpgroup computes 64 x tile_n: the largest WGMMA (n=256) keeps shared-memory reads
      per FLOP lowest, and 64x256 FP32 accumulators are 128 registers/thread. The CTA tile is 128 rows
      (coop, stagger: both warpgroups on one tile) or 64 rows (pingpong: one tile per warpgroup).
    - K per stage = 128 bytes of a row (one 128B swizzle atom): 128 for E4M3, 64 for BF16.
    - stages = as many as fit next to the epilogue buffers, at most 8: 4 for 128x256 (4 x 48 KiB),
      6 for 128x128, 5 for pingpong 64x256 (5 x 40 KiB); more stages hide more TMA latency.
    - group_m cluster rows per raster group (8: 2048 rows in coop, 1024 in pingpong).
    - cluster cluster_m x cluster_n CTAs: the cluster_m CTAs of a column share (multicast) the weight tile,
      the cluster_n CTAs of a row the activation tile.
    """
    if ab not in AB_DTYPES:
        raise ValueError(f"ab must be one of {sorted(AB_DTYPES)}, got {ab!r}")
    if tile_n not in (128, 256):
        raise ValueError(f"tile_n must be 128 or 256, got {tile_n}")
    if cluster_m not in (1, 2):
        raise ValueError(f"cluster_m must be 1 or 2, got {cluster_m}")
    if cluster_n not in (1, 2):
        raise ValueError(f"cluster_n must be 1 or 2, got {cluster_n}")
    if schedule not in ("coop", "pingpong", "stagger"):
        raise ValueError(f"schedule must be 'coop', 'pingpong' or 'stagger', got {schedule!r}")
    if group_m < 1:
        raise ValueError(f"group_m must be >= 1, got {group_m}")
    tile_m = 64 if schedule == "pingpong" else 128
    tile_k = 128 if ab == "e4m3" else 64
    stage_bytes = (tile_m + tile_n) * 128      # A + B rows of 128 bytes each, either dtype
    epi_bytes = 2 * 2 * 64 * 32 * 2            # 2 warpgroups x 2 buffers x 64x32 x <= 2 bytes
    stages = min(8, (SMEM_BYTES - epi_bytes - 4096) // stage_bytes)
    return TileConfig(tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, stages=stages, cluster_m=cluster_m,
                      cluster_n=cluster_n, group_m=group_m, schedule=schedule)


class PrefillGemm:
    """One compiled variant: operand dtype x tile config x epilogue policy chain."""

    def __init__(self, ab: str, epilogue: Chain, cfg: TileConfig):
        self.ab_dtype = AB_DTYPES[ab]
        self.acc_dtype = Float32
        self.cfg = cfg
        self.epi = epilogue
        self.tile_mnk = (cfg.tile_m, cfg.tile_n, cfg.tile_k)
        self.num_consumer_wg = 2
        self.pingpong = cfg.pingpong
        self.slabs_per_tile = cfg.tile_m // 64   # 64-row warpgroup slabs per CTA tile
        self.threads = THREADS_PER_WG * (1 + self.num_consumer_wg)
        # 40 registers for the producer, the rest to the math warpgroups (64K registers / SM)
        self.producer_regs = 40
        self.consumer_regs = 232
        self.half_n = cfg.tile_n // 2        # B is loaded as two half tiles (see `producer`)
        self.a_rows = cfg.tile_m // cfg.cluster_n   # ... and A as cluster_n parts of these rows
        self.split = epilogue.pair is not None and epilogue.pair.layout == "split"
        self.split_k = cfg.split_k
        self.out_tile_n = cfg.tile_n // epilogue.n_ratio
        self.epi_n = self.epi_subtile_n()    # output subtile: 64 rows x epi_n columns per warpgroup
        self.n_sub = self.out_tile_n // self.epi_n
        assert self.n_sub % cfg.epi_stages == 0, "subtile -> smem buffer mapping must be static"

    def epi_subtile_n(self) -> int:
        """64 output columns per subtile (half the barriers of 32) when the registers and the shared
        memory allow: not after a pair step (its 2 x 64 accumulator window), and only if the double-
        buffered D staging still fits next to the A/B stages and the policy buffers."""
        if self.epi.n_ratio != 1:
            return 32
        out_bytes = 2 if self.epi.out_dtype.width == 16 else 1
        used = (self.cfg.stages * (self.cfg.tile_m + self.cfg.tile_n) * 128
                + self.num_consumer_wg * self.cfg.epi_stages * 64 * 64 * out_bytes
                + 8 * 2 * self.cfg.stages + 4 * self.epi_floats())
        return 64 if used + 512 <= SMEM_BYTES and not any(s.wide_subtile_regs for s in self.epi.steps) else 32

    def epi_floats(self) -> int:
        """FP32 words of policy smem. coop: one copy per tile parity (a warpgroup may write tile i+1's
        while the other still reads tile i's); otherwise one copy per warpgroup, whose epilogue
        barriers already order its reads of tile i before its writes of tile i+1."""
        per = sum(step.smem_floats(self.cfg.tile_n) for step in self.epi.steps)
        return per * (self.num_consumer_wg if self.cfg.per_wg_policy_smem else 2)

    # ---------------------------------------------------------------------------------------------
    # host side (traced once per compile)
    # ---------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mD: cute.Tensor, *rest):
        """rest = (*epilogue tensors in chain order, [workspace, counters, splits: Int32,] num_sms: Int32,
        stream); the bracketed split-K arguments only for coop kernels (`TileConfig.split_k`)."""
        n_split_args = 3 if const_expr(self.split_k) else 0
        epi_args, num_sms, stream = rest[:-2 - n_split_args], rest[-2], rest[-1]
        split_args = rest[-2 - n_split_args:-2]
        cfg = self.cfg
        if const_expr(mA.element_type != self.ab_dtype or mB.element_type != self.ab_dtype):
            raise TypeError(f"A/B must be {self.ab_dtype}, got {mA.element_type}/{mB.element_type}")
        if const_expr(mD.element_type != self.epi.out_dtype):
            raise TypeError(f"D must be {self.epi.out_dtype} for policy {self.epi.key()}, got {mD.element_type}")
        self.d_dtype = mD.element_type

        a_staged = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, self.tile_mnk, self.ab_dtype, cfg.stages)
        b_staged = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, self.tile_mnk, self.ab_dtype, cfg.stages)
        # The same B buffer seen as 2 * stages half tiles: half h of stage s is buffer 2s + h (the
        # swizzle atoms stack along N, so a half tile is a contiguous slice of its stage).
        bh_staged = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (cfg.tile_m, self.half_n, cfg.tile_k), self.ab_dtype, 2 * cfg.stages)
        # A likewise as cluster_n * stages parts of a_rows rows (the atoms stack along M)
        ap_staged = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (self.a_rows, cfg.tile_n, cfg.tile_k), self.ab_dtype, cfg.cluster_n * cfg.stages)
        ap_smem = cute.slice_(ap_staged, (None, None, 0))
        bh_smem = cute.slice_(bh_staged, (None, None, 0))
        epi_tile = (64, self.epi_n)
        d_staged = sm90_utils.make_smem_layout_epi(
            self.d_dtype, LayoutEnum.ROW_MAJOR, epi_tile, cfg.epi_stages * self.num_consumer_wg)

        mcast, plain = cpasync.CopyBulkTensorTileG2SMulticastOp(), cpasync.CopyBulkTensorTileG2SOp()
        a_op = mcast if cfg.cluster_n > 1 else plain
        tma_a, gA_tma = cpasync.make_tiled_tma_atom(a_op, mA, ap_smem, (self.a_rows, cfg.tile_k))
        b_op = mcast if cfg.cluster_m > 1 else plain
        tma_b, gB_tma = cpasync.make_tiled_tma_atom(b_op, mB, bh_smem, (self.half_n, cfg.tile_k))
        tma_d, gD_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mD, cute.slice_(d_staged, (None, None, 0)), epi_tile)
        self.tma_bytes = (cfg.cluster_n * cute.size_in_bytes(self.ab_dtype, ap_smem)
                          + 2 * cute.size_in_bytes(self.ab_dtype, bh_smem))

        epi_floats = max(1, self.epi_floats())

        @cute.struct
        class SharedStorage:
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_staged)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_staged)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[self.d_dtype, cute.cosize(d_staged)], 1024]
            ab_mbar: cute.struct.MemRange[cutlass.Int64, cfg.stages * 2]
            split_flag: cute.struct.MemRange[Int32, 4]   # split-K: "this CTA reduces the tile", per unit
            epi_f32: cute.struct.Align[cute.struct.MemRange[Float32, epi_floats], 16]

        if const_expr(SharedStorage.size_in_bytes() > SMEM_BYTES):
            raise ValueError(f"{SharedStorage.size_in_bytes()} bytes of shared memory > {SMEM_BYTES}: fewer stages "
                             f"or a narrower epilogue subtile")
        self.shared_storage = SharedStorage

        # Persistent grid: at most one CTA per SM, in clusters of cluster_m x cluster_n. `num_sms`: the CTAs that
        # can run at once in such clusters (futx.hardware.cluster_slots), so that every cluster is resident.
        n_cluster_m, n_cluster_n = self.tile_counts(mA.shape[0], mB.shape[0])
        units = n_cluster_m * n_cluster_n
        if const_expr(self.split_k):
            units = units * split_args[2]
        num_clusters = cutlass.min(units, num_sms // cfg.cluster_size)
        self.kernel(
            tma_a, gA_tma, tma_b, gB_tma, tma_d, gD_tma, tuple(epi_args), tuple(split_args),
            a_staged, ap_staged, b_staged, bh_staged, d_staged,
        ).launch(
            grid=(cfg.cluster_m, cfg.cluster_n, num_clusters),
            block=(self.threads, 1, 1),
            cluster=(cfg.cluster_m, cfg.cluster_n, 1),
            stream=stream,
        )

    def tile_cols(self, n):
        """CTA tile columns of the problem."""
        if self.split:
            return (n // 2 + self.half_n - 1) // self.half_n
        return (n + self.cfg.tile_n - 1) // self.cfg.tile_n

    def tile_counts(self, m, n):
        """(cluster rows, cluster columns) of the problem."""
        rows = self.cfg.tile_m * self.cfg.cluster_m
        cn = self.cfg.cluster_n
        return (m + rows - 1) // rows, (self.tile_cols(n) + cn - 1) // cn

    def cluster_coord(self, cta_rank):
        """(cluster row, cluster column) of a CTA's rank in its cluster of dims (cluster_m, cluster_n, 1)."""
        return cta_rank % self.cfg.cluster_m, cta_rank // self.cfg.cluster_m

    def make_mmas(self):
        """(the CTA tile's MMA: both consumer warpgroups in coop, one in pingpong; one warpgroup's MMA
        for the epilogue)."""
        k_major = warpgroup.OperandMajorMode.K
        cta = sm90_utils.make_trivial_tiled_mma(self.ab_dtype, self.ab_dtype, k_major, k_major, self.acc_dtype,
                                                (self.slabs_per_tile, 1, 1), tiler_mn=(64, self.cfg.tile_n))
        wg = sm90_utils.make_trivial_tiled_mma(self.ab_dtype, self.ab_dtype, k_major, k_major, self.acc_dtype,
                                               (1, 1, 1), tiler_mn=(64, self.cfg.tile_n))
        return cta, wg

    # ---------------------------------------------------------------------------------------------
    # device side
    # ---------------------------------------------------------------------------------------------
    def unit(self, work: Int32, splits, k_tiles, whole):
        """Work unit -> (cluster-tile work index, split index, first k-tile, k-tiles, the tile's splits, its
        index among the split tiles). Units [0, whole) are whole tiles (full waves); the tiles after them come
        `splits` units each. The splits of a tile are adjacent units, so they run on neighbouring clusters at
        the same time."""
        if not self.split_k:
            return work, Int32(0), Int32(0), k_tiles, 1, Int32(0)
        split_tile = work >= whole
        v = cutlass.max(work - whole, 0)
        tail = v // splits
        ts = cutlass.select_(split_tile, splits, 1)
        s = cutlass.select_(split_tile, v - tail * splits, 0)
        k0 = s * k_tiles // ts
        return (cutlass.select_(split_tile, whole + tail, work), s, k0, (s + 1) * k_tiles // ts - k0, ts, tail)

    @cute.jit
    def tile_coords(self, work: Int32, n_cluster_m: Int32, n_cluster_n: Int32):
        """Linear cluster-work index -> (cluster row, cluster column), grouped raster (see module doc)."""
        g = self.cfg.group_m
        group_size = g * n_cluster_n
        group = work // group_size
        first = group * g
        rows = cutlass.min(n_cluster_m - first, g)
        local = work - group * group_size
        return first + local % rows, local // rows

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom, gA_tma: cute.Tensor,
        tma_b: cute.CopyAtom, gB_tma: cute.Tensor,
        tma_d: cute.CopyAtom, gD_tma: cute.Tensor,
        epi_args: tuple,
        split_args: tuple,
        a_staged: cute.ComposedLayout, ap_staged: cute.ComposedLayout, b_staged: cute.ComposedLayout,
        bh_staged: cute.ComposedLayout, d_staged: cute.ComposedLayout,
    ):
        cfg = self.cfg
        tiled_mma, wg_mma = self.make_mmas()
        self.wg_mma = wg_mma
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = warp_idx // 4
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_d)
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        rank_m, rank_n = self.cluster_coord(cta_rank)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # ---- mainloop pipeline: TMA producer -> consumer warps of every CTA that shares B ----
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_mbar.data_ptr(),
            num_stages=cfg.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                # one arrive per consumer warp of the stage's tile, from every CTA that writes into the stage:
                # the CTAs of its cluster column (B) and row (A), itself once
                pipeline.Agent.Thread, (cfg.cluster_m + cfg.cluster_n - 1) * self.slabs_per_tile * 4),
            tx_count=self.tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, cfg.cluster_m, cfg.cluster_n, 1)),
            defer_sync=True,
        )
        pipeline_init_arrive(cluster_shape_mn=(cfg.cluster_m, cfg.cluster_n), is_relaxed=True)

        sA = storage.sA.get_tensor(a_staged.outer, swizzle=a_staged.inner)
        sB = storage.sB.get_tensor(b_staged.outer, swizzle=b_staged.inner)
        sBh = storage.sB.get_tensor(bh_staged.outer, swizzle=bh_staged.inner)
        sAp = storage.sA.get_tensor(ap_staged.outer, swizzle=ap_staged.inner)

        m, n = gA_tma.shape[0], gB_tma.shape[0]
        gA = cute.local_tile(gA_tma, (self.a_rows, cfg.tile_k), (None, None))  # (bm/cn, bk, m parts, k tiles)
        gBh = cute.local_tile(gB_tma, (self.half_n, cfg.tile_k), (None, None))  # (bn/2, bk, n halves, k tiles)
        k_tiles = cute.size(gA, mode=[3])
        n_cluster_m, n_cluster_n = self.tile_counts(m, n)
        cols = self.tile_cols(n)
        _, _, first_work = cute.arch.block_idx()
        _, _, work_stride = cute.arch.grid_dim()
        splits = 1
        tiles = n_cluster_m * n_cluster_n
        whole = tiles
        if const_expr(self.split_k):
            splits = cutlass.max(cutlass.min(split_args[2], k_tiles), 1)   # every split gets >= 1 k-tile
            # the full waves of tiles run whole; only the last, partial wave is split (none if there is none)
            whole = tiles // work_stride * work_stride
        num_work = whole + (tiles - whole) * splits

        pipeline_init_wait(cluster_shape_mn=(cfg.cluster_m, cfg.cluster_n))

        if wg_idx == 0:
            # ======================= producer warpgroup =======================
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.producer(ab_pipe, tma_a, tma_b, sAp, sBh, gA, gBh, k_tiles, splits, whole, cta_rank,
                              n_cluster_m, n_cluster_n, num_work, first_work, work_stride, n)
        else:
            # ======================= consumer warpgroups =======================
            cute.arch.setmaxregister_increase(self.consumer_regs)
            cwg = wg_idx - 1
            wg_tid = tidx % THREADS_PER_WG
            # coop: this warpgroup computes rows [64 * cwg, 64 * cwg + 64) of every CTA tile;
            # pingpong: all 64 rows of every other CTA tile
            thr_mma = tiled_mma.get_slice(wg_tid if const_expr(self.pingpong) else cwg * THREADS_PER_WG)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            k_blocks = cute.size(tCrA, mode=[2])
            # this thread's accumulators of its warpgroup's 64 x tile_n, and their tile coordinates
            tCcD = wg_mma.get_slice(wg_tid).partition_C(cute.make_identity_tensor((64, cfg.tile_n)))
            acc = cute.make_rmem_tensor(tCcD.shape, self.acc_dtype)

            epi = WarpgroupEpilogue(self, wg_tid, cwg, storage.sD, d_staged, tma_d, gD_tma, storage.epi_f32,
                                    epi_args, tCcD, m, n)
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
            parity = Int32(0)
            work = first_work
            my_stride = work_stride
            stagger_gate = None
            gate_open = Int32(0)
            if const_expr(cfg.schedule == "stagger"):
                # once: warpgroup 1 waits until warpgroup 0 has issued its first STAGGER k-tiles
                stagger_gate = pipeline.NamedBarrier(barrier_id=int(Barrier.MMA_WG0), num_threads=2 * THREADS_PER_WG)
                if cwg == 1:
                    stagger_gate.arrive_and_wait()
            if const_expr(self.pingpong):
                # Tiles alternate between the warpgroups: warpgroup 1 starts at the CTA's second tile,
                # past the k-tiles of the first. Turn-taking: a warpgroup syncs on its "mma" barrier
                # (256 threads: its own 128 + the other's arrive) before issuing a mainloop and arrives
                # on the other's after issuing the last WGMMA; warpgroup 0 pre-arrives for its first turn.
                mma_turn = pipeline.NamedBarrier(barrier_id=Barrier.MMA_WG0 + cwg, num_threads=2 * THREADS_PER_WG)
                mma_next = pipeline.NamedBarrier(barrier_id=Barrier.MMA_WG1 - cwg, num_threads=2 * THREADS_PER_WG)
                my_stride = 2 * work_stride
                if cwg == 1:
                    work += work_stride
                    read.advance(k_tiles)
                    release.advance(k_tiles)
                else:
                    mma_turn.arrive()
            while work < num_work:
                tile_work, split_i, k0, kn, tile_splits, split_tile = self.unit(work, splits, k_tiles, whole)
                cm, cn = self.tile_coords(tile_work, n_cluster_m, n_cluster_n)
                tm = cm * cfg.cluster_m + rank_m
                tn = cn * cfg.cluster_n + rank_n
                slab = tm * self.slabs_per_tile + (0 if const_expr(self.pingpong) else cwg)
                WarpgroupEpilogue.prefetch(epi, slab, tn, parity)
                if const_expr(self.pingpong):
                    mma_turn.arrive_and_wait()

                # ---- mainloop: keep one k-tile of WGMMAs in flight, release the stage before it ----
                tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                ab_pipe.consumer_wait(read)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(k_blocks):
                    cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)], acc)
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                read.advance()
                for kt in cutlass.range(1, kn, unroll=1):
                    ab_pipe.consumer_wait(read)
                    warpgroup.fence()
                    for kb in cutlass.range_constexpr(k_blocks):
                        cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)], acc)
                    warpgroup.commit_group()
                    if const_expr(stagger_gate is not None):
                        if cwg == 0 and gate_open == 0 and kt == STAGGER - 1:
                            stagger_gate.arrive()
                            gate_open = Int32(1)
                    warpgroup.wait_group(1)       # the previous k-tile's WGMMAs no longer read smem
                    ab_pipe.consumer_release(release)
                    release.advance()
                    read.advance()
                if const_expr(stagger_gate is not None):   # first tile shorter than STAGGER k-tiles
                    if cwg == 0 and gate_open == 0:
                        stagger_gate.arrive()
                        gate_open = Int32(1)
                if const_expr(self.pingpong):
                    mma_next.arrive()             # the other warpgroup's WGMMAs queue behind ours
                warpgroup.wait_group(0)
                ab_pipe.consumer_release(release)
                release.advance()

                # a cluster_n = 2 cluster's last column may lie wholly right of N: that CTA only loads and
                # multicasts its part of A
                if tn < cols:
                    if const_expr(self.split_k):
                        reduces = Int32(1)
                        if tile_splits > 1:
                            flag = storage.split_flag.get_tensor(cute.make_layout(4))
                            reduces = self.exchange_partials(acc, split_args, flag, epi,
                                                             split_tile * cfg.cluster_size + cta_rank,
                                                             split_i, tile_splits, cwg, wg_tid)
                        if reduces != 0:
                            WarpgroupEpilogue.run_tile(epi, acc, slab, tn, parity)
                    else:
                        WarpgroupEpilogue.run_tile(epi, acc, slab, tn, parity)
                parity = 1 - parity
                work += my_stride
                if const_expr(self.pingpong):     # skip the other warpgroup's tile in the ring
                    read.advance(k_tiles)
                    release.advance(k_tiles)
            WarpgroupEpilogue.finish(epi)

    @cute.jit
    def exchange_partials(self, acc, split_args, flag, epi, tile_id, split_i, splits, cwg, wg_tid):
        """Split-K, after a unit's mainloop: write this CTA's partial tile to the float32 workspace; the
        last of the tile's `splits` CTAs to arrive (a self-resetting counter per CTA tile) sums every
        partial in split order, its own included, so the result does not depend on arrival order.
        Returns 1 in the CTA that then runs the tile's epilogue (uniform over its 256 consumer threads).

        `tile_id`: the CTA tile among the split tiles. Workspace: [tile_id][split][warpgroup][R / 4][128
        threads] float4, R accumulators per thread, so each warp instruction covers 512 contiguous bytes."""
        ws, counters = split_args[0], split_args[1]
        regs = cute.size(acc)
        wg_floats = regs * THREADS_PER_WG
        base = ws.iterator.toint() + (Int64(tile_id) * splits * 2 + cwg) * wg_floats * 4 + wg_tid * 16
        split_stride = 2 * wg_floats * 4
        mine = base + Int64(split_i) * split_stride
        for v in cutlass.range_constexpr(regs // 4):
            ptx.stg_cg_f32x4(mine + v * THREADS_PER_WG * 16, acc[4 * v], acc[4 * v + 1], acc[4 * v + 2], acc[4 * v + 3])
        cute.arch.fence_acq_rel_gpu()
        epi.tile_barrier.arrive_and_wait()          # both warpgroups' partials are written and fenced
        if cwg + wg_tid == 0:
            flag[0] = split_arrival.arrive(counters.iterator + tile_id, splits)
        epi.tile_barrier.arrive_and_wait()
        # one slot is enough: its next write is after the next unit's first barrier, which every thread
        # reaches only after reading it here
        reduces = flag[0]
        if reduces != 0:
            cute.arch.fence_acq_rel_gpu()
            if splits == 2:
                # a + b == b + a bit for bit: add the other partial to our own, whichever CTA reduces
                # (saves reading our own partial back: ~1 of the ~5 us the exchange costs)
                src = base + Int64(1 - split_i) * split_stride
                for v in cutlass.range_constexpr(regs // 4):
                    p = ptx.ldg_cg_f32x4(src + v * THREADS_PER_WG * 16)
                    for e in cutlass.range_constexpr(4):
                        acc[4 * v + e] = acc[4 * v + e] + p[e]
            else:
                for v in cutlass.range_constexpr(regs):
                    acc[v] = Float32(0.0)
                for sp in cutlass.range(splits, unroll=1):
                    src = base + Int64(sp) * split_stride
                    for v in cutlass.range_constexpr(regs // 4):
                        p = ptx.ldg_cg_f32x4(src + v * THREADS_PER_WG * 16)
                        for e in cutlass.range_constexpr(4):
                            acc[4 * v + e] = acc[4 * v + e] + p[e]
        return reduces

    @cute.jit
    def producer(self, ab_pipe, tma_a, tma_b, sAp, sBh, gA, gBh, k_tiles, splits, whole, cta_rank,
                 n_cluster_m, n_cluster_n, num_work, first_work, work_stride, n):
        """One warp: for every tile of this cluster, stream its k-tiles of A and B into the ring.

        B arrives as two half tiles (rows [0, bn/2) and [bn/2, bn) of the stage). With cluster_m = 2 the
        CTA at cluster row h loads half h and multicasts it to both CTAs of its cluster column; alone, a
        CTA loads both halves. With a split SwiGLU the halves come from the gate rows and the up rows
        (I = N/2 further down). A arrives as cluster_n parts of rows: with cluster_n = 2 the CTA at cluster
        column p loads part p and multicasts it to both CTAs of its cluster row.
        """
        cfg = self.cfg
        tAsA, tAgA = cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sAp, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sBh, 0, 2), cute.group_modes(gBh, 0, 2))
        cluster = cute.make_layout((cfg.cluster_m, cfg.cluster_n, 1))
        rank_m, rank_n = self.cluster_coord(cta_rank)
        b_mcast = a_mcast = None
        halves = (0, 1)
        if const_expr(cfg.cluster_m > 1):
            b_mcast = cute.make_layout_image_mask(cluster, cluster.get_flat_coord(cta_rank), mode=0)
            halves = (None,)
        if const_expr(cfg.cluster_n > 1):
            a_mcast = cute.make_layout_image_mask(cluster, cluster.get_flat_coord(cta_rank), mode=1)
        up_offset = (n // 2) // self.half_n   # split SwiGLU: first half-tile of the up rows
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
        work = first_work
        while work < num_work:
            tile_work, _, k0, kn, _, _ = self.unit(work, splits, k_tiles, whole)
            cm, cn = self.tile_coords(tile_work, n_cluster_m, n_cluster_n)
            tn = cn * cfg.cluster_n + rank_n
            tAgA_t = tAgA[(None, (cm * cfg.cluster_m + rank_m) * cfg.cluster_n + rank_n, None)]
            for kt in cutlass.range(k0, k0 + kn, unroll=1):
                ab_pipe.producer_acquire(state)
                bar = ab_pipe.producer_get_barrier(state)
                cute.copy(tma_a, tAgA_t[(None, kt)], tAsA[(None, state.index * cfg.cluster_n + rank_n)],
                          tma_bar_ptr=bar, mcast_mask=a_mcast)
                for hc in cutlass.range_constexpr(len(halves)):
                    h = rank_m if const_expr(halves[hc] is None) else halves[hc]
                    src = tn * 2 + h
                    if const_expr(self.split):
                        src = tn + h * up_offset
                    cute.copy(tma_b, tBgB[(None, src, kt)], tBsB[(None, state.index * 2 + h)],
                              tma_bar_ptr=bar, mcast_mask=b_mcast)
                ab_pipe.producer_commit(state)
                state.advance()
            work += work_stride
        ab_pipe.producer_tail(state)


class WarpgroupEpilogue:
    """The epilogue engine of one consumer warpgroup: subtiles -> policy chain -> smem -> TMA store.

    Per tile: `prefetch` (before the mainloop: policies issue their global loads, whose latency then
    hides behind the MMAs) -> mainloop -> `run_tile`: begin_tile (policies may fill the smem shared by
    the tile's warpgroups, double-buffered by tile parity; one barrier) -> whole-tile maps, if any ->
    for each (64 x epi_n) subtile: gather accumulators -> maps / pair / maps -> convert -> stmatrix ->
    TMA store (2 buffers). Subtiles entirely right of D (QKV: the K/V columns) skip the last three.
    """

    def __init__(self, gemm: PrefillGemm, wg_tid, cwg, sD_mem, d_staged, tma_d, gD_tma, epi_mem, epi_args,
                 tCcD, m, n):
        self.g = gemm
        self.chain = gemm.epi
        self.tCcD = tCcD
        self.m, self.n = m, n
        self.n_out = gD_tma.shape[1]
        self.d_dtype = gemm.d_dtype
        self.out_tile_n = gemm.out_tile_n
        self.tile_n = gemm.cfg.tile_n
        self.wg_tid = wg_tid
        # the threads that share this tile's policy smem: both warpgroups (coop) or this one
        own = gemm.cfg.per_wg_policy_smem
        self.epi_threads = THREADS_PER_WG * (1 if own else gemm.num_consumer_wg)
        self.epi_tid = wg_tid if own else cwg * THREADS_PER_WG + wg_tid
        self.S = gemm.epi_n * 64 // THREADS_PER_WG            # values per thread per output subtile
        self.n_sub = gemm.n_sub
        # registers -> shared memory with stmatrix, in the WGMMA accumulator layout
        st_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), gemm.d_dtype)
        r2s_atom = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, gemm.d_dtype, gemm.acc_dtype)
        self.r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(st_atom, gemm.wg_mma))
        thr = self.r2s.get_slice(wg_tid)
        # smem buffers [cwg * epi_stages, (cwg + 1) * epi_stages) belong to this warpgroup
        sD = sD_mem.get_tensor(d_staged.outer, swizzle=d_staged.inner)
        self.buf0 = cwg * gemm.cfg.epi_stages
        self.tRS_sD = thr.partition_D(sD)
        self.rD_shape = thr.partition_S(sD).shape[:3]
        gD = cute.local_tile(gD_tma, (64, gemm.epi_n), (None, None))
        self.tma_d = tma_d
        self.bSG_sD, self.bSG_gD = cpasync.tma_partition(
            tma_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), cute.group_modes(gD, 0, 2))
        self.barrier = pipeline.NamedBarrier(barrier_id=Barrier.EPI_WG0 + cwg, num_threads=THREADS_PER_WG)
        self.tile_barrier = (self.barrier if own
                             else pipeline.NamedBarrier(barrier_id=int(Barrier.EPI_TILE), num_threads=self.epi_threads))
        self.is_store_warp = wg_tid < 32
        # policy smem of the tile: step k gets a (2, floats) tensor, buffer [parity] per tile; unless
        # coop, each warpgroup has its own copy
        self._smem = []
        offset = cwg * (gemm.epi_floats() // gemm.num_consumer_wg) if own else 0
        parity_stride = 0 if own else 1     # own copy: both parities index the same buffer
        for step in self.chain.steps:
            floats = step.smem_floats(self.tile_n)
            if floats:
                self._smem.append(cute.make_tensor(epi_mem.data_ptr() + offset,
                                                   cute.make_layout((2, floats), stride=(floats * parity_stride, 1))))
            else:
                self._smem.append(None)
            offset += floats * (1 + parity_stride)
        self.uses_smem = gemm.epi_floats() > 0
        self._step = 0
        self.states = []
        for k, (step, tensors) in enumerate(zip(self.chain.steps, self.chain.split(epi_args))):
            self._step = k
            self.states.append(step.setup(self, *tensors))

    # ---- helpers for policies ----
    def smem(self):
        """This step's tile-shared smem, (2, floats) Float32: index [tile.parity, i] (call in setup)."""
        return self._smem[self._step]

    def thread_row(self, slot: int):
        """Row (inside the 64-row slab) of this thread's row slot 0 or 1."""
        return self.tCcD[2 * slot][0]

    def out_coord(self, tile, j: int, i: int):
        """Global (row, D column) of value i of output subtile j (for loads ahead of the subtile)."""
        rc = self.tCcD[i]
        return tile.row0 + rc[0], tile.out_col0 + j * self.g.epi_n + rc[1]

    @cute.jit
    def gemm_col(self, tile, local):
        """GEMM column (row of W) of tile-local accumulator column `local`."""
        if const_expr(self.g.split):   # gate half, then the matching rows of the up half (I = N/2)
            half = self.g.half_n
            return tile.tn * half + local + (self.n // 2 - half if local >= half else 0)
        return tile.col0 + local

    @cute.jit
    def in_bounds(self, r, c):
        """(row, D column) is a real output element."""
        return r < self.m and c < self.n_out

    def col_ok(self, c):
        return c < self.n_out

    def row_clamp(self, r):
        return cutlass.min(r, self.m - 1)

    def col_clamp(self, c):
        return cutlass.min(c, self.n - 1)

    def out_col_clamp(self, c):
        return cutlass.min(c, self.n_out - 1)

    def _frag(self, vals, flat, tile, col0, col_shift=0):
        """Frag over registers `vals`; element i is accumulator register flat(i) of the tile, whose
        tile-local column is shifted by col_shift (output-subtile offset) and globalized by col0."""
        def local(i):
            rc = self.tCcD[flat(i)]
            return rc[0], rc[1] + col_shift

        def coord(i):
            r, c = local(i)
            return tile.row0 + r, col0 + c

        frag = Frag(vals, coord, lambda i: (i // 2) % 2, local)
        frag.tile = tile
        return frag

    def _tile(self, slab, tn, parity):
        g = self.g
        return Tile(slab * 64, tn * g.cfg.tile_n, tn * g.out_tile_n, tn, parity)

    @cute.jit
    def prefetch(self, slab: Int32, tn: Int32, parity: Int32):
        """Before the tile's mainloop: policies issue their global loads."""
        tile = self._tile(slab, tn, parity)
        for step, st in zip(self.chain.steps, self.states):
            step.prefetch(st, tile)

    @cute.jit
    def run_tile(self, acc: cute.Tensor, slab: Int32, tn: Int32, parity: Int32):
        """Epilogue of one tile for this warpgroup's 64-row slab `slab` (global index of 64-row slabs)."""
        g, chain, S = self.g, self.chain, self.S
        tile = self._tile(slab, tn, parity)
        for step, st in zip(chain.steps, self.states):
            step.begin_tile(st, tile)
        if const_expr(self.uses_smem):
            self.tile_barrier.arrive_and_wait()   # policy smem of this tile written by all its threads
        t0, n_pre = chain.n_tile, len(chain.pre)
        pre_states = self.states[t0 : t0 + n_pre]
        post_states = self.states[len(chain.steps) - 1 - len(chain.post) : -1]
        if const_expr(t0 > 0):
            # whole-tile maps edit the accumulators in place
            frag = self._frag(acc, lambda i: i, tile, tile.col0)
            frag.subtile = None
            for step, st in zip(chain.tile, self.states[:t0]):
                step.visit(st, frag)

        for j in cutlass.range_constexpr(g.n_sub):
            if tile.out_col0 + j * g.epi_n < self.n_out:   # uniform over the warpgroup
                self._subtile(acc, tile, slab, j, pre_states, post_states)

        for step, st in zip(chain.steps, self.states):
            step.end_tile(st, tile)

    @cute.jit
    def _subtile(self, acc: cute.Tensor, tile, slab: Int32, j: int, pre_states, post_states):
        """Output subtile j: gather -> maps / pair / maps -> convert -> stmatrix -> TMA store."""
        g, chain, S = self.g, self.chain, self.S
        vals = cute.make_rmem_tensor((S,), Float32)
        if const_expr(chain.pair is None):
            for e in cutlass.range_constexpr(S):
                vals[e] = acc[j * S + e]
            frag = self._frag(vals, lambda i: j * S + i, tile, tile.col0)
            frag.subtile = j
            for step, st in zip(chain.pre, pre_states):
                step.visit(st, frag)
        else:
            self._pair(acc, vals, j, tile)
        # output subtile j: the accumulator layout of chunk 0, shifted by j * epi_n output columns
        out_frag = self._frag(vals, lambda i: i, tile, tile.out_col0, col_shift=j * g.epi_n)
        out_frag.subtile = j
        for step, st in zip(chain.post, post_states):
            step.visit(st, out_frag)
        rD = cute.make_rmem_tensor(self.rD_shape, g.d_dtype)
        rD.store(chain.store.convert(self.states[-1], out_frag))

        buf = self.buf0 + j % g.cfg.epi_stages
        cute.copy(self.r2s, rD, self.tRS_sD[(None, None, None, buf)])
        # make the generic-proxy smem writes visible to the TMA (async proxy), then store
        cute.arch.fence_proxy("async.shared", space="cta")
        self.barrier.arrive_and_wait()
        if self.is_store_warp:
            cute.copy(self.tma_d, self.bSG_sD[(None, buf)], self.bSG_gD[(None, slab, tile.out_col0 // g.epi_n + j)])
            cute.arch.cp_async_bulk_commit_group()
            # this buffer is written again epi_stages subtiles later: allow that many in flight - 1
            cute.arch.cp_async_bulk_wait_group(g.cfg.epi_stages - 1, read=True)
        self.barrier.arrive_and_wait()

    @cute.jit
    def _pair(self, acc, out, j, tile):
        """Gather gate/up accumulators for output subtile j, run pre-pair maps, combine into `out`."""
        g, chain, S = self.g, self.chain, self.S
        pair_states = self.states[chain.n_tile : chain.n_tile + len(chain.pre) + 1]
        both = cute.make_rmem_tensor((2 * S,), Float32)
        if const_expr(chain.pair.layout == "interleaved"):
            # GEMM columns 2c (gate) and 2c+1 (up) are adjacent registers of one thread
            base = 2 * j * S
            for e in cutlass.range_constexpr(2 * S):
                both[e] = acc[base + e]
            frag = self._frag(both, lambda i: base + i, tile, tile.col0)
            for step, st in zip(chain.pre, pair_states):
                step.visit(st, frag)
            # pair p = registers (2p, 2p+1): row slot p % 2, output column 4 * (p // 2) + lane % 4 ...
            half = cute.make_rmem_tensor((S,), Float32)
            for p in cutlass.range_constexpr(S):
                half[p] = chain.pair.combine(pair_states[-1], both[2 * p], both[2 * p + 1])
            # ... while the accumulator layout wants columns (2q, 2q + 1) of each 8: swap in the quad
            _quad_permute_pairs(half, out)
        else:
            # split: tile columns [0, bn/2) are gate rows tn*bn/2..., [bn/2, bn) the matching up rows
            gbase = j * S
            ubase = (j + g.n_sub) * S
            for e in cutlass.range_constexpr(S):
                both[e] = acc[gbase + e]
                both[S + e] = acc[ubase + e]
            frag = self._frag(both, lambda i: gbase + i if i < S else ubase + i - S, tile, 0)
            gate0 = tile.tn * g.half_n                    # GEMM column of local column 0 (gate half)
            up0 = self.n // 2 + gate0 - g.half_n          # ... and of local column bn/2 (up half) - bn/2
            frag._coord = lambda i: (tile.row0 + frag.local(i)[0], (gate0 if i < S else up0) + frag.local(i)[1])
            for step, st in zip(chain.pre, pair_states):
                step.visit(st, frag)
            for e in cutlass.range_constexpr(S):
                out[e] = chain.pair.combine(pair_states[-1], both[e], both[S + e])

    @cute.jit
    def finish(self):
        for step, st in zip(self.chain.steps, self.states):
            step.finish(st)
        if self.is_store_warp:
            cute.arch.cp_async_bulk_wait_group(0, read=True)   # smem must outlive the last TMA store


@cute.jit
def _quad_permute_pairs(src: cute.Tensor, dst: cute.Tensor):
    """Pair order -> WGMMA accumulator order after an interleaved pair step.

    In pair order, quad lane q holds output columns q (`lo`, from accumulator atom 2b) and q + 4
    (`hi`, atom 2b+1) of each 8-column output atom b; the accumulator layout wants (2q, 2q+1).
    Two shuffles per value pair: lanes 0/3 send (lo, hi), lanes 1/2 send (hi, lo), and read from
    lanes (0,1), (3,2), (1,0), (2,3) of the quad respectively.
    """
    lane = cute.arch.lane_idx()
    q = lane % 4
    straight = q == 0 or q == 3
    src1 = q // 2 if q % 2 == 0 else 3 - q // 2
    quad0 = lane - q
    for b in cutlass.range_constexpr(cute.size(src) // 4):
        for r in cutlass.range_constexpr(2):
            lo = src[4 * b + r]
            hi = src[4 * b + 2 + r]
            x1 = cute.arch.shuffle_sync(lo if straight else hi, quad0 + src1)
            x2 = cute.arch.shuffle_sync(hi if straight else lo, quad0 + (src1 ^ 1))
            dst[4 * b + 2 * r + 0] = x1 if straight else x2
            dst[4 * b + 2 * r + 1] = x2 if straight else x1


def compile_target(ab: str = "e4m3", policy: str = "bf16", tile_n: int = 256, cluster_m: int = 2,
                   schedule: str = "coop", group_m: int = 8, extra=None, cluster_n: int = 1):
    """Factory for the futx runtime: (jit_callable, fake_args) of one variant.

    M, N, K are symbolic (K, N multiples of 16 elements for TMA); the caller passes
    (A, B, D, *policy tensors, [workspace, counters, splits: coop only,] num_sms) and the stream comes from
    the TVM-FFI environment.
    `policy` names a shipped chain, or "chain-<fingerprint>" for the composed chain passed as `extra`.
    """
    if policy.startswith("chain-"):
        from futx.runtime.catalog.prefill import chain_name

        if extra is None or chain_name(extra) != policy:
            raise ValueError(f"kernel {policy!r} needs its Chain (KernelSpec.extra) with that fingerprint")
        chain = extra
    else:
        chain = resolve(policy)
    cfg = tile_config(ab, tile_n=tile_n, cluster_m=cluster_m, schedule=schedule, group_m=group_m, cluster_n=cluster_n)
    gemm = PrefillGemm(ab, chain, cfg)
    dt = AB_DTYPES[ab]
    m = cute.sym_int()
    n = cute.sym_int(divisibility=16)
    k = cute.sym_int(divisibility=16)
    fake_a = cute.runtime.make_fake_compact_tensor(dt, (m, k), stride_order=(1, 0), assumed_align=16)
    fake_b = cute.runtime.make_fake_compact_tensor(dt, (n, k), stride_order=(1, 0), assumed_align=16)
    fake_epi = chain.fake_tensors(m, n, cute.sym_int(divisibility=16))
    split_args = ()
    if cfg.split_k:
        from decode.signature import fake_split_args

        split_args = (*fake_split_args(), Int32(1))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return gemm, (fake_a, fake_b, *fake_epi, *split_args, Int32(132), stream)
