"""Decode projections as torch ops: y = x @ W^T (+ fused epilogue) for 1 <= M <= 64 rows (decode.plan.MAX_M).

    torch.ops.futx.decode_linear_int4(x, packed, scales, group_size, epilogue, residual) -> y
    torch.ops.futx.decode_linear_e4m3(x, data, scale, epilogue, residual) -> y
    torch.ops.futx.decode_linear_bf16(x, weight, epilogue, residual) -> y
    torch.ops.futx.decode_norm_linear_int4(x, packed, scales, group_size, epilogue, eps) -> y   (RMSNorm row
        factor of x first: one launch where decode.plan.fuses_norm, the tile GEMVs)
    decode_linear(x, weight, epilogue="store", residual=None)   # dispatch on the weight's type
    decode_norm_linear(x, weight, epilogue, eps)

x [M, K] bf16; weights as `futx.quant` stores them (Int4Weight: packed [N/16, K/64, 32, 4] int32 +
float16 scales [N/16, K/G, 16]; E4M3Weight: float8_e4m3fn [N, K] + float32 [N]; bf16 [N, K]).
epilogue: "store" -> y [M, N]; "residual" -> y = x @ W^T + residual; "swiglu" -> y [M, N/2] =
silu(gate) * up with gate/up rows interleaved (row 2j gate j, row 2j + 1 up j).
Every input is validated before launch. decode.plan picks the measured-fastest kernel (INT4 at M = 1: the
one-tile-per-CTA GEMV, and at 2..8 rows on small grids its multi-token form; up to M = 16 the persistent GEMV
where the activation rows fit in shared memory, INT4 only up to M = 8; else the skinny kernel) and its launch
shape.
The persistent GEMV and the skinny kernel launch with programmatic dependent launch: they may start
reading the weights and scales before the previous kernel on the stream has finished, so that kernel must
not write them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from decode import plan
from futx.hardware import sm_count
from futx.ops import checks, split_counters
from futx.ops.registration import futx_op
from futx.quant import layouts
from futx.runtime import get_kernel

def _check_common(x: torch.Tensor, n: int, k_w: int, epilogue: str, residual: Optional[torch.Tensor]) -> None:
    checks.cuda("x", x)
    checks.dtype("x", x, torch.bfloat16)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {list(x.shape)}")
    m, k = x.shape
    checks.in_range("x rows (M)", m, 1, plan.MAX_M)
    if k != k_w:
        raise ValueError(f"x has K = {k} but the weight has K = {k_w}")
    checks.multiple("x", k, layouts.INT4_WEIGHT.block_k, "K")
    checks.multiple("weight", n, layouts.INT4_WEIGHT.block_n, "N (output features)")
    checks.contiguous("x", x)
    checks.aligned("x", x)
    if epilogue not in plan.EPILOGUES:
        raise ValueError(f"unknown epilogue {epilogue!r}; known: {', '.join(plan.EPILOGUES)}")
    if (epilogue == "residual") != (residual is not None):
        raise ValueError("pass residual exactly when epilogue='residual'")
    if residual is not None:
        checks.cuda("residual", residual, x.device)
        checks.dtype("residual", residual, torch.bfloat16)
        checks.shape("residual", residual, (m, n))
        checks.contiguous("residual", residual)
        checks.aligned("residual", residual)


def _plan(fmt: str, group: int, epilogue: str, x: torch.Tensor, n: int, kernel: str = "auto", variant: str = "",
          tiles: Optional[int] = None, split: Optional[int] = None, warps: Optional[int] = None,
          norm: bool = False, nblocks: Optional[int] = None):
    """(launch choice, kernel) for validated operands; (None, None) for `norm` where no fused-norm kernel
    serves the projection."""
    m, k = x.shape
    if norm and not plan.fuses_norm(fmt, group, epilogue, m, n, k, sm_count(x.device)):
        return None, None
    choice = plan.choose(fmt, group, epilogue, m, n, k, sm_count(x.device), kernel, variant, tiles, split, warps,
                         norm, nblocks)
    if choice.kind == "gemv":
        checks.in_range("tiles", choice.tiles, 1, n // layouts.INT4_WEIGHT.block_n)
    elif choice.kind == "skinny":
        checks.in_range("split", choice.split, 1, plan.skinny_max_split(fmt, group, n, k, choice.variant))
    elif choice.split > 1:
        checks.in_range("split", choice.split, 1, k // plan.unit_k(fmt, group))
    return choice, get_kernel(choice.key)


def _launch(planned, epilogue: str, x, w, s, residual, n: int, out: Optional[torch.Tensor] = None,
            workspace: Optional[torch.Tensor] = None, eps: Optional[float] = None) -> torch.Tensor:
    choice, fn = planned
    m = x.shape[0]
    shape = (m, n // 2 if epilogue == "swiglu" else n)
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16, device=x.device)
    else:
        checks.cuda("out", out, x.device)
        checks.dtype("out", out, torch.bfloat16)
        checks.shape("out", out, shape)
        checks.contiguous("out", out)
    if choice.kind == "tile" and choice.split == 1:
        fn(x, w, s, residual, out, *(() if eps is None else (eps,)))
        return out
    if choice.kind == "gemv":
        fn(x, w, s, residual, out, choice.tiles)
        return out
    # split-K partials: [split][n][token bucket] (skinny; stream-K: two 128-channel tiles per CTA), [n / 16][split][16]
    # (tile GEMV, M = 1)
    if choice.kind == "skinny":
        need = plan.skinny_workspace(choice.variant, choice.split, n, m)
    else:
        need = choice.split * n if choice.split > 1 else 4
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=x.device)
    elif workspace.numel() < need or workspace.dtype != torch.float32:
        raise ValueError(f"workspace must hold {need} float32 values")
    fn(x, w, s, residual, out, workspace, split_counters.counters(x.device), choice.split)
    return out


# Validated call signatures -> (n, launch choice, kernel). Everything the checks look at except the data
# pointers' alignment is in the signature (dtype, device, shape, strides, group size, epilogue), so a repeated
# signature only re-tests alignment: the host cost of a decode step's ops stays a few microseconds.
_READY: dict[tuple, tuple] = {}
_READY_MAX = 4096


def _meta(t: Optional[torch.Tensor]):
    return None if t is None else (t.dtype, t.device, t.shape, t.stride())


def _prepared(fmt: str, group: int, epilogue: str, x, w, s, residual, check, norm: bool = False) -> tuple:
    """(n, choice, kernel) for this call, validating on the first call of a signature (and to name a
    misaligned pointer on later ones)."""
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        check()  # raises the TypeError
    sig = (fmt, group, epilogue, norm, _meta(x), _meta(w), _meta(s), _meta(residual), plan.tile_route())
    ready = _READY.get(sig)
    ptrs = x.data_ptr() | w.data_ptr() | (s.data_ptr() if s is not None else 0) | \
        (residual.data_ptr() if residual is not None else 0)
    if ready is None or ptrs % 16:
        n = check()
        if ready is None:
            if len(_READY) >= _READY_MAX:
                _READY.clear()
            ready = _READY[sig] = (n, *_plan(fmt, group, epilogue, x, n, norm=norm))
    return ready


# ---- INT4 ---------------------------------------------------------------------------------------
def _check_int4(x, packed, scales, group_size, epilogue, residual) -> int:
    checks.cuda("x", x)
    checks.cuda("packed", packed, x.device)
    checks.dtype("packed", packed, torch.int32)
    lay = layouts.INT4_WEIGHT
    if packed.dim() != 4 or tuple(packed.shape[2:]) != (layouts.WARP, lay.words_per_lane):
        raise ValueError(f"packed must be [N/16, K/64, {layouts.WARP}, {lay.words_per_lane}] int32, "
                         f"got {list(packed.shape)}")
    n, k = packed.shape[0] * lay.block_n, packed.shape[1] * lay.block_k
    lay.check_shape(n, k, group_size)
    plan.fmt_tag("int4", group_size)
    checks.cuda("scales", scales, packed.device)
    checks.dtype("scales", scales, torch.float16)
    checks.shape("scales", scales, (n // lay.block_n, k // group_size, lay.block_n))
    for name, t in (("packed", packed), ("scales", scales)):
        checks.contiguous(name, t)
        checks.aligned(name, t)
    _check_common(x, n, k, epilogue, residual)
    return n


@futx_op("decode_linear_int4")
def decode_linear_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int,
                       epilogue: str = "store", residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    n, *planned = _prepared("int4", group_size, epilogue, x, packed, scales, residual,
                            lambda: _check_int4(x, packed, scales, group_size, epilogue, residual))
    return _launch(planned, epilogue, x, packed, scales, residual, n)


@decode_linear_int4.register_fake
def _(x, packed, scales, group_size, epilogue="store", residual=None):
    n = packed.shape[0] * layouts.INT4_WEIGHT.block_n
    return x.new_empty(x.shape[0], n // 2 if epilogue == "swiglu" else n)


@futx_op("decode_norm_linear_int4")
def decode_norm_linear_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int,
                            epilogue: str = "store", eps: float = 1e-5) -> torch.Tensor:
    """The projection of x's RMSNorm row (+ "store" or "swiglu"): the decode step's RMSNorm row factor and the
    projection that reads it, in one launch where decode.plan.fuses_norm (the tile GEMVs, which compute
    rsqrt(mean(x^2) + eps) * (x @ W^T) in float32), else the row-factor kernel then decode_linear_int4, i.e.
    bf16(x * rsqrt(mean(x^2) + eps)) @ W^T."""
    _check_norm_epilogue(epilogue)
    if not (eps >= 0.0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    n, *planned = _prepared("int4", group_size, epilogue, x, packed, scales, None,
                            lambda: _check_int4(x, packed, scales, group_size, epilogue, None), norm=True)
    if planned[0] is None:
        return decode_linear_int4(_rms_rows(x, eps), packed, scales, group_size, epilogue)
    return _launch(planned, epilogue, x, packed, scales, None, n, eps=float(eps))


@decode_norm_linear_int4.register_fake
def _(x, packed, scales, group_size, epilogue="store", eps=1e-5):
    n = packed.shape[0] * layouts.INT4_WEIGHT.block_n
    return x.new_empty(x.shape[0], n // 2 if epilogue == "swiglu" else n)


def _check_norm_epilogue(epilogue: str) -> None:
    if epilogue not in plan.NORM_EPILOGUES:
        raise ValueError(f"epilogue must be one of {plan.NORM_EPILOGUES} with the RMSNorm row factor, got {epilogue!r}")


def _rms_rows(x: torch.Tensor, eps: float) -> torch.Tensor:
    from futx.ops.rms_rows import rms_rows

    return rms_rows(x, eps)


# ---- E4M3 ---------------------------------------------------------------------------------------
def _check_e4m3(x, data, scale, epilogue, residual) -> int:
    checks.cuda("x", x)
    checks.cuda("data", data, x.device)
    checks.dtype("data", data, torch.float8_e4m3fn)
    if data.dim() != 2:
        raise ValueError(f"E4M3 data must be 2-D [N, K], got {list(data.shape)}")
    n, k = data.shape
    checks.cuda("scale", scale, data.device)
    checks.dtype("scale", scale, torch.float32)
    checks.shape("scale", scale, (n,))
    for name, t in (("data", data), ("scale", scale)):
        checks.contiguous(name, t)
        checks.aligned(name, t)
    _check_common(x, n, k, epilogue, residual)
    return n


@futx_op("decode_linear_e4m3")
def decode_linear_e4m3(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, epilogue: str = "store",
                       residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    n, *planned = _prepared("e4m3", 128, epilogue, x, data, scale, residual,
                            lambda: _check_e4m3(x, data, scale, epilogue, residual))
    return _launch(planned, epilogue, x, data.view(torch.uint8), scale, residual, n)


@decode_linear_e4m3.register_fake
def _(x, data, scale, epilogue="store", residual=None):
    n = data.shape[0]
    return x.new_empty(x.shape[0], n // 2 if epilogue == "swiglu" else n)


# ---- BF16 ---------------------------------------------------------------------------------------
def _check_bf16(x, weight, epilogue, residual) -> int:
    checks.cuda("x", x)
    checks.cuda("weight", weight, x.device)
    checks.dtype("weight", weight, torch.bfloat16)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got {list(weight.shape)}")
    checks.contiguous("weight", weight)
    checks.aligned("weight", weight)
    _check_common(x, weight.shape[0], weight.shape[1], epilogue, residual)
    return weight.shape[0]


@futx_op("decode_linear_bf16")
def decode_linear_bf16(x: torch.Tensor, weight: torch.Tensor, epilogue: str = "store",
                       residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    n, *planned = _prepared("bf16", 128, epilogue, x, weight, None, residual,
                            lambda: _check_bf16(x, weight, epilogue, residual))
    return _launch(planned, epilogue, x, weight, None, residual, n)


@decode_linear_bf16.register_fake
def _(x, weight, epilogue="store", residual=None):
    n = weight.shape[0]
    return x.new_empty(x.shape[0], n // 2 if epilogue == "swiglu" else n)


# ---- convenience --------------------------------------------------------------------------------
def decode_linear(x: torch.Tensor, weight, epilogue: str = "store",
                  residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dispatch on the weight's type: futx.quant Int4Weight / E4M3Weight, or a bf16 tensor."""
    from futx.quant.fp8 import E4M3Weight
    from futx.quant.int4 import Int4Weight

    if isinstance(weight, Int4Weight):
        return decode_linear_int4(x, weight.packed, weight.scales, weight.group_size, epilogue, residual)
    if isinstance(weight, E4M3Weight):
        return decode_linear_e4m3(x, weight.data, weight.scale, epilogue, residual)
    if isinstance(weight, torch.Tensor):
        return decode_linear_bf16(x, weight, epilogue, residual)
    raise TypeError(f"decode_linear: unsupported weight type {type(weight).__name__}")


def decode_norm_linear(x: torch.Tensor, weight, epilogue: str, eps: float) -> torch.Tensor:
    """The projection of x's RMSNorm row (+ "store" or "swiglu"), dispatching on the weight's type: one launch
    where a fused-norm kernel serves it (INT4, decode_norm_linear_int4), else the row-factor kernel then
    decode_linear."""
    from futx.quant.int4 import Int4Weight

    if isinstance(weight, Int4Weight):
        return decode_norm_linear_int4(x, weight.packed, weight.scales, weight.group_size, epilogue, eps)
    _check_norm_epilogue(epilogue)
    return decode_linear(_rms_rows(x, eps), weight, epilogue)


def run_variant(fmt: str, x: torch.Tensor, w: torch.Tensor, s: Optional[torch.Tensor], group_size: int = 128,
                epilogue: str = "store", residual: Optional[torch.Tensor] = None, kernel: str = "auto",
                variant: str = "", tiles: Optional[int] = None, split: Optional[int] = None,
                out: Optional[torch.Tensor] = None, workspace: Optional[torch.Tensor] = None,
                warps: Optional[int] = None, nblocks: Optional[int] = None) -> torch.Tensor:
    """Test/benchmark hook: the ops' validation and launch with the kernel ("auto", "tile", "gemv",
    "skinny"), a tuning-space variant (decode.plan.GEMV_VARIANTS / TILE_VARIANTS; register them first with
    scripts/tuning_space.py), the launch shape (GEMV
    tiles per CTA, skinny split, tile-GEMV warps and n-blocks per CTA) and the output/workspace buffers chosen by
    the caller."""
    if fmt == "int4":
        n = _check_int4(x, w, s, group_size, epilogue, residual)
    elif fmt == "e4m3":
        n = _check_e4m3(x, w, s, epilogue, residual)
        w = w.view(torch.uint8)
    else:
        n = _check_bf16(x, w, epilogue, residual)
    planned = _plan(fmt, group_size, epilogue, x, n, kernel, variant, tiles, split, warps, nblocks=nblocks)
    return _launch(planned, epilogue, x, w, s, residual, n, out, workspace)
