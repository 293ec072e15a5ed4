"""Variant choice and launch shape of the decode projections (no DSL import: used by the torch ops).

Rules, from the bandwidth model in DESIGN/issue 5 (to be revised against the H200 measurements):
* M = 1 -> GEMV (one CTA per 16 output channels, 4 warps split K);
* 2 <= M <= 32 -> skinny kernel with 8, 16 or 32 token columns; split K across CTAs until about two
  CTAs per SM are busy, keeping at least `MIN_UNITS` units (scale groups / blocks) per CTA.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMATS = ("int4", "e4m3", "bf16")
GROUP_SIZES = (64, 128)           # INT4 group sizes with compiled variants
EPILOGUES = ("store", "residual", "swiglu")
M_TILES = {8: 1, 16: 2, 32: 4}    # skinny variants: token columns -> 8-token MMA groups
MAX_M = 32
SKINNY_WARPS, SKINNY_NB_PER_WARP = 4, 2
TILE_N = SKINNY_WARPS * SKINNY_NB_PER_WARP * 16
CTAS_PER_SM = 2
MIN_UNITS = 4
GEMV_MAX_K = 110_000              # the activation row lives in shared memory (227 KB per CTA)


def fmt_tag(fmt: str, group_size: int = 128) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown decode weight format {fmt!r}; known: {', '.join(FORMATS)}")
    if fmt != "int4":
        return fmt
    if group_size not in GROUP_SIZES:
        raise ValueError(f"INT4 group size {group_size} has no compiled decode kernel (supported: {GROUP_SIZES})")
    return "int4" if group_size == 128 else f"int4g{group_size}"


def m_bucket(m: int) -> int:
    if not 1 <= m <= MAX_M:
        raise ValueError(f"decode projections take 1 <= M <= {MAX_M} rows, got M = {m}")
    return next(b for b in sorted(M_TILES) if m <= b)


def gemv_key(fmt: str, group_size: int, epilogue: str, warps: int = 4) -> str:
    suffix = "" if warps == 4 else f".w{warps}"
    return f"decode.gemv.{fmt_tag(fmt, group_size)}.{epilogue}{suffix}"


def skinny_key(fmt: str, group_size: int, epilogue: str, m: int, weights: str = "smem") -> str:
    suffix = "" if weights == "smem" else f".w{weights}"
    return f"decode.skinny.{fmt_tag(fmt, group_size)}.m{m_bucket(m)}.{epilogue}{suffix}"


def unit_k(fmt: str, group_size: int) -> int:
    return group_size if fmt == "int4" else 64


@dataclass(frozen=True)
class Launch:
    key: str
    split: int = 1          # CTAs along K (skinny only)
    n_tiles: int = 0


def choose(fmt: str, group_size: int, epilogue: str, m: int, n: int, k: int, sms: int = 132,
           weights: str = "smem", gemv_warps: int = 4) -> Launch:
    if m == 1:
        return Launch(gemv_key(fmt, group_size, epilogue, gemv_warps))
    n_tiles = -(-n // TILE_N)
    units = k // unit_k(fmt, group_size)
    split = max(1, min(round(CTAS_PER_SM * sms / n_tiles), units // MIN_UNITS))
    return Launch(skinny_key(fmt, group_size, epilogue, m, weights), split, n_tiles)
