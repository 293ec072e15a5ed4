"""Prefill GEMM kernels: operand dtype x epilogue chain x variant (tile shape and schedule). No DSL imports.

A chain (epilogues.base.Chain) is the single source of what a kernel takes and writes; this module only
names kernels and decides which variants exist:

    prefill.gemm.<ab>.<name>[.<variant>]      <name>: a shipped chain (epilogues/catalog.py), or
                                              "chain-<fingerprint>" for a chain composed by the caller
                                              (its policies' classes, parameters and sources)

with the variant omitted for "n256" (coop 128x256). Every chain, shipped or composed, gets the same
variants (VARIANTS) and the same rule (choose_variant); docs/routing.md says why these two. The registry
holds the shipped chains x VARIANTS, which CI compiles and `futx build` builds. Other variants (TUNING:
schedule, cluster and raster alternatives) and composed chains get a registry entry on demand
(`spec_for`): the op compiles them at first use (JIT, disk-cached), `futx build --chain module:factory`
ahead of time, scripts/tuning_space.py for the benchmarks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from futx.runtime.registry import KernelSpec, get_spec, register

SOURCES = ("futx/prefill/mainloop.py", "epilogues/", "decode/ptx.py", "decode/split_arrival.py")
AB = ("e4m3", "bf16")

# What the rule can pick: pingpong 64x256 (never estimated slower than coop 128x256, measured faster at
# every benchmarked shape), coop 128x128 (with split-K: partial waves over a long K) and pingpong 64x128
# (launches with few tiles: each CTA's share of the work halves).
VARIANTS = ("n256.pp", "n128", "n128.pp")
# The tuning space the benchmarks compile on demand (scripts/tuning_space.py).
TUNING = ("n256", "n256.st", "n256.pp.g16", "n256.pp.c1", "n256.pp.c2x2", "n256.c2x2")

# The shipped chains per operand dtype (names of epilogues/catalog.py).
SHIPPED = {
    "e4m3": ("bf16", "scale_bf16", "scale_rho_bf16", "scale_fp8", "scale_rho_swiglu_bf16", "scale_rho_swiglu_fp8",
             "scale_rho_swiglu_split_fp8", "scale_res_bf16", "scale_res_rms_bf16", "scalet_res_rms_bf16",
             "scale_rho_qkv128_bf16", "scale_rho_qkv64_bf16", "scale_rho_qkv128p_bf16", "scale_rho_qkv64p_bf16"),
    "bf16": ("bf16", "swiglu_bf16", "swiglu_split_bf16", "rho_swiglu_bf16", "res_bf16", "res_rms_bf16",
             "rho_qkv128_bf16", "rho_qkv64_bf16", "rho_qkv128p_bf16", "rho_qkv64p_bf16"),
}


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
    group_m: int = 8      # cluster rows per raster group (L2 reuse; futx/prefill/mainloop.py); ".g<N>" if not 8
    cluster_n: int = 1    # ".c<M>x2": clusters of cluster_m x 2 CTAs that also share the activation tile

    @property
    def name(self) -> str:
        cluster = ("" if self.cluster_m == 2 else f".c{self.cluster_m}") if self.cluster_n == 1 \
            else f".c{self.cluster_m}x{self.cluster_n}"
        return (f"n{self.tile_n}" + _SCHED_SUFFIX[self.schedule] + cluster
                + ("" if self.group_m == 8 else f".g{self.group_m}"))

    @property
    def cluster_size(self) -> int:
        return self.cluster_m * self.cluster_n

    @property
    def tile_m(self) -> int:
        return 128 if self.schedule == "coop" else 64

    @classmethod
    def parse(cls, name: str) -> "Variant":
        parts = name.split(".")
        bad = (f"bad prefill variant name {name!r} (e.g. 'n256.pp', 'n128', 'n256', 'n256.pp.c1', 'n256.pp.c2x2', "
               "'n256.pp.g16')")
        try:
            if not parts[0].startswith("n"):
                raise ValueError
            tile_n, schedule, cluster, cluster_n, group = int(parts[0][1:]), "coop", 2, 1, 8
            for p in parts[1:]:
                if p in ("pp", "st"):
                    schedule = {"pp": "pingpong", "st": "stagger"}[p]
                elif p.startswith("c"):
                    cm, _, cn = p[1:].partition("x")
                    cluster, cluster_n = int(cm), int(cn or 1)
                elif p.startswith("g"):
                    group = int(p[1:])
                else:
                    raise ValueError
        except ValueError:
            raise ValueError(bad) from None
        v = cls(tile_n, schedule, cluster, group, cluster_n)
        if (v.name != name or tile_n not in (128, 256) or cluster not in (1, 2) or cluster_n not in (1, 2)
                or group not in (4, 8, 16, 32)):
            raise ValueError(bad)
        return v


_SCHED_SUFFIX = {"coop": "", "pingpong": ".pp", "stagger": ".st"}


def kernel_key(ab: str, name: str, variant: str = "n256") -> str:
    return f"prefill.gemm.{ab}.{name}" + ("" if variant == "n256" else f".{variant}")


@lru_cache(maxsize=None)
def _shipped_chain(name: str):
    from epilogues import catalog

    return catalog.chain(name)


@lru_cache(maxsize=None)
def _shipped_by_fingerprint() -> dict:
    from epilogues import catalog

    return {catalog.chain(name).fingerprint(): name for name in catalog.CHAINS}


def chain_name(chain) -> str:
    """The name a chain's kernels are keyed by: its shipped name if it equals a shipped chain (same
    policies, parameters and sources: it then loads the shipped artifacts), else chain-<fingerprint>."""
    fp = chain.fingerprint()
    return _shipped_by_fingerprint().get(fp) or f"chain-{fp[:16]}"


_COMPOSED: dict = {}   # chain-<fp> -> Chain, for the compile factory and the op's validation


def chain_of(name: str):
    """The Chain behind a kernel name (shipped, or composed and seen by `spec_for` in this process)."""
    if name.startswith("chain-"):
        try:
            return _COMPOSED[name]
        except KeyError:
            raise KeyError(f"no composed chain {name!r} in this process: pass the Chain itself "
                           "(prefill.gemm(..., chain=...)) so its kernels can be named and compiled") from None
    return _shipped_chain(name)


def _spec(ab: str, name: str, variant: str, chain=None) -> KernelSpec:
    v = Variant.parse(variant)
    params = (("ab", ab), ("policy", name), ("tile_n", v.tile_n), ("schedule", v.schedule),
              ("cluster_m", v.cluster_m)) + ((("group_m", v.group_m),) if v.group_m != 8 else ()) \
        + ((("cluster_n", v.cluster_n),) if v.cluster_n != 1 else ())
    # (shipped names end in their output dtype: naming them must not import the policies, and with them the DSL)
    out = chain.out if chain is not None else ("e4m3" if name.endswith("_fp8") else "bf16")
    return KernelSpec(
        key=kernel_key(ab, name, variant),
        module="futx.prefill.mainloop",
        params=params,
        sources=SOURCES,
        expect_sass=("QGMMA",) if ab == "e4m3" else ("HGMMA",),
        doc=f"prefill GEMM {ab} x {ab} -> {out}, epilogue {name}{' ' + repr(chain) if chain else ''}, "
            f"{v.schedule} {v.tile_m}x{v.tile_n} tiles, cluster {v.cluster_m}x{v.cluster_n}"
            + ("" if v.group_m == 8 else f", raster groups of {v.group_m} cluster rows"),
        extra=chain,
    )


def spec_for(ab: str, chain_or_name, variant: str) -> KernelSpec:
    """The registry entry of (ab, chain, variant), registered on demand for composed chains and for
    variants outside VARIANTS (the op then compiles it at first use, or finds it in an AOT directory)."""
    if ab not in AB:
        raise ValueError(f"prefill GEMM operands are {' or '.join(AB)}, got {ab!r}")
    Variant.parse(variant)
    if isinstance(chain_or_name, str):
        name, chain = chain_or_name, None
        if not name.startswith("chain-") and name not in {n for names in SHIPPED.values() for n in names}:
            known = ", ".join(sorted(set(SHIPPED["e4m3"]) | set(SHIPPED["bf16"])))
            raise ValueError(f"unknown prefill epilogue {name!r}; shipped: {known}; or pass a Chain (chain=...)")
    else:
        name, chain = chain_name(chain_or_name), chain_or_name
        if name.startswith("chain-"):
            _COMPOSED.setdefault(name, chain)
        else:
            chain = None   # equal to a shipped chain: use its entry
    key = kernel_key(ab, name, variant)
    try:
        return get_spec(key)
    except KeyError:
        spec = _spec(ab, name, variant, chain if name.startswith("chain-") else None)
        register(spec)
        return spec


def chain_specs(chain, abs=AB) -> list:
    """Registry entries of a composed (or shipped) chain at every VARIANT, for `futx build --chain`."""
    return [spec_for(ab, chain, v) for ab in abs for v in VARIANTS]


def load_chain(path: str):
    """"module:factory" -> the Chain that factory() returns (the module imported from the current
    directory or the Python path)."""
    import importlib
    import os
    import sys

    from epilogues.base import Chain

    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"a chain is given as 'module:factory', got {path!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    chain = getattr(importlib.import_module(module), attr)()
    if not isinstance(chain, Chain):
        raise TypeError(f"{path}() must return an epilogues.base.Chain, got {type(chain).__name__}")
    return chain


# The rule's cost model, in k-tile times of a 64x256 pingpong (or 128x128 coop) tile (~0.42 us, BF16 and E4M3
# alike: an E4M3 k-tile is twice as deep at twice the rate), fitted by scripts/fit_prefill_rule.py to the
# measured sweeps in docs/prefill/ (docs/results-prefill.md "Pingpong 64x128"):
K_TILE_COST = {("coop", 128): 1.02, ("coop", 256): 2.07,         # coop 128x256: run 2, 1277 vs 1322 TF/s
               ("pingpong", 256): 1.0, ("pingpong", 128): 0.61}  # 64x128: half the work at 82% of the rate
TILE_FIXED = {("coop", 128): 2.1, ("coop", 256): 2.1,            # first loads + epilogue, once per coop tile,
              ("pingpong", 256): 2.9, ("pingpong", 128): 1.5}    # once per pingpong launch (the rest overlaps)
EMPTY_CTA_COST = 1.2     # coop work when M leaves a cluster's second CTA without rows (M <= 128)
EXCHANGE_K_TILES = 9.7   # split-K: writing, counting and summing two splits' partials
EXCHANGE_PER_SPLIT = 3.7  # each further split the reducing CTA reads
MAX_SPLITS = 8
MIN_SPLIT_K_TILES = 4    # k-tiles per split at least: the ring must fill and drain
UNKNOWN_K = 4096         # what `choose_variant` assumes when the caller does not know K


class Costs(NamedTuple):
    """The cost model's constants (`_waves`); scripts/fit_prefill_rule.py passes trial values to refit them."""

    k_tile: dict = K_TILE_COST
    fixed: dict = TILE_FIXED
    empty_cta: float = EMPTY_CTA_COST
    exchange: float = EXCHANGE_K_TILES
    per_split: float = EXCHANGE_PER_SPLIT


def k_tiles(k: int, ab: str) -> int:
    """k-tiles of the mainloop: 128 bytes of a row per stage (futx/prefill/mainloop.py `tile_config`)."""
    return -(-k // (128 if ab == "e4m3" else 64))


def whole_tiles(tiles: int, splits: int, slots: int) -> int:
    """Cluster tiles of a split-K launch that run whole, as the kernel derives them (futx/prefill/mainloop.py): the full
    waves of the persistent grid (min(tiles x splits, slots) clusters); the rest are split."""
    grid = max(1, min(tiles * splits, slots))
    return tiles // grid * grid


def _waves(v: Variant, m: int, n: int, num_sms: int, kt: int = 64, splits: int = 1, costs: Costs = Costs()) -> float:
    """Estimated time of a persistent launch in k-tile times (`K_TILE_COST`); `kt` = k-tiles of the K loop.

    Work items are clusters of cluster_m x cluster_n CTA tiles, dealt round-robin to the num_sms / cluster size
    resident clusters (`num_sms`: the CTAs that run at once in such clusters), so the busiest CTA runs `rounds`
    tiles. A coop CTA runs its tiles
    one after another, each with its fixed cost (first loads, epilogue). A pingpong CTA's warpgroups take
    turns, so one tile's epilogue hides under the other's mainloop and the fixed cost is paid once; a lone
    warpgroup (one tile per CTA) issues its k-tiles as fast as two taking turns (measured at long K).

    Split-K (coop only): the full waves of tiles run whole; each tile of the last, partial wave becomes
    `splits` units of kt / splits k-tiles plus the exchange of partials (~4 us measured: it pays only where
    it fills idle SMs over a long K).
    """
    sched = "coop" if v.schedule == "stagger" else v.schedule
    clusters = math.ceil(m / (v.cluster_m * v.tile_m)) * math.ceil(n / (v.cluster_n * v.tile_n))
    slots = max(1, num_sms // v.cluster_size)
    cost, fixed = costs.k_tile[sched, v.tile_n], costs.fixed[sched, v.tile_n]
    rounds = math.ceil(clusters / slots)
    if sched == "pingpong":
        return rounds * kt * cost + fixed
    empty = costs.empty_cta if m <= v.tile_m * (v.cluster_m - 1) else 1.0
    if splits == 1:
        return rounds * (kt * cost + fixed) * empty
    # the full waves run whole tiles; the tiles of the last, partial wave are split (futx/prefill/mainloop.py)
    whole = whole_tiles(clusters, splits, slots)
    unit = kt / splits * cost + fixed + costs.exchange + costs.per_split * (splits - 2)
    return (whole // slots * (kt * cost + fixed) + math.ceil((clusters - whole) * splits / slots) * unit) * empty


def split_options(variant: str, k: int, ab: str) -> range:
    """Split counts a variant can run: coop schedules only, at least MIN_SPLIT_K_TILES k-tiles each."""
    if Variant.parse(variant).schedule != "coop":
        return range(1, 2)
    return range(1, max(1, min(MAX_SPLITS, k_tiles(k, ab) // MIN_SPLIT_K_TILES)) + 1)


_ROUTED: tuple = VARIANTS   # what choose_plan picks from by default (`route_variants`)


def route_variants(names: tuple | None = None) -> None:
    """Make the rule pick from `names` (a subset or superset of VARIANTS) from now on; None restores VARIANTS.
    Benchmarks only (e.g. a whole layer with and without a variant): variants outside VARIANTS compile on demand."""
    global _ROUTED
    for name in names or ():
        Variant.parse(name)
    _ROUTED = tuple(names) if names else VARIANTS


def choose_plan(m: int, n: int, k: int, ab: str, num_sms: int, names: tuple | None = None,
                split_k: bool = True) -> tuple:
    """The variant rule: (variant, splits) of least estimated time (`_waves`), ties to the first variant and the
    fewest splits; `names` defaults to the routed variants (VARIANTS unless `route_variants` changed them);
    `split_k` False: unsplit launches only."""
    names = names or _ROUTED
    best, best_t = (names[0], 1), math.inf
    kt = k_tiles(k, ab)
    for name in names:
        v = Variant.parse(name)
        for s in (split_options(name, k, ab) if split_k else (1,)):
            t = _waves(v, m, n, num_sms, kt, s)
            if t < best_t - 1e-9:
                best, best_t = (name, s), t
    return best


def choose_splits(variant: str, m: int, n: int, k: int, ab: str, num_sms: int) -> int:
    """The split count the rule gives `variant` (used when a caller names the variant)."""
    return choose_plan(m, n, k, ab, num_sms, (variant,))[1]


def choose_variant(m: int, n: int, num_sms: int, names: tuple | None = None, k: int = 0, ab: str = "e4m3") -> str:
    """The variant `choose_plan` picks; without K, the rule without split-K at a K of UNKNOWN_K."""
    if k <= 0:
        return choose_plan(m, n, UNKNOWN_K, ab, num_sms, names, split_k=False)[0]
    return choose_plan(m, n, k, ab, num_sms, names)[0]


def tuning_specs() -> list:
    """The benchmarks' tuning space: every shipped chain at the TUNING variants (not in the registry)."""
    return [_spec(ab, name, v) for ab, names in SHIPPED.items() for name in names for v in TUNING]


SPECS = [_spec(ab, name, v) for ab, names in SHIPPED.items() for name in names for v in VARIANTS]
