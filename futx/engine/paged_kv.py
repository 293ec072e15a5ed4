"""A request's rows of a paged KV-cache layer in torch (futx.paging): what the prefill glue reads and rewrites.

A paged EngineCache carries `layout` (futx.paging.PageLayout) and `table` (device int32 [slots + 1, max_pages]);
its layers are futx.ops.decode_attention.DecodeCache tensors in page mode ([pages + 1, Hkv, P, ...]). Every
address here comes from futx.paging.locate.

  * `gather`: positions [0, n) of one slot as [Hkv, n, ...] (the torch attention's K/V of a request);
  * `dequantize_pages`: the values the decode mirror holds for positions [0, n) of a slot (dequantized, the
    Hadamard rotation undone: what decode attention reads, as EngineCache.read computes them) written as BF16
    into the main-copy pages, so that a later prefill chunk can attend to earlier chunks through the mirror when
    the main copy was dropped (the INT4-only cache mode); `dequantize_pages_into` reads one page list and writes
    another (a cached prefix's mirror-only pages into staging pages). Torch ops on device index tensors, every
    layer of a group at once, no host synchronization: CUDA-graph capturable for a fixed (slot, n) once a first
    call has put the INT4 key index on the device. On the kernels the same by one launch per layer of
    futx::main_rows_ (decode/main_rows.py, the inverse of the mirror's row writer; `kernel=True`), for the
    formats in STAGE_KERNEL_FORMATS.
"""

from __future__ import annotations

from functools import lru_cache
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


def _stacked(group: list[DecodeCache], name: str, index) -> torch.Tensor:
    """Tensor `name` of every layer in `group`, indexed by `index`, stacked on a new leading dim (E4M3 as bytes:
    index kernels need not cover float8)."""
    ts = [getattr(layer, name) for layer in group]
    if ts[0].dtype == torch.float8_e4m3fn:
        return torch.stack([t.view(torch.uint8)[index] for t in ts]).view(torch.float8_e4m3fn)
    return torch.stack([t[index] for t in ts])


@lru_cache(maxsize=None)
def _key_gather_index(head_dim: int, device: torch.device) -> torch.Tensor:
    """For each (token, channel) of an 8-token INT4 key block, the flat (lane, byte, nibble) index holding it:
    the inverse of futx.quant.layouts' key-block index, kept on the device (no copy per call: capturable)."""
    return torch.from_numpy(layouts._key_block_index(head_dim).reshape(-1).argsort()).to(device)


def int4_key_values(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 key blocks [..., T/8, 32, D/8] -> their signed nibbles as float32 [..., T, D]: what
    layouts.unpack_int4_keys gives (tests tie the two), by one gather instead of a scatter."""
    *lead, tb, lanes, nbytes = blocks.shape
    d = nbytes * 8
    nibs = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).reshape(*lead, tb, lanes * nbytes * 2)
    q = nibs.index_select(-1, _key_gather_index(d, blocks.device))
    return ((q ^ 8).float() - 8.0).reshape(*lead, tb * 8, d)   # two's-complement nibble: (x ^ 8) - 8


def _mirror_values(group: list[DecodeCache], pages: torch.Tensor, offs: torch.Tensor, n: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) float32 [G, n, Hkv, D]: what decode attention reads at positions [0, n) (rows (pages[i], offs[i]))
    of each layer of `group`. One set of ops for the whole group (a stage is ~30 launches, not ~30 per layer)."""
    rows = (pages, slice(None), offs)
    k_scale, v_scale = _stacked(group, "k_scale", rows), _stacked(group, "v_scale", rows)
    if group[0].fmt == "e4m3":
        return (dequantize_rows(_stacked(group, "k_mirror", rows), k_scale),
                dequantize_rows(_stacked(group, "v_mirror", rows), v_scale))
    # INT4 keys: 8-token fragment-order blocks; positions [0, n) start at a page's start, so block b holds
    # positions 8b..8b+7: unpack each block once and keep the first n tokens
    blocks = _stacked(group, "k_mirror", (pages[::8], slice(None), offs[::8] // 8))   # [G, n/8, Hkv, 32, D/8]
    keys = int4_key_values(blocks.unsqueeze(-3))                                        # [G, n/8, Hkv, 8, D]
    kq = keys.transpose(2, 3).flatten(1, 2)[:, :n]                                      # [G, n, Hkv, D]
    vq = layouts.unpack_int4_values(_stacked(group, "v_mirror", rows))
    return hadamard.unrotate(kq * k_scale.unsqueeze(-1)), hadamard.unrotate(dequantize_rows(vq, v_scale))


# cache formats whose stage runs futx::main_rows_ on the kernels backend: both bit for bit the torch stage on the H200
# (tests/test_main_rows_gpu.py; INT4 after an explicit mul.rn kept ptxas from fusing the scale product into the
# butterfly's first add)
STAGE_KERNEL_FORMATS = ("e4m3", "int4")

# budget for a group's float32 temporaries (k and v of each of its layers, a few of them live at once)
_GROUP_BYTES = 256 << 20


def dequantize_rows_into(layers, src: tuple[torch.Tensor, torch.Tensor], dst: tuple[torch.Tensor, torch.Tensor],
                         n: int, kernel: bool = False) -> None:
    """Main copy at rows dst = (pages, offsets) [n] <- the mirror's values (module docstring) at rows src, which
    hold positions [0, n) of a request (page-aligned: position p at src[p // P], p % P). Layers in groups whose
    temporaries stay under ~256 MB. A BF16 cache has no mirror: nothing to do.
    kernel: one launch of futx::main_rows_ per layer instead (the same values, bit for bit; CUDA tensors)."""
    layers = [layers] if isinstance(layers, DecodeCache) else list(layers)
    if not layers or layers[0].fmt == "bf16" or n == 0:
        return
    if kernel:
        from futx.ops.main_rows import main_rows

        rows = [t.to(torch.int32).contiguous() for t in (*src, *dst)]
        for layer in layers:
            main_rows(layer.fmt, layer.k_cache, layer.v_cache, layer.k_mirror, layer.k_scale, layer.v_mirror,
                      layer.v_scale, *rows)
        return
    hkv, d = layers[0].k_cache.shape[1], layers[0].k_cache.shape[-1]
    step = max(1, _GROUP_BYTES // (2 * n * hkv * d * 4 * 4))
    for g in range(0, len(layers), step):
        group = layers[g:g + step]
        k, v = _mirror_values(group, *src, n)
        for layer, kl, vl in zip(group, k.to(torch.bfloat16), v.to(torch.bfloat16)):
            layer.k_cache[dst[0], :, dst[1]] = kl
            layer.v_cache[dst[0], :, dst[1]] = vl


def dequantize_pages(layers, table: torch.Tensor, page_size: int, slot: int, n: int) -> None:
    """Main copy <- the mirror's values at positions [0, n) of `slot` of paged layers (one DecodeCache or a list);
    rows past n (the chunk about to be written) are left alone."""
    rows = tuple(t.long() for t in slot_rows(table, slot, n, page_size))
    dequantize_rows_into(layers, rows, rows, n)


def dequantize_slot(cache, slot: int, n: int) -> None:
    """`dequantize_pages` on every layer of a paged EngineCache (checked: slot and n within its layout)."""
    layout = cache_layout(cache)
    if layout is None:
        raise ValueError("dequantize_slot needs a paged EngineCache (layout and table set)")
    check_span(layout, slot, n)
    dequantize_pages(cache.layers, cache.table, layout.page_size, slot, n)


def page_rows(pages: list[int], n: int, page_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages, offsets) long [n] of positions [0, n) held by the page list `pages` (in position order)."""
    pos = torch.arange(n, device=device)
    return torch.as_tensor(pages, dtype=torch.long, device=device)[pos // page_size], pos % page_size


def dequantize_pages_into(cache, src: list[int], dst: list[int], n: int, kernel: bool = False) -> None:
    """Main copy of pages `dst` <- the mirror's values of pages `src` (positions [0, n) of a request, in position
    order; every layer of a paged EngineCache): the INT4-only cache's stage of a cached prefix, read from its
    mirror-only pages straight into the staging pages' main copy (the prefill reads nothing else there).
    kernel: by futx::main_rows_ (dequantize_rows_into)."""
    layout = cache_layout(cache)
    if layout is None:
        raise ValueError("dequantize_pages_into needs a paged EngineCache (layout and table set)")
    p = layout.page_size
    if len(src) != len(dst) or not 0 <= n <= len(src) * p:
        raise ValueError(f"dequantize_pages_into: {len(src)} source pages, {len(dst)} destinations, {n} positions")
    extent = layout.storage_pages()
    if any(not 0 <= x < extent or x == layout.scratch_page for x in src + dst):
        raise ValueError(f"dequantize_pages_into: pages must lie in [0, {extent}), the scratch page excluded")
    dev = cache.table.device
    dequantize_rows_into(cache.layers, page_rows(src, n, p, dev), page_rows(dst, n, p, dev), n, kernel)


__all__ = ["STAGE_KERNEL_FORMATS", "cache_layout", "check_span", "dequantize_pages", "dequantize_pages_into",
           "dequantize_rows_into", "dequantize_slot", "gather", "int4_key_values", "page_rows", "slot_rows"]
