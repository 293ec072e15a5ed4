"""Decode attention variants: cache format x head dim x rotation (GQA group <= 8 and every batch, head
count, slot count, capacity and split count are runtime values), plus the engine's fused-QKV entries.

SPECS holds exactly what the op launches: `futx::decode_attention` always runs the default kernel of
(format, head dim, rotation) (decode.attn_plan.default_plan), the engine's entry the `.qkv` kernels. The
INT4 design alternatives of VARIANTS are the tuning space (named with the op's `variant=` argument once
scripts/tuning_space.py has registered them); docs/routing.md gives the measured reason for the default.
A paged cache (the op's `block_table=`, futx.paging) runs the `.p<page size>` twin of the same kernel; a paged cache
whose main copy holds only staging pages (the INT4-only cache) the engine entry's `.mo` twin (mirror row only)."""

from futx.runtime.registry import KernelSpec

SOURCES = ("decode/attention.py", "decode/attention_paged.py", "decode/attn_plan.py", "futx/paging.py",
           "decode/ptx.py", "decode/hadamard_warp.py", "decode/mirror_row.py", "decode/rope_warp.py",
           "decode/splitkv_combine.py", "futx/quant/layouts.py")

# INT4 variants (rotated, head dim 128), as overrides of decode.attn_plan.default_plan, whose INT4 default
# dequantizes keys and values by "pair" arithmetic without the table, with lean issue. Tuning space only:
#   table: keys through the 256-entry byte -> f16x2 shared-memory table, values by prmt + f16 arithmetic
#          (the design; the default before the "pair" dequantization);
#   s2:    table keys and values, 2-deep rings so that three 4-warp CTAs (12 warps) fit per SM, splits
#          chosen to fill them (the earlier long-context kernel);
#   vlut:  table keys and values;
#   w6v:   the table design with one 6-warp CTA of 2-deep rings twice per SM (12 warps per SM unsplit);
#   fx:    the default dequantization with 6 warps x 3 stages (2 CTAs = 12 warps per SM).
_TABLE = {"k_dequant": "lut", "lean_issue": False}
VARIANTS = {
    "": {},
    "table": {**_TABLE, "v_dequant": "alu"},
    "s2": {**_TABLE, "v_dequant": "lut", "stages": 2, "saturating_warps": 12},
    "vlut": {**_TABLE, "v_dequant": "lut"},
    "w6v": {**_TABLE, "v_dequant": "alu", "warps": 6, "stages": 2, "saturating_warps": 12},
    "fx": {"warps": 6, "stages": 3, "saturating_warps": 12},
}
TUNING = tuple(v for v in VARIANTS if v)


def _paged(page_size: int) -> str:
    return f".p{page_size}" if page_size else ""


def attn_key(fmt: str, head_dim: int, rotate: bool, variant: str = "", page_size: int = 0) -> str:
    return f"decode.attn.{fmt}.d{head_dim}" + (".rot" if rotate else "") + (f".{variant}" if variant else "") \
        + _paged(page_size)


def _page_params(page_size: int) -> tuple:
    """Contiguous entries carry no page_size parameter (their fingerprints stay what they were)."""
    return (("page_size", page_size),) if page_size else ()


def _page_doc(page_size: int) -> str:
    return f"; paged cache, {page_size}-position pages through a block table" if page_size else ""


def attn_spec(fmt: str, head_dim: int, rotate: bool, variant: str = "", page_size: int = 0) -> KernelSpec:
    what = {"int4": "INT4 mirror", "e4m3": "E4M3 mirror", "bf16": "BF16 main cache"}[fmt]
    extra = VARIANTS[variant]
    params = (("fmt", fmt), ("head_dim", head_dim), ("rotate", rotate)) + tuple(sorted(extra.items())) \
        + _page_params(page_size)
    return KernelSpec(key=attn_key(fmt, head_dim, rotate, variant, page_size), module="decode.attention",
                      params=params, sources=SOURCES, expect_sass=("HMMA",),
                      doc=f"GQA decode attention over the {what}, head dim {head_dim}"
                          + (", Hadamard-rotated" if rotate else "") + "; writes the new K/V row"
                          + (f"; tuning variant {variant}: {extra}" if variant else "") + _page_doc(page_size))


# The decode engine's attention: q, k, v read from the QKV projection's output and RoPE applied in the
# kernel, for the engine's cache formats (INT4 rotated, E4M3, BF16).
ENGINE_CACHES = (("int4", True), ("e4m3", False), ("bf16", False))


def qkv_key(fmt: str, head_dim: int, rotate: bool, page_size: int = 0, mirror_only: bool = False,
            pdl: bool = False) -> str:
    return attn_key(fmt, head_dim, rotate) + ".qkv" + _paged(page_size) + (".mo" if mirror_only else "") \
        + (".pdl" if pdl else "")


def _qkv_spec(fmt: str, head_dim: int, rotate: bool, page_size: int = 0, mirror_only: bool = False,
              pdl: bool = False) -> KernelSpec:
    return KernelSpec(key=qkv_key(fmt, head_dim, rotate, page_size, mirror_only, pdl), module="decode.attention",
                      params=(("fmt", fmt), ("head_dim", head_dim), ("rotate", rotate), ("fused_qkv", True))
                      + _page_params(page_size) + ((("mirror_only", True),) if mirror_only else ())
                      + ((("pdl", True),) if pdl else ()),
                      sources=SOURCES, expect_sass=("HMMA",),
                      doc=f"decode attention of the engine over the {fmt} cache, head dim {head_dim}: q/k/v from the "
                          "QKV projection output, RoPE in the kernel, new K/V row written" + _page_doc(page_size)
                          + ("; the mirror row only (the main copy holds staging pages only: the INT4-only cache)"
                             if mirror_only else "")
                          + ("; programmatic dependent launch (the decode step: its first tiles requested before the "
                             "wait, the O projection released at its start)" if pdl else ""))


# The paged cache (futx.paging): every shipped entry at the default page size, and the 8B INT4 entries at 256
# too (the page-size measurement, scripts/bench_paged_attention.py).
PAGE_SIZES = (128, 256)


def _entries(page_size: int) -> list[KernelSpec]:
    """The op's default kernels (the BF16 main cache is never rotated) and the engine's fused-QKV entries."""
    return [attn_spec(fmt, d, rot, page_size=page_size) for fmt in ("int4", "e4m3") for d in (64, 128)
            for rot in (False, True)] + \
        [attn_spec("bf16", d, False, page_size=page_size) for d in (64, 128)] + \
        [_qkv_spec(fmt, d, rot, page_size) for fmt, rot in ENGINE_CACHES for d in (64, 128)]


# The mirror-only cache (futx.paging staging pages, `--cache-main none`): the engine's entries of the mirror formats.
MIRROR_ONLY = [_qkv_spec(fmt, d, rot, 128, mirror_only=True) for fmt, rot in ENGINE_CACHES if fmt != "bf16"
               for d in (64, 128)]

_PLAIN = _entries(0) + _entries(128) + [attn_spec("int4", 128, True, page_size=256),
                                        _qkv_spec("int4", 128, True, 256)] + MIRROR_ONLY

# The engine's head-dim-128 entries (the Llama 8B / 70B shapes) again as a programmatic dependent launch
# (AttnPlan.pdl): the decode step's attention after its QKV projection (routing rule E5, futx.engine.backends); the
# block (verify) step and the op keep the plain launch. (At head dim 64 the E4M3 mirror-only twin spills a register
# held across the wait: not built.)
PDL_HEAD_DIMS = (128,)
PDL = [_qkv_spec(**{k: v for k, v in s.param_dict.items() if k != "fused_qkv"}, pdl=True) for s in _PLAIN
       if s.param_dict.get("fused_qkv") and s.param_dict["head_dim"] in PDL_HEAD_DIMS]

SPECS = _PLAIN + PDL
