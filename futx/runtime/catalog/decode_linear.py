"""Decode projection variants (issue 5): the one-tile-per-CTA GEMV for INT4 at M = 1 (4 or 8 warps), the
persistent GEMV for M <= 16 (token buckets 8 and 16) and the skinny kernel (buckets 16 and 32), for INT4
(group 128 and 64), E4M3 and BF16 weights and the three fused epilogues. Keys and compile parameters come
from decode.plan, which the torch ops use to pick them. Every variant decode.plan.choose can route to is
CI-compiled; design comparisons the router never picks are benchmark-only (ci=False)."""

from decode import plan
from futx.runtime.registry import KernelSpec

_SOURCES = tuple(f"decode/{f}.py" for f in ("__init__", "plan", "gemv_layout", "ptx", "dequant", "stream",
                                             "epilogue", "signature", "gemv", "gemv_tile", "skinny")) + (
    "futx/quant/layouts.py",)
_FORMATS = (("int4", 128), ("int4", 64), ("e4m3", 128), ("bf16", 128))


def _gemv(fmt, group, epilogue, m, variant="", ci=True):
    params = plan.gemv_params(fmt, group, epilogue, m, variant)
    return KernelSpec(key=plan.gemv_key(fmt, group, epilogue, m, variant), module="decode.gemv",
                      params=tuple(sorted(params.items())), sources=_SOURCES, expect_sass=("HMMA",), ci=ci,
                      doc=f"M<={m} persistent register-streaming GEMV, {plan.fmt_tag(fmt, group)} weights, "
                          f"{epilogue}{', ' + variant if variant else ''}")


def _tile(fmt, group, epilogue, warps, variant="", ci=True):
    params = plan.tile_params(fmt, group, epilogue, warps, variant)
    return KernelSpec(key=plan.tile_key(fmt, group, epilogue, warps, variant), module="decode.gemv_tile",
                      params=tuple(sorted(params.items())), sources=_SOURCES, expect_sass=("HMMA",), ci=ci,
                      doc=f"M=1 one-tile-per-CTA GEMV (run-1 design), {plan.fmt_tag(fmt, group)} weights, "
                          f"{epilogue}, {warps} warps{', ' + variant if variant else ''}")


def _skinny(fmt, group, epilogue, m, variant="", ci=True):
    return KernelSpec(key=plan.skinny_key(fmt, group, epilogue, m, variant), module="decode.skinny",
                      params=(("fmt", fmt), ("group_size", group), ("epilogue", epilogue),
                              ("m_tiles", plan.SKINNY_M_TILES[m]), ("warps", plan.SKINNY_WARPS),
                              ("nb_per_warp", plan.SKINNY_NB_PER_WARP)) + tuple(plan.SKINNY_VARIANTS[variant].items()),
                      sources=_SOURCES, expect_sass=("HMMA",), ci=ci,
                      doc=f"M<={m} skinny GEMM, {plan.fmt_tag(fmt, group)} weights, {epilogue}"
                          + (f"; benchmark-only variant {variant}" if variant else ""))


def _gemv_routed(fmt, m) -> bool:
    return not (fmt == "int4" and m > plan.INT4_GEMV_MAX_M)


_WARPS = (plan.TILE_WARPS_SMALL_K, plan.TILE_WARPS_LARGE_K)
SPECS = [_gemv(f, g, e, m, ci=_gemv_routed(f, m))
         for f, g in _FORMATS for e in plan.EPILOGUES for m in plan.GEMV_M_TILES]
SPECS += [_skinny(f, g, e, m) for f, g in _FORMATS for e in plan.EPILOGUES for m in plan.SKINNY_M_TILES]
SPECS += [_tile(f, g, e, w) for f, g in plan.TILE_FORMATS for e in plan.EPILOGUES for w in _WARPS]
# benchmark-only design comparisons at M = 1: the persistent GEMV without the fold and as measured in run 2
# (scales converted at the load); the tile GEMV with a rolling prefetch
SPECS += [_gemv("int4", 128, e, 8, v, ci=False) for v in plan.GEMV_VARIANTS if v for e in plan.EPILOGUES]
SPECS += [_tile(f, g, e, w, v, ci=False) for f, g in plan.TILE_FORMATS for v in plan.TILE_VARIANTS if v
          for e in plan.EPILOGUES for w in _WARPS]
SPECS += [_skinny("int4", 128, e, m, v, ci=False) for v in plan.SKINNY_VARIANTS if v for e in plan.EPILOGUES
          for m in plan.SKINNY_M_TILES]
