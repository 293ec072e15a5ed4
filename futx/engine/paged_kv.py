"""A request's rows of a paged KV-cache layer in torch (futx.paging): what the prefill glue reads and rewrites.

A paged EngineCache carries `layout` (futx.paging.PageLayout) and `table` (device int32 [slots + 1, max_pages]);
its layers are futx.ops.decode_attention.DecodeCache tensors in page mode ([pages + 1, Hkv, P, ...]). Every
address here comes from futx.paging.locate.

  * `gather`: positions [0, n) of one slot as [Hkv, n, ...] (the torch attention's K/V of a request);
  * `dequantize_pages`: the values the decode mirror holds for positions [0, n) of a slot (dequantized, the
    Hadamard rotation undone: what decode attention reads, as EngineCache.read computes them) written as BF16
    into the main-copy pages, so that a later prefill chunk can attend to earlier chunks through the mirror when
    the main copy was dropped (the INT4-only cache mode). Torch ops on device index tensors, no host
    synchronization: CUDA-graph capturable for a fixed (slot, n) with an E4M3 mirror; with INT4 not yet: the key
    unpacking (futx.quant.layouts.unpack_int4_keys) copies its small index table to the device per call, which a
    capture refuses (keeping that table on the device is a one-line change in layouts.py, left out because that
    file fingerprints every decode and engine kernel: it would stale all their AOT artifacts).
"""

from __future__ import annotations

from typing import Optional

import torch

from futx.ops.decode_attention import DecodeCache
from futx.paging import PageLayout, locate
from futx.quant import hadamard, layouts
from futx.quant.kv_mirror import dequantize_rows


def cache_layout(cache) -> Optional[PageLayout]:
    """The PageLayout of a paged EngineCache, None for a contiguous one."""
    return getattr(cache, "layout", None)


def slot_rows(table: torch.Tensor, slot: int, n: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages, offsets) int32 [n] of positions [0, n) of `slot` (device tensors, no host sync)."""
    pos = torch.arange(n, device=table.device, dtype=torch.int32)
    return locate(table, torch.full_like(pos, slot), pos, page_size)


def check_span(layout: PageLayout, slot: int, n: int) -> None:
    if not 0 <= slot <= layout.slots:
        raise ValueError(f"slot {slot} out of range [0, {layout.slots}] (the scratch slot included)")
    if not 0 <= n <= layout.capacity:
        raise ValueError(f"{n} positions do not fit a slot's {layout.max_pages} pages of {layout.page_size}")


def gather(x: torch.Tensor, table: torch.Tensor, slot: int, n: int, page_size: int) -> torch.Tensor:
    """Positions [0, n) of `slot` of a page-mode tensor x [pages + 1, Hkv, P, ...] as [Hkv, n, ...]."""
    pages, offs = slot_rows(table, slot, n, page_size)
    return x[pages.long(), :, offs.long()].transpose(0, 1)


def _mirror_values(layer: DecodeCache, pages: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) float32 [n, Hkv, D]: what decode attention reads at rows (pages[i], offs[i])."""
    if layer.fmt == "e4m3":   # rows gathered as bytes (index kernels need not cover float8)
        rows = lambda t: t.view(torch.uint8)[pages, :, offs].view(torch.float8_e4m3fn)  # noqa: E731
        return (dequantize_rows(rows(layer.k_mirror), layer.k_scale[pages, :, offs]),
                dequantize_rows(rows(layer.v_mirror), layer.v_scale[pages, :, offs]))
    # INT4: a key row is one token of its 8-token fragment-order block; unpack the block, keep the token
    blocks = layer.k_mirror[pages, :, offs // 8].unsqueeze(2)                 # [n, Hkv, 1, 32, D/8]
    keys = layouts.unpack_int4_keys(blocks)                                   # [n, Hkv, 8, D]
    kq = keys.gather(2, (offs % 8).view(-1, 1, 1, 1).expand(-1, keys.shape[1], 1, keys.shape[3])).squeeze(2)
    vq = layouts.unpack_int4_values(layer.v_mirror[pages, :, offs])
    k = dequantize_rows(kq, layer.k_scale[pages, :, offs])
    v = dequantize_rows(vq, layer.v_scale[pages, :, offs])
    return hadamard.unrotate(k), hadamard.unrotate(v)


def dequantize_pages(layer: DecodeCache, table: torch.Tensor, page_size: int, slot: int, n: int) -> None:
    """Main copy <- the mirror's values (module docstring) at positions [0, n) of `slot` of one paged layer;
    rows past n (the chunk about to be written) are left alone. A BF16 cache has no mirror: nothing to do."""
    if layer.fmt == "bf16" or n == 0:
        return
    pages, offs = (t.long() for t in slot_rows(table, slot, n, page_size))
    k, v = _mirror_values(layer, pages, offs)
    layer.k_cache[pages, :, offs] = k.to(torch.bfloat16)
    layer.v_cache[pages, :, offs] = v.to(torch.bfloat16)


def dequantize_slot(cache, slot: int, n: int) -> None:
    """`dequantize_pages` on every layer of a paged EngineCache (checked: slot and n within its layout)."""
    layout = cache_layout(cache)
    if layout is None:
        raise ValueError("dequantize_slot needs a paged EngineCache (layout and table set)")
    check_span(layout, slot, n)
    for layer in cache.layers:
        dequantize_pages(layer, cache.table, layout.page_size, slot, n)


__all__ = ["cache_layout", "check_span", "dequantize_pages", "dequantize_slot", "gather", "slot_rows"]
