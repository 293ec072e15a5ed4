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
        sizes = (("slots", 2 * self.slot_bytes),
                 ("x", m * self.x_row(units)),
                 ("sums", units * self.m_pad * 4 if self.fold else 0),
                 ("res", m * tiles * CHANNELS * 2 if self.residual else 0),
                 ("csc", tiles * CHANNELS * 4 if self.channel_scale else 0))
        out, at = {}, 0
        for name, size in sizes:
            out[name] = at
            at = at + size
        out["total"] = at
        return out
