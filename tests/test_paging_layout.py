"""futx.paging: the paged cache's addressing (CPU)."""

import pytest
import torch

from futx import paging


def test_page_size_must_hold_whole_prefill_tiles():
    assert paging.check_page_size(128) == 128
    assert paging.check_page_size(256) == 256
    for bad in (0, 64, 100, -128, 128.0, True):
        with pytest.raises(ValueError):
            paging.check_page_size(bad)


def test_layout_extents_and_scratch():
    lay = paging.PageLayout.for_capacity(128, pages=10, slots=3, capacity=300)
    assert lay.max_pages == 3 and lay.capacity == 384
    assert lay.scratch_page == 10 and lay.storage_pages() == 11 and lay.scratch_slot == 3
    t = lay.new_table()
    assert t.shape == (4, 3) and t.dtype == torch.int32 and bool((t == 10).all())
    assert paging.pages_for(0, 128) == 0 and paging.pages_for(1, 128) == 1 and paging.pages_for(129, 128) == 2


def test_locate_matches_the_definition_on_random_tables():
    gen = torch.Generator().manual_seed(0)
    lay = paging.PageLayout(256, pages=40, slots=5, max_pages=4)
    table = lay.new_table()
    perm = torch.randperm(40, generator=gen)[:20].to(torch.int32)
    table[:5] = perm.view(5, 4)
    slots = torch.randint(0, 5, (97,), generator=gen)
    pos = torch.randint(0, lay.capacity, (97,), generator=gen)
    pages, off = paging.locate(table, slots, pos, 256)
    for m in range(97):
        assert int(pages[m]) == int(table[slots[m], pos[m] // 256]) and int(off[m]) == int(pos[m]) % 256
    # a page holds each (page, offset) once: the mapping is injective over distinct (slot, position)
    keys = {(int(s), int(p)) for s, p in zip(slots, pos)}
    flat = {(int(a), int(b)) for a, b in zip(pages, off)}
    assert len(keys) == len(flat)


def test_check_rows_refuses_overflow_and_unowned_pages():
    lay = paging.PageLayout(128, pages=8, slots=2, max_pages=2)
    table = lay.new_table()
    table[0, 0] = 3
    paging.check_rows(table, torch.tensor([0, 2]), torch.tensor([5, 200]), 128, lay.scratch_page)  # scratch ok
    with pytest.raises(ValueError, match="no page"):
        paging.check_rows(table, torch.tensor([0]), torch.tensor([130]), 128, lay.scratch_page)
    with pytest.raises(ValueError, match="overflow"):
        paging.check_rows(table, torch.tensor([0]), torch.tensor([256]), 128, lay.scratch_page)
    with pytest.raises(ValueError, match="slot"):
        paging.check_rows(table, torch.tensor([3]), torch.tensor([0]), 128, lay.scratch_page)
