"""Decode projection variants (issue 5): GEMV for M = 1, skinny kernel for 2 <= M <= 32, each for INT4
(group 128 and 64), E4M3 and BF16 weights and the three fused epilogues. Keys come from decode.plan,
which the torch ops use to pick them."""

from decode import plan
from futx.runtime.registry import KernelSpec

_SOURCES = tuple(f"decode/{f}.py" for f in ("__init__", "plan", "ptx", "dequant", "stream", "epilogue", "signature",
                                             "gemv", "skinny")) + ("futx/quant/layouts.py",)
_FORMATS = (("int4", 128), ("int4", 64), ("e4m3", 128), ("bf16", 128))


def _gemv(fmt, group, epilogue, warps=4, ci=True):
    return KernelSpec(key=plan.gemv_key(fmt, group, epilogue, warps), module="decode.gemv",
                      params=(("fmt", fmt), ("group_size", group), ("epilogue", epilogue), ("warps", warps)),
                      sources=_SOURCES, expect_sass=("HMMA",), ci=ci,
                      doc=f"M=1 register-streaming GEMV, {plan.fmt_tag(fmt, group)} weights, {epilogue}, {warps} warps")


def _skinny(fmt, group, epilogue, m, weights="smem", ci=True):
    return KernelSpec(key=plan.skinny_key(fmt, group, epilogue, m, weights), module="decode.skinny",
                      params=(("fmt", fmt), ("group_size", group), ("epilogue", epilogue),
                              ("m_tiles", plan.M_TILES[m]), ("warps", plan.SKINNY_WARPS),
                              ("nb_per_warp", plan.SKINNY_NB_PER_WARP), ("weights", weights)),
                      sources=_SOURCES, expect_sass=("HMMA",), ci=ci,
                      doc=f"M<={m} skinny GEMM, {plan.fmt_tag(fmt, group)} weights ({weights}), {epilogue}")


SPECS = [_gemv(f, g, e) for f, g in _FORMATS for e in plan.EPILOGUES]
SPECS += [_skinny(f, g, e, m) for f, g in _FORMATS for e in plan.EPILOGUES for m in plan.M_TILES]
# benchmark-only design comparisons: skinny weights streamed into registers instead of cp.async stages;
# the GEMV with 8 warps (half the K share per warp, twice the warps per output tile)
SPECS += [_skinny("int4", 128, e, m, weights="regs", ci=False) for e in plan.EPILOGUES for m in plan.M_TILES]
SPECS += [_gemv("int4", 128, e, warps=8, ci=False) for e in plan.EPILOGUES]
