"""Page bookkeeping of the paged KV cache: which pages are free, who holds each, which full pages are cached
for reuse by later requests. Host-side integers only: no tensors, no kernels (the block table on the device is
the engine's; futx.paging says where a page's positions live).

PagePool. Pages first .. first+pages-1 (futx.paging.PageLayout.page_ids; the scratch page is never handed out).
Every page is either free (refcount 0, on the free list) or held (refcount >= 1): a request that allocated it holds
one reference; a request that attached it from the prefix cache holds one more; the prefix cache itself holds one
for every page it keeps (`pin` / `unpin`, so the pool counts the cached pages nobody else holds: `idle`, in O(1)
for the scheduler's every tick). `free` drops one reference and returns the page to the free list at zero; dropping
a reference nobody holds is an error (never a silent double free).

PrefixCache. A full page of a request's prompt is named by a hash chain over the tokens before and in it:
key(j) = H(key(j - 1) || tokens[j P : (j + 1) P]), key(-1) = b"", so equal keys mean equal whole prefixes (and
the same positions: page j always holds positions [j P, (j + 1) P)). The cache maps key -> page and holds one
reference per page; requests whose prompt starts with cached pages attach them (one more reference each, read
only: a request never writes a position below its attached length) and prefill only the rest. When the pool runs
dry, `evict` frees least recently used pages that no request holds (refcount 1: the cache's own), deepest pages
first, so a cached chain is shortened from its end and its prefix stays reachable.

H is BLAKE2b with 16-byte digests over the tokens as int64 bytes: a collision (two different prefixes, one key)
would silently share the wrong K/V, so the digest is wide enough that one never happens in practice.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import numpy as np

DIGEST_BYTES = 16


class PagePool:
    def __init__(self, pages: int, first: int = 0):
        """pages: how many; first: the index of the first (a layout's first_page)."""
        if not isinstance(pages, int) or pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {pages!r}")
        if not isinstance(first, int) or first < 0:
            raise ValueError(f"a page pool's first page index must be >= 0, got {first!r}")
        self.total, self.first = pages, first
        self.refs = [0] * pages          # refs[page - first]: the references to each page
        self._free = list(range(first + pages - 1, first - 1, -1))   # pop() hands out the lowest page first
        self._pinned: set[int] = set()                 # pages the prefix cache holds a reference to
        self.idle = 0                                  # ... that nobody else holds

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        """n fresh pages, each with one reference (all or none)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise MemoryError(f"{n} pages asked, {len(self._free)} of {self.total} free")
        got = [self._free.pop() for _ in range(n)]
        for p in got:
            self.refs[p - self.first] = 1
        return got

    def share(self, page: int) -> None:
        """One more reference to a held page."""
        self._check(page)
        if self.refs[page - self.first] == 0:
            raise ValueError(f"page {page} is free: only a held page can be shared")
        if self.refs[page - self.first] == 1 and page in self._pinned:
            self.idle -= 1
        self.refs[page - self.first] += 1

    def pin(self, page: int) -> None:
        """The prefix cache's reference to a held page."""
        if page in self._pinned:
            raise ValueError(f"page {page} is pinned already")
        self.share(page)
        self._pinned.add(page)

    def unpin(self, page: int) -> None:
        """Drop the prefix cache's reference."""
        if page not in self._pinned:
            raise ValueError(f"page {page} is not pinned")
        self._pinned.discard(page)
        if self.refs[page - self.first] == 1:
            self.idle -= 1
        self.free([page])

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; a page nobody holds any more goes back to the free list."""
        for p in pages:
            self._check(p)
            if self.refs[p - self.first] == 0:
                raise ValueError(f"page {p} freed but nobody holds it (double free)")
        for p in pages:
            self.refs[p - self.first] -= 1
            if self.refs[p - self.first] == 0:
                self._free.append(p)
            elif self.refs[p - self.first] == 1 and p in self._pinned:
                self.idle += 1

    def refcount(self, page: int) -> int:
        self._check(page)
        return self.refs[page - self.first]

    def _check(self, page: int) -> None:
        if not isinstance(page, int) or not self.first <= page < self.first + self.total:
            raise ValueError(f"page {page!r} out of range [{self.first}, {self.first + self.total})")

    def check(self) -> None:
        """The invariants (tests): every page free xor held, the free list without duplicates."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        for p, r in enumerate(self.refs, self.first):
            if r < 0 or (r == 0) != (p in free):
                raise AssertionError(f"page {p}: refcount {r}, {'' if p in free else 'not '}on the free list")
        if any(self.refs[p - self.first] == 0 for p in self._pinned):
            raise AssertionError("a pinned page is free")
        if self.idle != sum(1 for p in self._pinned if self.refs[p - self.first] == 1):
            raise AssertionError(f"idle count {self.idle} is wrong")


def page_keys(tokens: Sequence[int], page_size: int, pages: int) -> list[bytes]:
    """The hash-chain keys of the first `pages` full pages of `tokens`."""
    if pages * page_size > len(tokens):
        raise ValueError(f"{len(tokens)} tokens hold {len(tokens) // page_size} full pages, not {pages}")
    arr = np.asarray(tokens[:pages * page_size], dtype=np.int64)
    keys, prev = [], b""
    for j in range(pages):
        prev = hashlib.blake2b(prev + arr[j * page_size:(j + 1) * page_size].tobytes(),
                               digest_size=DIGEST_BYTES).digest()
        keys.append(prev)
    return keys


class PrefixCache:
    """Full prompt pages keyed by their whole token prefix, over a PagePool (see the module docstring)."""

    def __init__(self, pool: PagePool, page_size: int):
        self.pool, self.page_size = pool, page_size
        self._pages: OrderedDict[bytes, int] = OrderedDict()   # key -> page, least recently used first

    def __len__(self) -> int:
        return len(self._pages)

    def idle_pages(self) -> int:
        """Cached pages no request holds: what `evict` can free."""
        return self.pool.idle

    def attach(self, tokens: Sequence[int], max_pages: int) -> list[int]:
        """The pages of the longest cached prefix of `tokens` (at most max_pages full pages), each with one more
        reference for the caller (who frees them with the rest of its pages)."""
        n = min(max_pages, len(tokens) // self.page_size)
        if n <= 0 or not self._pages:
            return []
        got = []
        for key in page_keys(tokens, self.page_size, n):
            page = self._pages.get(key)
            if page is None:
                break
            got.append((key, page))
        for key, page in reversed(got):   # the deepest page least recent: evicted before its parents
            self._pages.move_to_end(key)
            self.pool.share(page)
        return [p for _, p in got]

    def publish(self, tokens: Sequence[int], pages: Sequence[int], full_pages: int) -> int:
        """Cache the first `full_pages` pages of a request (pages[j] holds tokens[j P:(j + 1) P], all written).
        A prefix already cached under another page keeps that page. Returns the pages newly cached."""
        n = min(full_pages, len(pages), len(tokens) // self.page_size)
        added = 0
        keys = page_keys(tokens, self.page_size, n) if n > 0 else []
        for j in reversed(range(n)):
            key = keys[j]
            if key in self._pages:
                self._pages.move_to_end(key)
                continue
            self.pool.pin(pages[j])
            self._pages[key] = pages[j]
            added += 1
        return added

    def evict(self, n: int) -> int:
        """Free up to n cached pages that no request holds, least recently used first; returns how many."""
        if n <= 0:
            return 0
        idle = []
        for k, p in self._pages.items():   # least recently used first
            if len(idle) == n:
                break
            if self.pool.refcount(p) == 1:
                idle.append((k, p))
        for k, p in idle:
            del self._pages[k]
            self.pool.unpin(p)
        return len(idle)

    def clear(self) -> int:
        return self.evict(len(self._pages))
