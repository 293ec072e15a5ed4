"""Shared-memory map of the persistent decode kernel (decode/gemv.py). No DSL import: the host (decode.plan)
and the kernel evaluate the same formulas, on Python ints there and on DSL Int32 values in the kernel, so
every formula sticks to +, * and // (no min/max/if on sizes)."""

from __future__ import annotations

from futx.hardware import SMEM_PER_CTA as SMEM_LIMIT  # noqa: F401 (the planner's budget)

X_ROW_PAD = 16           # bytes: consecutive activation rows land 16 bytes apart in the banks (ldmatrix rows)
CHANNELS = 16            # output channels per n-block
TOKENS = 8               # token columns per MMA


class GemvSmem:
    """Regions in order (all sizes multiples of 16 bytes):

    slots  [2][warps][16 rows][m_pad tokens] f32    warps' partials of a round, double-buffered by parity
    x      [m][units * unit_k] bf16 + pad           the activation rows; warp w stages and reads its K share
    sums   [units][m_pad] f32                      per-unit activation sums (INT4 fold only)
    res    [m][tiles * 16] bf16                     the tiles' residual (residual epilogue only)
    csc    [tiles * 16] f32                         per-channel scales (E4M3 only)
    """

    def __init__(self, unit_k: int, m_tiles: int, warps: int, fold: bool, residual: bool, channel_scale: bool):
        self.unit_k, self.warps, self.fold = unit_k, warps, fold
        self.m_pad = TOKENS * m_tiles
        self.residual, self.channel_scale = residual, channel_scale
        self.slot_bytes = warps * CHANNELS * self.m_pad * 4  # one parity

    def x_row(self, units):
        return units * self.unit_k * 2 + X_ROW_PAD

    def offsets(self, m, units, tiles) -> dict:
        """Byte offset of every region and "total"."""
        return regions((("slots", 2 * self.slot_bytes),
                        ("x", m * self.x_row(units)),
                        ("sums", units * self.m_pad * 4 if self.fold else 0),
                        ("res", m * tiles * CHANNELS * 2 if self.residual else 0),
                        ("csc", tiles * CHANNELS * 4 if self.channel_scale else 0)))


def regions(sizes) -> dict:
    """(name, bytes) regions laid out in order -> byte offset of each and "total"."""
    out, at = {}, 0
    for name, size in sizes:
        out[name] = at
        at = at + size
    out["total"] = at
    return out


# ---- the M = 1 tile GEMV (decode/gemv_tile.py) ------------------------------------------------------------
UNIT_BYTES = 1024        # one INT4 g128 unit of a 16-channel n-block: 16 x 128 nibbles
UNIT_SCALE_BYTES = 32    # its 16 float16 group scales


def tile_share_units(k: int, warps: int) -> int:
    """The most units (128 k each) one warp's K share holds."""
    return (k // 128 + warps - 1) // warps


def tile_slice_k(k: int, splits: int) -> int:
    """K of the activation slice one CTA of a `splits`-way split-K tile GEMV stages (its unit range rounded up)."""
    return (k // 128 + splits - 1) // splits * 128


def tile_smem(k: int, warps: int, norm: bool = False, ring: int = 0, fold: bool = False, split: bool = False,
              tokens: int = 1, rows=1, nblocks: int = 1, red_in_x: bool = False, mx=max) -> dict:
    """Byte offset of each shared-memory region of the tile GEMV and "total"; `ring` = units per warp of the
    "ring" pipeline (0: the register pipelines, no ring); `split`: the split-K kernel, whose `k` is the slice a
    CTA stages (`tile_slice_k`); `tokens` = TOKENS: the multi-token kernel, staging `rows` (1..TOKENS, may be a
    runtime value) activation rows; `nblocks`: n-blocks per CTA (one set of partials each).
    Regions in order (all multiples of 16 bytes):

    x       [k] bf16                     the activation row (split-K: the CTA's slice of it)
            [rows][k + 8] bf16           multi-token: the rows, X_ROW_PAD apart in the banks (ldmatrix rows)
    red     [nblocks][warps][16] f32     the warps' partial sums (multi-token: [nblocks][warps][16][TOKENS])
    ss      [warps] f32 (+ pad)          their sums of squares (`norm`; multi-token: [warps][TOKENS])
    scales  [warps][share units][16] f16 each warp's share of the group scales (ring only)
    ring    [warps][ring][1 KB]          each warp's weight ring (ring only)
    sums    [k / 128] f32 (+ pad)        each unit's sum of activations (`fold`)
    xchg    [16] f32 + flag (+ pad)      split-K: the tile's summed partials and the "last CTA" flag

    `red_in_x` (multi-token, one n-block: the persistent layer's tasks): the partials overwrite the staged rows
    (the body meets at a CTA barrier first), so 8 rows of the 8B down projection (K = 14336) fit; `mx` is max on
    the values given (the kernel passes the DSL's).
    """
    per_warp = TOKENS if tokens > 1 else 1  # token columns each warp reduces
    ss = -(-warps * per_warp * 4 // 16) * 16 if norm else 0
    x = rows * (k * 2 + X_ROW_PAD) if tokens > 1 else k * 2
    red = nblocks * warps * CHANNELS * per_warp * 4
    if red_in_x:
        if tokens == 1 or nblocks != 1 or ring or fold or split:
            raise ValueError("red_in_x is the multi-token kernel's, one n-block per CTA")
        x, red = mx(x, red), 0
    out = regions((("x", x), ("red", red), ("ss", ss),
                   ("scales", warps * tile_share_units(k, warps) * UNIT_SCALE_BYTES if ring else 0),
                   ("ring", warps * ring * UNIT_BYTES), ("sums", (k // 128 * 4 + 15) // 16 * 16 if fold else 0),
                   ("xchg", CHANNELS * 4 + 16 if split else 0)))
    if red_in_x:
        out["red"] = 0
    return out
