"""The E4M3 decode projection for 17..64 rows on the warp-specialized mixed-input warpgroup kernel
(decode/skinny_ws.py): y[M, N] = x[M, K] @ W[N, K]^T, W in float8 e4m3 [N, K] natural rows with one float32 scale
per output channel (futx.quant.fp8.E4M3Weight, the format every E4M3 decode kernel reads; unchanged).

The ring, schedules (grid split-K, stream-K), epilogues and exchanges are the INT4 kernel's. What differs:

* Unit = 64 k (K a multiple of 64). A stage holds the unit's activation tile [tokens x 64 k] (TMA, 128-byte swizzle:
  one of the INT4 kernel's two halves) and the tile's weights [128 channels x 64 bytes], one 2D TMA copy of the uint8
  [N, K] tensor into a 64-byte swizzle (`swizzled`; rows past N arrive as zeros and are never stored). No scales in
  the ring.
* A operands straight from natural rows. wgmma's register A operand must be the standard m64nTk16 fragment (lane 4g+t:
  a0 = row g, k 2t, 2t+1; a1 = row g + 8; a2, a3 = k + 8), because B (the activations, natural k order in shared
  memory) fixes the k order. Lane (g, t), h = t // 2, reads per k16 step j and row two words, A at byte 16 j + 4 h and
  B at 16 j + 8 + 4 h (ld.shared.b32, conflict-free in the 64-byte swizzle), and one `prmt` with a lane-dependent
  selector (0x5140 for even t, 0x7362 for odd) makes [A0, B0, A1, B1] of its bytes (k 2t, 2t+8, 2t+1, 2t+9), which
  `E4M3Format._to_bf16` (decode/dequant.py: bytes (0, 2) and (1, 3), exact) turns into a0/a2 (a1/a3 from row g + 8).
  `lane_offsets`, `lane_selector` and `lane_words` are the whole lane geometry; tests/test_skinny_ws_e4m3.py runs
  them on a numpy model of the stage and checks the fragment and the banks.
* No fold: one float32 accumulator, every unit's 4 k16 steps chained into it (the CTA's first step with scale-d 0),
  one commit group per unit; `wgmma.wait_group 1` after issuing unit u releases unit u - 1's stage (its activations
  are read by the asynchronous MMAs) and its A-operand registers, rewritten by unit u + 1: two units per loop trip, so
  that consecutive units' A operands are different registers (`_retire`). The per-channel scale is applied in the
  epilogue (decode/skinny.py).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from futx.quant import layouts

from . import ptx
from .dequant import BLOCK_N
from .skinny_ws import CONSUMER_WARPS, SWIZZLE_ATOM, SkinnyWs

UNIT_K = 64                          # k per unit (one 64-byte weight row per channel, one 128-byte activation row)
TILE_ROWS = CONSUMER_WARPS * BLOCK_N  # output channels of a tile (one 16-channel n-block per consumer warp)
W_ROW = UNIT_K                       # bytes of a channel's weights per unit
WT_BYTES = TILE_ROWS * W_ROW         # a stage's weights
K_STEPS = UNIT_K // layouts.MMA_K    # wgmma k16 steps per unit
ROW8 = layouts.MMA_N * W_ROW         # row g + 8 from row g (the swizzle phase repeats every 8 rows)
WORD_B = 8                           # word B (k + 8) from word A within a 16-byte chunk
SEL_EVEN, SEL_ODD = 0x5140, 0x7362   # prmt selectors of [A0, B0, A1, B1]: bytes (0, 1) or (2, 3) of A and of B


def swizzled(row, byte):
    """Byte offset of W[row, byte] (row of a stage's 128-channel tile, byte = k within the unit) where TMA's 64-byte
    swizzle stores it: Swizzle<2,4,3> in bytes, the 16-byte chunk c of row r at chunk c ^ ((r >> 1) & 3). Plain ints,
    numpy arrays or DSL integers."""
    return row * W_ROW + ((((byte >> 4) ^ (row >> 1)) & 3) << 4) + (byte & 15)


def lane_offsets(cw, lane) -> tuple:
    """This lane's word A offsets in a stage, one per k16 step j: row g of warp cw's n-block, byte 16 j + 4 (t // 2).
    Word B is WORD_B further, row g + 8 is ROW8 further (`swizzled` keeps both: same chunk phase)."""
    g, t = lane // 4, lane % 4
    row = cw * BLOCK_N + g
    return tuple(swizzled(row, layouts.MMA_K * j + 4 * (t // 2)) for j in range(K_STEPS))


def lane_selector(lane):
    """The prmt selector of lane 4g+t: its bytes 2t, 2t+1 of the 8-k half are bytes (0, 1) of its word for even t,
    (2, 3) for odd t."""
    return SEL_EVEN + (lane % 2) * (SEL_ODD - SEL_EVEN)


def lane_words(lds32, addrs, sel, ops=ptx) -> list:
    """The words [A0, B0, A1, B1] of rows g (k16 steps 0..3), then g + 8, read at `addrs` (per step, word A of row g in
    the stage: the stage's address + `lane_offsets`), in the order `E4M3Format.a_operands` takes (it returns per step
    (a0, a1, a2, a3) = (lo g, lo g+8, hi g, hi g+8))."""
    out = []
    for row in (0, ROW8):
        for addr in addrs:
            out.append(ops.prmt_r(lds32(addr + row), lds32(addr + row + WORD_B), sel))
    return out


class SkinnyWsE4M3(SkinnyWs):
    """The warp-specialized kernel on E4M3 weights: `m_tiles` 8-token groups (wgmma N = 8 * m_tiles), `stages` ring
    depth (0: as many as fit, at most skinny_ws.MAX_STAGES), `schedule` "grid" or "stream" as SkinnyWs."""

    w_smem_type = cutlass.Uint8

    def __init__(self, epilogue: str = "store", m_tiles: int = 4, stages: int = 0, schedule: str = "grid"):
        self.weights_tma = False   # (the INT4 option; these weights always arrive by TMA)
        self.halves = False
        self._setup("e4m3", 128, epilogue, m_tiles, stages, schedule, WT_BYTES, 0)
        assert self.unit_k == UNIT_K

    # ---- host side: the weights' TMA --------------------------------------------------------
    def _w_staged(self):
        """The weights ring: (128 rows, 64 bytes, stages), rows of 64 bytes in the 64-byte swizzle."""
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW64, cutlass.Uint8)
        return cute.tile_to_shape(atom, (TILE_ROWS, UNIT_K, self.stages), order=(0, 1, 2))

    def _weight_atoms(self, w, s) -> tuple:
        w_one = cute.slice_(self._w_staged(), (None, None, 0))
        tma_w, g_w = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), w, w_one, (TILE_ROWS, UNIT_K))
        return (tma_w, g_w)

    def _weight_atoms_of(self, tmas) -> tuple:
        return (tmas[0],)

    def _weight_ring(self, storage, tmas):
        """(weights atom, its (128, 64, tiles, units) tiles of global, the ring's stages)."""
        tma_w, g_w = tmas
        staged = self._w_staged()
        sw = storage.sw.get_tensor(staged.outer, swizzle=staged.inner)
        gw = cute.local_tile(g_w, (TILE_ROWS, UNIT_K), (None, None))
        tws, twg = cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sw, 0, 2),
                                         cute.group_modes(gw, 0, 2))
        return tma_w, twg, tws

    @cute.jit
    def _copy_weights(self, ring, state, pair, w_base, s_base, k_blocks, n_units, n_blocks, ws0, ss0, wt):
        """The tile's weights of pair `pair`'s unit: one TMA copy (rows past N arrive as zeros)."""
        tma_w, twg, tws = wt
        cute.copy(tma_w, twg[(None, pair // n_units, pair % n_units)], tws[(None, state.index)],
                  tma_bar_ptr=ring.producer_get_barrier(state))

    # ---- consumers ---------------------------------------------------------------------------
    @cute.jit
    def _consume(self, ring, xs0_lo, ws0, ss0, cw, lane, consts, i0, count):
        """The CTA's units i0 .. i0 + count - 1 (count >= 1) for this warp's n-block, chained into one accumulator;
        returns it (the m64nT C fragment of the warp's 16 rows) with every unit's stage released."""
        offs = tuple(ws0 + o for o in lane_offsets(cw, lane))
        sel = Int32(lane_selector(lane))
        acc = (Float32(0.0),) * (self.tokens // 2)
        acc = self._unit(ring, i0, acc, xs0_lo, offs, sel, consts, True)
        rest = count - 1
        for j in cutlass.range(rest // 2, unroll=1):   # two units per trip: each its own A-operand registers
            i = i0 + 1 + 2 * j
            acc = self._unit(ring, i, acc, xs0_lo, offs, sel, consts, False)
            self._retire(ring, i - 1)
            acc = self._unit(ring, i + 1, acc, xs0_lo, offs, sel, consts, False)
            self._retire(ring, i)
        if rest % 2 == 1:
            last = i0 + count - 1
            acc = self._unit(ring, last, acc, xs0_lo, offs, sel, consts, False)
            self._retire(ring, last - 1)
        ptx.wgmma_wait(0)
        acc = tuple(ptx.reg_fence(v) for v in acc)
        ring.consumer_release(self._state(i0 + count - 1))
        return acc

    def _retire(self, ring, i):
        """After the next unit is issued: wait until unit i's MMAs have completed (at most one group in flight), then
        free its stage (activations its MMAs read) and, implicitly, its A-operand registers, which the unit after next
        rewrites. wgmma reads its register A operand asynchronously and ptxas keeps no register of an in-flight wgmma
        from being rewritten: a unit's A operands are rewritten only after the wait that retires it, which is why a
        loop trip holds two units (one unit per trip rewrote the registers of the unit still in flight: wrong
        sums on the H200, 2026-12-04)."""
        ptx.wgmma_wait(1)
        ring.consumer_release(self._state(i))

    @cute.jit
    def _unit(self, ring, i, acc, xs0_lo, offs, sel, consts, first: bool):
        """Wait for the CTA's i-th unit, build this lane's A operands of its 4 k16 steps and issue them into `acc` as
        one committed group (the segment's first step with scale-d 0)."""
        ring.consumer_wait(self._state(i))
        stage = i % self.stages
        # the stage's word-A addresses, opaque: LLVM would otherwise hoist each (offset + constant) out of the loop and
        # add the stage to all 16 (16 adds per unit instead of 4; the constants are the loads' immediates)
        base = stage * self.wt_bytes
        words = lane_words(ptx.lds32, tuple(ptx.opaque_i32(base + o) for o in offs), sel)
        a_ops = self.fmt.a_operands(words, consts)
        xs_lo = xs0_lo + stage * (self.xs_bytes >> 4)   # the stage's descriptor word (start address >> 4)
        ptx.wgmma_fence()
        for j in cutlass.range_constexpr(K_STEPS):
            desc = ptx.gmma_desc_from_lo(xs_lo + ((j * layouts.MMA_K * 2) >> 4), SWIZZLE_ATOM, ptx.GMMA_SWIZZLE_128B)
            acc = ptx.wgmma_bf16_rs(acc, a_ops[j], desc, Int32(0 if first and j == 0 else 1))
        ptx.wgmma_commit()
        return acc


def make_target(epilogue: str = "store", m_tiles: int = 4, stages: int = 0, schedule: str = "grid"):
    """The kernel and its fake arguments: decode.skinny_dispatch.compile_target (the registry factory) delegates
    here for mma="ws" with E4M3 weights."""
    from .signature import fake_args, fake_split_args

    op = SkinnyWsE4M3(epilogue, m_tiles, stages, schedule)
    x, w, s, r, y, stream_ = fake_args("e4m3", epilogue)
    return op, (x, w, s, r, y, *fake_split_args(), Int32(1), stream_)
