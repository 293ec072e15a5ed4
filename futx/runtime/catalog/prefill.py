"""Prefill GEMM variants: operand dtype x epilogue policy chain x schedule variant (no DSL imports here).

Key: prefill.gemm.<ab>.<policy>[.<variant>] with the variant name omitted for "n256" (coop 128x256).
A *variant* is the kernel's shape and schedule (`Variant`): tile width, cooperative, pingpong or stagger
consumer warpgroups, cluster size, raster group height. The first shipped variant of a policy is its
default; the pingpong "n256.pp" measured fastest on the H200 (docs/results-prefill.md) and leads every
list. `POLICIES` describes each chain's runtime tensors for the op's validation (futx/ops/prefill.py);
tests/test_prefill_cpu.py checks it against epilogues/catalog.py.
User-written policy chains join through `register_policy` (see epilogues/README.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from futx.runtime.registry import KernelSpec

SOURCES = ("futx/mainloop.py", "epilogues/")


@dataclass(frozen=True)
class PolicyInfo:
    """args: (name, dtype, shape) in kernel order; shape symbols m / n / n_out / t (output tiles) / others
    (free, the op checks only their rank and dtype). `qkv`: D holds only the Q columns (n_out < N)."""

    args: tuple
    out: str              # dtype of D: "bf16" | "e4m3"
    n_ratio: int = 1      # GEMM columns per output column (2 for SwiGLU)
    split: bool = False   # split gate/up halves (needs I = N/2 divisible by tile_n / 2)
    writes: tuple = ()    # names of the args the kernel writes
    qkv: bool = False     # QKV placement: D = Q [M, Hq*hd]; K/V go to the cache tensors


@dataclass(frozen=True)
class Variant:
    """Shape and schedule of one compiled kernel.

    coop:     both consumer warpgroups work on one 128 x tile_n tile (64 rows each); the tensor cores
              idle while they run the epilogue.
    pingpong: each consumer warpgroup owns a whole 64 x tile_n tile and the two take turns on the
              tensor cores, so one's epilogue overlaps the other's mainloop (more L2/smem traffic per
              FLOP: the weight tile is loaded per 64 rows instead of per 128).
    stagger:  coop tiles with warpgroup 1 running a few k-tiles behind warpgroup 0, so each one's
              epilogue overlaps the other's last k-tiles (coop's traffic, pingpong's overlap).
    """

    tile_n: int = 256
    schedule: str = "coop"
    cluster_m: int = 2
    group_m: int = 8      # cluster rows per raster group (L2 reuse; futx/mainloop.py); ".g<N>" if not 8

    @property
    def name(self) -> str:
        return (f"n{self.tile_n}" + _SCHED_SUFFIX[self.schedule] + ("" if self.cluster_m == 2 else f".c{self.cluster_m}")
                + ("" if self.group_m == 8 else f".g{self.group_m}"))

    @property
    def tile_m(self) -> int:
        return 128 if self.schedule == "coop" else 64

    @classmethod
    def parse(cls, name: str) -> "Variant":
        parts = name.split(".")
        bad = f"bad prefill variant name {name!r} (e.g. 'n256', 'n128', 'n256.pp', 'n256.c1', 'n256.pp.g16')"
        try:
            if not parts[0].startswith("n"):
                raise ValueError
            tile_n, schedule, cluster, group = int(parts[0][1:]), "coop", 2, 8
            for p in parts[1:]:
                if p in ("pp", "st"):
                    schedule = {"pp": "pingpong", "st": "stagger"}[p]
                elif p.startswith("c"):
                    cluster = int(p[1:])
                elif p.startswith("g"):
                    group = int(p[1:])
                else:
                    raise ValueError
        except ValueError:
            raise ValueError(bad) from None
        v = cls(tile_n, schedule, cluster, group)
        if v.name != name or tile_n not in (128, 256) or cluster not in (1, 2) or group not in (4, 8, 16, 32):
            raise ValueError(bad)
        return v


_SCHED_SUFFIX = {"coop": "", "pingpong": ".pp", "stagger": ".st"}

_A = ("a_scale", "f32", ("m",))
_AT = ("a_scale", "f32", (1,))
_B = ("b_scale", "f32", ("n",))
_RHO = ("rho", "f32", ("m",))
_RES = ("residual", "bf16", ("m", "n_out"))
_RMS = ("sumsq", "f32", ("t", "m"))
_FP8 = (("scale", "f32", (1,)), ("amax", "f32", (1,)), ("saturated", "i32", (1,)))
_FP8_W = ("amax", "saturated")
_QKV_W = ("k_cache", "v_cache")


def _qkv(hd: int) -> tuple:
    """QKV placement: RoPE frequencies, per-row cache slot and position, the layer's K and V caches."""
    return (("inv_freq", "f32", (hd // 2,)), ("row_slot", "i32", ("m",)), ("row_pos", "i32", ("m",)),
            ("k_cache", "bf16", ("slots", "hkv", "cap", hd)), ("v_cache", "bf16", ("slots", "hkv", "cap", hd)))


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
    # QKV projection: scales (+ rho), RoPE on Q and K, Q -> D, K/V straight into the cache (head_dim 64/128)
    "scale_rho_qkv128_bf16": PolicyInfo((_A, _B, _RHO, *_qkv(128)), "bf16", writes=_QKV_W, qkv=True),
    "scale_rho_qkv64_bf16": PolicyInfo((_A, _B, _RHO, *_qkv(64)), "bf16", writes=_QKV_W, qkv=True),
    "rho_qkv128_bf16": PolicyInfo((_RHO, *_qkv(128)), "bf16", writes=_QKV_W, qkv=True),
}

# (ab, policy) -> variants that ship: CI compiles each (about 15 s on one core) and the GPU tests run each.
# The first is the default (choose_variant breaks ties toward it). Pingpong 64x256 ("n256.pp") leads every
# list: on the H200 it measured fastest at every benchmarked shape (run 2: 8192^3 FP8 1322 vs 1277 TF/s
# coop, 8B projections +2-9%, gate/up+SwiGLU 8B 363 vs 411 us FP8, 708 vs 762 us BF16; QKV epilogue
# 86 vs 98 us; BF16 GEMM +0-4%), because each warpgroup's epilogue overlaps the other's mainloop. The coop
# 128x256 "n256" stays shipped (CI-compiled) for the plain, scale, FP8-store, residual/RMS, QKV-128 and
# main SwiGLU policies; for the others it is a benchmark-only alternative (_BENCH): CI compiles 35 variants.
# The coop 128x128 "n128" ships for the plain, scale and residual policies (the O / down projections): the
# rule picks it where a pingpong launch is under one wave (small M on narrow weights, see _waves).
_SHIPPED = {
    "e4m3": {
        "bf16": ("n256.pp", "n256", "n128"),
        "scale_bf16": ("n256.pp", "n256", "n128"),
        "scale_rho_bf16": ("n256.pp", "n256", "n128"),
        "scale_fp8": ("n256.pp", "n256"),
        "scale_rho_swiglu_bf16": ("n256.pp",),
        "scale_rho_swiglu_fp8": ("n256.pp", "n256"),
        "scale_rho_swiglu_split_fp8": ("n256.pp",),
        "scale_res_bf16": ("n256.pp", "n256", "n128"),
        "scale_res_rms_bf16": ("n256.pp", "n256", "n128"),
        "scalet_res_rms_bf16": ("n256.pp",),
        "scale_rho_qkv128_bf16": ("n256.pp", "n256"),
        "scale_rho_qkv64_bf16": ("n256.pp",),
    },
    "bf16": {
        "bf16": ("n256.pp", "n256", "n128"),
        "swiglu_bf16": ("n256.pp",),
        "swiglu_split_bf16": ("n256.pp",),
        "rho_swiglu_bf16": ("n256.pp", "n256"),
        "res_bf16": ("n256.pp", "n128"),
        "rho_qkv128_bf16": ("n256.pp",),
    },
}

# Benchmark candidates (registry entries with ci=False; built with `futx build --only 'prefill.*'`, run by
# the GPU tests and scripts/bench_prefill.py / bench_swiglu.py): schedule, cluster and raster alternatives.
#   n256      coop 128x256 where it is not shipped (the alternative schedule of every policy)
#   n256.st   stagger (coop traffic, partial overlap; run 2: between coop and pingpong)
#   n128      coop 128x128 (run 2: 0.5-1% below n256 at M >= 2048; the rule never prefers it to n256.pp)
#   experiment for the final run (prediction in docs/results-prefill.md):
#   n256.pp.g16  pingpong with 16 cluster rows per raster group (2048 rows, like coop's 8 x 256): the
#                weight matrix is streamed from HBM once per 2048 rows instead of once per 1024
#   n256.pp.c1   pingpong without the 2x1 cluster (no B multicast): how much the multicast buys pingpong
# (run 2 also measured n128.pp, 6-16% slower than n256.pp, and coop n256.c1, within 1% of n256: dropped)
_BENCH = {
    "e4m3": {
        "scale_bf16": ("n256.st", "n256.pp.g16", "n256.pp.c1"),
        "scale_rho_swiglu_bf16": ("n256",),
        "scale_rho_swiglu_fp8": ("n256.st", "n128", "n256.pp.g16"),
        "scale_rho_swiglu_split_fp8": ("n256",),
        "scalet_res_rms_bf16": ("n256",),
        "scale_rho_qkv64_bf16": ("n256",),
    },
    "bf16": {
        "bf16": ("n256.st", "n256.pp.g16"),
        "swiglu_bf16": ("n256",),
        "swiglu_split_bf16": ("n256",),
        "rho_swiglu_bf16": ("n256.st", "n256.pp.g16"),
        "res_bf16": ("n256",),
        "rho_qkv128_bf16": ("n256",),
    },
}

_CHAIN_PATHS: dict = {}   # policy -> "module:factory" for chains registered from outside epilogues/


def kernel_key(ab: str, policy: str, variant: str = "n256") -> str:
    return f"prefill.gemm.{ab}.{policy}" + ("" if variant == "n256" else f".{variant}")


def variants(ab: str, policy: str, bench: bool = False) -> tuple:
    """Variant names of (ab, policy): the shipped ones, plus the benchmark candidates if `bench`."""
    try:
        shipped = _SHIPPED[ab][policy]
    except KeyError:
        raise ValueError(f"no prefill GEMM variant for ab={ab!r}, policy={policy!r}; shipped: "
                         + ", ".join(f"{a}.{p}" for a in _SHIPPED for p in _SHIPPED[a])) from None
    return shipped + (_BENCH.get(ab, {}).get(policy, ()) if bench else ())


def tile_widths(ab: str, policy: str) -> tuple:
    """Tile widths of the shipped variants (kept for callers that think in widths)."""
    return tuple(dict.fromkeys(Variant.parse(v).tile_n for v in variants(ab, policy)))


def _waves(v: Variant, m: int, n: int, num_sms: int) -> float:
    """Estimated time of a persistent launch in units of one 128x256 coop tile: tile-waves x tile cost.

    Work items are clusters of `cluster_m` CTA tiles over one weight tile, dealt round-robin to the
    num_sms / cluster_m resident clusters. A 128-wide tile costs ~0.55 of a 256-wide one (~10% less
    efficient per FLOP). A pingpong CTA's 64-row tiles take turns on the tensor cores, so each costs
    half a coop tile: the same rate per SM, at half the granularity (fewer idle SMs in the last wave) --
    except under one wave, where each CTA holds a single tile and one warpgroup idles: a whole coop tile's
    time (H200, 2026-11-30 14:54: at M = 512 the coop 128x128 tile beat pingpong by 2-7% on exactly the
    shapes this predicts, 1B QKV/O/down and 8B O/down, and lost or tied on all others).
    """
    clusters = math.ceil(m / (v.cluster_m * v.tile_m)) * math.ceil(n / v.tile_n)
    slots = max(1, num_sms // v.cluster_m)
    cost = (1.0 if v.tile_n == 256 else 0.55) * (0.5 if v.schedule == "pingpong" else 1.0)
    if v.schedule == "pingpong" and clusters <= slots:
        cost *= 2  # one tile per CTA: its second warpgroup has no tile to alternate with
    return math.ceil(clusters / slots) * cost


def choose_variant(ab: str, policy: str, m: int, n: int, num_sms: int) -> str:
    """The variant rule over the shipped variants: fewest estimated tile-waves (`_waves`), ties to the first.

    64x256 pingpong tiles (first in every list) never estimate slower than 128x256 coop tiles (same
    rate, finer granularity), and measured faster; a 128x128 coop tile wins only where its wave
    quantization is better by more than its ~10% per-FLOP cost. scripts/bench_prefill.py measures
    every variant.
    """
    names = variants(ab, policy)
    best, best_t = names[0], math.inf
    for name in names:
        t = _waves(Variant.parse(name), m, n, num_sms)
        if t < best_t - 1e-9:
            best, best_t = name, t
    return best


def choose_tile_n(ab: str, policy: str, m: int, n: int, num_sms: int) -> int:
    return Variant.parse(choose_variant(ab, policy, m, n, num_sms)).tile_n


def _spec(ab: str, policy: str, variant: str, chain: str | None = None, ci: bool = True) -> KernelSpec:
    v = Variant.parse(variant)
    params = (("ab", ab), ("policy", policy), ("tile_n", v.tile_n), ("schedule", v.schedule),
              ("cluster_m", v.cluster_m)) + ((("group_m", v.group_m),) if v.group_m != 8 else ()) + (
        (("chain", chain),) if chain else ())
    return KernelSpec(
        key=kernel_key(ab, policy, variant),
        module="futx.mainloop",
        params=params,
        sources=SOURCES,
        expect_sass=("QGMMA",) if ab == "e4m3" else ("HGMMA",),
        doc=f"prefill GEMM {ab} x {ab} -> {POLICIES[policy].out}, epilogue {policy}, "
            f"{v.schedule} {v.tile_m}x{v.tile_n} tiles, cluster {v.cluster_m}x1"
            + ("" if v.group_m == 8 else f", raster groups of {v.group_m} cluster rows"),
        ci=ci,
        tags=("prefill",),
    )


SPECS = ([_spec(ab, p, v) for ab, table in _SHIPPED.items() for p, vs in table.items() for v in vs]
         + [_spec(ab, p, v, ci=False) for ab, table in _BENCH.items() for p, vs in table.items() for v in vs])


def register_policy(name: str, info: PolicyInfo, chain: str, ab: tuple = ("e4m3",), variants: tuple = ("n256",),
                    widths: tuple | None = None) -> list:
    """Add a user policy chain: `chain` = "module:factory" returning an epilogues.base.Chain.

    Registers the op validation data and one kernel variant per (ab, variant) (`widths`, e.g. (256, 128),
    is shorthand for cooperative variants of those tile widths); the kernels compile on first use (JIT)
    or with `futx build --only 'prefill.gemm.*.<name>*'` in a process that imported the registering
    module. The fingerprint covers futx's sources, not the user module: give a changed policy a new
    name (or clear the kernel cache).
    """
    from futx.runtime.registry import register

    if name in POLICIES and _CHAIN_PATHS.get(name) != chain:
        raise ValueError(f"prefill policy {name!r} already exists")
    if ":" not in chain:
        raise ValueError(f"chain must be 'module:factory', got {chain!r}")
    if widths is not None:
        variants = tuple(f"n{w}" for w in widths)
    for v in variants:
        Variant.parse(v)
    POLICIES[name] = info
    _CHAIN_PATHS[name] = chain
    specs = []
    for a in ab:
        _SHIPPED.setdefault(a, {})[name] = tuple(variants)
        specs += [_spec(a, name, v, chain=chain, ci=False) for v in variants]
    register(*specs)
    return specs
