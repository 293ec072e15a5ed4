"""futx prefill attention: causal GQA over a packed batch, for Hopper (sm_90a), TMA + WGMMA.

    out[m, h] = softmax_j(scale * q[m, h] . K[slot, h // G, j]) @ V[slot, h // G, j],  j in [0, pos(m)]

q [M, Hq, D] holds the packed new rows of R requests (request r owns rows [cu_seqlens[r], cu_seqlens[r+1]));
K/V live in the BF16 cache [slots, Hkv, capacity, D] that the QKV prefill epilogue wrote (futx.kvcache.KVCache
layout); row i of request r sits at position start_pos[r] + i and attends to cache positions
[0, start_pos[r] + i] of slot[r] (chunked prefill: the first start_pos[r] positions were cached earlier).
G = Hq / Hkv (1..16, any value) and every size except D are runtime values.

CTA anatomy (384 threads, one work tile per CTA):

  work tile   (request, query tile, KV head). The G query heads of the KV head are stacked into the MMA's
              M side: CTA row i = token (i // G) of the tile, query head h * G + (i % G), so a tile holds
              T = 128 // G tokens x G heads and every K/V tile loaded serves the whole group. When G does
              not divide 128, rows T * G .. 127 are idle: their token index i // G = T is never < the
              tile's valid token count, so (like the rows past a request's end) their Q is not loaded and
              their O is not stored; MMA rows never mix (each S / P / O row and its quad-reduced max and
              sum are that row's own), so whatever those rows hold stays in them.
              blockIdx.x walks the flattened (request, query tile) list backwards (the last, longest
              tiles of the last request start first); blockIdx.y is the KV head.
  warpgroup 0 producer: one warp streams (K, V) tile pairs of 128 keys by TMA (the cache viewed as
              (capacity, D, Hkv, slots)) into a `stages`-deep ring (full mbarrier with transaction
              bytes, empty mbarrier with one arrive per consumer warp). Only the tiles up to the tile's
              last causal key are loaded.
  warpgroups 1, 2 consumers: load Q (cp.async, one 16-byte chunk per row segment, rows past the
              request's end skipped), then per K/V tile: S = Q K^T (WGMMA 64 x 128 per warpgroup, Q and
              K from shared memory), causal mask only on tiles that cross the diagonal, online softmax in
              FP32 with exp2 (row max / sum across the 4 lanes of a quad), P converted to BF16 in
              registers and O += P V (WGMMA with A from registers, V read MN-major from shared memory).
              At the end O / l goes through shared memory (stmatrix, into Q's buffer) to 16-byte stores
              of the valid rows.

Cache rows past the request's last position (never written in this prefill: NaN in futx's reference
cache) can only appear in the last K/V tile of a request's last query tile: masked scores are replaced
(not added to), and those V rows are zeroed in shared memory before P V, since 0 * NaN would poison
valid rows.

Shared memory: Q 128 x D, stages x (K + V) 128 x D tiles, BF16 with the 128-byte swizzle
(D = 128: 32 KiB + 3 x 64 KiB; D = 64: 16 KiB + 4 x 32 KiB).

Paged cache (compile-time page size P > 0, futx.paging): the caches are [pages + 1, Hkv, P, D] (the slot mode
is the page mode) and a block table int32 [slots + 1, max_pages] is one more argument. The TMA view is the same
(now (P, D, Hkv, pages)); only the producer's tile coordinates change: K/V tile n of request r is in-page tile
(128 n) % P / 128 of page table[slot[r], (128 n) // P]. P is a multiple of 128, so a tile never straddles two
pages, and the consumers are unchanged: rows past the request's end in its last page (anything, e.g. another
request's old rows) are masked and zeroed in V like the unwritten rows of a contiguous slot. P = 0 is the
contiguous kernel, traced from the same code as before.
"""

from __future__ import annotations

import math
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from futx.hardware import SMEM_PER_CTA

HEAD_DIMS = (64, 128)
TILE_M = 128          # CTA rows (tokens x group heads), 64 per consumer warpgroup
TILE_N = 128          # keys per K/V tile
THREADS_PER_WG = 128
LOG2_E = math.log2(math.e)


def stages_for(head_dim: int) -> int:
    """As many (K, V) stages as fit next to Q (at most 4)."""
    q_bytes = TILE_M * head_dim * 2
    stage_bytes = 2 * TILE_N * head_dim * 2
    return min(4, (SMEM_PER_CTA - q_bytes - 2048) // stage_bytes)


def _acc_mn_view(t: cute.Tensor) -> cute.Tensor:
    """A WGMMA accumulator ((2, 2, V), M, N) seen as (rows, cols) = ((2, M), (2, V, N))."""
    l = cute.make_layout(t.layout.shape)
    shape = ((l.shape[0][1], l.shape[1]), (l.shape[0][0], l.shape[0][2], l.shape[2]))
    stride = ((l.stride[0][1], l.stride[1]), (l.stride[0][0], l.stride[0][2], l.stride[2]))
    return cute.make_tensor(t.iterator, cute.composition(t.layout, cute.make_layout(shape, stride=stride)))


def _acc_as_frg_a(t: cute.Tensor) -> cute.Tensor:
    """A BF16-MMA accumulator ((2, 2, V), M, N) seen as the A-operand fragment ((2, 2, 2), M, (V / 2, N)) of
    the next WGMMA (the k = 16 A fragment covers two 8-column accumulator atoms)."""
    l = cute.logical_divide(t.layout, ((None, None, 2), None, None))
    shape = ((l.shape[0][0], l.shape[0][1], l.shape[0][2][0]), l.shape[1], (l.shape[0][2][1], l.shape[2]))
    stride = ((l.stride[0][0], l.stride[0][1], l.stride[0][2][0]), l.stride[1], (l.stride[0][2][1], l.stride[2]))
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


class PrefillAttention:
    """One compiled variant (head dim; page size, 0 = contiguous cache)."""

    def __init__(self, head_dim: int, page_size: int = 0):
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
        if page_size < 0 or page_size % TILE_N:
            raise ValueError(f"page_size must be 0 (contiguous) or a positive multiple of {TILE_N}, got {page_size}")
        self.hd = head_dim
        self.page_size = page_size
        self.stages = stages_for(head_dim)
        self.threads = 3 * THREADS_PER_WG
        self.producer_regs = 40
        self.consumer_regs = 232
        self.num_consumer_warps = 8

    # ---------------------------------------------------------------------------------------------
    # host side (traced once per compile)
    # ---------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mCu: cute.Tensor, mStart: cute.Tensor,
                 mSlot: cute.Tensor, mO: cute.Tensor, scale: Float32, stream,
                 mTable: Optional[cute.Tensor] = None):
        hd = self.hd
        if const_expr((mTable is None) != (self.page_size == 0)):
            raise ValueError("a block table goes with a paged variant (page_size > 0) and only with one")
        if const_expr(mQ.element_type != BFloat16 or mK.element_type != BFloat16 or mO.element_type != BFloat16):
            raise TypeError("q, the caches and out must be bfloat16")
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, BFloat16, hd), BFloat16)
        q_layout = cute.tile_to_shape(atom, (TILE_M, hd), order=(0, 1))
        kv_layout = cute.tile_to_shape(atom, (TILE_N, hd, self.stages), order=(0, 1, 2))
        kv_one = cute.select(kv_layout, mode=[0, 1])
        # the caches [slots, Hkv, cap, D] as (cap, D, Hkv, slots): one (cap, D) matrix per (head, slot)
        # (paged: [pages + 1, Hkv, P, D] as (P, D, Hkv, pages))
        mKt = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[2, 3, 1, 0]))
        mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[2, 3, 1, 0]))
        tma_k, gK_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mKt, kv_one, (TILE_N, hd))
        tma_v, gV_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mVt, kv_one, (TILE_N, hd))
        self.tma_bytes = 2 * cute.size_in_bytes(BFloat16, kv_one)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(kv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(kv_layout)], 1024]
            kv_mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]

        if const_expr(SharedStorage.size_in_bytes() > SMEM_PER_CTA):
            raise ValueError(f"{SharedStorage.size_in_bytes()} bytes of shared memory > {SMEM_PER_CTA}")
        self.shared_storage = SharedStorage

        hq = mQ.shape[1]
        hkv = mK.shape[1]
        group = hq // hkv
        block_t = TILE_M // group                     # tokens per work tile (T; rows T*G.. idle)
        num_req = mStart.shape[0]
        # an upper bound of sum_r ceil(len_r / block_t); the surplus CTAs exit at once
        tiles = (mQ.shape[0] + block_t - 1) // block_t + num_req
        self.kernel(mQ, mO, mCu, mStart, mSlot, tma_k, gK_tma, tma_v, gV_tma, q_layout, kv_layout,
                    scale * LOG2_E, group, block_t, mTable).launch(
            grid=(tiles, hkv, 1), block=(self.threads, 1, 1), stream=stream)

    def make_mmas(self):
        k_major, mn_major = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        qk = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, k_major, k_major, Float32, (2, 1, 1),
                                               tiler_mn=(64, TILE_N))
        pv = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, k_major, mn_major, Float32, (2, 1, 1),
                                               tiler_mn=(64, self.hd), a_source=warpgroup.OperandSource.RMEM)
        return qk, pv

    def row_copy(self, op):
        """A tiled copy of the 256 consumer threads moving 16-byte chunks of (TILE_M, hd) row-major tiles."""
        tpr = self.hd // 8
        atom = cute.make_copy_atom(op, BFloat16, num_bits_per_copy=128)
        return cute.make_tiled_copy_tv(atom, cute.make_layout((2 * THREADS_PER_WG // tpr, tpr), stride=(tpr, 1)),
                                       cute.make_layout((1, 8)))

    # ---------------------------------------------------------------------------------------------
    # device side
    # ---------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mO: cute.Tensor, mCu: cute.Tensor, mStart: cute.Tensor, mSlot: cute.Tensor,
               tma_k: cute.CopyAtom, gK_tma: cute.Tensor, tma_v: cute.CopyAtom, gV_tma: cute.Tensor,
               q_layout: cute.ComposedLayout, kv_layout: cute.ComposedLayout, scale_log2: Float32,
               group: Int32, block_t: Int32, mTable: Optional[cute.Tensor]):
        hd = self.hd
        tidx, _, _ = cute.arch.thread_idx()
        bidx, head_kv, _ = cute.arch.block_idx()
        gdx, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = warp_idx // 4

        # ---- which (request, query tile) this CTA owns: walk the per-request tile counts ----
        lin = gdx - 1 - bidx
        req = Int32(-1)
        qt = Int32(0)
        seen = Int32(0)
        for r in cutlass.range(mStart.shape[0], unroll=1):
            n_r = mCu[r + 1] - mCu[r]
            t_r = (n_r + block_t - 1) // block_t
            if lin >= seen and lin < seen + t_r:
                req = r
                qt = lin - seen
            seen += t_r

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        if req >= 0:
            row0 = mCu[req]
            seqlen = mCu[req + 1] - row0
            start = mStart[req]
            slot = mSlot[req]
            tok0 = qt * block_t
            n_tok = cutlass.min(block_t, seqlen - tok0)       # valid tokens of this tile
            kv_end = start + tok0 + n_tok                     # keys [0, kv_end) are visible to some row
            kv_total = start + seqlen                         # cache rows written for this request
            n_tiles = (kv_end + TILE_N - 1) // TILE_N
            n_plain = (start + tok0 + 1) // TILE_N            # tiles below the diagonal: no mask

            kv_pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.kv_mbar.data_ptr(),
                num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_warps),
                tx_count=self.tma_bytes,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            )
            sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
            sK = storage.sK.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
            sV = storage.sV.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)

            if wg_idx == 0:
                # ======================= producer warpgroup =======================
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if warp_idx == 0:
                    cpasync.prefetch_descriptor(tma_k)
                    cpasync.prefetch_descriptor(tma_v)
                    if const_expr(self.page_size == 0):
                        gK = cute.local_tile(gK_tma[None, None, head_kv, slot], (TILE_N, hd), (None, 0))
                        gV = cute.local_tile(gV_tma[None, None, head_kv, slot], (TILE_N, hd), (None, 0))
                        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                                           cute.group_modes(gK, 0, 2))
                        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                                           cute.group_modes(gV, 0, 2))
                        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                        for n in cutlass.range(n_tiles, unroll=1):
                            kv_pipe.producer_acquire(state)
                            bar = kv_pipe.producer_get_barrier(state)
                            cute.copy(tma_k, tKgK[(None, n)], tKsK[(None, state.index)], tma_bar_ptr=bar)
                            cute.copy(tma_v, tVgV[(None, n)], tVsV[(None, state.index)], tma_bar_ptr=bar)
                            kv_pipe.producer_commit(state)
                            state.advance()
                        kv_pipe.producer_tail(state)
                    else:
                        self.produce_paged(mTable, slot, head_kv, n_tiles, kv_pipe, sK, sV, tma_k, gK_tma, tma_v,
                                           gV_tma)
            else:
                # ======================= consumer warpgroups =======================
                cute.arch.setmaxregister_increase(self.consumer_regs)
                ctid = tidx - THREADS_PER_WG
                self.consume(mQ, mO, sQ, sK, sV, kv_pipe, ctid, row0, tok0, n_tok, start, head_kv, group,
                             n_tiles, n_plain, kv_total, scale_log2)

    @cute.jit
    def produce_paged(self, mTable, slot, head_kv, n_tiles, kv_pipe, sK, sV, tma_k, gK_tma, tma_v, gV_tma):
        """The producer loop over a paged cache: tile n from page table[slot, n // (P / 128)], in-page tile
        n % (P / 128) (the page's (P, D) matrix of this head, partitioned per tile like a contiguous slot's)."""
        hd = self.hd
        per_page = self.page_size // TILE_N
        last_entry = mTable.shape[1] - 1
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for n in cutlass.range(n_tiles, unroll=1):
            # the host checked every tile's entry exists; the clamp keeps a bad batch inside the table
            page = mTable[slot, cutlass.min(n // per_page, last_entry)]   # loaded before the ring slot frees
            gK = cute.local_tile(gK_tma[None, None, head_kv, page], (TILE_N, hd), (None, 0))
            gV = cute.local_tile(gV_tma[None, None, head_kv, page], (TILE_N, hd), (None, 0))
            tKsK, tKgK = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                               cute.group_modes(gK, 0, 2))
            tVsV, tVgV = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                               cute.group_modes(gV, 0, 2))
            t = n - (n // per_page) * per_page
            kv_pipe.producer_acquire(state)
            bar = kv_pipe.producer_get_barrier(state)
            cute.copy(tma_k, tKgK[(None, t)], tKsK[(None, state.index)], tma_bar_ptr=bar)
            cute.copy(tma_v, tVgV[(None, t)], tVsV[(None, state.index)], tma_bar_ptr=bar)
            kv_pipe.producer_commit(state)
            state.advance()
        kv_pipe.producer_tail(state)

    @cute.jit
    def consume(self, mQ, mO, sQ, sK, sV, kv_pipe, ctid, row0, tok0, n_tok, start, head_kv, group, n_tiles,
                n_plain, kv_total, scale_log2):
        hd = self.hd
        all_consumers = pipeline.NamedBarrier(barrier_id=1, num_threads=2 * THREADS_PER_WG)
        head0 = head_kv * group

        # ---- Q: rows (token i // G, head h G + i % G), 16-byte cp.async chunks; rows past the request skipped ----
        q_copy = self.row_copy(cpasync.CopyG2SOp())
        thr_q = q_copy.get_slice(ctid)
        tQsQ = thr_q.partition_D(sQ)
        tQcQ = thr_q.partition_S(cute.make_identity_tensor((TILE_M, hd)))
        self._valid_rows(tQcQ, mQ, row0, tok0, head0, group, n_tok,
                         lambda m, k, src: cute.copy(q_copy, src, tQsQ[None, m, k]))
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_proxy("async.shared", space="cta")   # generic-proxy writes -> WGMMA reads
        all_consumers.arrive_and_wait()

        # ---- MMA partitions: warpgroup w owns rows [64 w, 64 w + 64) ----
        mma_qk, mma_pv = self.make_mmas()
        wg_slice = (ctid // THREADS_PER_WG) * THREADS_PER_WG
        wg_qk = mma_qk.get_slice(wg_slice)
        wg_pv = mma_pv.get_slice(wg_slice)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        sVt = cute.composition(sV, cute.make_ordered_layout((hd, TILE_N, self.stages), order=(1, 0, 2)))
        tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(sVt))
        acc_s = cute.make_rmem_tensor(wg_qk.partition_shape_C((TILE_M, TILE_N)), Float32)
        acc_o = cute.make_rmem_tensor(wg_pv.partition_shape_C((TILE_M, hd)), Float32)
        acc_o.fill(0.0)
        s_mn = _acc_mn_view(acc_s)
        o_mn = _acc_mn_view(acc_o)
        c_mn = _acc_mn_view(mma_qk.get_slice(ctid).partition_C(cute.make_identity_tensor((TILE_M, TILE_N))))
        p_view = _acc_as_frg_a(acc_s)
        rows = cute.size(s_mn, mode=[0])
        cols = cute.size(s_mn, mode=[1])
        row_max = cute.make_rmem_tensor((rows,), Float32)
        row_sum = cute.make_rmem_tensor((rows,), Float32)
        row_pos = cute.make_rmem_tensor((rows,), Int32)
        for r in cutlass.range_constexpr(rows):
            row_max[r] = -Float32.inf
            row_sum[r] = 0.0
            row_pos[r] = start + tok0 + c_mn[r, 0][0] // group

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for n in cutlass.range(n_tiles, unroll=1):
            kv_pipe.consumer_wait(read)
            # ---- S = Q K^T ----
            qk_atom = cute.make_mma_atom(mma_qk.op)
            qk_atom.set(warpgroup.Field.ACCUMULATE, False)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                cute.gemm(qk_atom, acc_s, tSrQ[None, None, kb], tSrK[None, None, kb, read.index], acc_s)
                qk_atom.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

            # ---- causal mask (diagonal tiles only): key > position -> -inf (replaces NaN of unwritten rows) ----
            if n >= n_plain:
                for r in cutlass.range_constexpr(rows):
                    limit = row_pos[r] - n * TILE_N
                    for c in cutlass.range_constexpr(cols):
                        if c_mn[r, c][1] > limit:
                            s_mn[r, c] = -Float32.inf

            # ---- online softmax (FP32, exp2), O rescaled ----
            for r in cutlass.range_constexpr(rows):
                m_tile = s_mn[r, 0]
                for c in cutlass.range_constexpr(1, cols):
                    m_tile = cute.arch.fmax(m_tile, s_mn[r, c])
                m_tile = cute.arch.warp_reduction_max(m_tile, threads_in_group=4)
                m_new = cute.arch.fmax(row_max[r], m_tile)
                m_safe = 0.0 if m_new == -Float32.inf else m_new
                base = m_safe * scale_log2
                corr = cute.math.exp2(row_max[r] * scale_log2 - base, fastmath=True)
                row_max[r] = m_new
                part = Float32(0.0)
                for c in cutlass.range_constexpr(cols):
                    p = cute.math.exp2(s_mn[r, c] * scale_log2 - base, fastmath=True)
                    s_mn[r, c] = p
                    part += p
                row_sum[r] = row_sum[r] * corr + part
                for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                    o_mn[r, c] = o_mn[r, c] * corr
            r_p = cute.make_rmem_tensor(p_view.shape, BFloat16)
            r_p.store(p_view.load().to(BFloat16))

            # ---- cache rows past the request's end (last tile only): zero them in V ----
            tail = kv_total - n * TILE_N
            if tail < TILE_N:
                per = (TILE_N * hd) // (2 * THREADS_PER_WG)
                for e in cutlass.range_constexpr(per):
                    idx = e * 2 * THREADS_PER_WG + ctid
                    vr = idx // hd
                    if vr >= tail:
                        sV[vr, idx - vr * hd, read.index] = BFloat16(0.0)
                cute.arch.fence_proxy("async.shared", space="cta")
                all_consumers.arrive_and_wait()

            # ---- O += P V ----
            pv_atom = cute.make_mma_atom(mma_pv.op)
            pv_atom.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(tOrVt, mode=[2])):
                cute.gemm(pv_atom, acc_o, r_p[None, None, kb], tOrVt[None, None, kb, read.index], acc_o)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            kv_pipe.consumer_release(read)
            read.advance()

        # ---- O / l -> BF16 -> shared memory (Q's buffer; each warpgroup rewrites only its own rows) ----
        for r in cutlass.range_constexpr(rows):
            total = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
            inv = 0.0 if total == 0.0 else 1.0 / total
            for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                o_mn[r, c] = o_mn[r, c] * inv
        r_o = cute.make_rmem_tensor(acc_o.shape, BFloat16)
        r_o.store(acc_o.load().to(BFloat16))
        st_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), BFloat16)
        r2s = cute.make_tiled_copy_C(st_atom, mma_pv)
        thr_r2s = r2s.get_slice(ctid)
        cute.copy(r2s, thr_r2s.retile(r_o), thr_r2s.partition_D(sQ))
        all_consumers.arrive_and_wait()

        # ---- shared memory -> out, 16-byte stores of the valid rows ----
        o_copy = self.row_copy(cute.nvgpu.CopyUniversalOp())
        thr_o = o_copy.get_slice(ctid)
        tOsO = thr_o.partition_S(sQ)
        tOcO = thr_o.partition_S(cute.make_identity_tensor((TILE_M, hd)))
        r_out = cute.make_rmem_tensor_like(tOsO)
        cute.autovec_copy(tOsO, r_out)
        self._valid_rows(tOcO, mO, row0, tok0, head0, group, n_tok,
                         lambda m, k, dst: cute.copy(o_copy, r_out[None, m, k], dst))

    @cute.jit
    def _valid_rows(self, coords, mX, row0, tok0, head0, group, n_tok, move):
        """For the tile rows of a thread's (TILE_M, hd) partition `coords` that hold a token of the request (row
        i = token i // G, head h G + i % G): move(m, k, chunk) with its k-th 8-element chunk of mX [tokens,
        heads, hd] (Q loads and O stores share this walk)."""
        for m in cutlass.range_constexpr(cute.size(coords.shape[1])):
            row = coords[0, m, 0][0]
            tok = row // group
            if tok < n_tok:
                chunks = cute.tiled_divide(mX[row0 + tok0 + tok, head0 + row - tok * group, None], (8,))
                for k in cutlass.range_constexpr(cute.size(coords.shape[2])):
                    move(m, k, chunks[None, coords[0, 0, k][1] // 8])


def compile_target(head_dim: int = 128, page_size: int = 0):
    """Registry factory (docs/kernel-contract.md): (jit function, fake arguments) of one head dim and page size.

    Arguments: q [M, Hq, D], k_cache, v_cache [slots, Hkv, cap, D] (bfloat16), cu_seqlens [R + 1],
    start_pos [R], slot [R] (int32), out [M, Hq, D] bfloat16, scale (float); the stream comes from the
    TVM-FFI environment. M, Hq, Hkv, slots, cap and R are runtime values.
    page_size > 0 (paged cache, futx.paging): k_cache, v_cache [pages + 1, Hkv, P, D] and one more argument
    after slot, the block table int32 [slots + 1, max_pages] (both extents runtime values)."""
    kern = PrefillAttention(head_dim, page_size)

    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    def t(dtype, shape, align=16):
        return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))),
                                        assumed_align=align)

    m, hq, hkv, slots, cap, r1, r = (cute.sym_int() for _ in range(7))
    q, k, v = t(BFloat16, (m, hq, head_dim)), t(BFloat16, (slots, hkv, cap, head_dim)), \
        t(BFloat16, (slots, hkv, cap, head_dim))
    batch = (t(Int32, (r1,), 4), t(Int32, (r,), 4), t(Int32, (r,), 4))
    tail = (t(BFloat16, (m, hq, head_dim)), Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True))

    if page_size == 0:
        @cute.jit
        def prefill_attention(q: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor, cu_seqlens: cute.Tensor,
                              start_pos: cute.Tensor, slot: cute.Tensor, out: cute.Tensor, scale: Float32, stream):
            kern(q, k_cache, v_cache, cu_seqlens, start_pos, slot, out, scale, stream)

        return prefill_attention, (q, k, v, *batch, *tail)

    @cute.jit
    def prefill_attention_paged(q: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor, cu_seqlens: cute.Tensor,
                                start_pos: cute.Tensor, slot: cute.Tensor, table: cute.Tensor, out: cute.Tensor,
                                scale: Float32, stream):
        kern(q, k_cache, v_cache, cu_seqlens, start_pos, slot, out, scale, stream, table)

    rows, entries = cute.sym_int(), cute.sym_int()
    return prefill_attention_paged, (q, k, v, *batch, t(Int32, (rows, entries), 4), *tail)
