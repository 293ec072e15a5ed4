"""Decode attention variants: cache format x head dim x rotation (GQA group <= 8 and every batch, head
count, slot count, capacity and split count are runtime values)."""

from futx.runtime.registry import KernelSpec

SOURCES = ("decode/attention.py", "decode/attn_plan.py", "decode/attn_ptx.py", "decode/hadamard_warp.py",
           "decode/splitkv_combine.py", "futx/quant/layouts.py")


# INT4 dequantization ablations (not in CI): keys / values through the table ("lut") or prmt+lop3+fma
VARIANTS = {"": ("lut", "lut"), "valu": ("lut", "alu"), "alu": ("alu", "alu")}


def attn_key(fmt: str, head_dim: int, rotate: bool, variant: str = "") -> str:
    return f"decode.attn.{fmt}.d{head_dim}" + (".rot" if rotate else "") + (f".{variant}" if variant else "")


def _spec(fmt: str, head_dim: int, rotate: bool, variant: str = "") -> KernelSpec:
    what = {"int4": "INT4 mirror (LUT keys)", "e4m3": "E4M3 mirror", "bf16": "BF16 main cache"}[fmt]
    k_deq, v_deq = VARIANTS[variant]
    params = (("fmt", fmt), ("head_dim", head_dim), ("rotate", rotate))
    if variant:
        params += (("k_dequant", k_deq), ("v_dequant", v_deq))
    return KernelSpec(key=attn_key(fmt, head_dim, rotate, variant), module="decode.attention", params=params,
                      sources=SOURCES, expect_sass=("HMMA",), ci=not variant,
                      doc=f"GQA decode attention over the {what}, head dim {head_dim}"
                          + (", Hadamard-rotated" if rotate else "") + "; writes the new K/V row"
                          + (f"; ablation: keys {k_deq}, values {v_deq}" if variant else ""))


SPECS = [_spec(fmt, d, rot) for fmt in ("int4", "e4m3") for d in (64, 128) for rot in (False, True)] + \
        [_spec("bf16", d, False) for d in (64, 128)] + \
        [_spec("int4", 128, True, v) for v in ("valu", "alu")]
