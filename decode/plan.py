"""Variant choice and launch shape of the decode projections (no DSL import: used by the torch ops and the
kernel catalog, so compile-time parameters and launch shapes come from one place).

* 1 <= M <= 16 and the M activation rows fit in shared memory -> the persistent register-streaming kernel
  (`gemv.py`): one CTA of 16 warps per SM, each CTA `tiles` = ceil(N/16 / SMs) consecutive 16-channel
  n-blocks, so every SM streams the same number of bytes.
* otherwise (up to M = 32) -> the skinny kernel (`skinny.py`): 128-channel tiles and an activation ring,
  split K across CTAs until the resident CTA slots are filled (never a partial second wave), at least
  `MIN_UNITS` units per CTA.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from .gemv_layout import SMEM_LIMIT, GemvSmem

FORMATS = ("int4", "e4m3", "bf16")
GROUP_SIZES = (64, 128)           # INT4 group sizes with compiled variants
EPILOGUES = ("store", "residual", "swiglu")
MAX_M = 32
GEMV_MAX_M = 16
GEMV_M_TILES = {8: 1, 16: 2}      # token columns -> 8-token MMA groups
SKINNY_M_TILES = {16: 2, 32: 4}  # M <= 16 reaches the skinny kernel only where the GEMV cannot run
GEMV_WARPS = 16
# benchmark-only design comparisons of the GEMV (key suffix -> changed compile parameters)
GEMV_VARIANTS = {"": {}, "nofold": {"fold": False}, "nopdl": {"pdl": False}}
SKINNY_WARPS, SKINNY_NB_PER_WARP = 4, 2
TILE_N = SKINNY_WARPS * SKINNY_NB_PER_WARP * 16
CTAS_PER_SM = 2
MIN_UNITS = 4


def fmt_tag(fmt: str, group_size: int = 128) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown decode weight format {fmt!r}; known: {', '.join(FORMATS)}")
    if fmt != "int4":
        return fmt
    if group_size not in GROUP_SIZES:
        raise ValueError(f"INT4 group size {group_size} has no compiled decode kernel (supported: {GROUP_SIZES})")
    return "int4" if group_size == 128 else f"int4g{group_size}"


def _bucket(m: int, buckets) -> int:
    if not 1 <= m <= MAX_M:
        raise ValueError(f"decode projections take 1 <= M <= {MAX_M} rows, got M = {m}")
    return next(b for b in sorted(buckets) if m <= b)


def m_bucket(m: int) -> int:
    """Token-column bucket of the skinny kernel (also validates 1 <= M <= MAX_M)."""
    return _bucket(m, SKINNY_M_TILES)


def unit_k(fmt: str, group_size: int) -> int:
    return group_size if fmt == "int4" else 64


# ---- GEMV (1 <= M <= 16) ------------------------------------------------------------------------
def gemv_params(fmt: str, group_size: int, epilogue: str, m: int, variant: str = "") -> dict:
    """Compile-time parameters of a GEMV variant (decode.gemv.compile_target keywords)."""
    if m > GEMV_MAX_M:
        raise ValueError(f"the GEMV serves M <= {GEMV_MAX_M}, got M = {m}")
    m_tiles = GEMV_M_TILES[_bucket(m, GEMV_M_TILES)]
    # INT4 fold: one correction per group instead of an FMA per register; its per-phase activation sums
    # cost one tile's worth of MMAs, cheap only with few token groups
    params = dict(fmt=fmt, group_size=group_size, epilogue=epilogue, m_tiles=m_tiles, warps=GEMV_WARPS,
                  fold=fmt == "int4" and m_tiles == 1, pdl=True)
    params.update(GEMV_VARIANTS[variant])
    return params


def gemv_key(fmt: str, group_size: int, epilogue: str, m: int, variant: str = "") -> str:
    suffix = f".{variant}" if variant else ""
    return f"decode.gemv.{fmt_tag(fmt, group_size)}.m{_bucket(m, GEMV_M_TILES)}.{epilogue}{suffix}"


def gemv_smem(params: dict) -> GemvSmem:
    return GemvSmem(unit_k(params["fmt"], params["group_size"]), params["m_tiles"], params["warps"],
                    params["fold"], params["epilogue"] == "residual", params["fmt"] == "e4m3")


def gemv_tiles(params: dict, m: int, n: int, k: int, sms: int, tiles: Optional[int] = None) -> Optional[int]:
    """n-blocks per CTA (balanced over the SMs), or None when the activation rows do not fit."""
    tiles = tiles or -(-(n // 16) // sms)
    smem = gemv_smem(params).offsets(m, k // unit_k(params["fmt"], params["group_size"]), tiles)["total"]
    return tiles if smem <= SMEM_LIMIT else None


# ---- skinny (17 <= M <= 32, and benchmark comparisons) -----------------------------------------
def skinny_key(fmt: str, group_size: int, epilogue: str, m: int) -> str:
    return f"decode.skinny.{fmt_tag(fmt, group_size)}.m{m_bucket(m)}.{epilogue}"


def skinny_split(fmt: str, group_size: int, n: int, k: int, sms: int) -> int:
    n_tiles = -(-n // TILE_N)
    units = k // unit_k(fmt, group_size)
    return max(1, min(CTAS_PER_SM * sms // n_tiles, units // MIN_UNITS))


@dataclass(frozen=True)
class Launch:
    key: str
    kind: str               # "gemv" or "skinny"
    tiles: int = 0          # gemv: n-blocks per CTA
    split: int = 1          # skinny: CTAs along K


@lru_cache(maxsize=4096)
def choose(fmt: str, group_size: int, epilogue: str, m: int, n: int, k: int, sms: int = 132,
           kernel: str = "auto", variant: str = "", tiles: Optional[int] = None,
           split: Optional[int] = None) -> Launch:
    fmt_tag(fmt, group_size)
    m_bucket(m)  # validates M
    if kernel not in ("auto", "gemv", "skinny"):
        raise ValueError(f"kernel must be 'auto', 'gemv' or 'skinny', got {kernel!r}")
    if kernel != "skinny" and m <= GEMV_MAX_M:
        params = gemv_params(fmt, group_size, epilogue, m, variant)
        t = gemv_tiles(params, m, n, k, sms, tiles)
        if t is not None:
            return Launch(gemv_key(fmt, group_size, epilogue, m, variant), "gemv", tiles=t)
    if kernel == "gemv":
        raise ValueError(f"the GEMV cannot serve M = {m}, K = {k} (activation rows exceed shared memory)")
    sp = split or skinny_split(fmt, group_size, n, k, sms)
    return Launch(skinny_key(fmt, group_size, epilogue, m), "skinny", split=sp)
