"""The reference KV cache in the paged layout (futx.paging): what `futx serve --backend reference` runs, so the
scheduler's pages, prefix sharing and preemption are exercised on the reference model too.

A KVCache whose storage is `layout.pages` pages (+ the scratch page) of `layout.page_size` positions and whose
`offset` goes through a block table (futx.paging's definition: position p of slot s at page table[s, p // P],
row p % P). `set_pages` gives a slot its pages, and the length already written (pages attached from a prefix
cache hold that many positions, so the next write continues there instead of being refused as a gap).
"""

from __future__ import annotations

from typing import Optional

import torch

from futx import paging
from futx.config import LlamaConfig
from futx.kvcache import KVCache


class PagedKVCache(KVCache):
    def __init__(self, config: LlamaConfig, layout: paging.PageLayout, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.layout = layout
        self.page_size = layout.page_size
        self.table = layout.new_table(torch.device(device)).long()
        super().__init__(config, layout.slots, layout.capacity, dtype=dtype, device=device)

    def _storage_shape(self) -> tuple:
        return (self.layout.storage_pages(), self.kv_heads, self.page_size, self.head_dim)

    def offset(self, slot, kv_head, position, channel):
        """Element offset into a layer's flat storage: [page][kv_head][row in page][channel]."""
        page = self.table[slot, position // self.page_size]
        return ((page * self.kv_heads + kv_head) * self.page_size + position % self.page_size) * self.head_dim \
            + channel

    def write(self, layer, slots, positions, k, v, *, spans=None) -> None:
        if positions.numel():
            paging.check_rows(self.table, slots, positions, self.page_size, self.layout.scratch_page)
        super().write(layer, slots, positions, k, v, spans=spans)

    def read_batch(self, layer: int, slots, stop: int, *, mirror: bool = False):
        """K and V [B, Hkv, stop, D] of each slot: gathered from its pages."""
        reads = [self.read(layer, int(s), stop, mirror=mirror) for s in slots]
        return torch.stack([k for k, _ in reads]), torch.stack([v for _, v in reads])

    def set_pages(self, slot: int, pages: list[int], filled: Optional[int] = None) -> None:
        """Slot `slot` owns `pages` (position order); filled: positions [0, filled) are already written (a new
        request's attached prefix; None: the slot keeps its length, it only grew)."""
        lay = self.layout
        if not 0 <= slot < lay.slots or len(pages) > lay.max_pages:
            raise ValueError(f"slot {slot} / {len(pages)} pages outside the layout ({lay.slots} slots of "
                             f"{lay.max_pages} pages)")
        if filled is not None and filled > len(pages) * self.page_size:
            raise ValueError(f"{filled} positions written but {len(pages)} pages")
        self.table[slot] = lay.scratch_page
        self.table[slot, :len(pages)] = torch.as_tensor(pages, dtype=torch.long)
        if filled is not None:
            self.lengths[:, slot] = filled

    def reset(self, slot=None) -> None:
        super().reset(slot)
        if slot is None:
            self.table[:] = self.layout.scratch_page
        else:
            self.table[slot] = self.layout.scratch_page
