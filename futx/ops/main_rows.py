"""`futx::main_rows_` — BF16 main-copy rows read back from a cache's decode mirror (the INT4-only cache's stage).

    futx.ops.main_rows.main_rows(cache_format, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale,
                                 src_slot, src_pos, dst_slot, dst_pos)

k_cache, v_cache [S, Hkv, C, D] bfloat16 and the mirror tensors in futx.ops.decode_attention's layout (cache_format
"int4": Hadamard-rotated INT4 in fragment order; "e4m3"), the mirror possibly holding more slots (pages) than the
main copy (the INT4-only cache); src_* / dst_* int32 [M]: main-copy row (dst_slot[m], dst_pos[m]) gets mirror row
(src_slot[m], src_pos[m]) as decode attention reads it: dequantized, the rotation undone, rounded to BF16 (the
inverse of futx::mirror_rows_). Everything is validated before the launch except the index ranges, which live on
the device: the caller checks them (futx.engine.paged_kv.dequantize_pages_into does, from host page lists).
"""

from __future__ import annotations

import torch

from futx.ops import checks
from futx.ops.mirror_rows import check_inputs as check_cache
from futx.ops.registration import futx_op
from futx.runtime import get_kernel
from futx.runtime.catalog.engine import main_rows_key


def check_inputs(cache_format, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale, src_slot, src_pos, dst_slot,
                 dst_pos) -> None:
    check_cache(cache_format, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale, src_slot, src_pos,
                mirror_only=True)
    for name, t in (("dst_slot", dst_slot), ("dst_pos", dst_pos)):
        checks.cuda(name, t, k_cache.device)
        checks.dtype(name, t, torch.int32)
        checks.shape(name, t, tuple(src_slot.shape))
        checks.contiguous(name, t)
        checks.aligned(name, t)


@futx_op("main_rows_", mutates_args=("k_cache", "v_cache"))
def main_rows_(cache_format: str, k_cache: torch.Tensor, v_cache: torch.Tensor, k_mirror: torch.Tensor,
               k_scale: torch.Tensor, v_mirror: torch.Tensor, v_scale: torch.Tensor, src_slot: torch.Tensor,
               src_pos: torch.Tensor, dst_slot: torch.Tensor, dst_pos: torch.Tensor) -> None:
    """See the module docstring."""
    check_inputs(cache_format, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale, src_slot, src_pos, dst_slot,
                 dst_pos)
    if src_slot.shape[0] == 0:
        return
    u8 = (lambda t: t.view(torch.uint8)) if cache_format == "e4m3" else (lambda t: t)  # noqa: E731
    get_kernel(main_rows_key(cache_format, k_cache.shape[3]))(k_cache, v_cache, u8(k_mirror), k_scale, u8(v_mirror),
                                                              v_scale, src_slot, src_pos, dst_slot, dst_pos)


@main_rows_.register_fake
def _(cache_format, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale, src_slot, src_pos, dst_slot, dst_pos):
    return None


def main_rows(cache_format: str, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale, src_slot, src_pos,
              dst_slot, dst_pos) -> None:
    torch.ops.futx.main_rows_(cache_format, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale, src_slot,
                              src_pos, dst_slot, dst_pos)
