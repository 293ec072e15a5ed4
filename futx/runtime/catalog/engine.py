"""Small kernels that sit between the engine's projections (its glue): the decode step's RMSNorm row factor (and its
final norm with the gain), its greedy argmax, the prefill's mirror writer, per-row E4M3 quantization, the verify
step's block-rows writer and the INT4-only cache's main-copy rows from the mirror."""

from futx.runtime.registry import KernelSpec

MIRROR_SOURCES = ("decode/mirror_rows.py", "decode/mirror_row.py", "decode/attn_plan.py", "decode/ptx.py",
                  "decode/hadamard_warp.py", "futx/quant/layouts.py")


QKV_ROWS_SOURCES = ("decode/qkv_rows.py", "decode/rope_warp.py", *MIRROR_SOURCES[1:])
MAIN_ROWS_SOURCES = ("decode/main_rows.py", *MIRROR_SOURCES[2:])


def mirror_key(fmt: str, head_dim: int) -> str:
    return f"engine.mirror_rows.{fmt}.d{head_dim}"


def main_rows_key(fmt: str, head_dim: int) -> str:
    return f"engine.main_rows.{fmt}.d{head_dim}"


def qkv_rows_key(fmt: str, head_dim: int, mirror_only: bool = False) -> str:
    return f"engine.qkv_rows.{fmt}.d{head_dim}" + (".mo" if mirror_only else "")


SPECS = [
    KernelSpec(key="engine.rms_rows", module="decode.rms_rows",
               sources=("decode/rms_rows.py", "decode/block_reduce.py"),
               doc="RMSNorm row factor of bf16 rows (gain folded into the next projection)"),
    KernelSpec(key="engine.rms_rows.gain", module="decode.rms_rows", params=(("gain", True),),
               sources=("decode/rms_rows.py", "decode/block_reduce.py"),
               doc="RMSNorm of bf16 rows with its bf16 gain (the final norm before the LM head: rule E6)"),
    KernelSpec(key="engine.argmax_rows", module="decode.argmax_rows",
               sources=("decode/argmax_rows.py", "decode/argmax_plan.py", "decode/ptx.py", "decode/split_arrival.py"),
               doc="greedy argmax of bf16 logit rows, many CTAs per row (rule E7)"),
    KernelSpec(key="engine.row_quant_e4m3", module="futx.prefill.row_quant",
               sources=("futx/prefill/row_quant.py", "decode/ptx.py", "decode/block_reduce.py"),
               doc="per-row dynamic E4M3 quantization of bf16 activations (the prefill block's glue)"),
] + [
    # the engine cache rotates exactly its INT4 mirror (futx.engine.cache.EngineCache.rotate)
    KernelSpec(key=mirror_key(fmt, d), module="decode.mirror_rows",
               params=(("fmt", fmt), ("head_dim", d), ("rotate", fmt == "int4")), sources=MIRROR_SOURCES,
               doc=f"decode mirror ({fmt}) of cache rows a prefill wrote, head dim {d}")
    for fmt in ("int4", "e4m3") for d in (64, 128)
] + [
    KernelSpec(key=qkv_rows_key(fmt, d, mo), module="decode.qkv_rows",
               params=(("fmt", fmt), ("head_dim", d), ("rotate", fmt == "int4")) + ((("mirror_only", True),) if mo
                                                                                    else ()),
               sources=QKV_ROWS_SOURCES,
               doc=f"the new K/V rows of a QKV output (RoPE, " + ("" if not mo else "no main copy: the INT4-only "
                   "cache, ") + f"{fmt} mirror), head dim {d}: the verify step's block rows")
    for fmt in ("int4", "e4m3") for d in (64, 128) for mo in (False, True)
] + [
    KernelSpec(key=main_rows_key(fmt, d), module="decode.main_rows",
               params=(("fmt", fmt), ("head_dim", d), ("rotate", fmt == "int4")), sources=MAIN_ROWS_SOURCES,
               doc=f"BF16 main-copy rows from the {fmt} mirror (dequantized, rotation undone), head dim {d}: the "
                   "INT4-only cache's stage of a cached prefix")
    for fmt in ("int4", "e4m3") for d in (64, 128)
]
