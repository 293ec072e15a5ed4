"""Prefill GEMM variants: operand dtype x epilogue policy chain x tile width (no DSL imports here).

Key: prefill.gemm.<ab>.<policy>[.n128]. `POLICIES` describes each chain's runtime tensors for the op's
validation (futx/ops/prefill.py); tests/test_prefill_cpu.py checks it against epilogues/catalog.py.
User-written policy chains join through `register_policy` (see epilogues/README.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from futx.runtime.registry import KernelSpec

SOURCES = ("futx/mainloop.py", "epilogues/")


@dataclass(frozen=True)
class PolicyInfo:
    """args: (name, dtype, shape) in kernel order, shape symbols m / n / n_out / t (output tiles)."""

    args: tuple
    out: str              # dtype of D: "bf16" | "e4m3"
    n_ratio: int = 1      # GEMM columns per output column (2 for SwiGLU)
    split: bool = False   # split gate/up halves (needs I = N/2 divisible by tile_n / 2)
    writes: tuple = ()    # names of the args the kernel writes


_A = ("a_scale", "f32", ("m",))
_AT = ("a_scale", "f32", (1,))
_B = ("b_scale", "f32", ("n",))
_RHO = ("rho", "f32", ("m",))
_RES = ("residual", "bf16", ("m", "n_out"))
_RMS = ("sumsq", "f32", ("t", "m"))
_FP8 = (("scale", "f32", (1,)), ("amax", "f32", (1,)), ("saturated", "i32", (1,)))
_FP8_W = ("amax", "saturated")

POLICIES = {
    "bf16": PolicyInfo((), "bf16"),
    "scale_bf16": PolicyInfo((_A, _B), "bf16"),
    "scale_rho_bf16": PolicyInfo((_A, _B, _RHO), "bf16"),
    "scale_fp8": PolicyInfo((_A, _B, *_FP8), "e4m3", writes=_FP8_W),
    "swiglu_bf16": PolicyInfo((), "bf16", 2),
    "swiglu_split_bf16": PolicyInfo((), "bf16", 2, split=True),
    "rho_swiglu_bf16": PolicyInfo((_RHO,), "bf16", 2),
    "scale_rho_swiglu_bf16": PolicyInfo((_A, _B, _RHO), "bf16", 2),
    "scale_rho_swiglu_fp8": PolicyInfo((_A, _B, _RHO, *_FP8), "e4m3", 2, writes=_FP8_W),
    "scale_rho_swiglu_split_fp8": PolicyInfo((_A, _B, _RHO, *_FP8), "e4m3", 2, split=True, writes=_FP8_W),
    "res_bf16": PolicyInfo((_RES,), "bf16"),
    "scale_res_bf16": PolicyInfo((_A, _B, _RES), "bf16"),
    "scale_res_rms_bf16": PolicyInfo((_A, _B, _RES, _RMS), "bf16", writes=("sumsq",)),
    "scalet_res_rms_bf16": PolicyInfo((_AT, _B, _RES, _RMS), "bf16", writes=("sumsq",)),
}

# (ab, policy, tile widths): what ships. CI compiles all of them (about 10-20 s each on one core).
_SHIPPED = {
    "e4m3": {
        "bf16": (256, 128),
        "scale_bf16": (256, 128),
        "scale_rho_bf16": (256, 128),
        "scale_fp8": (256,),
        "scale_rho_swiglu_bf16": (256,),
        "scale_rho_swiglu_fp8": (256, 128),
        "scale_rho_swiglu_split_fp8": (256,),
        "scale_res_bf16": (256,),
        "scale_res_rms_bf16": (256, 128),
        "scalet_res_rms_bf16": (256, 128),
    },
    "bf16": {
        "bf16": (256, 128),
        "swiglu_bf16": (256,),
        "swiglu_split_bf16": (256,),
        "rho_swiglu_bf16": (256,),
        "res_bf16": (256,),
    },
}

TILE_M = 128
_CHAIN_PATHS: dict = {}   # policy -> "module:factory" for chains registered from outside epilogues/


def kernel_key(ab: str, policy: str, tile_n: int = 256) -> str:
    return f"prefill.gemm.{ab}.{policy}" + ("" if tile_n == 256 else f".n{tile_n}")


def tile_widths(ab: str, policy: str) -> tuple:
    try:
        return _SHIPPED[ab][policy]
    except KeyError:
        raise ValueError(f"no prefill GEMM variant for ab={ab!r}, policy={policy!r}; shipped: "
                         + ", ".join(f"{a}.{p}" for a in _SHIPPED for p in _SHIPPED[a])) from None


def choose_tile_n(ab: str, policy: str, m: int, n: int, num_sms: int) -> int:
    """The tile-width rule: fewest estimated tile-waves, a 128-wide tile costing 0.55 of a 256-wide one.

    128x256 tiles are the most efficient per FLOP (largest WGMMA, least smem traffic per FLOP); when
    they leave most SMs idle (few tiles: small M and N), 128x128 tiles double the parallelism. With a
    persistent grid the time is ~ ceil(tiles / SMs) * cost(tile). 0.55 (a 128-wide tile is ~10% less
    efficient per FLOP) is a starting estimate; scripts/bench_prefill.py measures both widths.
    """
    widths = tile_widths(ab, policy)
    if len(widths) == 1:
        return widths[0]
    cost = {256: 1.0, 128: 0.55}
    best, best_t = widths[0], math.inf
    for w in widths:
        # work items are 2-CTA clusters (two 128-row tiles over the same weight tile)
        clusters = math.ceil(m / (2 * TILE_M)) * math.ceil(n / w)
        t = math.ceil(clusters / max(1, num_sms // 2)) * cost[w]
        if t < best_t - 1e-9:
            best, best_t = w, t
    return best


def _spec(ab: str, policy: str, w: int, chain: str | None = None, ci: bool = True) -> KernelSpec:
    params = (("ab", ab), ("policy", policy), ("tile_n", w)) + ((("chain", chain),) if chain else ())
    return KernelSpec(
        key=kernel_key(ab, policy, w),
        module="futx.mainloop",
        params=params,
        sources=SOURCES,
        expect_sass=("QGMMA",) if ab == "e4m3" else ("HGMMA",),
        doc=f"prefill GEMM {ab} x {ab} -> {POLICIES[policy].out}, epilogue {policy}, tile 128x{w}",
        ci=ci,
        tags=("prefill",),
    )


SPECS = [_spec(ab, policy, w) for ab, table in _SHIPPED.items() for policy, widths in table.items() for w in widths]


def register_policy(name: str, info: PolicyInfo, chain: str, ab: tuple = ("e4m3",), widths: tuple = (256,)) -> list:
    """Add a user policy chain: `chain` = "module:factory" returning an epilogues.base.Chain.

    Registers the op validation data and one kernel variant per (ab, width); the kernels compile on
    first use (JIT) or with `futx build --only 'prefill.gemm.*.<name>*'` in a process that imported
    the registering module. The fingerprint covers futx's sources, not the user module: give a
    changed policy a new name (or clear the kernel cache).
    """
    from futx.runtime.registry import register

    if name in POLICIES and _CHAIN_PATHS.get(name) != chain:
        raise ValueError(f"prefill policy {name!r} already exists")
    if ":" not in chain:
        raise ValueError(f"chain must be 'module:factory', got {chain!r}")
    POLICIES[name] = info
    _CHAIN_PATHS[name] = chain
    specs = []
    for a in ab:
        _SHIPPED.setdefault(a, {})[name] = tuple(widths)
        specs += [_spec(a, name, w, chain=chain, ci=False) for w in widths]
    register(*specs)
    return specs
