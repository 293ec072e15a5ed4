"""Decode projection variants (issue 5): the one-tile-per-CTA GEMV for INT4 g128 at M = 1 (4 or 8 warps) and for
2..8 rows (8 warps, 1 to 16 n-blocks per CTA), the persistent GEMV (token buckets 8 and 16; INT4 only bucket 8) and the skinny kernel (buckets 16 and 32), for
INT4 (group 128 and 64), E4M3 and BF16 weights and the three fused epilogues. Keys and compile parameters
come from decode.plan, whose router (`plan.choose`) the torch ops use to pick them.

SPECS holds exactly the variants the router can pick (docs/routing.md gives each rule's measured reason);
all are CI-compiled. Design comparisons the router never picks are the tuning space: scripts/tuning_space.py
builds them with the spec functions below and registers / compiles them on demand."""

from decode import plan
from futx.runtime.registry import KernelSpec

_SOURCES = tuple(f"decode/{f}.py" for f in ("__init__", "plan", "gemv_layout", "ptx", "dequant", "stream",
                                             "epilogue", "signature", "gemv", "gemv_tile", "skinny",
                                             "skinny_wgmma", "skinny_regs", "split_arrival")) + (
    "futx/quant/layouts.py",)
# weight formats (format, INT4 group size) with compiled variants
FORMATS = (("int4", 128), ("int4", 64), ("e4m3", 128), ("bf16", 128))


def gemv_spec(fmt, group, epilogue, m, variant=""):
    params = plan.gemv_params(fmt, group, epilogue, m, variant)
    return KernelSpec(key=plan.gemv_key(fmt, group, epilogue, m, variant), module="decode.gemv",
                      params=tuple(sorted(params.items())), sources=_SOURCES, expect_sass=("HMMA",),
                      doc=f"M<={m} persistent register-streaming GEMV, {plan.fmt_tag(fmt, group)} weights, "
                          f"{epilogue}{', ' + variant if variant else ''}")


def tile_spec(fmt, group, epilogue, warps, variant="", norm=False, split=False, tokens=1, nblocks=1):
    params = plan.tile_params(fmt, group, epilogue, warps, variant, norm, split, tokens, nblocks)
    return KernelSpec(key=plan.tile_key(fmt, group, epilogue, warps, variant, norm, split, tokens, nblocks),
                      module="decode.gemv_tile", params=tuple(sorted(params.items())), sources=_SOURCES,
                      expect_sass=("HMMA",),
                      doc=f"M{'<=' + str(tokens) if tokens > 1 else '=1'} one-tile-per-CTA GEMV"
                          f"{' with the RMSNorm row factor' if norm else ''}"
                          f"{', split-K over CTAs' if split else ''}"
                          f"{f', {nblocks} n-blocks per CTA' if nblocks > 1 else ''}, "
                          f"{plan.fmt_tag(fmt, group)} weights, {epilogue}, {warps} warps"
                          f"{', ' + variant if variant else ''}")


def skinny_spec(fmt, group, epilogue, m, variant=""):
    params = {"fmt": fmt, "group_size": group, "epilogue": epilogue, "m_tiles": plan.SKINNY_M_TILES[m],
              "warps": plan.SKINNY_WARPS, "nb_per_warp": plan.SKINNY_NB_PER_WARP, **plan.SKINNY_VARIANTS[variant]}
    wgmma = params.get("mma") in ("wgmma", "ws")
    # only the warp-specialized kernel imports its files (E4M3: and its subclass)
    ws = params.get("mma") == "ws"
    sources = _SOURCES + (("decode/skinny_ws.py", "decode/stream_k.py") if ws else ()) + (
        ("decode/skinny_ws_e4m3.py",) if ws and fmt == "e4m3" else ())
    return KernelSpec(key=plan.skinny_key(fmt, group, epilogue, m, variant), module="decode.skinny_dispatch",
                      params=tuple(params.items()), sources=sources, expect_sass=("HGMMA",) if wgmma else ("HMMA",),
                      doc=f"M<={m} skinny GEMM{' on warpgroup MMA' if wgmma else ''}, {plan.fmt_tag(fmt, group)} "
                          f"weights, {epilogue}" + (f"; tuning variant {variant}" if variant else ""))


TILE_WARPS = (plan.TILE_WARPS_SMALL_K, plan.TILE_WARPS_LARGE_K)
# what plan.choose(kernel="auto") can return (tests/test_decode_linear.py checks both directions on a shape grid)
SPECS = [gemv_spec(f, g, e, m) for f, g in FORMATS for e in plan.EPILOGUES for m in plan.gemv_buckets(f)]
SPECS += [skinny_spec(f, g, e, m, v) for f, g in FORMATS for e in plan.EPILOGUES
          for m in plan.SKINNY_M_TILES for v in plan.skinny_routed_variants(f, g, m)]
SPECS += [tile_spec(f, g, e, w) for f, g in plan.TILE_FORMATS for e in plan.EPILOGUES for w in TILE_WARPS]
SPECS += [tile_spec(f, g, e, w, norm=True) for f, g in plan.TILE_FORMATS for e in plan.NORM_EPILOGUES
          for w in TILE_WARPS]
# K > TILE_LONG_K without the fused norm: 8 warps (K > TILE_LARGE_K), batches of 3 units
SPECS += [tile_spec(f, g, e, plan.TILE_WARPS_LARGE_K, plan.TILE_LONG_K_VARIANT)
          for f, g in plan.TILE_FORMATS for e in plan.EPILOGUES]


def multi_token_tile_specs(routed: bool) -> list:
    """The multi-token tile GEMV (1 < M <= 8) with 1 or TILE_ROWS_NBLOCKS n-blocks per CTA: the variants the router
    picks (`routed`: 8 warps, the routed epilogues, with and without the fused norm; plan.tile_serves_rows and
    plan.tile_rows_nblocks) or the others (every epilogue and warp count; tuning space)."""
    def picked(epilogue, warps):
        return plan.TILE_MAX_M > 1 and epilogue in plan.TILE_MULTI_EPILOGUES and warps == plan.TILE_WARPS_LARGE_K

    return [tile_spec(f, g, e, w, norm=nm, tokens=plan.TOKENS, nblocks=nb) for f, g in plan.TILE_FORMATS
            for e in plan.EPILOGUES for nm in (False, True) if not nm or e in plan.NORM_EPILOGUES
            for w in TILE_WARPS if picked(e, w) == routed for nb in (1,) + plan.TILE_ROWS_NBLOCKS]


SPECS += multi_token_tile_specs(routed=True)


def fill_tile_specs() -> list:
    """The M = 1 tile GEMV at the warp counts only the fill rule picks (plan.TILE_FILL_WARPS beyond TILE_WARPS):
    every epilogue, the fused-norm ones, and the long-K batches of 3."""
    return [spec for f, g in plan.TILE_FORMATS for w in plan.TILE_FILL_WARPS if w not in TILE_WARPS
            for spec in ([tile_spec(f, g, e, w) for e in plan.EPILOGUES]
                         + [tile_spec(f, g, e, w, norm=True) for e in plan.NORM_EPILOGUES]
                         + [tile_spec(f, g, e, w, plan.TILE_LONG_K_VARIANT) for e in plan.EPILOGUES])]


def nblocks_tile_specs() -> list:
    """The M = 1 tile GEMV with several n-blocks per CTA (plan.TILE_NBLOCKS): both warp counts, every epilogue, the
    fused-norm ones and the long-K batches of 3."""
    return [spec for f, g in plan.TILE_FORMATS for nb in plan.TILE_NBLOCKS for w in TILE_WARPS
            for spec in ([tile_spec(f, g, e, w, nblocks=nb) for e in plan.EPILOGUES]
                         + [tile_spec(f, g, e, w, norm=True, nblocks=nb) for e in plan.NORM_EPILOGUES]
                         + [tile_spec(f, g, e, w, plan.TILE_LONG_K_VARIANT, nblocks=nb) for e in plan.EPILOGUES])]
