"""`futx::prefill_gemm` — the prefill GEMM with an epilogue chain, as a torch op.

    out = futx.ops.prefill.gemm(a, w, "scale_rho_swiglu_fp8", a_scale=..., b_scale=..., rho=...,
                                scale=..., amax=..., saturated=...)          # a shipped chain, by name
    out = futx.ops.prefill.gemm(a, w, chain=Chain(ScaleRestore(), BiasAdd(), StoreBF16()),
                                a_scale=..., b_scale=..., bias=...)           # composed by the caller
    q = futx.ops.prefill.qkv(x8, w8, k_cache, v_cache, row_slot, row_pos, inv_freq, rho=..., a_scale=..., b_scale=...)

a: [M, K] activations, w: [N, K] weights (nn.Linear layout), both E4M3 or both BF16, contiguous.
The chain declares its tensors (epilogues.base.Arg: name, dtype, shape symbols m / n / n_out / t = output
tiles / free names), its output dtype and column ratio; every tensor is validated from that declaration
(device, dtype, shape, contiguity, 16-byte alignment) and by the policies' own `check` before any launch.
A composed chain compiles at first use (JIT, cached on disk under a key that holds its fingerprint, so an
edited policy recompiles) unless `futx build --chain module:factory` built it ahead of time.
Alignment rules (TMA): K and N multiples of 16, D's width (N, or N/2 after SwiGLU) a multiple of 16.
M is free (any value >= 0; M = 0 launches nothing). The variant and split-K count follow `choose_plan`
unless `variant=` names one (the benchmarks' tuning space, e.g. "n256" coop or "n256.pp.g16", compiles on
demand) or `splits=` sets the count (coop variants: the tiles of the last, partial wave have K cut into
`splits` ranges whose partial tiles the last CTA to finish sums in split order, futx/prefill/mainloop.py; a float32
workspace of splits x those tiles is allocated per call).
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, Optional

import torch

from futx.hardware import cluster_slots, sm_count
from futx.ops import checks, split_counters
from futx.ops.registration import futx_op
from futx.runtime import get_kernel
from futx.runtime.catalog.prefill import (MAX_SPLITS, SHIPPED, Variant, chain_of, choose_plan, choose_splits,
                                          k_tiles, spec_for, whole_tiles)

_TORCH = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "f32": torch.float32, "i32": torch.int32,
          "f64": torch.float64}
_AB = {torch.float8_e4m3fn: "e4m3", torch.bfloat16: "bf16"}


def out_tiles(n_out: int, chain, tile_n: int) -> int:
    """Rows of the `sumsq` partials tensor (RmsPartials): output tiles along N."""
    return -(-n_out // (tile_n // chain.n_ratio))


def _check(a, b, out, key, args):
    spec_params = dict(_params(key))
    chain = chain_of(spec_params["policy"])
    ab, tile_n = spec_params["ab"], spec_params["tile_n"]
    checks.cuda("a", a)
    checks.cuda("w", b, a.device)
    checks.dtype("a", a, tuple(_AB))
    checks.dtype("w", b, a.dtype)
    if _AB[a.dtype] != ab:
        raise ValueError(f"kernel {key} takes {ab} operands, got {_AB[a.dtype]}")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and w must be 2-D ([M, K] and [N, K]), got {list(a.shape)} and {list(b.shape)}")
    m, k = a.shape
    n = b.shape[0]
    checks.shape("w", b, (None, k))
    if k == 0:
        raise ValueError("a and w have K = 0 columns: the GEMM needs K >= 16")
    checks.multiple("a", k, 16, "K (reduction width)")
    checks.multiple("w", n, 16 * chain.n_ratio, "N (output channels)")
    decl = chain.args()
    if len(args) != len(decl):
        raise ValueError(f"{chain!r} takes {len(decl)} tensors "
                         f"({', '.join(x.name for x in decl) or 'none'}), got {len(args)}")
    tensors = {}
    for x, t in zip(decl, args):   # devices, dtypes and ranks first: out_width may read shapes
        checks.cuda(x.name, t, a.device)
        checks.dtype(x.name, t, _TORCH[x.dtype])
        checks.shape(x.name, t, tuple(d if isinstance(d, int) else None for d in x.shape))
        tensors[x.name] = t
    n_out = chain.out_width(n, tensors)
    checks.cuda("out", out, a.device)
    checks.dtype("out", out, _TORCH[chain.out])
    checks.shape("out", out, (m, n_out))
    checks.multiple("out", n_out, 16, "the output width")
    sizes = {"m": m, "n": n, "n_out": n_out, "t": out_tiles(n_out, chain, tile_n)}
    for x, t in zip(decl, args):
        for d, s in zip(x.shape, t.shape):   # other names: free sizes that must agree across tensors
            if isinstance(d, str) and d not in sizes:
                sizes[d] = s
        checks.shape(x.name, t, tuple(sizes[d] if isinstance(d, str) else d for d in x.shape))
    for name, t in (("a", a), ("w", b), ("out", out), *tensors.items()):
        checks.contiguous(name, t)
        checks.aligned(name, t)
    chain.check(sizes, tensors, tile_n)


def _cluster_dims(params: dict) -> tuple:
    """(cluster_m, cluster_n) of a prefill kernel from its registry parameters (cluster_n only where it is not 1)."""
    return params["cluster_m"], params.get("cluster_n", 1)


@lru_cache(maxsize=None)
def _params(key: str) -> tuple:
    from futx.runtime.registry import get_spec

    return get_spec(key).params


def _split_args(a: torch.Tensor, w: torch.Tensor, key: str, splits: int) -> tuple:
    """(workspace, counters, splits) of a coop kernel (`TileConfig.split_k`); () for the other schedules."""
    p = dict(_params(key))
    if p["schedule"] != "coop":
        if splits != 1:
            raise ValueError(f"split-K runs on coop kernels only; {key} is {p['schedule']} (pass splits=1)")
        return ()
    m, k = a.shape
    splits = min(splits, k_tiles(k, p["ab"]))
    if splits == 1:
        return _NO_WORKSPACE.setdefault(a.device, torch.empty(4, dtype=torch.float32, device=a.device)), \
            split_counters.counters(a.device), 1
    tile_m, tile_n, (cluster_m, cluster_n) = 128, p["tile_n"], _cluster_dims(p)
    chain = chain_of(p["policy"])
    n = w.shape[0]
    cols = -(-(n // 2) // (tile_n // 2)) if chain.pair is not None and chain.pair.layout == "split" else -(-n // tile_n)
    # as the kernel does (futx/prefill/mainloop.py): the full waves of cluster tiles run whole, the rest is split
    size = cluster_m * cluster_n
    tiles = -(-m // (tile_m * cluster_m)) * -(-cols // cluster_n)
    split_tiles = (tiles - whole_tiles(tiles, splits, cluster_slots(a.device, size) // size)) * size
    if split_tiles > split_counters.SLOTS:
        raise ValueError(f"split-K over {split_tiles} output tiles (> {split_counters.SLOTS} arrival counters)")
    ws = torch.empty(max(1, split_tiles * splits * tile_m * tile_n), dtype=torch.float32, device=a.device)
    return ws, split_counters.counters(a.device), splits


_NO_WORKSPACE: dict = {}


@futx_op("prefill_gemm", mutates_args=("out", "args"))
def prefill_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, key: str, args: List[torch.Tensor],
                 splits: int = 1) -> None:
    """out = chain(a @ w.T) for the kernel `key` (a prefill.gemm.* registry entry); `args` = the chain's
    tensors in declaration order (some are written); `splits`: split-K count (coop kernels only)."""
    _check(a, w, out, key, args)
    checks.in_range("splits", splits, 1, MAX_SPLITS)
    extra = _split_args(a, w, key, splits)
    if a.shape[0] == 0:
        return
    cluster_m, cluster_n = _cluster_dims(dict(_params(key)))
    get_kernel(key)(a, w, out, *args, *extra, cluster_slots(a.device, cluster_m * cluster_n))


@prefill_gemm.register_fake
def _(a, w, out, key, args, splits=1):
    return None


def gemm(a: torch.Tensor, w: torch.Tensor, policy: str = "bf16", *, chain=None, out: Optional[torch.Tensor] = None,
         variant: Optional[str] = None, splits: Optional[int] = None, **tensors: torch.Tensor) -> torch.Tensor:
    """Allocate D if needed, pick the variant and split-K count (`choose_plan`) and run `futx::prefill_gemm`.

    policy: a shipped chain's name (epilogues/catalog.py); chain: an epilogues.base.Chain instead.
    tensors: the chain's tensors by name (its Args), e.g. a_scale=, b_scale=, rho=.
    variant: e.g. "n256.pp" or "n128" (what the rule picks from), or a tuning-space one such as "n256".
    splits: split-K count of a coop variant (default: the rule's for that variant; 1 = no split).
    """
    if not isinstance(a, torch.Tensor) or not isinstance(w, torch.Tensor) or a.dim() != 2 or w.dim() != 2:
        raise ValueError("a and w must be 2-D tensors ([M, K] and [N, K])")
    ab = _AB.get(a.dtype)
    if ab is None:
        raise TypeError(f"a must be float8_e4m3fn or bfloat16, got {a.dtype}")
    if chain is None:
        if not isinstance(policy, str):
            raise TypeError(f"policy names a shipped chain; pass a composed Chain as chain=, got {type(policy).__name__}")
        chain, target = chain_of(policy), policy
    else:
        target = chain
    decl = chain.args()
    names = [x.name for x in decl]
    unknown = sorted(set(tensors) - set(names))
    if unknown:
        raise TypeError(f"{chain!r} does not take {unknown}; it takes: {', '.join(names) or 'nothing'}")
    missing = [x for x in decl if tensors.get(x.name) is None]
    if missing:
        raise ValueError(f"{chain!r} needs " + ", ".join(f"{x.name!r} ({x.dtype}{list(x.shape)})" for x in missing))
    sms = sm_count(a.device) if a.is_cuda else 132
    m, k = a.shape
    if variant is None:
        variant, rule_splits = choose_plan(m, w.shape[0], k, ab, sms)
        splits = rule_splits if splits is None else splits
    else:
        Variant.parse(variant)
        if splits is None:
            splits = choose_splits(variant, m, w.shape[0], k, ab, sms)
    key = spec_for(ab, target, variant).key
    if out is None:
        if not all(isinstance(tensors[nm], torch.Tensor) for nm in names):
            raise TypeError("the chain's tensors must be torch.Tensors")
        width = chain.out_width(w.shape[0], tensors)
        out = torch.empty(a.shape[0], max(width, 0), dtype=_TORCH[chain.out], device=a.device)
    torch.ops.futx.prefill_gemm(a, w, out, key, [tensors[nm] for nm in names], splits)
    return out


def qkv(a: torch.Tensor, w: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row_slot: torch.Tensor,
        row_pos: torch.Tensor, inv_freq: torch.Tensor, *, rho: torch.Tensor, a_scale: Optional[torch.Tensor] = None,
        b_scale: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
        variant: Optional[str] = None, splits: Optional[int] = None, paged: bool = False) -> torch.Tensor:
    """The QKV projection of a packed batch, with RoPE and direct KV-cache placement (paper 3.2.1).

    w: [(Hq + 2 Hkv) * hd, K], rows [Q heads | K heads | V heads] (RMSNorm gain folded in);
    k_cache, v_cache: one layer's BF16 main cache, [slots, Hkv, capacity, hd] (futx.kvcache.KVCache);
    row_slot, row_pos: int32 [M], the cache slot and position of every packed row (PackedBatch.row_slot /
    row_position); inv_freq: float32 [hd / 2] (futx.rope.inv_freq); rho: float32 [M] RMSNorm row factors;
    E4M3 operands also take a_scale [M] and b_scale [N]. Returns Q, [M, Hq, hd] BF16 (RoPE applied);
    K (RoPE applied) and V are written into the caches. The caller advances the cache lengths.
    paged: a paged layer [pages + 1, Hkv, P, hd] (futx.paging); row_slot is then each row's page
    (futx.paging.locate) and row_pos its true position (RoPE), the row lands at in-page row row_pos % P.
    """
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise ValueError("k_cache must be a 4-D tensor [slots, Hkv, capacity, head_dim]")
    hkv, hd = k_cache.shape[1], k_cache.shape[3]
    fp8 = a.dtype == torch.float8_e4m3fn
    place = f"qkv{hd}" + ("p" if paged else "")
    policy = f"scale_rho_{place}_bf16" if fp8 else f"rho_{place}_bf16"
    if policy not in SHIPPED["e4m3" if fp8 else "bf16"]:
        known = [f"{ab}: {p}" for ab, names in SHIPPED.items() for p in names if "qkv" in p]
        raise ValueError(f"no QKV placement chain for head_dim {hd} ({'e4m3' if fp8 else 'bf16'} operands); "
                         f"shipped: {', '.join(known)}")
    if fp8 and (a_scale is None or b_scale is None):
        raise ValueError("E4M3 operands need a_scale [M] and b_scale [N]")
    if not fp8 and (a_scale is not None or b_scale is not None):
        raise ValueError("a_scale/b_scale are for E4M3 operands; BF16 operands take rho only")
    tensors = dict(rho=rho, inv_freq=inv_freq, row_slot=row_slot, row_pos=row_pos, k_cache=k_cache, v_cache=v_cache)
    if fp8:
        tensors.update(a_scale=a_scale, b_scale=b_scale)
    out = gemm(a, w, policy, out=out, variant=variant, splits=splits, **tensors)
    return out.view(a.shape[0], out.shape[1] // hd, hd)


def rms_rho(sumsq: torch.Tensor, hidden: int, eps: float) -> torch.Tensor:
    """rho[m] = (sum_t sumsq[t, m] / H + eps)^-1/2 from RmsPartials (the small reduction of paper 3.2.2)."""
    return torch.rsqrt(sumsq.sum(dim=0) / hidden + eps)
