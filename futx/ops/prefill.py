"""`futx::prefill_gemm` — the prefill GEMM + epilogue policy as a torch custom op.

    out = futx.ops.prefill.gemm(a, w, "scale_rho_swiglu_fp8", a_scale=..., b_scale=..., rho=...,
                                scale=..., amax=..., saturated=...)

a: [M, K] activations, w: [N, K] weights (nn.Linear layout), both E4M3 or both BF16, contiguous.
The policy names and their tensors are listed in futx/runtime/catalog/prefill.py (POLICIES; user
policies join with `register_policy`); every tensor is validated (device, dtype, shape, contiguity,
16-byte alignment) before any launch.
Alignment rules (TMA): K and N multiples of 16, D's width (N, or N/2 after SwiGLU) a multiple of 16.
M is free (any value >= 0; M = 0 launches nothing). The tile width follows `choose_tile_n`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, Optional

import torch

from futx.ops import checks
from futx.runtime import get_kernel
from futx.runtime.catalog.prefill import POLICIES, choose_tile_n, kernel_key, tile_widths

_TORCH = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "f32": torch.float32, "i32": torch.int32}
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


def _check(a, b, out, policy, tile_n, args) -> str:
    info = _policy(policy)
    checks.cuda("a", a)
    checks.cuda("w", b, a.device)
    checks.dtype("a", a, tuple(_AB))
    checks.dtype("w", b, a.dtype)
    ab = _AB[a.dtype]
    if tile_n not in tile_widths(ab, policy):
        raise ValueError(f"policy {policy!r} with {ab} operands ships tile widths {tile_widths(ab, policy)}, "
                         f"not {tile_n}")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and w must be 2-D ([M, K] and [N, K]), got {list(a.shape)} and {list(b.shape)}")
    m, k = a.shape
    n = b.shape[0]
    checks.shape("w", b, (None, k))
    checks.multiple("a", k, 16, "K (reduction width)")
    checks.multiple("w", n, 16 * info.n_ratio, "N (output channels)")
    n_out = n // info.n_ratio
    if info.split and (n // 2) % (tile_n // 2):
        raise ValueError(f"split SwiGLU needs I = N/2 = {n // 2} to be a multiple of {tile_n // 2}; "
                         "interleave the gate/up rows instead (policy without _split)")
    checks.cuda("out", out, a.device)
    checks.dtype("out", out, _TORCH[info.out])
    checks.shape("out", out, (m, n_out))
    if len(args) != len(info.args):
        raise ValueError(f"policy {policy!r} takes {len(info.args)} tensors "
                         f"({', '.join(nm for nm, _, _ in info.args) or 'none'}), got {len(args)}")
    sizes = {"m": m, "n": n, "n_out": n_out, "t": out_tiles(n_out, policy, tile_n)}
    for (name, dt, shape), t in zip(info.args, args):
        checks.cuda(name, t, a.device)
        checks.dtype(name, t, _TORCH[dt])
        checks.shape(name, t, tuple(sizes[d] if isinstance(d, str) else d for d in shape))
    for name, t in (("a", a), ("w", b), ("out", out), *((nm, t) for (nm, _, _), t in zip(info.args, args))):
        checks.contiguous(name, t)
        checks.aligned(name, t)
    return kernel_key(ab, policy, tile_n)


@torch.library.custom_op("futx::prefill_gemm", mutates_args=("out", "args"))
def prefill_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, policy: str, tile_n: int,
                 args: List[torch.Tensor]) -> None:
    """out = policy(a @ w.T); `args` = the policy's tensors in POLICIES order (some are written)."""
    key = _check(a, w, out, policy, tile_n, args)
    if a.shape[0] == 0:
        return
    index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    get_kernel(key)(a, w, out, *args, _num_sms(index))


@prefill_gemm.register_fake
def _(a, w, out, policy, tile_n, args):
    return None


def gemm(a: torch.Tensor, w: torch.Tensor, policy: str = "bf16", *, out: Optional[torch.Tensor] = None,
         tile_n: Optional[int] = None, **tensors: torch.Tensor) -> torch.Tensor:
    """Allocate D if needed, pick the tile width (`choose_tile_n`) and run `futx::prefill_gemm`.

    tensors: the policy's tensors by name (POLICIES[policy].args), e.g. a_scale=, b_scale=, rho=.
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
        out = torch.empty(a.shape[0], w.shape[0] // info.n_ratio, dtype=_TORCH[info.out], device=a.device)
    if tile_n is None:
        ab = _AB.get(a.dtype)
        if ab is None:
            raise TypeError(f"a must be float8_e4m3fn or bfloat16, got {a.dtype}")
        sms = _num_sms(a.device.index or 0) if a.is_cuda else 132
        tile_n = choose_tile_n(ab, policy, a.shape[0], w.shape[0], sms)
    torch.ops.futx.prefill_gemm(a, w, out, policy, tile_n, [tensors[nm] for nm in names])
    return out


def rms_rho(sumsq: torch.Tensor, hidden: int, eps: float) -> torch.Tensor:
    """rho[m] = (sum_t sumsq[t, m] / H + eps)^-1/2 from RmsPartials (the small reduction of paper 3.2.2)."""
    return torch.rsqrt(sumsq.sum(dim=0) / hidden + eps)
