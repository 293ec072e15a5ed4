"""`futx::row_quant_e4m3_` — per-row dynamic E4M3 quantization of BF16 activations (futx/prefill/row_quant.py):

    q, scale = futx.ops.row_quant.quantize_rows_e4m3(x)     # x bf16 [M, K] -> float8_e4m3fn [M, K], float32 [M]

scale[m] = amax_m / 448 (IEEE division; 1 for an all-zero row), q = e4m3(x / scale) rounded to nearest even and
saturated: bit for bit futx.engine.prefill.quantize_rows, in one launch instead of ~6 torch passes.
"""

from __future__ import annotations

from typing import Optional

import torch

from futx.ops import checks
from futx.ops.registration import futx_op
from futx.runtime import get_kernel


def check_inputs(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    checks.cuda("x", x)
    checks.cuda("q", q, x.device)
    checks.cuda("scale", scale, x.device)
    checks.dtype("x", x, torch.bfloat16)
    checks.dtype("q", q, (torch.float8_e4m3fn, torch.uint8))
    checks.dtype("scale", scale, torch.float32)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got {list(x.shape)}")
    checks.multiple("x", x.shape[1], 4, "K (row width)")
    checks.shape("q", q, tuple(x.shape))
    checks.shape("scale", scale, (x.shape[0],))
    for name, t in (("x", x), ("q", q), ("scale", scale)):
        checks.contiguous(name, t)
        checks.aligned(name, t)


@futx_op("row_quant_e4m3_", mutates_args=("q", "scale"))
def row_quant_e4m3_(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Writes q [M, K] (E4M3, or its uint8 view) and scale [M] float32 from x [M, K] bf16."""
    check_inputs(x, q, scale)
    if x.shape[0] == 0:
        return
    get_kernel("engine.row_quant_e4m3")(x, q.view(torch.uint8), scale)


@row_quant_e4m3_.register_fake
def _(x, q, scale):
    return None


def quantize_rows_e4m3(x: torch.Tensor, q: Optional[torch.Tensor] = None,
                       scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device) if q is None else q
    scale = torch.empty(x.shape[:1], dtype=torch.float32, device=x.device) if scale is None else scale
    torch.ops.futx.row_quant_e4m3_(x, q, scale)
    return q, scale
