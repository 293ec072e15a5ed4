"""The paged KV-cache layout: the one definition of where a (request, position) lives in a paged cache.

Every writer and reader of a paged cache (the decode attention kernel, the prefill attention kernel, the QKV
epilogue, the mirror kernel, the engine's torch glue and the emulated backend) derives its addresses from the
functions here; tests tie them together.

Storage. A paged layer is the contiguous layer of futx.ops.decode_attention.DecodeCache with the *slot* mode
reinterpreted as the *page* mode and the capacity as the page size P:

    main copy    k_cache, v_cache  [pages + 1, Hkv, P, D] bf16
    INT4 mirror  k_mirror [pages + 1, Hkv, P/8, 32, D/8] u8,  v_mirror [pages + 1, Hkv, P, D/2] u8
    E4M3 mirror  k_mirror, v_mirror [pages + 1, Hkv, P, D] e4m3
    scales       k_scale, v_scale [pages + 1, Hkv, P] f32

so a page holds P consecutive positions of one request for every KV head, in exactly the byte order a
contiguous slot holds them (fragment-order INT4 key blocks of 8 tokens never straddle a page: P % 8 == 0).
Page index `pages` is the *scratch page*: rows nobody owns (the padding rows of a CUDA-graph bucket, block-table
entries past a request's end) point at it, so they write and read only there.

Block table. int32 [slots + 1, max_pages]: entry (s, j) is the page holding positions [j P, (j + 1) P) of the
request in slot s; row `slots` is the scratch slot's, every entry the scratch page. Position p of slot s lives
at (table[s, p // P], p % P). A table row's entries past the request's pages are the scratch page, never
garbage, so a kernel that reads one entry too far stays inside the cache.

Staging pages (the INT4-only cache, `--cache-main none`). A layout with `staging` S > 0 keeps the BF16 main copy
only for requests being prefilled: page indices [0, S) are *staging* pages (main copy and mirror), index S is the
scratch page, and [S + 1, S + 1 + pages) are the cache's *mirror-only* pages (the memory: no main copy). The main
copy tensors then hold S + 1 pages, the mirror tensors S + 1 + pages. A request is prefilled on staging pages (the
prefill kernels read and write the main copy through the table as always), then its mirror rows are copied to its
own mirror-only pages and the table row points there (futx.serve.scheduler); decode attention reads the mirror only
and, on such a cache, writes no main-copy row (its `.mo` kernel). S >= max_pages, so any one request can prefill.

Page size. A multiple of 128 (the prefill attention kernel's K/V tile, so one TMA tile never straddles two
pages; the decode kernel's 16/32-token tiles and the 8-token INT4 key blocks divide it too). 128 is the default;
the choice is measured (docs/serving.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAGE_ALIGN = 128           # the prefill attention's K/V tile: pages hold whole tiles
DEFAULT_PAGE_SIZE = 128
TABLE_DTYPE = torch.int32


def check_page_size(page_size: int) -> int:
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0 \
            or page_size % PAGE_ALIGN:
        raise ValueError(f"page size must be a positive multiple of {PAGE_ALIGN} tokens, got {page_size!r}")
    return page_size


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` positions."""
    if tokens < 0:
        raise ValueError(f"negative token count {tokens}")
    return -(-tokens // page_size)


@dataclass(frozen=True)
class PageLayout:
    """pages usable pages of page_size positions (+ the scratch page), block tables of max_pages entries for
    slots request slots (+ the scratch slot)."""

    page_size: int
    pages: int
    slots: int
    max_pages: int
    staging: int = 0     # > 0: the INT4-only cache's staging pages (module docstring); 0: every page has its main copy

    def __post_init__(self):
        check_page_size(self.page_size)
        for name in ("pages", "slots", "max_pages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"PageLayout.{name} must be a positive integer, got {v!r}")
        if not isinstance(self.staging, int) or isinstance(self.staging, bool) or self.staging < 0:
            raise ValueError(f"PageLayout.staging must be a non-negative integer, got {self.staging!r}")
        if 0 < self.staging < self.max_pages:
            raise ValueError(f"{self.staging} staging pages cannot prefill one request of {self.max_pages} pages "
                             f"({self.capacity} positions): give at least {self.max_pages}")

    @classmethod
    def for_capacity(cls, page_size: int, pages: int, slots: int, capacity: int, staging: int = 0) -> "PageLayout":
        """A layout whose requests may grow to `capacity` positions."""
        return cls(page_size, pages, slots, pages_for(capacity, check_page_size(page_size)), staging)

    @property
    def scratch_page(self) -> int:
        return self.staging if self.staging else self.pages

    @property
    def first_page(self) -> int:
        """Index of the first of the cache's `pages` pages (after the staging pages and the scratch page)."""
        return self.staging + 1 if self.staging else 0

    def page_ids(self) -> range:
        """The indices of the cache's pages (what futx.engine.pages.PagePool hands out)."""
        return range(self.first_page, self.first_page + self.pages)

    def staging_ids(self) -> range:
        return range(self.staging)

    def main_pages(self) -> int:
        """The main copy tensors' page extent: every page (+ scratch), or the staging pages (+ scratch)."""
        return self.staging + 1 if self.staging else self.pages + 1

    @property
    def scratch_slot(self) -> int:
        return self.slots

    @property
    def capacity(self) -> int:
        """Positions one request can address (its table row's span)."""
        return self.max_pages * self.page_size

    def storage_pages(self) -> int:
        """The page mode's extent in the mirror tensors (the usable pages, the scratch page and any staging pages);
        the main copy's is main_pages()."""
        return self.pages + 1 + self.staging

    def new_table(self, device=None) -> torch.Tensor:
        """A block table with every entry the scratch page."""
        return torch.full((self.slots + 1, self.max_pages), self.scratch_page, dtype=TABLE_DTYPE, device=device)


def locate(table: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, page_size: int):
    """(pages, offsets) of positions[m] of slots[m]: the (page, in-page row) the paged cache stores them at.
    Device tensors in, device tensors out, no host synchronization (CUDA-graph capturable); the caller checked
    the ranges (positions within the table row's span, slots within the table)."""
    pos = positions.long()
    pages = table[slots.long(), torch.div(pos, page_size, rounding_mode="floor")]
    return pages.to(torch.int32), (pos % page_size).to(torch.int32)


def check_rows(table: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, page_size: int,
               scratch_page: int) -> None:
    """Host-side checks of rows about to be written (reads the indices back): every position inside its slot's
    table row, and (except for the scratch slot) on a page the request owns, never the scratch page."""
    if positions.numel() == 0:
        return
    lo, hi = int(positions.min()), int(positions.max())
    span = table.shape[1] * page_size
    if lo < 0 or hi >= span:
        raise ValueError(f"KV cache overflow: positions span [{lo}, {hi}] but a request holds at most {span} "
                         f"positions ({table.shape[1]} pages of {page_size})")
    if int(slots.min()) < 0 or int(slots.max()) >= table.shape[0]:
        raise ValueError(f"cache slot out of range [0, {table.shape[0] - 1}]")
    pages, _ = locate(table, slots.to(table.device), positions.to(table.device), page_size)
    owned = slots.to(table.device).long() != table.shape[0] - 1
    if bool(((pages == scratch_page) & owned).any()):
        bad = int(torch.nonzero((pages == scratch_page) & owned)[0, 0])
        raise ValueError(f"row {bad}: position {int(positions[bad])} of slot {int(slots[bad])} has no page "
                         f"(allocate its pages before writing)")
