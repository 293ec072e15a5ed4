"""`futx::prefill_gemm` — the prefill GEMM + epilogue policy as a torch op.

    out = futx.ops.prefill.gemm(a, w, "scale_rho_swiglu_fp8", a_scale=..., b_scale=..., rho=...,
                                scale=..., amax=..., saturated=...)
    q = futx.ops.prefill.qkv(x8, w8, k_cache, v_cache, row_slot, row_pos, inv_freq, rho=..., a_scale=..., b_scale=...)

a: [M, K] activations, w: [N, K] weights (nn.Linear layout), both E4M3 or both BF16, contiguous.
The policy names and their tensors are listed in futx/runtime/catalog/prefill.py (POLICIES; user
policies join with `register_policy`); every tensor is validated (device, dtype, shape, contiguity,
16-byte alignment) before any launch.
Alignment rules (TMA): K and N multiples of 16, D's width (N, or N/2 after SwiGLU) a multiple of 16.
M is free (any value >= 0; M = 0 launches nothing). The kernel variant (tile width, schedule, cluster)
follows `choose_variant` (pingpong "n256.pp" by default) unless `variant=` names one (e.g. "n256" for
the coop schedule; the benchmarks also pass candidates such as "n256.pp.g16").
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, Optional

import torch

from futx.ops import checks
from futx.ops.registration import futx_op
from futx.runtime import get_kernel
from futx.runtime.catalog.prefill import POLICIES, Variant, choose_variant, kernel_key, variants

_TORCH = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "f32": torch.float32, "i32": torch.int32,
          "f64": torch.float64}
_AB = {torch.float8_e4m3fn: "e4m3", torch.bfloat16: "bf16"}


@lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def out_tiles(n_out: int, policy: str, tile_n: int) -> int:
    """Rows of the `sumsq` partials tensor: output tiles along N."""
    return -(-n_out // (tile_n // POLICIES[policy].n_ratio))


def _policy(policy: str):
    if policy not in POLICIES:
        raise ValueError(f"unknown prefill policy {policy!r}; known: {', '.join(sorted(POLICIES))}")
    return POLICIES[policy]


def _check(a, b, out, policy, variant, args) -> str:
    info = _policy(policy)
    checks.cuda("a", a)
    checks.cuda("w", b, a.device)
    checks.dtype("a", a, tuple(_AB))
    checks.dtype("w", b, a.dtype)
    ab = _AB[a.dtype]
    if variant not in variants(ab, policy, bench=True):
        raise ValueError(f"policy {policy!r} with {ab} operands ships variants {variants(ab, policy, bench=True)}, "
                         f"not {variant!r}")
    tile_n = Variant.parse(variant).tile_n
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and w must be 2-D ([M, K] and [N, K]), got {list(a.shape)} and {list(b.shape)}")
    m, k = a.shape
    n = b.shape[0]
    checks.shape("w", b, (None, k))
    if k == 0:
        raise ValueError("a and w have K = 0 columns: the GEMM needs K >= 16")
    checks.multiple("a", k, 16, "K (reduction width)")
    checks.multiple("w", n, 16 * info.n_ratio, "N (output channels)")
    if info.split and (n // 2) % (tile_n // 2):
        raise ValueError(f"split SwiGLU needs I = N/2 = {n // 2} to be a multiple of {tile_n // 2}; "
                         "interleave the gate/up rows instead (policy without _split)")
    checks.cuda("out", out, a.device)
    checks.dtype("out", out, _TORCH[info.out])
    if info.qkv:   # D is Q only: its width is N minus the K and V blocks
        checks.shape("out", out, (m, None))
        n_out = out.shape[1]
        checks.multiple("out", n_out, 16, "Q width (Hq * head_dim)")
    else:
        n_out = n // info.n_ratio
        checks.shape("out", out, (m, n_out))
    if len(args) != len(info.args):
        raise ValueError(f"policy {policy!r} takes {len(info.args)} tensors "
                         f"({', '.join(nm for nm, _, _ in info.args) or 'none'}), got {len(args)}")
    sizes = {"m": m, "n": n, "n_out": n_out, "t": out_tiles(n_out, policy, tile_n)}
    for (name, dt, shape), t in zip(info.args, args):
        checks.cuda(name, t, a.device)
        checks.dtype(name, t, _TORCH[dt])
        if not isinstance(t, torch.Tensor) or t.dim() != len(shape):
            checks.shape(name, t, tuple(d if isinstance(d, int) else None for d in shape))
        for d, s in zip(shape, t.shape):   # other names: free sizes that must agree across tensors
            if isinstance(d, str) and d not in sizes:
                sizes[d] = s
        checks.shape(name, t, tuple(sizes[d] if isinstance(d, str) else d for d in shape))
    for name, t in (("a", a), ("w", b), ("out", out), *((nm, t) for (nm, _, _), t in zip(info.args, args))):
        checks.contiguous(name, t)
        checks.aligned(name, t)
    if info.qkv:
        _check_qkv(n, n_out, tile_n, dict(zip((nm for nm, _, _ in info.args), args)))
    return kernel_key(ab, policy, variant)


def _check_qkv(n: int, n_out: int, tile_n: int, t: dict) -> None:
    slots, hkv, cap, hd = t["k_cache"].shape
    if n_out <= 0 or n_out % hd or n - n_out != 2 * hkv * hd:
        raise ValueError(f"QKV: w has N = {n} rows and out (Q) {n_out} columns, but the caches hold {hkv} KV "
                         f"heads of {hd}: need N = Q width + 2 * {hkv} * {hd} and Q width a multiple of {hd}")
    if tile_n % hd:
        raise ValueError(f"QKV: head_dim {hd} must divide the tile width {tile_n}")
    pos, slot = t["row_pos"], t["row_slot"]
    capturing = pos.is_cuda and torch.cuda.is_current_stream_capturing()
    if pos.numel() and not capturing:   # one host sync (skipped in graph capture); the kernel also masks
        lo_p, hi_p, lo_s, hi_s = torch.stack([pos.min(), pos.max(), slot.min(), slot.max()]).tolist()
        if lo_p < 0 or hi_p >= cap:
            raise ValueError(f"QKV: KV cache overflow: positions span [{lo_p}, {hi_p}] but the cache holds "
                             f"{cap} positions per slot; allocate a larger cache")
        if lo_s < 0 or hi_s >= slots:
            raise ValueError(f"QKV: cache slots span [{lo_s}, {hi_s}] but the cache has {slots} slots")


@futx_op("prefill_gemm", mutates_args=("out", "args"))
def prefill_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, policy: str, variant: str,
                 args: List[torch.Tensor]) -> None:
    """out = policy(a @ w.T); `args` = the policy's tensors in POLICIES order (some are written)."""
    key = _check(a, w, out, policy, variant, args)
    if a.shape[0] == 0:
        return
    index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    get_kernel(key)(a, w, out, *args, _num_sms(index))


@prefill_gemm.register_fake
def _(a, w, out, policy, variant, args):
    return None


def _variant(a, w, policy, variant, tile_n) -> str:
    if variant is not None:
        return variant
    ab = _AB.get(a.dtype)
    if ab is None:
        raise TypeError(f"a must be float8_e4m3fn or bfloat16, got {a.dtype}")
    if tile_n is not None:      # shorthand: the cooperative variant of that width
        return f"n{tile_n}"
    sms = _num_sms(a.device.index or 0) if a.is_cuda else 132
    return choose_variant(ab, policy, a.shape[0], w.shape[0], sms)


def gemm(a: torch.Tensor, w: torch.Tensor, policy: str = "bf16", *, out: Optional[torch.Tensor] = None,
         variant: Optional[str] = None, tile_n: Optional[int] = None, **tensors: torch.Tensor) -> torch.Tensor:
    """Allocate D if needed, pick the variant (`choose_variant`) and run `futx::prefill_gemm`.

    tensors: the policy's tensors by name (POLICIES[policy].args), e.g. a_scale=, b_scale=, rho=.
    variant: e.g. "n256.pp" (the default), "n256" (coop) (catalog `variants(ab, policy, bench=True)`);
    tile_n=W is shorthand for the coop variant "nW".
    """
    info = _policy(policy)
    names = [nm for nm, _, _ in info.args]
    unknown = sorted(set(tensors) - set(names))
    if unknown:
        raise TypeError(f"policy {policy!r} does not take {unknown}; it takes: {', '.join(names) or 'nothing'}")
    missing = [nm for nm in names if tensors.get(nm) is None]
    if missing:
        spec = {nm: f"{dt}{list(shape)}" for nm, dt, shape in info.args}
        raise ValueError(f"policy {policy!r} needs {', '.join(f'{nm!r} ({spec[nm]})' for nm in missing)}")
    if not isinstance(a, torch.Tensor) or not isinstance(w, torch.Tensor) or a.dim() != 2 or w.dim() != 2:
        raise ValueError("a and w must be 2-D tensors ([M, K] and [N, K])")
    if out is None:
        if info.qkv:
            raise ValueError(f"policy {policy!r} writes Q into `out` ([M, Hq * head_dim]): pass out=, or use prefill.qkv")
        out = torch.empty(a.shape[0], w.shape[0] // info.n_ratio, dtype=_TORCH[info.out], device=a.device)
    torch.ops.futx.prefill_gemm(a, w, out, policy, _variant(a, w, policy, variant, tile_n),
                                [tensors[nm] for nm in names])
    return out


def qkv(a: torch.Tensor, w: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row_slot: torch.Tensor,
        row_pos: torch.Tensor, inv_freq: torch.Tensor, *, rho: torch.Tensor, a_scale: Optional[torch.Tensor] = None,
        b_scale: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
        variant: Optional[str] = None) -> torch.Tensor:
    """The QKV projection of a packed batch, with RoPE and direct KV-cache placement (paper 3.2.1).

    w: [(Hq + 2 Hkv) * hd, K], rows [Q heads | K heads | V heads] (RMSNorm gain folded in);
    k_cache, v_cache: one layer's BF16 main cache, [slots, Hkv, capacity, hd] (futx.kvcache.KVCache);
    row_slot, row_pos: int32 [M], the cache slot and position of every packed row (PackedBatch.row_slot /
    row_position); inv_freq: float32 [hd / 2] (futx.rope.inv_freq); rho: float32 [M] RMSNorm row factors;
    E4M3 operands also take a_scale [M] and b_scale [N]. Returns Q, [M, Hq, hd] BF16 (RoPE applied);
    K (RoPE applied) and V are written into the caches. The caller advances the cache lengths.
    """
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise ValueError("k_cache must be a 4-D tensor [slots, Hkv, capacity, head_dim]")
    hkv, hd = k_cache.shape[1], k_cache.shape[3]
    fp8 = a.dtype == torch.float8_e4m3fn
    policy = f"scale_rho_qkv{hd}_bf16" if fp8 else f"rho_qkv{hd}_bf16"
    if policy not in POLICIES:
        raise ValueError(f"no QKV placement policy for head_dim {hd} ({'e4m3' if fp8 else 'bf16'} operands); "
                         f"known: {', '.join(p for p in POLICIES if POLICIES[p].qkv)}")
    if fp8 and (a_scale is None or b_scale is None):
        raise ValueError("E4M3 operands need a_scale [M] and b_scale [N]")
    if not fp8 and (a_scale is not None or b_scale is not None):
        raise ValueError("a_scale/b_scale are for E4M3 operands; BF16 operands take rho only")
    hq_hd = w.shape[0] - 2 * hkv * hd
    if out is None:
        out = torch.empty(a.shape[0], max(hq_hd, 0), dtype=torch.bfloat16, device=a.device)
    tensors = dict(rho=rho, inv_freq=inv_freq, row_slot=row_slot, row_pos=row_pos, k_cache=k_cache, v_cache=v_cache)
    if fp8:
        tensors.update(a_scale=a_scale, b_scale=b_scale)
    gemm(a, w, policy, out=out, variant=variant, **tensors)
    return out.view(a.shape[0], out.shape[1] // hd, hd)


def rms_rho(sumsq: torch.Tensor, hidden: int, eps: float) -> torch.Tensor:
    """rho[m] = (sum_t sumsq[t, m] / H + eps)^-1/2 from RmsPartials (the small reduction of paper 3.2.2)."""
    return torch.rsqrt(sumsq.sum(dim=0) / hidden + eps)
