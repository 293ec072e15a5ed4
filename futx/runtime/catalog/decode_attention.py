"""Decode attention variants: cache format x head dim x rotation (GQA group <= 8 and every batch, head
count, slot count, capacity and split count are runtime values)."""

from futx.runtime.registry import KernelSpec

SOURCES = ("decode/attention.py", "decode/attn_plan.py", "decode/attn_ptx.py", "decode/hadamard_warp.py",
           "decode/splitkv_combine.py", "futx/quant/layouts.py")

# Benchmark-only INT4 variants (not in CI), as overrides of decode.attn_plan.default_plan:
#   valu / alu: the paper's ablation -- values, or keys and values, dequantized by prmt+lop3+f16 FMA
#               instead of the 256-entry table (which also frees its 32 KB of shared memory);
#   s2, w12:    tuning -- a 2-deep ring per warp, so that three 4-warp CTAs (s2) or one 12-warp CTA (w12)
#               fit per SM with the table: 12 warps per SM against 8 (two 4-warp CTAs with 3-deep rings).
# The variants that can hold 12 warps per SM also split so as to fill them (saturating_warps=12).
VARIANTS = {
    "": {},
    "valu": {"v_dequant": "alu"},
    "alu": {"k_dequant": "alu", "v_dequant": "alu", "saturating_warps": 12},
    "s2": {"stages": 2, "saturating_warps": 12},
    "w12": {"warps": 12, "stages": 2, "saturating_warps": 12},
}
BENCH_ONLY = ("valu", "alu", "s2", "w12")


def attn_key(fmt: str, head_dim: int, rotate: bool, variant: str = "") -> str:
    return f"decode.attn.{fmt}.d{head_dim}" + (".rot" if rotate else "") + (f".{variant}" if variant else "")


def _spec(fmt: str, head_dim: int, rotate: bool, variant: str = "") -> KernelSpec:
    what = {"int4": "INT4 mirror (LUT keys)", "e4m3": "E4M3 mirror", "bf16": "BF16 main cache"}[fmt]
    extra = VARIANTS[variant]
    params = (("fmt", fmt), ("head_dim", head_dim), ("rotate", rotate)) + tuple(sorted(extra.items()))
    return KernelSpec(key=attn_key(fmt, head_dim, rotate, variant), module="decode.attention", params=params,
                      sources=SOURCES, expect_sass=("HMMA",), ci=not variant,
                      doc=f"GQA decode attention over the {what}, head dim {head_dim}"
                          + (", Hadamard-rotated" if rotate else "") + "; writes the new K/V row"
                          + (f"; benchmark-only variant {variant}: {extra}" if variant else ""))


SPECS = [_spec(fmt, d, rot) for fmt in ("int4", "e4m3") for d in (64, 128) for rot in (False, True)] + \
        [_spec("bf16", d, False) for d in (64, 128)] + \
        [_spec("int4", 128, True, v) for v in BENCH_ONLY]
