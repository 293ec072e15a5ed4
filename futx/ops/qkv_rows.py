"""`futx::qkv_rows_` — the new K/V rows of a QKV projection output into a cache: RoPE on the key, the BF16 main
copy and the decode mirror, one launch (decode.qkv_rows: the decode attention kernel's own bytes for a new row).

    futx.ops.qkv_rows.qkv_rows(cache_format, qkv, rope, positions, row_slot, row_pos, k_cache, v_cache, k_mirror,
                               k_scale, v_mirror, v_scale)

qkv [M, Hq + 2 Hkv, D] bfloat16 (the projection's output, viewed by heads), rope float32 [>= positions, D] (cos |
sin per position), positions int32 [M] (RoPE's angles), row_slot / row_pos int32 [M] (where each row is stored:
slot and position, or a paged cache's page and in-page row from futx.paging.locate), the cache tensors in
futx.ops.decode_attention's layout with an "int4" or "e4m3" mirror (a mirror of more pages than the main copy,
the INT4-only cache: the rows go to the mirror only, the `.mo` kernel). Everything but the index ranges is checked
before the launch; the ranges live on the device and the caller checks them on the host (the verify step's
load_blocks does), so that a CUDA graph can hold the op.
"""

from __future__ import annotations

import torch

from futx.ops import checks
from futx.ops.decode_attention import mirror_only_cache
from futx.ops.mirror_rows import check_inputs as check_cache
from futx.ops.registration import futx_op
from futx.runtime import get_kernel
from futx.runtime.catalog.engine import qkv_rows_key


def check_inputs(cache_format, qkv, rope, positions, row_slot, row_pos, k_cache, v_cache, k_mirror, k_scale,
                 v_mirror, v_scale) -> None:
    check_cache(cache_format, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale, row_slot, row_pos,
                mirror_only_cache(k_cache, k_scale))
    for name, t in (("qkv", qkv), ("rope", rope), ("positions", positions)):
        checks.cuda(name, t, k_cache.device)
    checks.dtype("qkv", qkv, torch.bfloat16)
    checks.dtype("rope", rope, torch.float32)
    checks.dtype("positions", positions, torch.int32)
    hkv, d = k_cache.shape[1], k_cache.shape[3]
    if qkv.dim() != 3 or qkv.shape[0] != row_slot.shape[0] or qkv.shape[2] != d or qkv.shape[1] <= 2 * hkv:
        raise ValueError(f"qkv must be [rows {row_slot.shape[0]}, Hq + 2 Hkv (Hkv = {hkv}), D = {d}], got "
                         f"{list(qkv.shape)}")
    if rope.dim() != 2 or rope.shape[1] != d:
        raise ValueError(f"rope must be float32 [positions, D = {d}] (cos | sin), got {list(rope.shape)}")
    checks.shape("positions", positions, tuple(row_slot.shape))
    for name, t in (("qkv", qkv), ("rope", rope), ("positions", positions)):
        checks.contiguous(name, t)
        checks.aligned(name, t)


@futx_op("qkv_rows_", mutates_args=("k_cache", "v_cache", "k_mirror", "k_scale", "v_mirror", "v_scale"))
def qkv_rows_(cache_format: str, qkv: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor,
              row_slot: torch.Tensor, row_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              k_mirror: torch.Tensor, k_scale: torch.Tensor, v_mirror: torch.Tensor, v_scale: torch.Tensor) -> None:
    """See the module docstring."""
    check_inputs(cache_format, qkv, rope, positions, row_slot, row_pos, k_cache, v_cache, k_mirror, k_scale,
                 v_mirror, v_scale)
    if row_slot.shape[0] == 0:
        return
    u8 = (lambda t: t.view(torch.uint8)) if cache_format == "e4m3" else (lambda t: t)  # noqa: E731
    get_kernel(qkv_rows_key(cache_format, k_cache.shape[3], mirror_only_cache(k_cache, k_scale)))(qkv, rope, positions, row_slot, row_pos, k_cache,
                                                              v_cache, u8(k_mirror), k_scale, u8(v_mirror), v_scale)


@qkv_rows_.register_fake
def _(cache_format, qkv, rope, positions, row_slot, row_pos, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale):
    return None


def qkv_rows(cache_format: str, qkv, rope, positions, row_slot, row_pos, k_cache, v_cache, k_mirror, k_scale,
             v_mirror, v_scale) -> None:
    torch.ops.futx.qkv_rows_(cache_format, qkv, rope, positions, row_slot, row_pos, k_cache, v_cache, k_mirror,
                             k_scale, v_mirror, v_scale)
