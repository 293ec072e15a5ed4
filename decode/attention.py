"""GQA decode attention over the BF16 cache or its INT4 / E4M3 mirror, with the cache write fused in.

One CTA per (split, KV head, sequence); its warps stream disjoint 32- (or 16-) token tiles of that
sequence's cache range through their own cp.async rings (keys, values and per-token scales of a tile
travel together) and run the two products on tensor cores (see attn_plan.py for the formulation):
  * INT4 keys arrive in mma.sync B-fragment byte order: each lane loads its own contiguous segment and
    fills its operand registers from it, either through a 256-entry shared-memory byte -> f16x2 table
    (k_dequant "lut", variant "table") or, by default (measured faster), by "pair" dequantization without
    the table: one lop3 + one hadd2 per register, on nibbles 16 bits apart (the query fragment is permuted
    to match). Values stay in natural order and are regrouped from shared memory (two tokens' bytes ->
    "pair" by default, or prmt + f16 magic-number arithmetic, or the table). The K scale multiplies the
    finished q.k dot product, the V scale the probability.
  * E4M3 uses cvt.e4m3x2 instead of the table, BF16 the raw registers and ldmatrix.trans for V.
The CTA owning the last split of a sequence writes the new K/V row first (BF16 main copy, and for the
mirrors the Hadamard rotation + quantization + packing), so no separate quantization kernel runs.
The query is rotated once per CTA, the output once per (sequence, head) by whoever finishes it. Split-KV
partials are merged by the last CTA of a (sequence, KV head) to arrive (self-resetting counter).
The decode engine's entry (`fused_qkv`) reads q, k and v as heads of the QKV projection's output and applies
rotate-half RoPE to the query and the new key row as it loads them (lane l holds channels l*n.., its RoPE
partner channels sit in lane l ^ 16), so no RoPE or split kernel runs between the projection and attention.
A paged cache (plan.page_size P > 0, futx.paging) is read through a block table: each tile's page comes from one
table entry (loaded a tile ahead; a tile never straddles a page) and the new row goes to its page's row pos % P;
with page_size 0 the kernel is the contiguous one, unchanged.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint32
import cutlass.memory as cmem

from decode import ptx
from decode import hadamard_warp as hw
from decode import mirror_row
from decode import rope_warp
from decode.attn_plan import (ATTN_TENSORS, E4M3_PAIR_SELECTORS, MAX_GROUP, AttnPlan, default_plan,
                              int4_value_pairs, new_row_prologue_stage)
from decode.splitkv_combine import merge_splits, merge_warps

LOG2E = math.log2(math.e)
PAIR_CONST_OFFSET = 64  # bytes into the 128-byte flag area after the ring (the split flag uses the first 4)
XOR8 = 0x88888888  # signed nibbles -> offset binary (n + 8), for the arithmetic dequantization


class AttnTensors(NamedTuple):
    """Every tensor the kernel may read or write, passed as its one tensor argument. A compile entry fills
    exactly the fields it declares (attn_plan.entry_tensors); the others stay None and the kernel never
    touches them (which ones are used follows from the plan at trace time)."""

    q: Optional[cute.Tensor] = None          # [B, Hq, D] bf16           (unfused entries)
    k_new: Optional[cute.Tensor] = None      # [B, Hkv, D] bf16          (unfused entries)
    v_new: Optional[cute.Tensor] = None      # [B, Hkv, D] bf16          (unfused entries)
    qkv: Optional[cute.Tensor] = None        # [B, Hq + 2 Hkv, D] bf16   (fused_qkv)
    rope: Optional[cute.Tensor] = None       # [>= capacity, D] f32 cos | sin (fused_qkv)
    positions: Optional[cute.Tensor] = None  # [B] int32
    slots: Optional[cute.Tensor] = None      # [B] int32
    block_table: Optional[cute.Tensor] = None  # [S, max_pages] int32 (paged: futx.paging; the cache tensors'
                                             # first mode is then the page, C the page size)
    k_cache: Optional[cute.Tensor] = None    # [S, Hkv, C, D] bf16 main copy (always written)
    v_cache: Optional[cute.Tensor] = None
    k_mirror: Optional[cute.Tensor] = None   # int4 / e4m3 mirror (uint8) and its per-token f32 scales
    k_scale: Optional[cute.Tensor] = None
    v_mirror: Optional[cute.Tensor] = None
    v_scale: Optional[cute.Tensor] = None
    lut: Optional[cute.Tensor] = None        # [256] int32 byte -> f16x2 table (int4; read when plan.uses_lut)
    out: Optional[cute.Tensor] = None        # [B, Hq, D] bf16
    ws_o: Optional[cute.Tensor] = None       # split-KV workspace [B, Hkv, splits, MAX_GROUP, D] f32
    ws_ml: Optional[cute.Tensor] = None      # [B, Hkv, splits, MAX_GROUP, 2] f32
    counters: Optional[cute.Tensor] = None   # [B, Hkv] int32 split-arrival counters


assert AttnTensors._fields == ATTN_TENSORS


def _row_addr(t: cute.Tensor, slot, kvh, elem_bytes: int):
    """64-bit byte address of t[slot, kvh, 0, ...] (the first two modes index slot and KV head)."""
    st = t.layout.stride
    return t.iterator.toint() + (Int64(slot) * Int64(st[0]) + Int64(kvh) * Int64(st[1])) * elem_bytes


def _page_offset(t: cute.Tensor, page, elem_bytes: int):
    """Bytes from t[0, ...] to t[page, ...] of a paged cache tensor, as one unsigned 32 x 32 -> 64-bit multiply
    (page >= 0; a page of one layer holds at most Hkv * P * D * 2 bytes, far below 2^32)."""
    return Int64(Uint32(page)) * Int64(Uint32(t.layout.stride[0] * elem_bytes))


def _div_mod(x, m: int):
    """(x // m, x % m) of a non-negative DSL integer by a constant: a shift and a mask when m is a power of two
    (signed division would add sign fix-ups)."""
    if m & (m - 1) == 0:
        return x >> (m.bit_length() - 1), x & (m - 1)
    return x // m, x % m


class DecodeAttention:
    def __init__(self, plan: AttnPlan):
        plan.check_maps()
        self.p = plan

    def _sync(self) -> None:
        """The CTA barrier of the attention bodies: every thread of a standalone launch (the persistent ring layer,
        decode/persistent_ring.py, meets only its consumer warps: its producer warp never joins)."""
        cute.arch.sync_threads()

    def tensors(self, **given) -> AttnTensors:
        """AttnTensors of a compile entry, by keyword: exactly the tensors its plan declares, in order."""
        if tuple(given) != self.p.tensors:
            raise TypeError(f"decode attention entry passes {tuple(given)}, its plan declares {self.p.tensors}")
        return AttnTensors(**given)

    # ---- host side ----------------------------------------------------------------------------------
    @cute.jit
    def launch(self, t: AttnTensors, softmax_scale: Float32, stream):
        pdl = {"use_pdl": True} if self.p.pdl else {}   # (the plain launch keeps its arguments as they were)
        self.kernel(t, softmax_scale * Float32(LOG2E)).launch(
            grid=(t.ws_o.shape[2], t.k_cache.shape[1], t.out.shape[0]), block=(32 * self.p.warps, 1, 1),
            stream=stream, **pdl)

    # ---- device side --------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, t: AttnTensors, scale_log2: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        split, kvh, b = cute.arch.block_idx()
        nsplit, _, _ = cute.arch.grid_dim()
        smem = cmem.SmemAllocator()
        base = smem.allocate(self.p.smem_bytes, byte_alignment=1024).toint()
        if cutlass.const_expr(self.p.pdl):
            cute.arch.griddepcontrol_launch_dependents()   # the O projection may start streaming its weights
        self.partial(t, scale_log2, split, kvh, b, nsplit, base, tidx, True, self._launch_wait())

    def _launch_wait(self):
        """A dependent launch's wait for the step's inputs (partial's `early_wait`), None for a plain launch."""
        return cute.arch.griddepcontrol_wait if self.p.pdl else None

    def extent(self, t: AttnTensors, b, nsplit):
        """Where row b's new K/V row goes and how its context splits: (pos, slot, bad, page, in-page row, ctx,
        tiles, tiles per split, splits holding tiles). Out-of-range positions or slots never touch the cache: the
        rows come out as NaN (the op validates on the host; this guards graph replays with bad device inputs)."""
        p = self.p
        mKc = t.k_cache
        pos = t.positions[b]
        slot = t.slots[b]
        if cutlass.const_expr(p.paged):  # the new row goes to (row_page, row_off) of the block table
            # (mirror_only: the main copy holds only the staging pages; the mirror's extent counts the pages)
            pages = t.k_scale.shape[0] if cutlass.const_expr(p.mirror_only) else mKc.shape[0]
            bad, row_page, row_off = self.locate_row(t.block_table, pages, slot, pos)
        else:
            cap = mKc.shape[2]
            bad = (pos < 0) | (pos >= cap) | (slot < 0) | (slot >= mKc.shape[0])
            row_page, row_off = slot, pos
        ctx = cutlass.select_(bad, 1, pos + 1)
        tiles = (ctx + p.tile_tokens - 1) // p.tile_tokens
        per_split = (tiles + nsplit - 1) // nsplit
        n_active = cutlass.select_(bad, 0, (tiles + per_split - 1) // per_split)
        return pos, slot, bad, row_page, row_off, ctx, tiles, per_split, n_active

    @cute.jit
    def partial(self, t: AttnTensors, scale_log2: Float32, split, kvh, b, nsplit, base, tidx,
                arrive: cutlass.Constexpr, early_wait=None):
        """One (split, KV head, row): the new K/V row first where this split holds position pos, then this
        split's tokens; with one split holding tiles the finished rows, else the partial into the workspace.
        arrive: the last split to arrive merges the partials (self-resetting counter; the standalone launch);
        otherwise a separate `combine` does (the persistent kernel's combine task). `base`: shared memory of
        plan.smem_bytes, 1024-byte aligned.

        early_wait: how the CTA waits for the QKV projection's output when its first tiles are requested before that
        (None: the inputs are ready at entry). A dependent launch (plan.pdl: griddepcontrol.wait) or the ring layer's
        attention task (its counter) reads before it only what was written before the decode step (or layer) began:
        positions, slots, the block table, the cache rows before each row's position (its first tiles, the new row's
        position zero-filled: `prefetch`) and the INT4 table; everything else (the QKV projection's output, the new
        row, the output, the workspace and the counters) after it."""
        p = self.p
        early = early_wait is not None
        mSlot, mKc, mOut = t.slots, t.k_cache, t.out
        mWsO, mWsML, mCnt = t.ws_o, t.ws_ml, t.counters
        mQ = self._heads(t, "q")
        D, n, NW = p.head_dim, p.per_lane, p.warps
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(tidx // 32)
        hkv = mKc.shape[1]
        hq = mOut.shape[1]
        group = hq // hkv
        # fused_qkv: q, k, v are heads [0, hq), [hq, hq + hkv), [hq + hkv, hq + 2 hkv) of mQ
        k_head = kvh
        v_head = kvh
        if cutlass.const_expr(p.fused_qkv):
            k_head = hq + kvh
            v_head = hq + hkv + kvh
        pos, slot, bad, row_page, row_off, ctx, tiles, per_split, n_active = self.extent(t, b, nsplit)
        pages = None
        if cutlass.const_expr(p.paged):
            # the pages of this warp's first `stages` tiles, loaded now: their latency overlaps the setup below
            # (new row, query, table) instead of delaying the first copies (a bad row reads table row 0, unused)
            first = split * per_split + warp
            pages = [self.tile_page(t, cutlass.select_(bad, 0, slot), first + i * NW) for i in range(p.stages)]

        s_lut = base
        s_q = base + p.lut_bytes
        s_ring = s_q + p.q_bytes
        s_flag = s_ring + p.ring_bytes

        t_begin = split * per_split   # this split's tiles [t_begin, t_end)
        t_end = cutlass.min(tiles, t_begin + per_split)
        if cutlass.const_expr(early):
            self.prefetch(t, s_ring, slot, kvh, ctx, t_begin, t_end, warp, lane, pages, split < n_active)
            if split < n_active:
                self.setup_tables(t, s_lut, s_flag, tidx, lane)
            early_wait()   # the QKV projection's output is complete from here on

        if bad:
            if split == 0:
                for idx in range(tidx, group * D, 32 * NW):
                    mOut[b, kvh * group + idx // D, idx % D] = BFloat16(float("nan"))

        if split < n_active:
            if split == n_active - 1:  # this CTA's range holds position `pos`: write the new row first
                if warp == 0:
                    self.write_row(t, k_head, b, kvh, row_page, row_off, pos, lane, True)
                if warp == 1:
                    self.write_row(t, v_head, b, kvh, row_page, row_off, pos, lane, False)
                if cutlass.const_expr(early):
                    self._sync()   # the new row is in global memory: its tile is requested again while queries stage
                    self.request_new_row(t, s_ring, slot, kvh, ctx, t_begin, t_end, warp, lane)
            if cutlass.const_expr(not early):   # (set up before the early wait otherwise)
                self.setup_tables(t, s_lut, s_flag, tidx, lane)
            for j in range(warp, MAX_GROUP, NW):
                self.stage_query(mQ, t.rope, pos, s_q, b, kvh, group, j, lane, scale_log2)
            self._sync()  # new row in global memory, table and query in shared memory

            self.attend(t, s_lut, s_q, s_ring, slot, kvh, ctx, t_begin, t_end, warp, lane, scale_log2, pages, early)
            self._sync()  # scratch (the ring) holds every warp's partial

            for h in range(warp, group, NW):
                big, lsum, outs = merge_warps(s_ring, NW, MAX_GROUP, D, h, lane)
                if n_active == 1:
                    self.finish_row(mOut, b, kvh * group + h, lane, outs, lsum)
                else:
                    for i in cutlass.range_constexpr(n):
                        mWsO[b, kvh, split, h, lane * n + i] = outs[i]
                    if lane == 0:
                        mWsML[b, kvh, split, h, 0] = big
                        mWsML[b, kvh, split, h, 1] = lsum

            if cutlass.const_expr(arrive):
                if n_active > 1:
                    cute.arch.fence_acq_rel_gpu()  # publish this thread's partials before the count
                    self._sync()
                    if tidx == 0:
                        cnt_addr = mCnt.iterator.toint() + Int64(cute.crd2idx((b, kvh), mCnt.layout)) * 4
                        arrived = ptx.atomic_add_acq_rel_gpu(cnt_addr, 1)
                        last = Int32(0)
                        if arrived == n_active - 1:
                            last = Int32(1)
                            mCnt[b, kvh] = Int32(0)  # every split has arrived: ready for the next launch
                        ptx.sts32(s_flag, Uint32(last))
                    self._sync()
                    if ptx.lds32(s_flag) != Uint32(0):
                        cute.arch.fence_acq_rel_gpu()
                        self.merge(t, b, kvh, n_active, warp, lane, group)

    @cute.jit
    def merge(self, t: AttnTensors, b, kvh, n_active, warp, lane, group):
        """The finished rows of (row b, KV head kvh) from its n_active split partials in the workspace."""
        n = self.p.per_lane
        res = cute.make_rmem_tensor((n + 1,), Float32)
        for h in range(warp, group, self.p.warps):
            merge_splits(t.ws_o, t.ws_ml, b, kvh, h, lane, n_active, res, self.p.head_dim)
            self.finish_row(t.out, b, kvh * group + h, lane, [res[i] for i in range(n)], res[n])

    @cute.jit
    def combine(self, t: AttnTensors, kvh, b, nsplit, tidx):
        """The persistent kernel's combine task of (row b, KV head kvh): once every split's `partial` (arrive
        False) has run, merge their partials (nothing to do where one split held every tile: it finished the
        rows itself)."""
        n_active = self.extent(t, b, nsplit)[8]
        if n_active > 1:
            group = t.out.shape[1] // t.k_cache.shape[1]
            self.merge(t, b, kvh, n_active, cute.arch.make_warp_uniform(tidx // 32), tidx % 32, group)

    # ---- setup ----------------------------------------------------------------------------------------
    def locate_row(self, mBt, pages, slot, pos):
        """Paged cache: (bad, page, in-page row) of position `pos` of slot `slot` (futx.paging: entry
        (slot, pos // P) of the block table, row pos % P). bad: the position is outside the table row's span,
        the slot outside the table, or the entry not a page of the cache (the table is read only when the
        first two hold)."""
        P = self.p.page_size
        bad = (pos < 0) | (pos >= mBt.shape[1] * P) | (slot < 0) | (slot >= mBt.shape[0])
        j, row = _div_mod(pos, P)  # (meaningless when bad: then neither is used)
        page = mBt[cutlass.select_(bad, 0, slot), cutlass.select_(bad, 0, j)]
        bad = bad | (page < 0) | (page >= pages)
        return bad, page, row

    def _heads(self, t: AttnTensors, which: str):
        """The tensor holding the new q / k / v heads: qkv when fused (heads offset in the kernel)."""
        return t.qkv if self.p.fused_qkv else getattr(t, which)

    def _row_tensors(self, t: AttnTensors, is_key: bool):
        """(new rows, main cache, mirror, scales) of the keys or the values (mirror/scales None for bf16)."""
        if is_key:
            return self._heads(t, "k_new"), t.k_cache, t.k_mirror, t.k_scale
        return self._heads(t, "v_new"), t.v_cache, t.v_mirror, t.v_scale

    @cute.jit
    def write_row(self, t: AttnTensors, src_head, b, kvh, slot, row, pos, lane, is_key: bool):
        """One warp: copy the new BF16 row (row `src_head` of k_new / v_new, or of qkv when fused; keys
        RoPE-rotated first when fused, for position `pos`) into row (slot, kvh, row) of the main cache (a
        paged cache: slot = the page, row = the in-page row); for a mirror also store its mirror row
        (decode.mirror_row: rotation, scale, quantization, packed order)."""
        p = self.p
        n = p.per_lane
        mNew, mMain, mMir, mScale = self._row_tensors(t, is_key)
        c0 = lane * n
        raw = [mNew[b, src_head, c0 + i] for i in range(n)]
        if cutlass.const_expr(p.fused_qkv and is_key):
            raw = [v.to(BFloat16) for v in self.rope([v.to(Float32) for v in raw], t.rope, pos, lane)]
        if cutlass.const_expr(not p.mirror_only):   # mirror_only: the page may have no main copy
            for i in cutlass.range_constexpr(n):
                mMain[slot, kvh, row, c0 + i] = raw[i]
        if cutlass.const_expr(p.quantized):
            mirror_row.store_row([v.to(Float32) for v in raw], mMir, mScale, slot, kvh, row, lane, fmt=p.fmt,
                                 rotate=p.rotate, head_dim=p.head_dim, is_key=is_key)

    @cute.jit
    def setup_tables(self, t: AttnTensors, s_lut, s_flag, tidx, lane):
        """The INT4 dequantization's shared-memory constants: the byte table (plan.uses_lut) and the "pair"
        constants, read back in attend() (see there)."""
        p = self.p
        if cutlass.const_expr(p.uses_lut):
            self.fill_lut(t.lut, s_lut, tidx, lane)
        if cutlass.const_expr(p.uses_pair):
            if tidx == 0:
                ptx.sts32(s_flag + PAIR_CONST_OFFSET, Uint32(ptx.ALU_CONSTANTS["p_lo"]))
                ptx.sts32(s_flag + PAIR_CONST_OFFSET + 4, Uint32(ptx.ALU_CONSTANTS["p_hi"]))

    @cute.jit
    def fill_lut(self, mLut, s_lut, tidx, lane):
        """Copy the 256-entry byte -> f16x2 table into shared memory, 32 copies interleaved so that
        lane l reads entry e at word 32 e + l: every lookup of a warp hits 32 different banks."""
        nthreads = 32 * self.p.warps
        for e in range(tidx, 256, nthreads):
            v = Uint32(mLut[e])
            for k in cutlass.range_constexpr(8):
                chunk = (lane + k) % 8  # spread the warp's stores over the banks
                ptx.sts128(s_lut + e * 128 + chunk * 16, v, v, v, v)

    def rope(self, x, mRope, pos, lane):
        """decode.rope_warp.rope of the n values this lane holds (channels lane*n + i)."""
        return rope_warp.rope(x, mRope, pos, lane, self.p.head_dim)

    def stage_query(self, mQ, mRope, pos, s_q, b, kvh, group, j, lane, scale_log2):
        """One warp: query head j of this KV head's group (RoPE-rotated when fused; Hadamard-rotated and
        pre-scaled for the mirrors) into shared memory as f16 (mirrors) or bf16 (main cache); rows
        j >= group are zeros."""
        p = self.p
        n = p.per_lane
        c0 = lane * n
        live = j < group
        head = kvh * group + cutlass.min(j, group - 1)
        x = [mQ[b, head, c0 + i].to(Float32) for i in range(n)]
        if cutlass.const_expr(p.fused_qkv):
            x = self.rope(x, mRope, pos, lane)
        x = [cutlass.select_(live, v, Float32(0.0)) for v in x]
        row = s_q + (j * p.head_dim + c0) * 2
        if cutlass.const_expr(p.quantized):
            if cutlass.const_expr(p.rotate):
                x = hw.rotate(x, lane, p.head_dim)
            x = [v * scale_log2 for v in x]  # log2(e) / sqrt(d) folded in: scores come out in log2 units
            for e in range(n // 2):
                ptx.sts32(row + 4 * e, ptx.pack_f16x2(x[2 * e], x[2 * e + 1]))
        else:
            for e in range(n // 2):
                ptx.sts32(row + 4 * e, ptx.pack_bf16x2(x[2 * e], x[2 * e + 1]))

    # ---- main loop ------------------------------------------------------------------------------------
    def ring_start(self, t: AttnTensors, s_ring, slot, kvh, t_begin, t_end, warp):
        """(ring, first, n_my, globs): this warp's ring in shared memory, its first tile, how many of
        [t_begin, t_end) it runs, and the slot's region bases (fixed for the whole loop; paged: None, each tile's
        own in issue_tile)."""
        p = self.p
        globs = None
        if cutlass.const_expr(not p.paged):
            globs = self.region_bases(t, slot, kvh)
        ring = s_ring + warp * (p.stages * p.stage_bytes)
        first = t_begin + warp
        left = t_end - first
        n_my = cutlass.select_(left > 0, (left + p.warps - 1) // p.warps, 0)
        return ring, first, n_my, globs

    @cute.jit
    def ring_prologue(self, ring, t: AttnTensors, first, n_my, pages, kvh, ctx, lane, globs):
        """Request this warp's first stages - 1 tiles (those it has), one commit group each."""
        p = self.p
        for i in cutlass.range_constexpr(p.stages - 1):
            if i < n_my:
                self.issue_tile(ring + i * p.stage_bytes, t, first + i * p.warps, pages[i] if p.paged else None, kvh,
                                ctx, lane, globs)
            cute.arch.cp_async_commit_group()

    @cute.jit
    def prefetch(self, t: AttnTensors, s_ring, slot, kvh, ctx, t_begin, t_end, warp, lane, pages, live):
        """The ring prologue before partial's early wait (griddepcontrol.wait, or the ring layer's counter): the first
        tiles of the cached positions (the new row's position ctx - 1 zero-filled: it is written after the wait, and
        request_new_row requests its tile again); nothing where `live` is false (a split without tiles, a bad row)."""
        ring, first, n_my, globs = self.ring_start(t, s_ring, slot, kvh, t_begin, t_end, warp)
        self.ring_prologue(ring, t, first, cutlass.select_(live, n_my, 0), pages, kvh, ctx - 1, lane, globs)

    @cute.jit
    def request_new_row(self, t: AttnTensors, s_ring, slot, kvh, ctx, t_begin, t_end, warp, lane):
        """After an early prologue (`prefetch`), in the CTA that wrote the new row, once it is in global memory: the
        warp whose early tiles include the row's tile (attn_plan.new_row_prologue_stage) requests that tile again,
        from L2, into the same stage, in one more commit group that attend() waits for before its loop."""
        p = self.p
        ring, first, n_my, globs = self.ring_start(t, s_ring, slot, kvh, t_begin, t_end, warp)
        last = (ctx - 1) // p.tile_tokens
        held, stage = new_row_prologue_stage(first, last, p.warps, p.stages, n_my)
        if held:
            cute.arch.cp_async_wait_group(0)   # the stage's first copy has landed: never two in flight to it
            self.issue_tile(ring + stage * p.stage_bytes, t, last, self.tile_page(t, slot, last), kvh, ctx, lane,
                            globs)
            cute.arch.cp_async_commit_group()

    @cute.jit
    def attend(self, t: AttnTensors, s_lut, s_q, s_ring, slot, kvh, ctx, t_begin, t_end, warp, lane, scale_log2,
               pages=None, prefetched: bool = False):
        """This warp's tiles first + warp, first + warp + NW, ... of [t_begin, t_end) through a
        `stages`-deep cp.async ring; leaves its partial (m, l, O) in the ring (merge scratch). Paged: `pages`
        holds the block-table entries of the warp's first `stages` tiles. prefetched: the ring prologue was
        requested before partial's early wait (`prefetch`), the new row's tile without the new row, and
        `request_new_row` that tile again (its ring state is recomputed here rather than kept live across the wait:
        fewer registers)."""
        p = self.p
        D, TT, NS, NW, SB = p.head_dim, p.tile_tokens, p.stages, p.warps, p.stage_bytes
        qa = self.query_fragments(s_q, lane)
        self.consts = {k: ptx.const_b32(v, Uint32) for k, v in ptx.ALU_CONSTANTS.items()}
        if cutlass.const_expr(p.uses_pair):
            # Loaded from shared memory, so ptxas cannot see that they are constants: otherwise it
            # re-materializes them (one MOV per LOP3, ~120 per tile) instead of keeping two registers.
            s_flag = s_ring + p.ring_bytes
            self.consts["p_lo"] = ptx.lds32(s_flag + PAIR_CONST_OFFSET)
            self.consts["p_hi"] = ptx.lds32(s_flag + PAIR_CONST_OFFSET + 4)
        ring, first, n_my, globs = self.ring_start(t, s_ring, slot, kvh, t_begin, t_end, warp)
        if cutlass.const_expr(not prefetched):
            self.ring_prologue(ring, t, first, n_my, pages, kvh, ctx, lane, globs)
        else:
            held, _ = new_row_prologue_stage(first, (ctx - 1) // TT, NW, NS, n_my)
            if held:   # request_new_row's extra group: the loop's group count does not cover it
                cute.arch.cp_async_wait_group(0)
        # paged: the page of the next tile to issue, looked up one issue ahead (below) so that the table load's
        # latency hides behind a tile's math instead of stalling the refill
        nxt = pages[NS - 1] if p.paged else None

        # running max and sum of the two heads 2t, 2t+1 whose O^T columns this lane accumulates
        m0 = Float32(float("-inf"))
        m1 = Float32(float("-inf"))
        l0 = Float32(0.0)
        l1 = Float32(0.0)
        acc = cute.make_rmem_tensor((p.ktiles * 4,), Float32)
        for i in cutlass.range_constexpr(p.ktiles * 4):
            acc[i] = Float32(0.0)
        for it in range(n_my):
            ahead = it + NS - 1
            if ahead < n_my:  # refill the stage consumed in the previous iteration
                self.issue_tile(ring + (ahead % NS) * SB, t, first + ahead * NW, nxt, kvh, ctx, lane, globs)
                if cutlass.const_expr(p.paged):
                    nxt = self.tile_page(t, slot, first + (ahead + 1) * NW)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(NS - 1)
            cute.arch.sync_warp()  # every lane's copies of this tile are visible to the warp
            sb = ring + (it % NS) * SB
            m_new, l_new, alpha, pfrag = self.softmax_step(sb, (first + it * NW) * TT, ctx, lane, qa,
                                                           (m0, m1), (l0, l1), s_lut, scale_log2)
            if cute.arch.vote_any_sync((alpha[0] != Float32(1.0)) | (alpha[1] != Float32(1.0))):
                self.rescale(acc, alpha)  # the running max moved for some head
            self.accumulate_pv(sb, lane, pfrag, acc, s_lut)
            m0, m1 = m_new
            l0, l1 = l_new
            cute.arch.sync_warp()  # all lanes are done with this stage before it is refilled

        cute.arch.cp_async_wait_group(0)
        self._sync()  # the ring becomes merge scratch
        self.store_partial(s_ring, warp, lane, acc, (m0, m1), (l0, l1))

    def tile_page(self, t: AttnTensors, slot, tile):
        """Paged cache: the block-table entry of the page holding tile `tile` of slot `slot` (None when
        contiguous). The entry index is clamped into the table row: a look-ahead past the sequence's last
        tile reads the row's last entry, never past the row."""
        if not self.p.paged:
            return None
        j = cutlass.min(_div_mod(tile, self.p.tiles_per_page)[0], t.block_table.shape[1] - 1)
        return t.block_table[slot, j]

    def region_tensors(self, t: AttnTensors):
        """(tensor, element bytes) of the regions issue() copies from, in its order: key rows, value rows and
        (mirrors) their scales (None: no scales)."""
        if self.p.quantized:
            return (t.k_mirror, 1), (t.v_mirror, 1), (t.k_scale, 4), (t.v_scale, 4)
        return (t.k_cache, 2), (t.v_cache, 2), None, None

    def region_bases(self, t: AttnTensors, row, kvh):
        """Byte addresses of row `row` (the slot) of KV head kvh in each region (None: no scales)."""
        return tuple(None if r is None else _row_addr(r[0], row, kvh, r[1]) for r in self.region_tensors(t))

    @cute.jit
    def issue_tile(self, sb, t: AttnTensors, tile, page, kvh, ctx, lane, globs):
        """issue() of tile `tile` of the sequence: from the slot's rows `globs`, or (paged) from rows
        tok0 % P.. of its page `page` (a tile never straddles two pages): page 0's rows of this KV head (block
        uniform: the compiler keeps them in uniform registers) plus one wide multiply-add per region."""
        p = self.p
        tok0 = tile * p.tile_tokens
        if cutlass.const_expr(p.paged):
            bases = [None if r is None else _row_addr(r[0], 0, kvh, r[1]) + _page_offset(r[0], page, r[1])
                     for r in self.region_tensors(t)]
            self.issue(sb, tok0, _div_mod(tile, p.tiles_per_page)[1] * p.tile_tokens, ctx, lane, *bases)
        else:
            self.issue(sb, tok0, tok0, ctx, lane, *globs)

    @cute.jit
    def issue(self, sb, tok0, at, ctx, lane, k_glob, v_glob, ks_glob, vs_glob):
        """cp.async one tile (keys, values, scales) into stage `sb`: tokens [tok0, tok0 + TT) of the sequence,
        stored at rows [at, at + TT) past the region bases (at = tok0 contiguous); rows at or past `ctx` are
        zero-filled (their source address is clamped to the base, which is always valid)."""
        p = self.p
        if cutlass.const_expr(p.lean_issue):
            if tok0 + p.tile_tokens <= ctx:  # a whole tile (all but a sequence's last): no per-chunk tests
                self.issue_full(sb, at, lane, k_glob, v_glob, ks_glob, vs_glob)
            else:
                self.issue_tail(sb, tok0, at, ctx, lane, k_glob, v_glob, ks_glob, vs_glob)
        else:
            self.issue_tail(sb, tok0, at, ctx, lane, k_glob, v_glob, ks_glob, vs_glob)

    @cute.jit
    def issue_full(self, sb, at, lane, k_glob, v_glob, ks_glob, vs_glob):
        """issue() for a tile that lies wholly inside the context: one base address per region."""
        p = self.p
        R = p.k_row_bytes
        kb = k_glob + Int64(at * R)
        vb = v_glob + Int64(at * R)
        for i in cutlass.range_constexpr(p.chunks_per_lane(p.k_region)):
            off = (lane + 32 * i) * 16
            dst = sb + off
            if cutlass.const_expr(p.fmt != "int4"):
                dst = sb + p.k_smem_offset(off // R, (off % R) // 16)
            ptx.cp_async_16_zfill(dst, kb + Int64(off), 16)
        for i in cutlass.range_constexpr(p.chunks_per_lane(p.tile_tokens * R)):
            off = (lane + 32 * i) * 16
            ptx.cp_async_16_zfill(sb + p.v_offset + (off // R) * p.v_stride + off % R, vb + Int64(off), 16)
        if cutlass.const_expr(p.quantized):
            q4 = p.tile_tokens // 4
            if lane < 2 * q4:
                j = lane % q4
                is_v = lane >= q4
                src = cutlass.select_(is_v, vs_glob, ks_glob) + Int64((at + 4 * j) * 4)
                dst = sb + cutlass.select_(is_v, p.vs_offset, p.ks_offset) + j * 16
                ptx.cp_async_16_zfill(dst, src, 16)

    @cute.jit
    def issue_tail(self, sb, tok0, at, ctx, lane, k_glob, v_glob, ks_glob, vs_glob):
        """issue() with every chunk tested against the context end."""
        p = self.p
        R = p.k_row_bytes
        for i in cutlass.range_constexpr(p.chunks_per_lane(p.k_region)):
            off = (lane + 32 * i) * 16
            row = off // R
            live = tok0 + row < ctx
            dst = sb + off  # INT4: fragment-order blocks land as they are
            if cutlass.const_expr(p.fmt != "int4"):
                dst = sb + p.k_smem_offset(row, (off % R) // 16)
            src = cutlass.select_(live, k_glob + Int64(at * R + off), k_glob)
            ptx.cp_async_16_zfill(dst, src, cutlass.select_(live, 16, 0))
        for i in cutlass.range_constexpr(p.chunks_per_lane(p.tile_tokens * R)):
            off = (lane + 32 * i) * 16
            row = off // R
            live = tok0 + row < ctx
            dst = sb + p.v_offset + row * p.v_stride + off % R
            src = cutlass.select_(live, v_glob + Int64(at * R + off), v_glob)
            ptx.cp_async_16_zfill(dst, src, cutlass.select_(live, 16, 0))
        if cutlass.const_expr(p.quantized):
            q4 = p.tile_tokens // 4  # 16-byte chunks of one scale vector
            if lane < 2 * q4:
                j = lane % q4
                is_v = lane >= q4
                tok = tok0 + 4 * j
                row = tok
                if cutlass.const_expr(p.paged):
                    row = at + 4 * j
                valid = cutlass.max(cutlass.min(ctx - tok, 4), 0)
                src = cutlass.select_(is_v, vs_glob, ks_glob)
                src = cutlass.select_(valid > 0, src + Int64(row * 4), src)
                dst = sb + cutlass.select_(is_v, p.vs_offset, p.ks_offset) + j * 16
                ptx.cp_async_16_zfill(dst, src, valid * 4)

    def query_fragments(self, s_q, lane):
        """B registers of Q^T per k16 tile: column g = head g, k pairs 2t and 2t + 8 (channels from the
        plan's map, which matches how the key bytes feed the A operand)."""
        p = self.p
        g, t = lane // 4, lane % 4
        qa = []
        for tile in range(p.ktiles):
            regs = []
            for r in range(2):
                if cutlass.const_expr(p.key_pairs_split):  # halves from two aligned channel pairs
                    lb, hb, step, sel = p.q_pair_loads(tile, r)
                    lo = ptx.lds32(s_q + (g * p.head_dim + lb + step * t) * 2)
                    hi = ptx.lds32(s_q + (g * p.head_dim + hb + step * t) * 2)
                    regs.append(ptx.prmt(lo, hi, sel, Uint32))
                else:
                    base, step = p.q_channel_parts(tile, r)
                    regs.append(ptx.lds32(s_q + (g * p.head_dim + base + step * t) * 2))
            qa.append(regs)
        return qa

    def softmax_step(self, sb, tok0, ctx, lane, qa, m_run, l_run, s_lut, scale_log2):
        """Scores of one tile and the online-softmax update for this lane's heads 2t, 2t+1.

        S^T = K Q^T per 16-token step: A = keys (two 8-token blocks: their B fragments are exactly the A
        fragment of 16 tokens), B = the query (8 heads), so no MMA row is padding. Lane (g, t) gets
        tokens g and g+8 of the step for heads 2t and 2t+1. Returns (m_new, l_new, alpha, P^T B
        fragments with the V scale applied), the pairs indexed by head 2t + h."""
        p = self.p
        TT = p.tile_tokens
        steps = TT // 16
        g, t = lane // 4, lane % 4
        lane4 = Uint32(lane * 4)
        kind = "bf16" if p.fmt == "bf16" else "f16"
        blocks = [self.key_fragments(sb, kb, g, t, lane, lane4, s_lut) for kb in range(TT // 8)]
        # two partial accumulators per step (even / odd k16 tiles): shorter dependent MMA chains
        part = [[[Float32(0.0)] * 4 for _ in range(2)] for _ in range(steps)]
        for tile in range(p.ktiles):
            for st in range(steps):
                lo, hi = blocks[2 * st](tile), blocks[2 * st + 1](tile)
                part[st][tile % 2] = ptx.mma_16816((lo[0], hi[0], lo[1], hi[1]), (qa[tile][0], qa[tile][1]),
                                                   part[st][tile % 2], kind)
        # s[h][j]: head 2t + h, token j-th of this lane (step st, row g then g + 8)
        s = [[], []]
        toks = []
        for st in range(steps):
            c = [part[st][0][k] + part[st][1][k] for k in range(4)]
            for row in range(2):
                r = 16 * st + 8 * row + g
                toks.append(r)
                live = tok0 + r < ctx
                if p.quantized:  # K scale on the finished dot product
                    f = ptx.lds_f32(sb + p.ks_offset + r * 4)
                else:
                    f = scale_log2
                for h in range(2):
                    s[h].append(cutlass.select_(live, c[2 * row + h] * f, Float32(float("-inf"))))

        m_new, l_new, alpha, pr = [], [], [], [[], []]
        for h in range(2):  # reduce over the 8 lanes g of the same t
            mx = s[h][0]
            for v in s[h][1:]:
                mx = cute.arch.fmax(mx, v)
            for off in (4, 8, 16):
                mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=off))
            mn = cute.arch.fmax(m_run[h], mx)
            pr[h] = [ptx.ex2(v - mn) for v in s[h]]
            psum = pr[h][0]
            for v in pr[h][1:]:
                psum = psum + v
            m_new.append(mn)
            alpha.append(ptx.ex2(m_run[h] - mn))
            l_new.append(l_run[h] * alpha[h] + psum)
        if p.quantized:  # V scale on the probability, before the P.V product
            for j, r in enumerate(toks):
                f = ptx.lds_f32(sb + p.vs_offset + r * 4)
                pr[0][j] = pr[0][j] * f
                pr[1][j] = pr[1][j] * f
        pack = ptx.pack_bf16x2 if p.fmt == "bf16" else ptx.pack_f16x2
        # (token g, heads 2t, 2t+1) is one 8x8 fragment of P^T; its transpose is the B fragment
        # (head g, tokens 2t, 2t+1) that O^T = V^T P^T needs
        mats = [ptx.movmatrix_trans(pack(pr[0][j], pr[1][j])) for j in range(2 * steps)]
        pfrag = [(mats[2 * st], mats[2 * st + 1]) for st in range(steps)]
        return m_new, l_new, alpha, pfrag

    def rescale(self, acc, alpha):
        """O^T columns are this lane's heads 2t, 2t+1."""
        for mt in range(self.p.ktiles):
            for k in range(4):
                acc[4 * mt + k] = acc[4 * mt + k] * alpha[k & 1]

    def accumulate_pv(self, sb, lane, pfrag, acc, s_lut):
        """O^T += V^T P^T over the tile's 16-token steps."""
        p = self.p
        g, t = lane // 4, lane % 4
        lane4 = Uint32(lane * 4)
        kind = "bf16" if p.fmt == "bf16" else "f16"
        for ks in range(p.tile_tokens // 16):
            vfr = self.value_fragments(sb, ks, g, t, lane, lane4, s_lut)
            for mt in range(p.ktiles):
                r = ptx.mma_16816(vfr[mt], pfrag[ks],
                                  (acc[4 * mt], acc[4 * mt + 1], acc[4 * mt + 2], acc[4 * mt + 3]), kind)
                for k in range(4):
                    acc[4 * mt + k] = r[k]

    def store_partial(self, s_ring, warp, lane, acc, m_run, l_run):
        """This warp's (m, l, O) into the merge scratch: O [warp][head][channel], m and l [warp][head]."""
        p = self.p
        D = p.head_dim
        g, t = lane // 4, lane % 4
        m_base = s_ring + p.warps * MAX_GROUP * D * 4
        l_base = m_base + p.warps * MAX_GROUP * 4
        for h in range(2):
            l = l_run[h]
            for off in (4, 8, 16):  # partial sums of the 8 lanes that share head 2t + h
                l = l + cute.arch.shuffle_sync_bfly(l, offset=off)
            # every lane of the column holds the same (m, l); the 8 writes of a value coincide
            ptx.sts_f32_def(m_base + (warp * MAX_GROUP + 2 * t + h) * 4, m_run[h])
            ptx.sts_f32_def(l_base + (warp * MAX_GROUP + 2 * t + h) * 4, l)
        for mt in range(p.ktiles):
            for k in range(4):
                base, step = p.out_channel_parts(mt, k >> 1)
                head = 2 * t + (k & 1)
                ptx.sts_f32_def(s_ring + ((warp * MAX_GROUP + head) * D + base + step * g) * 4, acc[4 * mt + k])

    # ---- operand fragments ----------------------------------------------------------------------------
    def _lut(self, word, byte: int, lane4, s_lut):
        """Table lookup of byte `byte` of `word`: entry e of lane l sits at s_lut + 128 e + 4 l."""
        return ptx.lds32(ptx.lut_offset(word, byte, lane4) + s_lut)

    def key_fragments(self, sb, kb, g, t, lane, lane4, s_lut):
        """Load key block kb (8 tokens) of the stage; return tile -> (reg0, reg1), this lane's B-fragment
        registers of k16 tile `tile` (two blocks' registers make up the A fragment of S^T = K Q^T),
        produced on first use so that their conversions interleave with the MMAs that consume them."""
        p = self.p
        D = p.head_dim
        made = {}
        if p.fmt == "int4":
            seg = sb + kb * 4 * D + lane * (D // 8)
            words = ptx.lds128(seg) if D // 8 == 16 else ptx.lds64(seg)
            if p.k_dequant == "pair":
                def reg_pair(tile, r):  # word tile // 2 -> registers m = 0..3 (attn_plan.int4_pair_key_channels)
                    j, m, _ = p.int4_pair_map[(tile, r)]
                    if j not in made:
                        made[j] = ptx.int4_word_to_f16x2x4_pair(words[j], self.consts)
                    return made[j][m]
                return lambda tile: (reg_pair(tile, 0), reg_pair(tile, 1))
            where = {frag: b for b, frag in enumerate(p.int4_key_frag)}

            def reg(tile, r):
                b = where[(tile, r)]
                return self._lut(words[b // 4], b % 4, lane4, s_lut)
        else:
            chunks = [ptx.lds128(sb + p.k_smem_offset(kb * 8 + g, t + 4 * i)) for i in range(p.key_chunks())]
            regs_per_word = 2 if p.fmt == "e4m3" else 1
            where = {p.key_frag(i, j): (i, j) for i in range(p.key_chunks()) for j in range(4 * regs_per_word)}

            def reg(tile, r):
                i, j = where[(tile, r)]
                w = chunks[i][j // regs_per_word]
                if p.fmt == "bf16":
                    return w
                if (i, j // 2) not in made:
                    made[(i, j // 2)] = ptx.e4m3x4_to_f16x2x2(w)
                return made[(i, j // 2)][j % 2]

        return lambda tile: (reg(tile, 0), reg(tile, 1))

    def value_fragments(self, sb, ks, g, t, lane, lane4, s_lut):
        """A registers (4 per m16 channel tile) of V^T for tokens 16ks..16ks+15 of the stage."""
        p = self.p
        VS = p.v_stride
        rows = sb + p.v_offset + (16 * ks) * VS
        out = [None] * p.ktiles
        if cutlass.const_expr(p.fmt == "bf16"):
            r = (lane % 8) + 8 * (lane // 16)
            col = 16 * ((lane // 8) % 2)
            for mt in range(p.ktiles):
                out[mt] = ptx.ldmatrix_x4_trans(rows + r * VS + col + 32 * mt)
            return out
        for cc in range(p.value_passes()):
            w = [ptx.lds32(rows + tk * VS + 4 * p.value_word(g, cc)) for tk in p.value_tokens(t)]
            if p.fmt == "int4" and p.v_dequant == "pair":
                for i in range(4):
                    e01, o01 = ptx.int4_token_pair_to_f16x2_pair(w[0], w[1], i, self.consts)
                    e23, o23 = ptx.int4_token_pair_to_f16x2_pair(w[2], w[3], i, self.consts)
                    out[4 * cc + i] = (e01, o01, e23, o23)
            elif p.fmt == "int4" and p.v_dequant == "alu":
                wx = [x ^ XOR8 for x in w]
                for i in range(4):
                    e01, o01 = ptx.int4_token_pair_to_f16x2_alu(wx[0], wx[1], i, self.consts)
                    e23, o23 = ptx.int4_token_pair_to_f16x2_alu(wx[2], wx[3], i, self.consts)
                    out[4 * cc + i] = (e01, o01, e23, o23)
            elif p.fmt == "int4":
                lo01, hi01 = int4_value_pairs(w[0], w[1])  # tokens 2t, 2t+1
                lo23, hi23 = int4_value_pairs(w[2], w[3])  # tokens 2t+8, 2t+9
                for i in range(4):
                    out[4 * cc + i] = (self._lut(lo01, i, lane4, s_lut), self._lut(hi01, i, lane4, s_lut),
                                       self._lut(lo23, i, lane4, s_lut), self._lut(hi23, i, lane4, s_lut))
            else:
                for e, sel in enumerate(E4M3_PAIR_SELECTORS):
                    a0, a1 = ptx.e4m3x4_to_f16x2x2(ptx.prmt(w[0], w[1], sel, Uint32))
                    a2, a3 = ptx.e4m3x4_to_f16x2x2(ptx.prmt(w[2], w[3], sel, Uint32))
                    out[2 * cc + e] = (a0, a1, a2, a3)
        return out

    # ---- output ----------------------------------------------------------------------------------------
    def finish_row(self, mOut, b, head, lane, outs, lsum):
        """O / l, rotated back to the model basis for a rotated mirror, stored as bf16."""
        p = self.p
        n = p.per_lane
        inv = Float32(1.0) / lsum
        y = [v * inv for v in outs]
        if cutlass.const_expr(p.rotate):
            y = hw.rotate(y, lane, p.head_dim)
        for i in range(n):
            mOut[b, head, lane * n + i] = y[i].to(BFloat16)


# ---- compile entry points (one jit signature per cache format and head source) ----------------------------
# Each declares exactly the tensors of attn_plan.entry_tensors(fmt, fused_qkv), in that order, and passes
# them by keyword into one AttnTensors (DecodeAttention.tensors checks the names against the table).
def make_entry(plan: AttnPlan):
    kern = DecodeAttention(plan)
    if plan.paged:
        from decode.attention_paged import make_paged_entry

        return make_paged_entry(plan, kern)
    if plan.fused_qkv:
        return _make_fused_entry(plan, kern)
    if plan.fmt == "bf16":
        @cute.jit
        def decode_attention_bf16(q: cute.Tensor, k_new: cute.Tensor, v_new: cute.Tensor, positions: cute.Tensor,
                                  slots: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor, out: cute.Tensor,
                                  ws_o: cute.Tensor, ws_ml: cute.Tensor, counters: cute.Tensor,
                                  softmax_scale: Float32, stream):
            kern.launch(kern.tensors(q=q, k_new=k_new, v_new=v_new, positions=positions, slots=slots,
                                     k_cache=k_cache, v_cache=v_cache, out=out, ws_o=ws_o, ws_ml=ws_ml,
                                     counters=counters), softmax_scale, stream)
        return decode_attention_bf16
    if plan.fmt == "int4":
        @cute.jit
        def decode_attention_int4(q: cute.Tensor, k_new: cute.Tensor, v_new: cute.Tensor, positions: cute.Tensor,
                                  slots: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor,
                                  k_mirror: cute.Tensor, k_scale: cute.Tensor, v_mirror: cute.Tensor,
                                  v_scale: cute.Tensor, lut: cute.Tensor, out: cute.Tensor, ws_o: cute.Tensor,
                                  ws_ml: cute.Tensor, counters: cute.Tensor, softmax_scale: Float32, stream):
            kern.launch(kern.tensors(q=q, k_new=k_new, v_new=v_new, positions=positions, slots=slots,
                                     k_cache=k_cache, v_cache=v_cache, k_mirror=k_mirror, k_scale=k_scale,
                                     v_mirror=v_mirror, v_scale=v_scale, lut=lut, out=out, ws_o=ws_o, ws_ml=ws_ml,
                                     counters=counters), softmax_scale, stream)
        return decode_attention_int4

    @cute.jit
    def decode_attention_e4m3(q: cute.Tensor, k_new: cute.Tensor, v_new: cute.Tensor, positions: cute.Tensor,
                              slots: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor,
                              k_mirror: cute.Tensor, k_scale: cute.Tensor, v_mirror: cute.Tensor,
                              v_scale: cute.Tensor, out: cute.Tensor, ws_o: cute.Tensor, ws_ml: cute.Tensor,
                              counters: cute.Tensor, softmax_scale: Float32, stream):
        kern.launch(kern.tensors(q=q, k_new=k_new, v_new=v_new, positions=positions, slots=slots, k_cache=k_cache,
                                 v_cache=v_cache, k_mirror=k_mirror, k_scale=k_scale, v_mirror=v_mirror,
                                 v_scale=v_scale, out=out, ws_o=ws_o, ws_ml=ws_ml, counters=counters),
                    softmax_scale, stream)
    return decode_attention_e4m3


def _make_fused_entry(plan: AttnPlan, kern: DecodeAttention):
    """Entry points reading the QKV projection's output qkv [B, Hq + 2 Hkv, D] and a RoPE table
    rope [capacity, D] float32 (cos of the D/2 angles, then their sin) instead of q, k_new, v_new."""
    if plan.fmt == "bf16":
        @cute.jit
        def decode_attention_qkv_bf16(qkv: cute.Tensor, positions: cute.Tensor, slots: cute.Tensor,
                                      k_cache: cute.Tensor, v_cache: cute.Tensor, rope: cute.Tensor,
                                      out: cute.Tensor, ws_o: cute.Tensor, ws_ml: cute.Tensor, counters: cute.Tensor,
                                      softmax_scale: Float32, stream):
            kern.launch(kern.tensors(qkv=qkv, positions=positions, slots=slots, k_cache=k_cache, v_cache=v_cache,
                                     rope=rope, out=out, ws_o=ws_o, ws_ml=ws_ml, counters=counters),
                        softmax_scale, stream)
        return decode_attention_qkv_bf16
    if plan.fmt == "int4":
        @cute.jit
        def decode_attention_qkv_int4(qkv: cute.Tensor, positions: cute.Tensor, slots: cute.Tensor,
                                      k_cache: cute.Tensor, v_cache: cute.Tensor, k_mirror: cute.Tensor,
                                      k_scale: cute.Tensor, v_mirror: cute.Tensor, v_scale: cute.Tensor,
                                      lut: cute.Tensor, rope: cute.Tensor, out: cute.Tensor, ws_o: cute.Tensor,
                                      ws_ml: cute.Tensor, counters: cute.Tensor, softmax_scale: Float32, stream):
            kern.launch(kern.tensors(qkv=qkv, positions=positions, slots=slots, k_cache=k_cache, v_cache=v_cache,
                                     k_mirror=k_mirror, k_scale=k_scale, v_mirror=v_mirror, v_scale=v_scale,
                                     lut=lut, rope=rope, out=out, ws_o=ws_o, ws_ml=ws_ml, counters=counters),
                        softmax_scale, stream)
        return decode_attention_qkv_int4

    @cute.jit
    def decode_attention_qkv_e4m3(qkv: cute.Tensor, positions: cute.Tensor, slots: cute.Tensor,
                                  k_cache: cute.Tensor, v_cache: cute.Tensor, k_mirror: cute.Tensor,
                                  k_scale: cute.Tensor, v_mirror: cute.Tensor, v_scale: cute.Tensor,
                                  rope: cute.Tensor, out: cute.Tensor, ws_o: cute.Tensor, ws_ml: cute.Tensor,
                                  counters: cute.Tensor, softmax_scale: Float32, stream):
        kern.launch(kern.tensors(qkv=qkv, positions=positions, slots=slots, k_cache=k_cache, v_cache=v_cache,
                                 k_mirror=k_mirror, k_scale=k_scale, v_mirror=v_mirror, v_scale=v_scale, rope=rope,
                                 out=out, ws_o=ws_o, ws_ml=ws_ml, counters=counters), softmax_scale, stream)
    return decode_attention_qkv_e4m3


def fake_args(plan: AttnPlan):
    """Fake tensors in the argument order of make_entry(plan) (plan.tensors, then the softmax scale and the
    stream; row-major, dynamic batch/heads/slots/capacity/splits)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    def t(dtype, shape, align=16):
        return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))),
                                        assumed_align=align)

    D = plan.head_dim
    B, HQ, HKV, S, C, NSPL = (cute.sym_int() for _ in range(6))
    C8, HT, R = cute.sym_int(), cute.sym_int(), cute.sym_int()
    TS, MP = cute.sym_int(), cute.sym_int()  # block table rows (slots + 1) and entries (paged: S counts pages)
    SM = cute.sym_int() if plan.mirror_only else S  # mirror_only: the main copy's own (smaller) page extent
    mirror = {"int4": (Uint8, (S, HKV, C8, 32, D // 8)), "e4m3": (Uint8, (S, HKV, C, D))}
    value = {"int4": (Uint8, (S, HKV, C, D // 2)), "e4m3": (Uint8, (S, HKV, C, D))}
    make = {
        "q": lambda: t(BFloat16, (B, HQ, D)), "k_new": lambda: t(BFloat16, (B, HKV, D)),
        "v_new": lambda: t(BFloat16, (B, HKV, D)), "qkv": lambda: t(BFloat16, (B, HT, D)),
        "rope": lambda: t(Float32, (R, D)), "positions": lambda: t(Int32, (B,), 4),
        "slots": lambda: t(Int32, (B,), 4), "block_table": lambda: t(Int32, (TS, MP), 4),
        "k_cache": lambda: t(BFloat16, (SM, HKV, C, D)),
        "v_cache": lambda: t(BFloat16, (SM, HKV, C, D)), "k_mirror": lambda: t(*mirror[plan.fmt]),
        "k_scale": lambda: t(Float32, (S, HKV, C)), "v_mirror": lambda: t(*value[plan.fmt]),
        "v_scale": lambda: t(Float32, (S, HKV, C)), "lut": lambda: t(Int32, (256,)),
        "out": lambda: t(BFloat16, (B, HQ, D)), "ws_o": lambda: t(Float32, (B, HKV, NSPL, MAX_GROUP, D)),
        "ws_ml": lambda: t(Float32, (B, HKV, NSPL, MAX_GROUP, 2)), "counters": lambda: t(Int32, (B, HKV), 4),
    }
    return (*(make[name]() for name in plan.tensors), Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True))


def compile_target(fmt: str = "int4", head_dim: int = 128, rotate: bool = False, k_dequant: str | None = None,
                   v_dequant: str | None = None, warps: int = 4, stages: int = 3, saturating_warps: int = 8,
                   lean_issue: bool | None = None, fused_qkv: bool = False, page_size: int = 0,
                   mirror_only: bool = False, pdl: bool = False):
    """Registry factory (docs/kernel-contract.md): (jit function, fake arguments) of one variant
    (saturating_warps only steers the host's split choice; it is a parameter so that variants that
    differ in it are distinct registry entries; page_size > 0: the paged cache's entry; mirror_only: its twin
    for a main copy of staging pages only; pdl: the engine entry's dependent launch)."""
    plan = default_plan(fmt, head_dim, rotate, k_dequant, v_dequant, warps, stages, saturating_warps,
                        lean_issue, fused_qkv, page_size, mirror_only, pdl)
    return make_entry(plan), fake_args(plan)
