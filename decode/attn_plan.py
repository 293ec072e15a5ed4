"""Trace-time plan of the decode attention kernel: tiles, shared-memory map and register-fragment maps.

Plain Python (no DSL import) so CPU tests can check every map. The INT4 key order comes from
`futx.quant.layouts` (derived and checked here, never restated); the E4M3 and BF16 caches are stored
in natural order and their in-kernel channel permutations are the kernel's own business, defined here.

Tensor-core formulation (mma.sync m16n8k16, f32 accumulators), per warp and per 16 cached tokens:
  S^T = K . Q^T  : A = keys (16 tokens x 16 channels), B = the query heads of one KV head (N = 8).
                   The B fragments of two 8-token key blocks in layouts' INT4 key order are exactly
                   the A fragment of 16 tokens. Each lane feeds its registers from contiguous bytes of
                   one token's row, so the channel order of the reduction is permuted; the query
                   fragment uses the same map (q_channel).
  O^T = V^T . P^T: A = values (16 channels x 16 tokens), B = probabilities (16 tokens x 8 heads). The
                   S^T accumulators (token rows) become P^T's B fragment (head rows) through one
                   movmatrix transpose per 8x8 block; the 8 heads of a GQA group fill N = 8.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from futx import paging
from futx.hardware import SMEM_PER_CTA
from futx.quant import layouts

FORMATS = ("int4", "e4m3", "bf16")
K_DEQUANT = ("lut", "pair")         # INT4 keys
V_DEQUANT = ("lut", "alu", "pair")  # INT4 values
QMAX = {"int4": 7.0, "e4m3": 448.0}
MAX_GROUP = 8          # query heads per KV head handled by one n8 P.V tile
LUT_COPIES = 32        # byte -> f16x2 table replicated per lane: lookups never conflict on a bank
V_ROW_PAD = 16         # bytes added to each V row in shared memory (conflict-free fragment reads)


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# ---- INT4 key order, derived from futx.quant.layouts ----------------------------------------------
def int4_key_pair_slot(c):
    """Where the key channel pair (c, c+1) (c even) of token g of an 8-token block lives:
    (t, byte) = (lane within the token's 4 lanes, byte within that lane's D/8-byte segment).
    Written with shifts and masks so it serves both Python ints and DSL integers; checked against
    layouts.Int4KeyLayout.byte_coord by `check_int4_key_formulas`."""
    return (c >> 1) & 3, ((c >> 4) << 1) | ((c >> 3) & 1)


def check_int4_key_formulas(head_dim: int) -> list[tuple[int, int]]:
    """Verify the kernel's INT4 key formulas against the layout module; return, per segment byte,
    the (k16 tile, B register) it feeds (identical for every lane)."""
    lay = layouts.INT4_KEY
    nbytes = lay.bytes_per_lane(head_dim)
    frag = []
    for b in range(nbytes):
        seen = set()
        for lane in range(layouts.WARP):
            g, t = divmod(lane, 4)
            for h in range(2):
                tok, ch = lay.byte_coord(lane, b, h)
                if tok != g:
                    raise AssertionError(f"INT4 key layout: lane {lane} byte {b} holds token {tok}, expected {g}")
                tile, k = divmod(ch, layouts.MMA_K)
                reg = (k - 2 * t - h) // 8
                if layouts.b_fragment_coord(lane, reg, h) != (k, g):
                    raise AssertionError(f"INT4 key layout: byte {b} is not a B-fragment register")
                seen.add((tile, reg))
                if h == 0 and int4_key_pair_slot(ch) != (t, b):
                    raise AssertionError(f"int4_key_pair_slot({ch}) = {int4_key_pair_slot(ch)}, "
                                         f"layout says {(t, b)}")
        if len(seen) != 1:
            raise AssertionError(f"INT4 key byte {b} feeds different fragments on different lanes: {seen}")
        frag.append(seen.pop())
    if sorted(frag) != [(tile, reg) for tile in range(head_dim // 16) for reg in range(2)]:
        raise AssertionError("INT4 key bytes do not cover every B fragment exactly once")
    return frag


def int4_pair_key_channels(head_dim: int) -> dict[tuple[int, int], tuple[int, int, list[tuple[int, int]]]]:
    """The "pair" key dequantization (ptx.int4_word_to_f16x2x4_pair) turns word j of a lane's segment
    into four registers m = 0..3 whose halves are nibble m % 2 of bytes 4j + m // 2 and 4j + 2 + m // 2.
    Register m feeds the A-fragment slot (k16 tile 2j + m // 2, register m % 2); the reduction is a sum over
    channels, so any slot works as long as the query fragment holds the same two channels.
    Returns (tile, reg) -> (j, m, [(channel of the low half, channel of the high half) for t = 0..3]),
    derived from layouts.INT4_KEY.byte_coord (checked: one token per lane, every channel once per lane quad)."""
    lay = layouts.INT4_KEY
    words = lay.bytes_per_lane(head_dim) // 4
    out = {}
    for j in range(words):
        for m in range(4):
            h = m % 2
            chans = []
            for t in range(4):
                pair = []
                for byte in (4 * j + m // 2, 4 * j + 2 + m // 2):
                    for g in range(8):  # every token row of the block sees the same channels
                        tok, ch = lay.byte_coord(4 * g + t, byte, h)
                        if tok != g:
                            raise AssertionError(f"INT4 key layout: lane {4 * g + t} byte {byte} holds token {tok}")
                        if g == 0:
                            c0 = ch
                        elif ch != c0:
                            raise AssertionError("INT4 key layout: channel depends on the token row")
                    pair.append(c0)
                chans.append(tuple(pair))
            out[(2 * j + m // 2, m % 2)] = (j, m, chans)
    seen = sorted(c for _, _, chans in out.values() for pair in chans for c in pair)
    if seen != list(range(head_dim)) or len(out) != 2 * (head_dim // 16):
        raise AssertionError("INT4 pair key map does not cover every channel exactly once")
    return out


NIB_LO, NIB_HI = 0x0F0F0F0F, 0xF0F0F0F0
E4M3_PAIR_SELECTORS = (0x5140, 0x7362)  # prmt: bytes (a0, b0, a1, b1) and (a2, b2, a3, b3)


def int4_value_pairs(w_even, w_odd):
    """Two V-row words (same 8 channels, tokens 2t and 2t+1) -> (lo, hi): byte i of lo holds the
    even channel 2i of both tokens (token 2t in the low nibble), byte i of hi the odd channel 2i+1.
    Each byte is then one table lookup = one f16 pair (V[2t][c], V[2t+1][c]) of a V^T A fragment.
    Shifts and masks only, so the kernel and the CPU tests run this same function."""
    lo = (w_even & NIB_LO) | ((w_odd << 4) & NIB_HI)
    hi = ((w_even >> 4) & NIB_LO) | (w_odd & NIB_HI)
    return lo, hi


# ---- the kernel's tensors --------------------------------------------------------------------------
# Every tensor the kernel may read or write: the fields of decode.attention.AttnTensors, which the kernel
# receives as one argument (fields a format or entry does not use are None, never a placeholder).
ATTN_TENSORS = ("q", "k_new", "v_new", "qkv", "rope", "positions", "slots", "block_table", "k_cache", "v_cache",
                "k_mirror", "k_scale", "v_mirror", "v_scale", "lut", "out", "ws_o", "ws_ml", "counters")
_MIRROR_TENSORS = {"bf16": (), "int4": ("k_mirror", "k_scale", "v_mirror", "v_scale", "lut"),
                   "e4m3": ("k_mirror", "k_scale", "v_mirror", "v_scale")}


def entry_tensors(fmt: str, fused_qkv: bool, paged: bool = False) -> tuple[str, ...]:
    """The one table of which tensors a compile entry declares, in its argument order (softmax_scale and
    the stream follow): the jit entries (checked when traced), their fake arguments and the op's launch
    all read it. A paged entry also takes the block table (futx.paging), right after the slots."""
    heads = ("qkv",) if fused_qkv else ("q", "k_new", "v_new")
    return (*heads, "positions", "slots", *(("block_table",) if paged else ()), "k_cache", "v_cache",
            *_MIRROR_TENSORS[fmt],
            *(("rope",) if fused_qkv else ()), "out", "ws_o", "ws_ml", "counters")


def new_row_prologue_stage(first, last_tile, warps: int, stages: int, n_my):
    """(held, stage) for an early prologue (DecodeAttention.partial's early_wait: a dependent launch's
    griddepcontrol.wait, AttnPlan.pdl, or the ring layer's counter wait): a warp whose tiles are first, first + warps,
    ... (n_my of them) requests its first stages - 1 before that wait, with the new row's position still zero-filled
    (it is written after the wait). held: one of those is the sequence's last tile `last_tile`, the one holding the
    new row, at ring stage `stage`, so the warp requests it again once the row is written. Works on ints and DSL
    integers (the kernel's formula; the CPU test replays every warp's ring with it)."""
    d = last_tile - first
    stage = d // warps
    held = (d >= 0) & (d % warps == 0) & (stage < stages - 1) & (stage < n_my)
    return held, stage


@dataclass(frozen=True)
class AttnPlan:
    fmt: str                 # cache the kernel reads: "int4" | "e4m3" (mirrors) | "bf16" (main copy)
    head_dim: int
    rotate: bool = False     # Hadamard-rotated mirror (int4/e4m3 only), one block of head_dim channels
    tile_tokens: int = 32    # tokens per warp iteration (multiple of 16)
    stages: int = 3          # cp.async ring depth per warp
    warps: int = 4
    k_dequant: str = "lut"   # INT4 keys: "lut" (256-entry shared table) or "pair" (lop3 + hadd2 on nibbles
                             # 16 bits apart, query permuted to match)
    v_dequant: str = "alu"   # INT4 values: "lut", "alu" (prmt + xor + lop3 + f16 ops) or "pair" (no xor)
    saturating_warps: int = 8  # split policy only: resident warps per SM assumed to reach full bandwidth
    lean_issue: bool = False   # whole tiles skip the per-chunk context tests of the async copies
    fused_qkv: bool = False    # read q, k, v from the QKV projection's output [B, Hq + 2 Hkv, D] and apply
                               # RoPE (rotate-half, cos/sin table [capacity, D]) to q and the new k row
    page_size: int = 0         # 0: contiguous cache [slots, Hkv, capacity, ...]; P > 0: paged (futx.paging), the
                               # cache tensors' slot mode holds pages of P positions, reached through a block table
    mirror_only: bool = False  # paged mirror formats: the new row goes to the mirror only (the main copy holds only
                               # the staging pages of futx.paging, fewer than the mirror: the INT4-only cache)
    pdl: bool = False          # programmatic dependent launch (the engine's decode step, fused_qkv only): releases
                               # its dependents (the O projection) at its start and requests its first tiles of the
                               # cached positions before griddepcontrol.wait; see DecodeAttention.partial for what
                               # it reads before the wait

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"decode attention: unknown cache format {self.fmt!r}; known {FORMATS}")
        if self.head_dim not in (64, 128):
            raise ValueError(f"decode attention: head dim {self.head_dim} not supported (64 or 128)")
        if self.rotate and self.fmt == "bf16":
            raise ValueError("decode attention: the BF16 main cache is never rotated")
        if self.tile_tokens % 16 or self.stages < 2 or self.warps < 2:
            raise ValueError("decode attention: tile_tokens must be a multiple of 16, stages and warps >= 2")
        if self.fmt == "int4":
            layouts.INT4_KEY.check(self.head_dim, 8)
            check_int4_key_formulas(self.head_dim)
        for which, known in ((self.k_dequant, K_DEQUANT), (self.v_dequant, V_DEQUANT)):
            if which not in known:
                raise ValueError(f"decode attention: dequantization {which!r} must be one of {known}")
        if self.page_size:
            paging.check_page_size(self.page_size)
            if self.page_size % self.tile_tokens:  # a tile never straddles two pages: one table entry per tile
                raise ValueError(f"decode attention: page size {self.page_size} is not a multiple of the "
                                 f"{self.tile_tokens}-token tile")
        if self.mirror_only and not (self.page_size and self.fmt != "bf16"):
            raise ValueError("decode attention: a mirror-only kernel needs a paged cache with a mirror (int4 / e4m3)")
        if self.pdl and not self.fused_qkv:
            raise ValueError("decode attention: the dependent launch (pdl) is the engine's fused-QKV entry only")

    @property
    def tensors(self) -> tuple[str, ...]:
        """The tensors this plan's compile entry declares (entry_tensors)."""
        return entry_tensors(self.fmt, self.fused_qkv, self.paged)

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def tiles_per_page(self) -> int:
        return self.page_size // self.tile_tokens

    # ---- sizes ------------------------------------------------------------------------------------
    @property
    def quantized(self) -> bool:
        return self.fmt != "bf16"

    @property
    def ktiles(self) -> int:
        """k16 tiles of the score MMA = m16 channel tiles of the value MMA."""
        return self.head_dim // 16

    @property
    def per_lane(self) -> int:
        """Channels per lane when a warp holds one D-row (new cache rows, query, output)."""
        return self.head_dim // 32

    @property
    def k_row_bytes(self) -> int:
        """Bytes of one token's key row (in global memory and in the stage)."""
        return {"int4": self.head_dim // 2, "e4m3": self.head_dim, "bf16": 2 * self.head_dim}[self.fmt]

    @property
    def v_row_bytes(self) -> int:
        return self.k_row_bytes

    @property
    def v_stride(self) -> int:
        return self.v_row_bytes + V_ROW_PAD

    @property
    def k_region(self) -> int:
        return self.tile_tokens * self.k_row_bytes

    @property
    def v_offset(self) -> int:
        return self.k_region

    @property
    def ks_offset(self) -> int:
        return self.v_offset + self.tile_tokens * self.v_stride

    @property
    def vs_offset(self) -> int:
        return self.ks_offset + 4 * self.tile_tokens

    @property
    def stage_bytes(self) -> int:
        end = self.vs_offset + 4 * self.tile_tokens if self.quantized else self.ks_offset
        return _ceil_to(end, 128)

    @property
    def ring_bytes(self) -> int:
        return self.warps * self.stages * self.stage_bytes

    @property
    def uses_lut(self) -> bool:
        return self.fmt == "int4" and "lut" in (self.k_dequant, self.v_dequant)

    @property
    def uses_pair(self) -> bool:
        return self.fmt == "int4" and "pair" in (self.k_dequant, self.v_dequant)

    @property
    def lut_bytes(self) -> int:
        return 256 * LUT_COPIES * 4 if self.uses_lut else 0

    @property
    def q_bytes(self) -> int:
        return MAX_GROUP * self.head_dim * 2

    @property
    def scratch_bytes(self) -> int:
        """Per-warp partial results for the CTA merge (reuses the ring)."""
        return self.warps * MAX_GROUP * (self.head_dim + 2) * 4

    @property
    def smem_bytes(self) -> int:
        return self.lut_bytes + self.q_bytes + self.ring_bytes + 128

    def chunks_per_lane(self, region_bytes: int) -> int:
        n, r = divmod(region_bytes // 16, 32)
        if r:
            raise ValueError(f"{region_bytes} bytes are not a whole number of 16-byte chunks per lane")
        return n

    # ---- shared-memory swizzle of K rows (E4M3 / BF16) ------------------------------------------------
    @property
    def k_swizzle(self) -> int:
        """XOR applied to the 16-byte chunk index on odd rows. Lanes (2p, t) and (2p+1, t) read the
        same logical chunk of neighbouring rows in one phase; when a row spans >= 128 bytes those land
        on the same banks unless odd rows flip to the other half."""
        return 4 if self.k_row_bytes >= 128 else 0

    def k_smem_offset(self, row, chunk):
        """Byte offset in a stage of 16-byte chunk `chunk` of key row `row` (E4M3 / BF16); the cp.async
        writer and the fragment reader both use it. Works on ints and DSL integers."""
        return row * self.k_row_bytes + (chunk ^ ((row & 1) * self.k_swizzle)) * 16

    # ---- fragment maps --------------------------------------------------------------------------------
    VALUE_WORDS_PER_PASS = 8  # lane g reads 32-bit word g + 8 cc of a value row in pass cc

    def value_passes(self) -> int:
        """Passes over a value row (INT4: 8 channels per word; E4M3: 4)."""
        return self.v_row_bytes // (4 * self.VALUE_WORDS_PER_PASS)

    @staticmethod
    def value_tokens(t):
        """Tokens (within a 16-token step) whose value words lane quad position t reads: the k pairs
        2t, 2t+1 and 2t+8, 2t+9 of the V^T A fragment."""
        return (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)

    @classmethod
    def value_word(cls, g, cc):
        return g + cls.VALUE_WORDS_PER_PASS * cc

    @cached_property
    def int4_key_frag(self) -> list[tuple[int, int]]:
        return check_int4_key_formulas(self.head_dim)

    def key_chunks(self) -> int:
        """16-byte chunks of one key row a lane loads (E4M3 / BF16): logical chunks t + 4i."""
        return self.k_row_bytes // 64

    def key_frag(self, i: int, j: int) -> tuple[int, int]:
        """(k16 tile, B register) fed by the j-th 32-bit register unpacked from the lane's i-th chunk."""
        if self.fmt == "e4m3":   # 16 bytes -> 8 f16 pairs
            return 4 * i + j // 2, j % 2
        if self.fmt == "bf16":   # 16 bytes -> 4 bf16 pairs
            return 2 * i + j // 2, j % 2
        raise ValueError("INT4 keys use int4_key_frag")

    def q_channel(self, tile: int, reg: int, t: int) -> int:
        """Channel of the low half of the query A-fragment pair (k = 2t + 8 reg) of k16 tile `tile`
        for lane quad position t; the high half is channel + 1. Must match the key map."""
        if self.fmt == "int4":
            return 16 * tile + 8 * reg + 2 * t
        if self.fmt == "e4m3":
            return 16 * t + 64 * (tile // 4) + 4 * (tile % 4) + 2 * reg
        return 8 * t + 32 * (tile // 2) + 4 * (tile % 2) + 2 * reg

    def q_channel_parts(self, tile: int, reg: int) -> tuple[int, int]:
        """q_channel = base + step * t, as (base, step) for the kernel."""
        base = self.q_channel(tile, reg, 0)
        return base, self.q_channel(tile, reg, 1) - base

    @property
    def key_pairs_split(self) -> bool:
        """True when the two halves of a query register are not neighbouring channels (INT4 "pair" keys)."""
        return self.fmt == "int4" and self.k_dequant == "pair"

    @cached_property
    def int4_pair_map(self):
        return int4_pair_key_channels(self.head_dim)

    def q_pair(self, tile: int, reg: int, t: int) -> tuple[int, int]:
        """Channels of the (low, high) halves of the query B-fragment register (k16 tile, reg) of lane quad
        position t; must be the channels of the key A-fragment register in the same slot."""
        if self.key_pairs_split:
            return self.int4_pair_map[(tile, reg)][2][t]
        c = self.q_channel(tile, reg, t)
        return c, c + 1

    def q_pair_parts(self, tile: int, reg: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """q_pair = (base + step * t) per half, as ((lo base, lo step), (hi base, hi step)); checked linear."""
        parts = []
        for half in range(2):
            base = self.q_pair(tile, reg, 0)[half]
            step = self.q_pair(tile, reg, 1)[half] - base
            if any(self.q_pair(tile, reg, t)[half] != base + step * t for t in range(4)):
                raise AssertionError(f"query channel map of tile {tile} reg {reg} is not linear in t")
            parts.append((base, step))
        return parts[0], parts[1]

    def q_pair_loads(self, tile: int, reg: int) -> tuple[int, int, int, int, int]:
        """How the kernel builds a query register whose halves are not neighbours: two aligned 32-bit loads
        of the row's f16 pairs holding them, at channels (lo_base + step t) and (hi_base + step t), then
        prmt(lo_word, hi_word, selector). Returns (lo_base, hi_base, step, selector)."""
        (lb, ls), (hb, hs) = self.q_pair_parts(tile, reg)
        if ls != hs or ls % 2:
            raise AssertionError(f"query map of tile {tile} reg {reg}: steps {ls}, {hs} must be equal and even")
        lo_half, hi_half = lb & 1, hb & 1
        sel = (2 * lo_half) | (2 * lo_half + 1) << 4 | (4 + 2 * hi_half) << 8 | (5 + 2 * hi_half) << 12
        return lb - lo_half, hb - hi_half, ls, sel

    def out_channel(self, mt: int, upper: int, g: int) -> int:
        """Channel of value-MMA row g + 8*upper of m16 tile mt (rows of O^T)."""
        if self.fmt == "int4":   # word g + 8cc of a V row, byte i: low nibble -> row g, high -> g + 8
            cc, i = divmod(mt, 4)
            return 8 * (g + 8 * cc) + 2 * i + upper
        if self.fmt == "e4m3":   # word g + 8cc of a V row: bytes (0,1) -> tile 2cc, (2,3) -> tile 2cc+1
            cc, e = divmod(mt, 2)
            return 4 * (g + 8 * cc) + 2 * e + upper
        return 16 * mt + 8 * upper + g

    def out_channel_parts(self, mt: int, upper: int) -> tuple[int, int]:
        base = self.out_channel(mt, upper, 0)
        return base, self.out_channel(mt, upper, 1) - base

    # ---- checks used by tests ---------------------------------------------------------------------------
    def check_maps(self) -> None:
        d = self.head_dim
        for tile in range(self.ktiles):  # query/key reduction order is a permutation of the channels
            chans = sorted(self.q_pair(tile, r, t)[h] for r in range(2) for t in range(4) for h in range(2))
            if len(set(chans)) != 16:
                raise AssertionError(f"{self.fmt}: k16 tile {tile} channels repeat: {chans}")
            for r in range(2):
                self.q_pair_parts(tile, r)
        allc = sorted(self.q_pair(tl, r, t)[h] for tl in range(self.ktiles) for r in range(2)
                      for t in range(4) for h in range(2))
        if allc != list(range(d)):
            raise AssertionError(f"{self.fmt}: query channel map is not a permutation")
        outc = sorted(self.out_channel(mt, u, g) for mt in range(self.ktiles) for u in range(2) for g in range(8))
        if outc != list(range(d)):
            raise AssertionError(f"{self.fmt}: output channel map is not a permutation")
        if self.fmt != "int4":  # key chunk registers cover each (tile, reg) once per lane
            regs_per_chunk = 8 if self.fmt == "e4m3" else 4
            got = sorted(self.key_frag(i, j) for i in range(self.key_chunks()) for j in range(regs_per_chunk))
            if got != [(tl, r) for tl in range(self.ktiles) for r in range(2)]:
                raise AssertionError(f"{self.fmt}: key chunk map does not cover every fragment once")
            for i in range(self.key_chunks()):  # and its channels are the query map's
                for j in range(regs_per_chunk):
                    tile, reg = self.key_frag(i, j)
                    for t in range(4):
                        chunk_bytes = 16 * (t + 4 * i) + 4 * j * (1 if self.fmt == "bf16" else 0) \
                            + 2 * j * (1 if self.fmt == "e4m3" else 0)
                        elem = chunk_bytes // (2 if self.fmt == "bf16" else 1)
                        if elem != self.q_channel(tile, reg, t):
                            raise AssertionError(f"{self.fmt}: key chunk {i} reg {j} lane t={t} is channel "
                                                 f"{elem}, query map says {self.q_channel(tile, reg, t)}")
        if self.scratch_bytes > self.ring_bytes:
            raise AssertionError("merge scratch does not fit in the ring")


def default_plan(fmt: str, head_dim: int, rotate: bool = False, k_dequant: str | None = None,
                 v_dequant: str | None = None, warps: int = 4, stages: int = 3, saturating_warps: int = 8,
                 lean_issue: bool | None = None, fused_qkv: bool = False, page_size: int = 0,
                 mirror_only: bool = False, pdl: bool = False) -> AttnPlan:
    """Tile rule: 32-token tiles for INT4 (4.9 KB per stage at D=128) and E4M3 at D=64, 16 for E4M3 at
    D=128 and BF16 (~8.5 KB); three stages and four warps, so two CTAs (~24 tiles in flight) fit per SM.
    INT4 keys and values by "pair" dequantization (no shared-memory table) with lean issue: the fastest INT4
    kernel, or within 2.5%, at every measured batch and context (docs/routing.md A1-A2; numbers in
    docs/results-decode-attention.md). None = that default; the keywords after `rotate` are the tuning
    variants' overrides (futx.runtime.catalog.decode_attention.VARIANTS); page_size > 0 the paged cache's kernel
    (same tiles: every page size divides into whole tiles); mirror_only its twin that stores no main-copy row; pdl
    the engine entry's programmatic dependent launch (same arithmetic, the first tiles requested before the wait)."""
    int4 = fmt == "int4"
    tt = 16 if fmt == "bf16" or (fmt == "e4m3" and head_dim == 128) else 32
    return AttnPlan(fmt=fmt, head_dim=head_dim, rotate=rotate, tile_tokens=tt, stages=stages, warps=warps,
                    k_dequant=k_dequant or ("pair" if int4 else "lut"),
                    v_dequant=v_dequant or ("pair" if int4 else "alu"), saturating_warps=saturating_warps,
                    lean_issue=int4 if lean_issue is None else lean_issue, fused_qkv=fused_qkv, page_size=page_size,
                    mirror_only=mirror_only, pdl=pdl)


SMEM_PER_SM = SMEM_PER_CTA  # residency budget: the per-CTA cap, a conservative bound on what an SM holds


def choose_splits(plan: AttnPlan, batch: int, kv_heads: int, max_context: int, sms: int = 132) -> int:
    """Split-KV count for a launch: the smallest modelled time over s splits, where the busiest SM runs
    n = ceil(batch*kv_heads*s / sms) CTAs of ceil(tiles/s) tiles (+2 tiles of setup/merge each) and only
    reaches full bandwidth with plan.saturating_warps warps resident (8: two 4-warp CTAs). Each split keeps
    >= 1 tile per warp."""
    tiles = max(1, -(-max_context // plan.tile_tokens))
    base = max(1, batch * kv_heads)
    resident = max(1, SMEM_PER_SM // plan.smem_bytes)
    best, best_cost = 1, None
    for s in range(1, 65):
        per = -(-tiles // s)
        if s > 1 and per < plan.warps:
            break
        n = -(-base * s // sms)
        waves = -(-n // resident)
        rate = min(1.0, min(n, resident) * plan.warps / plan.saturating_warps)
        cost = waves * min(n, resident) * (per + 2) / rate + (0.5 if s > 1 else 0.0)
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best


# Routing rule A8 (docs/routing.md): inside the engine's decode step one 4-warp attention CTA per SM was faster
# than two at 1..8 rows (INT4 cache, 2-4% of the step at long contexts), though the standalone launch likes two; so
# there the split count is chosen as if 4 resident warps saturated: 128 CTAs where the standalone rule takes 256.
STEP_SATURATING_WARPS = 4
STEP_SPLIT_MAX_ROWS = 8
STEP_SPLIT_FORMATS = ("int4",)


def step_splits(plan: AttnPlan, batch: int, kv_heads: int, max_context: int, sms: int = 132) -> int:
    """Split-KV count of the engine step's attention launch (the fused-QKV entry): `choose_splits` under rule
    A8 where it applies (docs/routing.md), else the standalone rule."""
    if plan.fmt in STEP_SPLIT_FORMATS and batch <= STEP_SPLIT_MAX_ROWS:
        plan = replace(plan, saturating_warps=STEP_SATURATING_WARPS)
    return choose_splits(plan, batch, kv_heads, max_context, sms)
