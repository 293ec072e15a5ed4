"""Test helpers for the paged KV cache (futx.paging): the same contents in a contiguous DecodeCache and in a paged
one at randomly permuted pages, the contiguous view gathered back through a block table, and the engine's paged
EngineCache (futx.engine.cache, `layout` set) built on a given table, empty or holding a contiguous cache's
contents."""

from __future__ import annotations

import torch

from futx import paging
from futx.ops.decode_attention import DecodeCache

NAMES = ("k_cache", "v_cache", "k_mirror", "k_scale", "v_mirror", "v_scale")


def tensors(cache: DecodeCache) -> dict:
    """name -> tensor as bytes-or-values (E4M3 mirrors viewed as uint8, so equality is bitwise)."""
    out = {}
    for name in NAMES:
        t = getattr(cache, name)
        if t is not None:
            out[name] = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN poison included, which torch.equal calls unequal)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def randomize(cache: DecodeCache, gen: torch.Generator) -> None:
    """Random contents in every tensor: bf16 normal, mirror bytes uniform (no E4M3 NaN codes), scales positive.
    `gen` lives on the cache's device (a CUDA generator fills a GPU cache without a host round trip)."""
    for t in tensors(cache).values():
        kw = dict(generator=gen, device=gen.device)
        if t.dtype == torch.uint8:
            r = torch.randint(0, 256, t.shape, dtype=torch.uint8, **kw)
            t.copy_(torch.where(r & 0x7F == 0x7F, r ^ 1, r))
        elif t.dtype == torch.float32:
            t.copy_(torch.rand(t.shape, **kw) * 0.1 + 0.01)
        else:
            t.copy_(torch.randn(t.shape, **kw).to(t.dtype))


def poison(cache: DecodeCache, page: int) -> None:
    """Values no real row holds on one page (NaN main copy and scales, 0xFF mirror bytes): a kernel reading them
    shows NaN, a write shows as changed bytes."""
    for t in tensors(cache).values():
        t[page] = 0xFF if t.dtype == torch.uint8 else float("nan")


def random_table(layout: paging.PageLayout, gen: torch.Generator, used: int | None = None) -> torch.Tensor:
    """A block table whose slots own `used` (default: all max_pages) pages each, at a random permutation of the
    usable pages; the rest of each row and the scratch slot's row are the scratch page (CPU; `gen` a CPU one)."""
    used = layout.max_pages if used is None else used
    if layout.slots * used > layout.pages:
        raise ValueError(f"{layout.slots} slots x {used} pages do not fit {layout.pages} pages")
    table = layout.new_table()
    perm = torch.randperm(layout.pages, generator=gen)[:layout.slots * used].to(paging.TABLE_DTYPE)
    table[:layout.slots, :used] = perm.view(layout.slots, used)
    return table


def page_extent(t: torch.Tensor, page_size: int) -> int:
    """Entries of mode 2 (positions) one page holds: P, or P/8 for the INT4 key mirror [S, Hkv, C/8, 32, D/8] of
    8-token blocks (the only 5-D tensor)."""
    return page_size // 8 if t.dim() == 5 else page_size


def to_paged(cache: DecodeCache, layout: paging.PageLayout, table: torch.Tensor) -> DecodeCache:
    """The contiguous cache's slots [0, layout.slots) in a new paged cache through `table` (positions past a
    slot's owned pages are dropped); unowned pages and the scratch page are poisoned."""
    hkv, d = cache.k_cache.shape[1], cache.k_cache.shape[3]
    p = layout.page_size
    paged = DecodeCache.allocate(cache.fmt, layout.storage_pages(), hkv, p, d, cache.k_cache.device)
    src, dst = tensors(cache), tensors(paged)
    owned = set(table[:layout.slots].flatten().tolist()) - {layout.scratch_page}
    for page in set(range(layout.storage_pages())) - owned:
        poison(paged, page)
    for name, t in src.items():
        e = page_extent(t, p)
        for s in range(layout.slots):
            for j in range(layout.max_pages):
                page = int(table[s, j])
                if page != layout.scratch_page and (j + 1) * e <= t.shape[2]:
                    dst[name][page] = t[s, :, j * e:(j + 1) * e]
    return paged


def gather(paged: DecodeCache, table: torch.Tensor, page_size: int) -> dict:
    """The contiguous view of a paged cache: name -> [table rows, Hkv, max_pages * extent, ...], slot s's
    positions in order (entry j of its table row supplies positions [j P, (j + 1) P))."""
    out = {}
    for name, t in tensors(paged).items():
        rows = t[table.long()]                      # [slots + 1, max_pages, Hkv, extent, ...]
        out[name] = rows.transpose(1, 2).flatten(2, 3)
    return out


def engine_cache(config, fmt: str, layout: paging.PageLayout, table: torch.Tensor, device="cuda",
                 keep_values: bool = False):
    """The engine's paged EngineCache (futx.engine.cache: `layout` set, page-mode layers) for `layout`, its block
    table filled from `table` through EngineCache.set_pages (each slot's entries up to its first scratch entry)."""
    from futx.engine.cache import EngineCache

    cache = EngineCache(config, fmt, layout.slots, layout.capacity, device, keep_values=keep_values, layout=layout)
    for s, row in enumerate(table[:layout.slots].tolist()):
        owned = row.index(layout.scratch_page) if layout.scratch_page in row else len(row)
        cache.set_pages(s, row[:owned])
    if not torch.equal(cache.table.cpu(), table.cpu()):
        raise ValueError("the table's rows must own a prefix of their entries (scratch page after)")
    return cache


def engine_cache_from(cache, layout: paging.PageLayout, table: torch.Tensor):
    """A paged EngineCache (engine_cache) holding a contiguous EngineCache's request slots at the table's pages
    (to_paged per layer: unowned pages and the scratch page poisoned)."""
    out = engine_cache(cache.config, cache.fmt, layout, table, cache.device)
    for c, lc in zip(cache.layers, out.layers):
        src = tensors(to_paged(c, layout, out.table))
        for name, t in tensors(lc).items():
            t.copy_(src[name])
    return out
