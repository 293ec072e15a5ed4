"""Decode attention variants: cache format x head dim x rotation (GQA group <= 8 and every batch, head
count, slot count, capacity and split count are runtime values), plus the INT4 variants below."""

from futx.runtime.registry import KernelSpec

SOURCES = ("decode/attention.py", "decode/attn_plan.py", "decode/attn_ptx.py", "decode/hadamard_warp.py",
           "decode/splitkv_combine.py", "futx/quant/layouts.py")

# INT4 variants (rotated, head dim 128), as overrides of decode.attn_plan.default_plan (whose INT4 default,
# since H200 run 2, takes keys through the 256-entry table and values by arithmetic: "valu" there).
# Shipped (compiled in CI, chosen by the op):
#   s2:   2-deep rings with table values, so that three 4-warp CTAs (12 warps) fit per SM, splits chosen to
#         fill them; the op launches it for max_context >= decode.attn_plan.LONG_CONTEXT (run 2: best at
#         (8, 32768)).
# Benchmark-only (not in CI; each also runs once in the GPU tests):
#   vlut: the run-2 default (table values), to re-measure the default switch;
#   w6v:  the default dequantization with one 6-warp CTA of 2-deep rings twice per SM: 12 warps per SM
#         without splitting (B*Hkv = 256 pairs fill 132 SMs twice, which three CTAs per SM cannot balance);
#   fx:   "pair" dequantization of keys and values (lop3 + hadd2 per register, the query permuted to match;
#         no table, 28 instead of 92 shared loads per 32-token tile, ~520 instead of ~660 loop instructions),
#         whole tiles copied without per-chunk tests, 6 warps x 3 stages (2 CTAs = 12 warps per SM);
#   fx4:  the same kernel body with 4 warps (the default's shape: isolates the instruction savings).
VARIANTS = {
    "": {},
    "s2": {"v_dequant": "lut", "stages": 2, "saturating_warps": 12},
    "vlut": {"v_dequant": "lut"},
    "w6v": {"warps": 6, "stages": 2, "saturating_warps": 12},
    "fx": {"k_dequant": "pair", "v_dequant": "pair", "warps": 6, "stages": 3, "saturating_warps": 12,
           "lean_issue": True},
    "fx4": {"k_dequant": "pair", "v_dequant": "pair", "lean_issue": True},
}
SHIPPED = ("s2",)
BENCH_ONLY = ("vlut", "w6v", "fx", "fx4")


def attn_key(fmt: str, head_dim: int, rotate: bool, variant: str = "") -> str:
    return f"decode.attn.{fmt}.d{head_dim}" + (".rot" if rotate else "") + (f".{variant}" if variant else "")


def _spec(fmt: str, head_dim: int, rotate: bool, variant: str = "") -> KernelSpec:
    what = {"int4": "INT4 mirror (LUT keys)", "e4m3": "E4M3 mirror", "bf16": "BF16 main cache"}[fmt]
    extra = VARIANTS[variant]
    params = (("fmt", fmt), ("head_dim", head_dim), ("rotate", rotate)) + tuple(sorted(extra.items()))
    return KernelSpec(key=attn_key(fmt, head_dim, rotate, variant), module="decode.attention", params=params,
                      sources=SOURCES, expect_sass=("HMMA",), ci=not variant or variant in SHIPPED,
                      doc=f"GQA decode attention over the {what}, head dim {head_dim}"
                          + (", Hadamard-rotated" if rotate else "") + "; writes the new K/V row"
                          + (f"; {'long-context' if variant in SHIPPED else 'benchmark-only'} variant {variant}: "
                             f"{extra}" if variant else ""))


SPECS = [_spec(fmt, d, rot) for fmt in ("int4", "e4m3") for d in (64, 128) for rot in (False, True)] + \
        [_spec("bf16", d, False) for d in (64, 128)] + \
        [_spec("int4", 128, True, v) for v in SHIPPED + BENCH_ONLY]
