"""`futx::argmax_rows_` — the decode step's greedy argmax: out[m] = torch.argmax(x[m]) for bf16 logits x [M, V], in
one launch of many CTAs per row (decode/argmax_rows.py); the same answer as torch, ties and NaNs included.

The kernel's workspace (a partial pair per CTA, an arrival counter per row that the kernel leaves at zero) is one
buffer per (device, stream), as for the split-K counters: kernels on one stream run one after another. It grows
outside CUDA-graph capture (the engine's warm-up on the capture stream runs the largest bucket first); an outgrown
buffer is kept, since graphs captured before may still point at it.
"""

from __future__ import annotations

import torch

from decode.argmax_plan import MAX_VOCAB, VEC, blocks_per_row
from futx.ops import checks
from futx.ops.registration import futx_op
from futx.runtime import get_kernel

_WORK: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
_OUTGROWN: list = []


def supported(x: torch.Tensor) -> bool:
    """Whether the kernel takes these logits (else torch.argmax): what `_check_logits` asks."""
    try:
        _check_logits(x)
    except (TypeError, ValueError):
        return False
    return True


def _check_logits(x: torch.Tensor) -> None:
    """bf16 on CUDA, [M, V] with unit column stride, V and the row stride multiples of 8, 16-byte aligned."""
    checks.cuda("x", x)
    checks.dtype("x", x, torch.bfloat16)
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"x must be 2-D [M, V] with M, V >= 1, got {list(x.shape)}")
    if x.shape[1] >= MAX_VOCAB:
        raise ValueError(f"x has {x.shape[1]} columns; the kernel takes fewer than {MAX_VOCAB}")
    if x.stride(1) != 1:
        raise ValueError(f"x's columns must be contiguous (stride 1), got strides {x.stride()}")
    checks.multiple("x.shape[1]", x.shape[1], VEC, "columns")
    checks.multiple("x.stride(0)", x.stride(0), VEC, "row stride")
    checks.aligned("x", x)


def _check(x: torch.Tensor, out: torch.Tensor) -> None:
    _check_logits(x)
    checks.cuda("out", out, x.device)
    checks.dtype("out", out, torch.int64)
    checks.contiguous("out", out)
    checks.shape("out", out, (x.shape[0],))


def workspace(device: torch.device, rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials float32, counters int32, zero) holding at least `rows` rows of `vocab` logits: this stream's
    buffer; in a CUDA-graph capture that finds none big enough, one of the graph's own (its zeroing captured too)."""
    key = (device.index, torch.cuda.current_stream(device).stream_id)
    need = rows * blocks_per_row(vocab) * 2
    have = _WORK.get(key)
    if have is not None and have[0].numel() >= need and have[1].numel() >= rows:
        return have
    if torch.cuda.is_current_stream_capturing():   # in the graph's pool, stream-ordered like any temporary: not
        return (torch.empty(need, dtype=torch.float32, device=device),   # kept for eager calls, which could
                torch.zeros(rows, dtype=torch.int32, device=device))     # outlive the graph
    if have is not None:
        _OUTGROWN.append(have)
        need, rows = max(need, have[0].numel()), max(rows, have[1].numel())
    _WORK[key] = (torch.empty(need, dtype=torch.float32, device=device),
                  torch.zeros(rows, dtype=torch.int32, device=device))
    return _WORK[key]


@futx_op("argmax_rows_", mutates_args=("out",))
def argmax_rows_(x: torch.Tensor, out: torch.Tensor) -> None:
    """Writes out [M] int64 = argmax of each row of x [M, V] bf16 (V and the row stride multiples of 8, columns
    contiguous, 16-byte aligned)."""
    _check(x, out)
    partials, counters = workspace(x.device, x.shape[0], x.shape[1])
    get_kernel("engine.argmax_rows")(x, out, partials, counters)


@argmax_rows_.register_fake
def _(x, out):
    return None


def greedy(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [M]: argmax of each row of x [M, V] on the kernel where it takes x (`supported`), else torch.argmax."""
    if out is None:
        out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    if supported(x):
        argmax_rows_(x, out)
    else:
        torch.argmax(x, dim=-1, out=out)
    return out
