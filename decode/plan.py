"""Variant choice and launch shape of the decode projections (no DSL import: used by the torch ops and the
kernel catalog, so compile-time parameters and launch shapes come from one place).

The default routing (`kernel="auto"`, `default_kernel`), per format and M; each rule's measured reason is in
docs/routing.md:

* INT4 group 128, M = 1 -> the one-tile-per-CTA GEMV (`gemv_tile.py`, batches of 2 units; of 3 for K >
  TILE_LONG_K without the fused norm), 8 warps when K > TILE_LARGE_K or the grid has at most
  TILE_SMALL_GRID_CTAS CTAs per SM, else 4 (where the activation row fits in shared memory). QKV and gate/up
  there have a fused-RMSNorm variant (`norm=True`, `fuses_norm`) that the decode step uses instead of the
  row-factor kernel.
* INT4 g128, 2 <= M <= TILE_MAX_M, store and SwiGLU epilogues, where some n-block count per CTA fits the grid in
  one wave (`tile_serves_rows`, `tile_rows_nblocks`: the 8B QKV and gate/up, the 70B QKV; P12/P13) -> the
  multi-token tile GEMV (`gemv_tile.py` with 8 token columns, n-blocks per CTA), with its fused-RMSNorm variant.
* INT4, M <= INT4_GEMV_MAX_M -> the persistent GEMV (`gemv.py`, one 8-token group, folded nibble bias)
  where the activation rows fit in shared memory, else the skinny kernel.
* INT4, INT4_GEMV_MAX_M < M <= MAX_M -> the skinny kernel (a second token group doubles the GEMV's MMA and
  dequantization work and turns the fold off).
* BF16 and E4M3, M <= GEMV_MAX_M -> the persistent GEMV where the activation rows fit, else the skinny kernel.
* otherwise (up to M = MAX_M) -> the skinny kernel: 128-channel tiles and an activation ring, split K across
  CTAs until the resident CTA slots are filled (never a partial second wave), at least `MIN_UNITS` units
  per CTA. For INT4 g128 its register-weights form (`skinny_regs.py`, SKINNY_ROUTED_VARIANTS by token bucket,
  P15): the weights streamed into registers, only the activations in the ring. The 64-row bucket runs the
  register-weights form for every format (P16: the ring kernel's accumulators for 8 token groups spill). INT4 g128
  (P17) and E4M3 (P18) run the warp-specialized kernel from 17 rows on (`skinny_ws.py`, `skinny_ws_e4m3.py`).

The package registry (futx/runtime/catalog/decode_linear.py) holds exactly the variants this router picks.
The `*_VARIANTS` tables below (and the INT4 GEMV M bucket 16) describe the tuning space: design comparisons
the router never picks, which `choose(kernel=..., variant=...)` can still name and scripts/tuning_space.py
registers and compiles on demand.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Union

from .gemv_layout import SMEM_LIMIT, TOKENS, GemvSmem, tile_smem

FORMATS = ("int4", "e4m3", "bf16")
GROUP_SIZES = (64, 128)           # INT4 group sizes with compiled variants
EPILOGUES = ("store", "residual", "swiglu")
KERNELS = ("auto", "tile", "gemv", "skinny")
MAX_M = 64
GEMV_MAX_M = 16
GEMV_M_TILES = {8: 1, 16: 2}      # token columns -> 8-token MMA groups
INT4_GEMV_MAX_M = 8               # INT4 with two token groups: the skinny kernel measured faster
SKINNY_M_TILES = {16: 2, 32: 4, 64: 8}  # M <= 16 reaches the skinny kernel only where the GEMV cannot run
GEMV_WARPS = 16
# tuning space of the GEMV (key suffix -> changed compile parameters): without the fold, and with the
# scales converted at the load
GEMV_VARIANTS = {"": {}, "nofold": {"fold": False}, "r2": {"raw_scales": False}}
# the one-tile-per-CTA M = 1 GEMV (gemv_tile.py): formats with compiled variants, warps by K
TILE_FORMATS = (("int4", 128),)
TILE_WARPS_SMALL_K, TILE_WARPS_LARGE_K = 4, 8
TILE_LARGE_K = 8192               # K > this: 8 warps (measured on the down projections)
TILE_LONG_K = 16384               # K > this, without the fused norm: batches of 3 units (the 70B down; P2)
TILE_LONG_K_VARIANT = "p3"
TILE_SMALL_GRID_CTAS = 3          # and where the grid has at most this many CTAs per SM (8B QKV and O, P3)
# the fill rule (tuning space, P14: no gain in the decode step): M = 1 grids of a few CTAs per SM get the most warps
# per CTA (of TILE_FILL_WARPS) whose CTAs per SM fit in TILE_WARP_SLOTS warps (the 8-warp kernel's 79 registers
# leave 25 warps per SM), so one wave fills the SM's warp slots (8B O and down: 12 warps, 70B O and down: 6)
TILE_WARP_SLOTS = 24
TILE_FILL_WARPS = (4, 6, 8, 12, 16)
# resident tile GEMV CTAs per SM by warps: the builds with n-blocks per CTA (and the M = 1 ones) keep at most 72
# registers at 4 warps (64-70) and 80 at 8 (72-79)
TILE_CTAS_PER_SM = {4: 7, 8: 3}
# n-blocks per CTA at M = 1 (tuning space, P14: slower in the decode step): grids of more than one wave of CTAs
# take TILE_NBLOCKS consecutive 16-channel n-blocks per CTA, so the grid fits in one wave (8B gate/up: 2, 70B: 4)
TILE_NBLOCKS = (2, 3, 4)
# the multi-token tile GEMV on grids of any size (routing rule P13): the fewest TILE_ROWS_NBLOCKS n-blocks per CTA
# that bring its grid within one wave of resident CTAs (TILE_CTAS_PER_SM, fewer where the staged rows and partials
# take the shared memory), so each CTA stages the rows once for all of its n-blocks
TILE_ROWS_NBLOCKS = (2, 3, 4, 5, 6, 8, 10, 12, 16)
# the multi-token tile GEMV (B columns = tokens, 1..TOKENS rows staged; key decode.tile.<fmt>.m8.*[.nb<c>]): routed
# for 2 <= M <= TILE_MAX_M with the TILE_MULTI_EPILOGUES on every grid some n-block count fits in one wave (P13: the
# 8B QKV and gate/up, the 70B QKV, the 70B gate/up at 2 and 3 rows); with P13 off
# (route_tile_variant(rows_nblocks=False)) the P12 rule: small grids (at most TILE_SMALL_GRID_CTAS CTAs per SM) whose
# staged rows leave room for TILE_ROWS_MIN_CTAS CTAs per SM; its warps: 8 from TILE_ROWS_W8 rows on, else the M = 1
# rule
TILE_MAX_M = 8
TILE_MULTI_EPILOGUES = ("store", "swiglu")
TILE_ROWS_W8 = 2
TILE_ROWS_MIN_CTAS = 2
NORM_EPILOGUES = ("store", "swiglu")   # the projections that read an RMSNorm row (QKV, gate/up)
# split-K of the tile GEMV (tuning space, routing rule P11: measured slower in the decode step): the residual
# projections' CTAs of a tile each stream a K range and the last to arrive sums the 16 row partials
TILE_SPLIT_EPILOGUES = ("residual",)
TILE_MAX_SPLITS = 4
# tuning space: a rolling prefetch (6 units deep); batches of 1, 3 or 4 units instead of 2 (INT4 g128);
# "ring<u>": each warp streams its weights through a shared-memory ring of u units (cp.async), so the bytes in
# flight are not bounded by registers, and the first u units are requested before the PDL wait;
# "fold": the nibble bias folded into one correction per unit (no bf16x2 FMA per weight register)
TILE_VARIANTS = {"": {"pipeline": "batch"}, "rolling": {"pipeline": "rolling", "prefetch": 3},
                 **{f"p{u}": {"pipeline": "batch", "prefetch": u} for u in (1, 3, 4)},
                 **{f"ring{u}": {"pipeline": "ring", "prefetch": u} for u in (4, 8)},
                 "fold": {"pipeline": "batch", "fold": True}}
SKINNY_WARPS, SKINNY_NB_PER_WARP = 4, 2
TILE_N = SKINNY_WARPS * SKINNY_NB_PER_WARP * 16
CTAS_PER_SM = 2
# tuning space of the skinny kernel (INT4): a shorter ring so that more CTAs (warps) fit per SM, the split
# then filling that many CTA slots per SM ("ctas_per_sm" only steers the host's split choice)
# "wg": the same tiles on warpgroup MMA (decode/skinny_wgmma.py, INT4 only; measured slower, docs/routing.md P8);
# "wgo": its MMAs overlapped with the next unit's dequantization; "rwg", "rwgo": warpgroup MMA with the weights streamed
# into registers in batches of 2 units (decode/skinny_wgmma.py SkinnyRegsWgmma; "rwgo": the second unit dequantized
# while the first one's MMAs run); "c2": two accumulation chains per
# token group (its top stall at M = 32 is the fixed-latency MMA dependency, results-decode-linear.md run 7)
SKINNY_VARIANTS = {"": {}, "s3": {"stages": 3, "ctas_per_sm": 4}, "s4": {"stages": 4, "ctas_per_sm": 3},
                   "wg": {"mma": "wgmma", "warps": 8, "nb_per_warp": 1},
                   "wgo": {"mma": "wgmma", "warps": 8, "nb_per_warp": 1, "overlap": True},
                   "c2": {"chains": 2},
                   "rw": {"weights": "regs", "warps": 8, "nb_per_warp": 1},
                   "rw1": {"weights": "regs", "warps": 8, "nb_per_warp": 1, "prefetch": 1},
                   "rw4": {"weights": "regs", "prefetch": 1, "ctas_per_sm": 3},
                   "rwc": {"weights": "regs", "warps": 8, "nb_per_warp": 1, "reduce": "cluster"},
                   "rw1c": {"weights": "regs", "warps": 8, "nb_per_warp": 1, "prefetch": 1, "reduce": "cluster"},
                   "rwg": {"weights": "regs", "mma": "wgmma", "warps": 8, "nb_per_warp": 1},
                   "rwgo": {"weights": "regs", "mma": "wgmma", "warps": 8, "nb_per_warp": 1, "overlap": True,
                            "ctas_per_sm": 1},
                   **{v: {"weights": "regs", "warps": 8, "nb_per_warp": 1, "ctas_per_sm": 1, **kw}
                      for v, kw in (("rww", {}), ("rww1", {"prefetch": 1}),
                                    ("rwwb", {"prefetch": 1, "ctas_per_sm": 2, "min_ctas": 2}))},
                   **{v: {"mma": "ws", "warps": 8, "nb_per_warp": 1, "ctas_per_sm": 1, **kw}
                      for v, kw in (("ws", {}), ("wsk", {"schedule": "stream"}), ("wst", {"weights_tma": True}),
                                    ("wskt", {"schedule": "stream", "weights_tma": True}))}}
# "ws": the warp-specialized mixed-input warpgroup GEMM (decode/skinny_ws.py, INT4 g128): a producer warp streams the
# weights, scales and activations into a mbarrier ring by bulk copies and TMA, two consumer warpgroups run wgmma with
# the expanded weights as the register A operand and fold each unit's partial one unit behind; one CTA per SM, every
# token bucket (ANY_BUCKET_VARIANTS). "wsk": the same kernel persistent, one CTA per SM over an even share of all
# (tile, unit) pairs (stream-K: no partial wave; a tile split between CTAs is summed by the last to finish it), its
# `split` the CTA count. "wst", "wskt": the same with each stage's weights and scales loaded by one 2D TMA copy each
# instead of 8 + 8 bulk copies (tuning space)
ANY_BUCKET_VARIANTS = ("ws", "wsk", "wst", "wskt")
# "ws", "wsk" on E4M3 weights (decode/skinny_ws_e4m3.py: 64-k units, the weights by one 2D TMA copy per stage into a
# 64-byte swizzle, their A operands from natural rows by one lane-dependent prmt per 4 weights, no fold: the channel
# scale in the epilogue); every token bucket; "wst", "wskt" do not apply (its weights always arrive by TMA)
E4M3_WS_VARIANTS = ("ws", "wsk")
# the 64-row bucket's variants: the register-weights kernel at 148-198 registers, one CTA (8 warps) per SM, which
# the split rule counts (ctas_per_sm); "rww" batches 2 units, "rww1" 1; "rwwb" 1, bounded to 128 registers for two
# CTAs per SM: faster on projections of >= 64 tiles (70B QKV 55 vs 81 us at M = 64) but it spills (18-33 local loads),
# and a shipped kernel must not (tests/test_kernel_compile.py), so it stays tuning space (routing rule P16)
WIDE_VARIANTS = ("rww", "rww1", "rwwb")
CLUSTER_MAX = 8   # CTAs per tile of the cluster split-K ("reduce": "cluster"): the portable cluster size
# the register-weights skinny kernel (decode/skinny_regs.py: "rw" batches of 2 units, "rw1" of 1, 8 warps of one
# n-block; "rw4": 4 warps of two n-blocks, 1 unit) is what the router runs for INT4 g128 (routing rule P15), by token
# bucket: batches of 2 units at M <= 16 (~120 registers, 2 CTAs per SM); of 1 at M <= 32, where 2 units take 148
# registers and leave one CTA per SM
SKINNY_ROUTED_VARIANTS = {16: "rw", 32: "rw1", 64: "rww"}
# rule P17: INT4 g128 in the 32- and 64-token buckets (17..64 rows) runs the warp-specialized kernel instead
# (decode/skinny_ws.py), on the grid schedule ("ws") where its tiles x split CTAs fill at least WS_STREAM_FILL of
# their waves, else persistent stream-K ("wsk": the 8B QKV and gate/up, the 70B QKV and gate/up); the 16-token bucket
# keeps P15 (the register-weights kernel measured faster there)
WS_BUCKETS = (32, 64)
WS_STREAM_FILL = 0.9
# rule P18: E4M3 in the same buckets runs its warp-specialized kernel (decode/skinny_ws_e4m3.py) with P17's schedule
# rule counted in its 64-k units; the ring kernel ("", 17..32 rows) and "rww" (33..64) it replaced are tuning space.
# M <= 16 keeps P6/P7 (the persistent GEMV where the rows fit, else the ring kernel)
WS_FORMATS = (("int4", 128), ("e4m3", 128))
MIN_UNITS = 4
# the tile GEMV variant and small-grid rule the router applies (route_tile_variant lets a benchmark time a tuning
# variant or another threshold in the decode step as the router would launch it)
TILE_ROUTED = ""
TILE_SMALL_GRID = TILE_SMALL_GRID_CTAS
TILE_SPLIT: Optional[int] = None   # a forced split count of the split-capable projections (None: the rule)
TILE_LONG_K_ROUTED = TILE_LONG_K_VARIANT
TILE_MAX_M_ROUTED = TILE_MAX_M
TILE_MULTI_ROUTED = TILE_MULTI_EPILOGUES
TILE_FILL_ROUTED = 0               # warp slots of the fill rule (0: off)
TILE_FILL_MIN_K_ROUTED = 0         # the fill rule only for K above this
TILE_NBLOCKS_ROUTED = False        # the n-blocks-per-CTA rule (tile_nblocks) on
TILE_ROWS_NBLOCKS_ROUTED = True    # the multi-token tile GEMV on every grid, n-blocks by tile_rows_nblocks (P13);
                                   # an int: at most that many n-blocks per CTA
TILE_ROWS_W8_ROUTED = TILE_ROWS_W8
SKINNY_ROUTED: Optional[str] = None  # a skinny variant forced for INT4 g128 (None: SKINNY_ROUTED_VARIANTS)


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


def gemv_buckets(fmt: str) -> tuple[int, ...]:
    """GEMV M buckets the router picks for this format (INT4 stops at INT4_GEMV_MAX_M)."""
    return tuple(b for b in sorted(GEMV_M_TILES) if fmt != "int4" or b <= INT4_GEMV_MAX_M)


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


# ---- skinny (M beyond the GEMV's reach, up to 32) -----------------------------------------------
def skinny_key(fmt: str, group_size: int, epilogue: str, m: int, variant: str = "") -> str:
    if variant not in SKINNY_VARIANTS:
        raise ValueError(f"unknown skinny variant {variant!r}; known: {sorted(SKINNY_VARIANTS)}")
    return f"decode.skinny.{fmt_tag(fmt, group_size)}.m{m_bucket(m)}.{epilogue}" + (f".{variant}" if variant else "")


def skinny_variant(fmt: str, group_size: int, m: int, n: Optional[int] = None, k: Optional[int] = None,
                   sms: int = 132) -> str:
    """The skinny variant the router runs: for INT4 g128 the variant a benchmark forces, else the warp-specialized
    kernel in the WS_BUCKETS (P17, and for E4M3 P18; its schedule by `ws_schedule`, "ws" when the shape is not given)
    and the register-weights kernel of the 16-token bucket (SKINNY_ROUTED_VARIANTS, P15); for the other formats (and
    E4M3 up to 16 rows) the ring kernel ("") up to 32 rows and the register-weights kernel in the 64-row bucket
    (P16)."""
    bucket = m_bucket(m)
    if (fmt, group_size) == ("int4", 128) and SKINNY_ROUTED is not None:
        return SKINNY_ROUTED
    if _ws_format(fmt, group_size) and bucket in WS_BUCKETS:
        return ws_schedule(n, k, sms, fmt, group_size) if n is not None and k is not None else "ws"
    if (fmt, group_size) != ("int4", 128):
        return SKINNY_ROUTED_VARIANTS[bucket] if bucket == 64 else ""
    return SKINNY_ROUTED_VARIANTS[bucket]


def _ws_format(fmt: str, group_size: int) -> bool:
    """Whether the warp-specialized kernel is routed for these weights (WS_FORMATS; the group size counts for INT4)."""
    return (fmt, group_size if fmt == "int4" else 128) in WS_FORMATS


def ws_schedule(n: int, k: int, sms: int = 132, fmt: str = "int4", group_size: int = 128) -> str:
    """P17's (and P18's) schedule: "ws" (tiles x split CTAs, the split counted in the format's units) where they fill
    at least WS_STREAM_FILL of their waves, else "wsk" (stream-K)."""
    ctas = -(-n // TILE_N) * skinny_split(fmt, group_size, n, k, sms, "ws")
    return "ws" if ctas >= WS_STREAM_FILL * -(-ctas // sms) * sms else "wsk"


def skinny_routed_variants(fmt: str, group_size: int, m: int) -> tuple:
    """Every skinny variant the router can pick in M's token bucket (the registry holds exactly these)."""
    if _ws_format(fmt, group_size) and m_bucket(m) in WS_BUCKETS:
        return ("ws", "wsk")
    return (skinny_variant(fmt, group_size, m),)


def skinny_replaced_variants(fmt: str, group_size: int, m: int) -> tuple:
    """The skinny variants P18 took the E4M3 buckets from (the ring kernel up to 32 rows, "rww" in the 64-row bucket):
    tuning space since."""
    if fmt == "e4m3" and m_bucket(m) in WS_BUCKETS:
        return (SKINNY_ROUTED_VARIANTS[64] if m_bucket(m) == 64 else "",)
    return ()


def is_stream_k(variant: str) -> bool:
    """Whether the skinny variant is persistent over (tile, unit) pairs ("schedule": "stream"; its split = CTAs)."""
    return SKINNY_VARIANTS[variant].get("schedule") == "stream"


def skinny_max_split(fmt: str, group_size: int, n: int, k: int, variant: str = "") -> int:
    """The largest split a skinny launch takes: one unit per CTA (stream-K: per (tile, unit) pair)."""
    units = k // unit_k(fmt, group_size)
    return units * -(-n // TILE_N) if is_stream_k(variant) else units


def skinny_workspace(variant: str, split: int, n: int, m: int) -> int:
    """float32 values of a skinny launch's split-K workspace: [split][n][token bucket], or for stream-K two partial
    128-channel tiles per CTA, [CTA][2][TILE_N][token bucket]."""
    if is_stream_k(variant):
        return split * 2 * TILE_N * m_bucket(m)
    return split * n * m_bucket(m) if split > 1 else 4


def skinny_split(fmt: str, group_size: int, n: int, k: int, sms: int, variant: str = "") -> int:
    n_tiles = -(-n // TILE_N)
    units = k // unit_k(fmt, group_size)
    if is_stream_k(variant):   # one CTA per SM, each with at least MIN_UNITS (tile, unit) pairs where there are fewer
        return max(1, min(sms, n_tiles * units // MIN_UNITS))
    ctas = SKINNY_VARIANTS[variant].get("ctas_per_sm", CTAS_PER_SM)
    most = CLUSTER_MAX if SKINNY_VARIANTS[variant].get("reduce") == "cluster" else units
    return max(1, min(ctas * sms // n_tiles, units // MIN_UNITS, most))


# ---- tile GEMV (M = 1; 2..8 rows on small grids) ------------------------------------------------------
def has_tile(fmt: str, group_size: int) -> bool:
    """Whether a tile GEMV is compiled for these weights (TILE_FORMATS; the group size counts for INT4 only)."""
    return (fmt, group_size if fmt == "int4" else 128) in TILE_FORMATS


def route_tile_variant(variant: str, small_grid: Optional[float] = None, split: Optional[int] = None,
                       long_k: Optional[str] = None, max_m: Optional[int] = None,
                       multi_epilogues: Optional[tuple] = None, fill: Optional[int] = None,
                       nblocks: bool = False, fill_min_k: int = 0, rows_nblocks: Union[bool, int] = True,
                       rows_w8: Optional[int] = None, skinny: Optional[str] = None) -> None:
    """Make `choose(kernel="auto")` pick this TILE_VARIANTS entry for the tile GEMV from now on ("": the shipped
    rule, `long_k` for K > TILE_LONG_K without the fused norm, None: TILE_LONG_K_VARIANT), 8 warps up to
    `small_grid` CTAs per SM (None: the shipped TILE_SMALL_GRID_CTAS) and `split` CTAs per tile of the
    split-capable projections (None: `tile_splits`), and the multi-token tile GEMV up to `max_m` rows (None: the
    shipped TILE_MAX_M; 1: never) for the `multi_epilogues` (None: TILE_MULTI_EPILOGUES), the M = 1 warps by the
    fill rule with `fill` warp slots per SM (None or 0: off) where K > `fill_min_k`, and n-blocks per CTA by
    `tile_nblocks` (`nblocks`), the multi-token tile GEMV on grids of any size with n-blocks per CTA by
    `tile_rows_nblocks` (`rows_nblocks`, the shipped P13; an int: at most that many n-blocks per CTA; False: small
    grids only, the P12 rule), with 8 warps from
    `rows_w8` rows (None: TILE_ROWS_W8), and the SKINNY_VARIANTS entry `skinny` for INT4 g128 where the router
    picks the skinny kernel (None: `skinny_variant`, the shipped P15; "": the ring kernel). Benchmarks only: a
    tuning variant must be registered (scripts/tuning_space.py); ("",) restores the shipped rule."""
    global TILE_ROUTED, TILE_SMALL_GRID, TILE_SPLIT, TILE_LONG_K_ROUTED, TILE_MAX_M_ROUTED, TILE_MULTI_ROUTED
    global TILE_FILL_ROUTED, TILE_NBLOCKS_ROUTED, TILE_FILL_MIN_K_ROUTED, TILE_ROWS_NBLOCKS_ROUTED
    global TILE_ROWS_W8_ROUTED, SKINNY_ROUTED
    for v in (variant, long_k or ""):
        if v not in TILE_VARIANTS:
            raise ValueError(f"unknown tile GEMV variant {v!r}; known: {sorted(TILE_VARIANTS)}")
    if split is not None and not 1 <= split <= TILE_MAX_SPLITS:
        raise ValueError(f"a tile GEMV split is 1..{TILE_MAX_SPLITS}, got {split}")
    if max_m is not None and not 1 <= max_m <= TOKENS:
        raise ValueError(f"the multi-token tile GEMV serves up to {TOKENS} rows, got max_m = {max_m}")
    if multi_epilogues is not None and not set(multi_epilogues) <= set(EPILOGUES):
        raise ValueError(f"unknown epilogues {sorted(set(multi_epilogues) - set(EPILOGUES))}; known: {EPILOGUES}")
    if not isinstance(rows_nblocks, bool) and rows_nblocks not in TILE_ROWS_NBLOCKS:
        raise ValueError(f"rows_nblocks is True, False or one of {TILE_ROWS_NBLOCKS}, got {rows_nblocks}")
    if skinny is not None and skinny not in SKINNY_VARIANTS:
        raise ValueError(f"unknown skinny variant {skinny!r}; known: {sorted(SKINNY_VARIANTS)}")
    if rows_w8 is not None and not 2 <= rows_w8 <= TOKENS + 1:
        raise ValueError(f"rows_w8 is 2..{TOKENS + 1} rows, got {rows_w8}")
    if fill is not None and not (fill == 0 or min(TILE_FILL_WARPS) <= fill <= 64):
        raise ValueError(f"fill is 0 (off) or {min(TILE_FILL_WARPS)}..64 warp slots per SM, got {fill}")
    TILE_ROUTED = variant
    TILE_SMALL_GRID = TILE_SMALL_GRID_CTAS if small_grid is None else small_grid
    TILE_SPLIT = split
    TILE_LONG_K_ROUTED = TILE_LONG_K_VARIANT if long_k is None else long_k
    TILE_MAX_M_ROUTED = TILE_MAX_M if max_m is None else max_m
    TILE_MULTI_ROUTED = TILE_MULTI_EPILOGUES if multi_epilogues is None else tuple(multi_epilogues)
    TILE_FILL_ROUTED = fill or 0
    TILE_NBLOCKS_ROUTED = bool(nblocks)
    TILE_FILL_MIN_K_ROUTED = fill_min_k
    TILE_ROWS_NBLOCKS_ROUTED = rows_nblocks
    TILE_ROWS_W8_ROUTED = TILE_ROWS_W8 if rows_w8 is None else rows_w8
    SKINNY_ROUTED = skinny
    choose.cache_clear()


def tile_route() -> tuple:
    """The routing state route_tile_variant sets (part of the ops' per-signature launch cache key)."""
    return (TILE_ROUTED, TILE_SMALL_GRID, TILE_SPLIT, TILE_LONG_K_ROUTED, TILE_MAX_M_ROUTED, TILE_MULTI_ROUTED,
            TILE_FILL_ROUTED, TILE_NBLOCKS_ROUTED, TILE_FILL_MIN_K_ROUTED, TILE_ROWS_NBLOCKS_ROUTED,
            TILE_ROWS_W8_ROUTED, SKINNY_ROUTED)


def tile_variant(k: int, norm: bool = False, epilogue: str = "") -> str:
    """The routed tile GEMV variant: a routed tuning variant, else batches of 3 units for K > TILE_LONG_K without
    the fused norm (the 70B and 405B down projections, P2), else the default batches of 2 (also under a forced
    split: the split kernel has batches of 2)."""
    if TILE_ROUTED:
        return TILE_ROUTED
    if TILE_SPLIT is not None and epilogue in TILE_SPLIT_EPILOGUES and not norm:
        return ""
    return TILE_LONG_K_ROUTED if k > TILE_LONG_K and not norm else ""


def tile_warps(k: int, n: Optional[int] = None, sms: int = 132, m: int = 1) -> int:
    """8 warps for the long-K down projections, and where the grid of n / 16 CTAs leaves the SMs nearly empty
    (at most TILE_SMALL_GRID per SM: more warps per CTA put more loads in flight), and for the multi-token kernel
    from TILE_ROWS_W8 rows (the staged rows leave room for fewer CTAs per SM); else 4. With the fill rule on
    (M = 1): the most TILE_FILL_WARPS whose CTAs per SM fit in its warp slots, where some do."""
    if TILE_FILL_ROUTED and m == 1 and n is not None and k > TILE_FILL_MIN_K_ROUTED:
        per_sm = -(-(n // 16) // sms)
        fits = [w for w in TILE_FILL_WARPS if per_sm * w <= TILE_FILL_ROUTED]
        if fits:
            return max(fits)
    if k > TILE_LARGE_K or (n is not None and n // 16 <= TILE_SMALL_GRID * sms) or m >= TILE_ROWS_W8_ROUTED:
        return TILE_WARPS_LARGE_K
    return TILE_WARPS_SMALL_K


def tile_nblocks(n: int, k: int, warps: int, sms: int = 132, variant: str = "") -> int:
    """n-blocks per CTA of the M = 1 tile GEMV: 1, or with the rule routed (route_tile_variant(nblocks=True)) the
    TILE_NBLOCKS count that brings a grid of more than one wave of resident CTAs (TILE_CTAS_PER_SM) within one,
    where every warp's K share holds a unit and the variant is a batch pipeline."""
    ctas = TILE_CTAS_PER_SM.get(warps)
    v = TILE_VARIANTS[variant]
    if not TILE_NBLOCKS_ROUTED or ctas is None or v["pipeline"] != "batch" or v.get("fold") or k // 128 < warps:
        return 1
    per_cta = -(-(n // 16) // (ctas * sms))
    return per_cta if per_cta in TILE_NBLOCKS else 1


def tile_params(fmt: str, group_size: int, epilogue: str, warps: int, variant: str = "",
                norm: bool = False, split: bool = False, tokens: int = 1, nblocks: int = 1) -> dict:
    """Compile-time parameters of a tile GEMV variant (decode.gemv_tile.compile_target keywords); `split`: the
    split-K kernel (runtime split count, workspace and arrival counters); `tokens` = TOKENS: the multi-token
    kernel (routed variant only)."""
    if not has_tile(fmt, group_size):
        raise ValueError(f"no tile GEMV is compiled for {fmt_tag(fmt, group_size)} weights")
    if norm and epilogue not in NORM_EPILOGUES:
        raise ValueError(f"the fused-norm tile GEMV serves the {NORM_EPILOGUES} epilogues, got {epilogue!r}")
    if split and (norm or variant or epilogue not in TILE_SPLIT_EPILOGUES):
        raise ValueError(f"the split-K tile GEMV serves the {TILE_SPLIT_EPILOGUES} epilogues of the routed "
                         f"variant without the fused norm, got {epilogue!r}, variant {variant!r}, norm={norm}")
    if tokens not in (1, TOKENS) or (tokens > 1 and (variant or split)):
        raise ValueError(f"the multi-token tile GEMV ({TOKENS} token columns) has no variant or split, got "
                         f"tokens={tokens}, variant {variant!r}, split={split}")
    counts = TILE_ROWS_NBLOCKS if tokens > 1 else TILE_NBLOCKS
    if nblocks != 1 and (nblocks not in counts or split or TILE_VARIANTS[variant]["pipeline"] != "batch"
                         or TILE_VARIANTS[variant].get("fold")):
        raise ValueError(f"n-blocks per CTA ({nblocks}) is one of {counts} ({tokens} token columns), for the batch "
                         f"pipelines without the fold or split-K, got variant {variant!r}, split={split}")
    params = dict(fmt=fmt, group_size=group_size, epilogue=epilogue, warps=warps, **TILE_VARIANTS[variant])
    return {**params, **({"norm": True} if norm else {}), **({"split": True} if split else {}),
            **({"tokens": tokens} if tokens > 1 else {}), **({"nblocks": nblocks} if nblocks > 1 else {})}


def tile_key(fmt: str, group_size: int, epilogue: str, warps: int, variant: str = "", norm: bool = False,
             split: bool = False, tokens: int = 1, nblocks: int = 1) -> str:
    suffix = ((f".w{warps}" if warps != TILE_WARPS_SMALL_K else "") + (".norm" if norm else "")
              + (".split" if split else "") + (f".{variant}" if variant else "")
              + (f".nb{nblocks}" if nblocks > 1 else ""))
    if tokens > 1:
        return f"decode.tile.{fmt_tag(fmt, group_size)}.m{tokens}.{epilogue}{suffix}"
    return f"decode.gemv.{fmt_tag(fmt, group_size)}.m1.{epilogue}{suffix}"


def tile_splits(epilogue: str, k: int) -> int:
    """CTAs per 16-channel tile of the routed tile GEMV: 1 (split-K measured slower, P11) unless a benchmark
    forces a count (`route_tile_variant`) for a projection that can split."""
    if TILE_SPLIT is None or epilogue not in TILE_SPLIT_EPILOGUES or TILE_ROUTED:
        return 1
    return TILE_SPLIT if TILE_SPLIT <= k // 128 else 1


def tile_fits(k: int, warps: int, norm: bool = False, variant: str = "", m: int = 1, nblocks: int = 1) -> bool:
    """The tile GEMV's shared memory (the activation row or, for 1 < m <= TOKENS, the m rows, the warps'
    partials, a weight ring) fits."""
    v = TILE_VARIANTS[variant]
    ring = v["prefetch"] if v["pipeline"] == "ring" else 0
    tokens = TOKENS if m > 1 else 1
    return m <= TOKENS and tile_smem(k, warps, norm, ring, v.get("fold", False), tokens=tokens,
                                     rows=m, nblocks=nblocks)["total"] <= SMEM_LIMIT


def tile_rows_nblocks(m: int, n: int, k: int, warps: int, norm: bool, sms: int = 132) -> int:
    """n-blocks per CTA of the multi-token tile GEMV for a grid of any size: 1 or the fewest TILE_ROWS_NBLOCKS whose
    grid fits in one wave of resident CTAs (TILE_CTAS_PER_SM, fewer where the shared memory holds fewer); 0
    where none does."""
    most = TILE_ROWS_NBLOCKS[-1] if TILE_ROWS_NBLOCKS_ROUTED is True else TILE_ROWS_NBLOCKS_ROUTED
    for nb in (1,) + tuple(c for c in TILE_ROWS_NBLOCKS if c <= most):
        smem = tile_smem(k, warps, norm, tokens=TOKENS, rows=m, nblocks=nb)["total"]
        per_sm = min(TILE_CTAS_PER_SM.get(warps, 0), SMEM_LIMIT // smem)
        if per_sm and -(-(n // 16) // nb) <= per_sm * sms:
            return nb
    return 0


def tile_serves_rows(fmt: str, group_size: int, epilogue: str, m: int, n: int, k: int, sms: int = 132) -> bool:
    """Where the router sends 1 < M <= TILE_MAX_M rows to the multi-token tile GEMV: INT4 g128, the routed epilogues
    and (P13) a grid that some n-block count per CTA fits in one wave (`tile_rows_nblocks`); with P13 off, the P12
    rule: a grid of at most TILE_SMALL_GRID CTAs per SM (where the persistent GEMV's fixed cost dominates) whose
    staged rows leave room for TILE_ROWS_MIN_CTAS CTAs per SM (the 8B down at M = 4, one CTA per SM, measured
    slower)."""
    if not has_tile(fmt, group_size) or epilogue not in TILE_MULTI_ROUTED or m > TOKENS:
        return False
    if TILE_ROWS_NBLOCKS_ROUTED:
        return tile_rows_nblocks(m, n, k, tile_warps(k, n, sms, m), epilogue in NORM_EPILOGUES, sms) > 0
    if n // 16 > TILE_SMALL_GRID * sms:
        return False
    smem = tile_smem(k, tile_warps(k, n, sms, m), epilogue in NORM_EPILOGUES, tokens=TOKENS, rows=m)["total"]
    return smem * TILE_ROWS_MIN_CTAS <= SMEM_LIMIT


def fuses_norm(fmt: str, group_size: int, epilogue: str, m: int, n: int, k: int, sms: int = 132) -> bool:
    """Whether the routed kernel of this projection has a fused-RMSNorm variant (the tile GEMV at M = 1 for
    QKV and gate/up, docs/routing.md E2); elsewhere the row factor stays its own kernel."""
    return (epilogue in NORM_EPILOGUES and default_kernel(fmt, group_size, m, n, k, sms, epilogue) == "tile"
            and tile_fits(k, tile_warps(k, n, sms, m), True, TILE_ROUTED if m == 1 else "", m))


def default_kernel(fmt: str, group_size: int, m: int, n: int, k: int, sms: int = 132,
                   epilogue: str = "residual") -> str:
    """The measured-fastest kernel for this format and M (the rules in the module docstring and
    docs/routing.md)."""
    if (m == 1 and has_tile(fmt, group_size)
            and tile_fits(k, tile_warps(k, n, sms), False, tile_variant(k))):
        return "tile"
    if 1 < m <= TILE_MAX_M_ROUTED and tile_serves_rows(fmt, group_size, epilogue, m, n, k, sms):
        return "tile"
    if fmt == "int4" and m > INT4_GEMV_MAX_M:
        return "skinny"
    if m <= GEMV_MAX_M and gemv_tiles(gemv_params(fmt, group_size, epilogue, m), m, n, k, sms) is not None:
        return "gemv"
    return "skinny"


@dataclass(frozen=True)
class Launch:
    key: str
    kind: str               # "tile", "gemv" or "skinny" (a fused-norm tile GEMV takes eps: key ".norm")
    tiles: int = 0          # gemv: n-blocks per CTA
    split: int = 1          # skinny: CTAs along K (stream-K variants: the persistent CTAs)
    variant: str = ""       # skinny: the SKINNY_VARIANTS entry


@lru_cache(maxsize=4096)
def choose(fmt: str, group_size: int, epilogue: str, m: int, n: int, k: int, sms: int = 132,
           kernel: str = "auto", variant: str = "", tiles: Optional[int] = None,
           split: Optional[int] = None, warps: Optional[int] = None, norm: bool = False,
           nblocks: Optional[int] = None) -> Launch:
    """Kernel and launch shape. `kernel` other than "auto", `variant`, `tiles`, `split` and `warps` (tile
    GEMV) force a design for tests and benchmarks; keys outside the router's choices exist only once
    scripts/tuning_space.py has registered them. `norm`: the fused-RMSNorm tile GEMV (where `fuses_norm`).
    `nblocks`: n-blocks per CTA of the tile GEMV (None: `tile_nblocks` at M = 1, `tile_rows_nblocks` for more
    rows)."""
    fmt_tag(fmt, group_size)
    m_bucket(m)  # validates M
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, KERNELS))}, got {kernel!r}")
    if kernel == "auto":
        kernel = default_kernel(fmt, group_size, m, n, k, sms, epilogue)
        if kernel == "tile" and m == 1:
            variant = variant or tile_variant(k, norm, epilogue)
        elif kernel == "skinny":
            variant = variant or skinny_variant(fmt, group_size, m, n, k, sms)
    if norm and kernel != "tile":
        raise ValueError(f"no fused-norm kernel for this projection (M = {m}, {kernel}): use the row-factor kernel")
    if kernel == "tile":
        wp = warps or tile_warps(k, n, sms, m)
        if m > TOKENS:
            raise ValueError(f"the tile GEMV serves M <= {TOKENS}, got M = {m}")
        tokens = TOKENS if m > 1 else 1
        tile_params(fmt, group_size, epilogue, wp, variant, norm, tokens=tokens)  # validates the choice
        if not tile_fits(k, wp, norm, variant, m):
            raise ValueError(f"the tile GEMV cannot serve M = {m}, K = {k} (activation rows exceed shared memory)")
        if tokens > 1:
            if split not in (None, 1):
                raise ValueError("the multi-token tile GEMV does not split K")
            sp = 1
            nbk = nblocks or ((tile_rows_nblocks(m, n, k, wp, norm, sms) or 1) if TILE_ROWS_NBLOCKS_ROUTED else 1)
        else:
            sp = split if split is not None else (1 if norm or variant else tile_splits(epilogue, k))
            nbk = nblocks or (tile_nblocks(n, k, wp, sms, variant) if sp == 1 else 1)
        if nbk > 1:
            tile_params(fmt, group_size, epilogue, wp, variant, norm, sp > 1, tokens, nbk)  # validates
            if not tile_fits(k, wp, norm, variant, m, nbk):
                raise ValueError(f"the tile GEMV cannot serve M = {m}, K = {k} with {nbk} n-blocks per CTA")
            return Launch(tile_key(fmt, group_size, epilogue, wp, variant, norm, tokens=tokens, nblocks=nbk), "tile")
        if sp > 1:
            tile_params(fmt, group_size, epilogue, wp, variant, norm, split=True)  # validates what can split
            if not 1 <= sp <= min(TILE_MAX_SPLITS, k // 128):
                raise ValueError(f"a tile GEMV split is 1..{min(TILE_MAX_SPLITS, k // 128)} here, got {sp}")
        return Launch(tile_key(fmt, group_size, epilogue, wp, variant, norm, sp > 1, tokens), "tile", split=sp)
    if kernel == "gemv":
        params = gemv_params(fmt, group_size, epilogue, m, variant)
        t = gemv_tiles(params, m, n, k, sms, tiles)
        if t is None:
            raise ValueError(f"the GEMV cannot serve M = {m}, K = {k} (activation rows exceed shared memory)")
        return Launch(gemv_key(fmt, group_size, epilogue, m, variant), "gemv", tiles=t)
    key = skinny_key(fmt, group_size, epilogue, m, variant)
    if split and SKINNY_VARIANTS[variant].get("reduce") == "cluster" and split > CLUSTER_MAX:
        raise ValueError(f"the cluster split-K takes at most {CLUSTER_MAX} CTAs per tile, got split = {split}")
    return Launch(key, "skinny", split=split or skinny_split(fmt, group_size, n, k, sms, variant), variant=variant)
