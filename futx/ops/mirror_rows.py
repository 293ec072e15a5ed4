"""`futx::mirror_rows_` — the decode mirror of rows already in a cache's BF16 main copy (a prefill wrote them).

    futx.ops.mirror_rows.mirror_rows(cache_format, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale,
                                     row_slot, row_pos)

k_cache, v_cache [S, Hkv, C, D] bfloat16 and the mirror tensors in futx.ops.decode_attention's layout
(cache_format "int4": Hadamard-rotated INT4 in fragment order; "e4m3"); row_slot, row_pos int32 [M]: the rows
(slot, position) whose mirror is written, exactly as the decode attention kernel writes its own new rows.
Everything is validated before the launch except the index ranges, which live on the device: the caller checks
them on the host (futx.engine.prefill does, from the batch's host lists), so that a CUDA graph can hold the op.
A paged cache (futx.paging) is the same tensors with pages in the slot mode: the caller passes each row's
(page, in-page row) from futx.paging.locate as (row_slot, row_pos) (futx.engine.backends.KernelOps.mirror_rows).
"""

from __future__ import annotations

import torch

from futx.ops import checks
from futx.ops.decode_attention import check_mirror_tensors
from futx.ops.registration import futx_op
from futx.runtime import get_kernel
from futx.runtime.catalog.engine import mirror_key


def check_inputs(cache_format, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale, row_slot, row_pos,
                 mirror_only: bool = False) -> None:
    """mirror_only: the mirror may hold more pages than the main copy (futx.ops.qkv_rows' INT4-only twin)."""
    if cache_format not in ("int4", "e4m3"):
        raise ValueError(f"mirror_rows: cache_format must be 'int4' or 'e4m3', got {cache_format!r}")
    checks.cuda("k_cache", k_cache)
    for name, t in (("v_cache", v_cache), ("row_slot", row_slot), ("row_pos", row_pos)):
        checks.cuda(name, t, k_cache.device)
    checks.dtype("k_cache", k_cache, torch.bfloat16)
    checks.dtype("v_cache", v_cache, torch.bfloat16)
    checks.dtype("row_slot", row_slot, torch.int32)
    checks.dtype("row_pos", row_pos, torch.int32)
    if k_cache.dim() != 4 or k_cache.shape[3] not in (64, 128):
        raise ValueError(f"k_cache must be [slots, kv_heads, capacity, head_dim 64 | 128], got {list(k_cache.shape)}")
    checks.shape("v_cache", v_cache, tuple(k_cache.shape))
    if row_slot.dim() != 1:
        raise ValueError(f"row_slot must be 1-D [rows], got {list(row_slot.shape)}")
    checks.shape("row_pos", row_pos, tuple(row_slot.shape))
    mirrors = check_mirror_tensors("mirror_rows", cache_format, k_cache, k_mirror, k_scale, v_mirror, v_scale,
                                   mirror_only)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("row_slot", row_slot), ("row_pos", row_pos),
                    *mirrors):
        checks.contiguous(name, t)
        checks.aligned(name, t)


@futx_op("mirror_rows_", mutates_args=("k_mirror", "k_scale", "v_mirror", "v_scale"))
def mirror_rows_(cache_format: str, k_cache: torch.Tensor, v_cache: torch.Tensor, k_mirror: torch.Tensor,
                 k_scale: torch.Tensor, v_mirror: torch.Tensor, v_scale: torch.Tensor, row_slot: torch.Tensor,
                 row_pos: torch.Tensor) -> None:
    """See the module docstring."""
    check_inputs(cache_format, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale, row_slot, row_pos)
    if row_slot.shape[0] == 0:
        return
    u8 = (lambda t: t.view(torch.uint8)) if cache_format == "e4m3" else (lambda t: t)  # noqa: E731
    get_kernel(mirror_key(cache_format, k_cache.shape[3]))(k_cache, v_cache, u8(k_mirror), k_scale, u8(v_mirror),
                                                            v_scale, row_slot, row_pos)


@mirror_rows_.register_fake
def _(cache_format, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale, row_slot, row_pos):
    return None


def mirror_rows(cache_format: str, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale, row_slot,
                row_pos) -> None:
    torch.ops.futx.mirror_rows_(cache_format, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale, row_slot,
                                row_pos)
