"""The shipped policy chains, by the name used in kernel keys (futx/runtime/catalog/prefill.py).

Naming: steps joined by "_"; "scale" = per-row activation x per-column weight scales, "scalet" = one
per-tensor activation scale x per-column weight scales, "rho" = RMSNorm row factor, "swiglu[_split]",
"res" = residual add, "rms" = sum-of-squares partials, "qkv<hd>" = RoPE + KV-cache placement (D = Q), "qkv<hd>p"
the same into a paged cache;
the suffix is the dtype of D.
"""

from __future__ import annotations

from epilogues.base import Chain
from epilogues.fp8_store import StoreFP8
from epilogues.qkv import QKVPlacement
from epilogues.residual import ResidualAdd
from epilogues.rms import RmsPartials
from epilogues.scale import ScaleRestore
from epilogues.store import StoreBF16
from epilogues.swiglu import SwiGLU

CHAINS = {
    # plain GEMM (either operand dtype)
    "bf16": lambda: Chain(StoreBF16()),
    # FP8 projections: restore the row x column quantization scales (and the RMSNorm factor rho)
    "scale_bf16": lambda: Chain(ScaleRestore(), StoreBF16()),
    "scale_rho_bf16": lambda: Chain(ScaleRestore(rho=True), StoreBF16()),
    "scale_fp8": lambda: Chain(ScaleRestore(), StoreFP8()),
    # gate/up projection + SwiGLU
    "swiglu_bf16": lambda: Chain(SwiGLU("interleaved"), StoreBF16()),
    "swiglu_split_bf16": lambda: Chain(SwiGLU("split"), StoreBF16()),
    "rho_swiglu_bf16": lambda: Chain(ScaleRestore(row=None, col=False, rho=True), SwiGLU("interleaved"), StoreBF16()),
    "scale_rho_swiglu_bf16": lambda: Chain(ScaleRestore(rho=True), SwiGLU("interleaved"), StoreBF16()),
    "scale_rho_swiglu_fp8": lambda: Chain(ScaleRestore(rho=True), SwiGLU("interleaved"), StoreFP8()),
    "scale_rho_swiglu_split_fp8": lambda: Chain(ScaleRestore(rho=True), SwiGLU("split"), StoreFP8()),
    # output / down projections: residual add (+ the next RMSNorm's sum-of-squares partials)
    "res_bf16": lambda: Chain(ResidualAdd(), StoreBF16()),
    "res_rms_bf16": lambda: Chain(ResidualAdd(), RmsPartials(), StoreBF16()),
    "scale_res_bf16": lambda: Chain(ScaleRestore(), ResidualAdd(), StoreBF16()),
    "scale_res_rms_bf16": lambda: Chain(ScaleRestore(), ResidualAdd(), RmsPartials(), StoreBF16()),
    "scalet_res_rms_bf16": lambda: Chain(ScaleRestore(row="tensor"), ResidualAdd(), RmsPartials(), StoreBF16()),
    # QKV projection: RoPE on Q/K, Q -> D, K/V straight into the KV cache (head_dim in the name)
    "scale_rho_qkv128_bf16": lambda: Chain(ScaleRestore(rho=True), QKVPlacement(128), StoreBF16()),
    "scale_rho_qkv64_bf16": lambda: Chain(ScaleRestore(rho=True), QKVPlacement(64), StoreBF16()),
    "rho_qkv128_bf16": lambda: Chain(ScaleRestore(row=None, col=False, rho=True), QKVPlacement(128), StoreBF16()),
    "rho_qkv64_bf16": lambda: Chain(ScaleRestore(row=None, col=False, rho=True), QKVPlacement(64), StoreBF16()),
    # ... into a paged cache (futx.paging): row_slot = the row's page, K/V at in-page row pos % P ("p" suffix)
    "scale_rho_qkv128p_bf16": lambda: Chain(ScaleRestore(rho=True), QKVPlacement(128, paged=True), StoreBF16()),
    "scale_rho_qkv64p_bf16": lambda: Chain(ScaleRestore(rho=True), QKVPlacement(64, paged=True), StoreBF16()),
    "rho_qkv128p_bf16": lambda: Chain(ScaleRestore(row=None, col=False, rho=True), QKVPlacement(128, paged=True),
                                      StoreBF16()),
    "rho_qkv64p_bf16": lambda: Chain(ScaleRestore(row=None, col=False, rho=True), QKVPlacement(64, paged=True),
                                     StoreBF16()),
}


def chain(name: str) -> Chain:
    try:
        return CHAINS[name]()
    except KeyError:
        raise ValueError(f"unknown epilogue policy {name!r}; known: {', '.join(sorted(CHAINS))}") from None
