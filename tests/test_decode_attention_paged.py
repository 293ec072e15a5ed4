"""Decode attention over a paged cache, on the CPU: the plan's paged mode, the torch reference of paged reads
(the contiguous view gathered through the block table, and single positions found by futx.paging.locate) equal to
the contiguous layout on random data and random page permutations, the ops' argument checks (before any launch),
and KernelOps' translation of prewritten rows. The sm_90a compile / SASS check of the paged registry entries is
tests/test_kernel_compile.py (they ship: decode.attn.*.p128, decode.attn.int4.d128.rot*.p256); the kernel on the
GPU is tests/test_decode_attention_paged_gpu.py."""

from __future__ import annotations

import math

import pytest
import torch

from decode.attn_plan import AttnPlan, default_plan, entry_tensors
from futx import paging
from futx.ops.decode_attention import DecodeCache, check_block_table, check_paged_rows, resolve

import paged_cache as pc

FORMATS = ("int4", "e4m3", "bf16")


def test_plan_page_size():
    plan = default_plan("int4", 128, True, page_size=256)
    assert plan.paged and plan.tiles_per_page == 256 // plan.tile_tokens
    assert plan.tensors == entry_tensors("int4", False, True)
    assert plan.tensors[:6] == ("q", "k_new", "v_new", "positions", "slots", "block_table")
    assert "block_table" not in default_plan("int4", 128, True).tensors  # contiguous: unchanged entry
    assert not default_plan("bf16", 64).paged
    for fmt in FORMATS:  # every default tile divides every page size: a tile never straddles two pages
        for d in (64, 128):
            assert 128 % default_plan(fmt, d).tile_tokens == 0
    for bad in (64, 100, -128):
        with pytest.raises(ValueError, match="multiple of 128"):
            AttnPlan("int4", 128, page_size=bad)
    with pytest.raises(ValueError, match="no paged-cache kernel"):
        resolve("int4", 128, True, "table", 128)
    assert resolve("e4m3", 64, False, "", 128)[1].page_size == 128


def _setup(fmt, d=64, hkv=2, slots=3, page_size=128, max_pages=3, spare=2, seed=0):
    """A random contiguous cache of `slots` slots holding max_pages * P positions, and the same contents in a paged
    cache at a random permutation of slots * max_pages + spare pages."""
    gen = torch.Generator().manual_seed(seed)
    lay = paging.PageLayout(page_size, pages=slots * max_pages + spare, slots=slots, max_pages=max_pages)
    contig = DecodeCache.allocate(fmt, slots, hkv, lay.capacity, d, "cpu")
    pc.randomize(contig, gen)
    table = pc.random_table(lay, gen)
    return lay, contig, table, pc.to_paged(contig, lay, table)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("page_size", [128, 256])
def test_gathered_view_is_the_contiguous_cache(fmt, page_size):
    """Gathering every tensor through the table gives back the contiguous slots bit for bit (the scratch slot's
    row gathers the poisoned scratch page); positions found one by one with futx.paging.locate hold the same
    elements (the INT4 key mirror by 8-token block: P % 8 == 0, so blocks never straddle pages)."""
    lay, contig, table, paged = _setup(fmt, page_size=page_size, seed=page_size)
    view, want = pc.gather(paged, table, page_size), pc.tensors(contig)
    for name, t in want.items():
        assert torch.equal(view[name][:lay.slots], t), name
        g = view[name][lay.scratch_slot]
        assert bool(torch.isnan(g).all()) if g.is_floating_point() else bool((g == 0xFF).all()), name
    gen = torch.Generator().manual_seed(1)
    slots = torch.randint(0, lay.slots, (200,), generator=gen)
    pos = torch.randint(0, lay.capacity, (200,), generator=gen)
    pages, rows = paging.locate(table, slots, pos, page_size)
    p, r, s, q = pages.long(), rows.long(), slots.long(), pos.long()
    got, ref = pc.tensors(paged), want
    for name in ("k_cache", "v_cache", "k_scale", "v_scale", "v_mirror"):
        if name in ref:
            assert torch.equal(got[name][p, :, r], ref[name][s, :, q]), name
    if fmt == "int4":
        assert torch.equal(got["k_mirror"][p, :, r // 8], ref["k_mirror"][s, :, q // 8])
    elif fmt == "e4m3":
        assert torch.equal(got["k_mirror"][p, :, r], ref["k_mirror"][s, :, q])


def _attention(q, read_kv, contexts, d):
    """float64 GQA attention of q [B, Hq, D] over read_kv(i, ctx) -> (k, v) [Hkv, ctx, D] of sequence i."""
    out = []
    for i, ctx in enumerate(contexts):
        k, v = read_kv(i, ctx)
        g = q.shape[1] // k.shape[0]
        k, v = k.double().repeat_interleave(g, 0), v.double().repeat_interleave(g, 0)
        s = torch.einsum("hd,htd->ht", q[i].double(), k) / math.sqrt(d)
        out.append(torch.einsum("ht,htd->hd", s.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("page_size", [128, 256])
def test_paged_reference_reads_equal_the_contiguous_layout(page_size):
    """Attention over the BF16 main copy read position by position through the table (futx.paging.locate) is the
    contiguous cache's, for contexts on both sides of page edges, several random permutations."""
    d, hq, hkv = 64, 8, 2
    contexts = [1, page_size - 1, page_size, page_size + 1, 2 * page_size + 5, 3 * page_size]
    for seed in range(3):
        lay, contig, table, paged = _setup("bf16", d=d, hkv=hkv, slots=len(contexts), page_size=page_size, seed=seed)
        q = torch.randn(len(contexts), hq, d, generator=torch.Generator().manual_seed(seed))

        def contiguous(i, ctx):
            return contig.k_cache[i, :, :ctx], contig.v_cache[i, :, :ctx]

        def through_table(i, ctx):
            pos = torch.arange(ctx)
            pages, rows = paging.locate(table, torch.full_like(pos, i), pos, page_size)
            k = paged.k_cache[pages.long(), :, rows.long()]       # [ctx, Hkv, D]
            v = paged.v_cache[pages.long(), :, rows.long()]
            return k.transpose(0, 1), v.transpose(0, 1)

        ref = _attention(q, contiguous, contexts, d)
        got = _attention(q, through_table, contexts, d)
        assert not got.isnan().any(), "a read reached an unowned (poisoned) page"
        assert torch.equal(got, ref)


# ---- the ops' checks: everything below raises before a launch -------------------------------------------------
def test_block_table_checks():
    lay, contig, table, paged = _setup("int4", page_size=128)
    k = paged.k_cache
    with pytest.raises(ValueError, match="multiple of 128"):
        check_block_table("op", table, 100, k)
    with pytest.raises(ValueError, match="multiple of 128"):
        check_block_table("op", table, 0, k)
    with pytest.raises(ValueError, match="without a block_table"):
        check_block_table("op", None, 128, k)
    check_block_table("op", None, 0, k)  # contiguous
    with pytest.raises(TypeError, match="block_table must be a torch.Tensor"):
        check_block_table("op", table.tolist(), 128, k)
    with pytest.raises(TypeError, match="dtype int32"):
        check_block_table("op", table.long(), 128, k)
    with pytest.raises(ValueError, match=r"\[slots \+ 1, max_pages\]"):
        check_block_table("op", table.flatten(), 128, k)
    with pytest.raises(ValueError, match=r"\[slots \+ 1, max_pages\]"):
        check_block_table("op", table[:, :0], 128, k)
    with pytest.raises(ValueError, match="contiguous"):
        check_block_table("op", table.t(), 128, k)
    with pytest.raises(ValueError, match="positions per page"):
        check_block_table("op", table, 256, k)  # the cache tensors hold 128-position pages
    with pytest.raises(ValueError, match="CUDA device"):  # all else right: only the device is left
        check_block_table("op", table, 128, k)


def test_paged_row_checks():
    lay, contig, table, paged = _setup("int4", page_size=128, slots=3, max_pages=3)
    n = lay.storage_pages()
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    check_paged_rows(i32(0, 383, 200), i32(0, 1, 2), table, 128, n)
    with pytest.raises(ValueError, match="overflow"):  # past max_pages * P
        check_paged_rows(i32(0, 384), i32(0, 1), table, 128, n)
    with pytest.raises(ValueError, match="negative position"):
        check_paged_rows(i32(-1), i32(0), table, 128, n)
    with pytest.raises(ValueError, match="slot out of range"):
        check_paged_rows(i32(5), i32(4), table, 128, n)
    with pytest.raises(ValueError, match="share a cache slot"):
        check_paged_rows(i32(5, 6), i32(1, 1), table, 128, n)
    bad = table.clone()
    bad[1, 2] = n  # not a page of the cache
    with pytest.raises(ValueError, match="outside the cache"):
        check_paged_rows(i32(5), i32(1), bad, 128, n)
    bad = table.clone()
    bad[1, 1] = lay.scratch_page  # a real row onto the scratch page
    with pytest.raises(ValueError, match="has no page"):
        check_paged_rows(i32(130), i32(1), bad, 128, n)
    check_paged_rows(i32(130), i32(lay.scratch_slot), bad, 128, n)  # the scratch slot writes only the scratch page
    bad = table.clone()
    bad[2, 0] = bad[1, 0]  # two requests on one page, writing one page row
    with pytest.raises(ValueError, match="same page row"):
        check_paged_rows(i32(7, 7), i32(1, 2), bad, 128, n)


# ---- KernelOps on a paged engine cache ----------------------------------------------------------------------
def _config(hkv=2, d=64, hq=4):
    from futx.config import LlamaConfig

    return LlamaConfig(hidden_size=hq * d, intermediate_size=128, num_attention_heads=hq, num_key_value_heads=hkv,
                       head_dim=d, num_hidden_layers=1, vocab_size=256)


def test_cache_paging_of_engine_caches():
    from types import SimpleNamespace

    from futx.engine.backends import cache_paging

    from futx.engine.cache import EngineCache

    assert cache_paging(SimpleNamespace()) == (None, 0)               # an object without a layout
    assert cache_paging(EngineCache(_config(), "bf16", 2, 512, "cpu")) == (None, 0)   # contiguous: layout None
    lay = paging.PageLayout(256, pages=4, slots=2, max_pages=2)
    cache = EngineCache(_config(), "bf16", 2, lay.capacity, "cpu", layout=lay)
    table, p = cache_paging(cache)
    assert table is cache.table and p == 256


def test_prewrite_rows_land_on_their_pages():
    """KernelOps.prewrite_rows (the verify step's block rows) on a paged BF16 cache writes exactly the bytes it
    writes on a contiguous one, at the table's (page, in-page row) of each (slot, position); no other page
    changes (the BF16 format has no mirror, so this runs in torch on the CPU; the mirror kernel's paged rows are
    tests/test_decode_attention_paged_gpu.py)."""
    from futx.engine.backends import KernelOps, rope_table
    from futx.engine.cache import EngineCache

    cfg = _config()
    lay = paging.PageLayout(128, pages=9, slots=2, max_pages=3)
    gen = torch.Generator().manual_seed(3)
    table = pc.random_table(lay, gen)
    contig = EngineCache(cfg, "bf16", slots=2, capacity=lay.capacity, device="cpu")
    paged = pc.engine_cache(cfg, "bf16", lay, table, device="cpu")
    before = {n: t.clone() for n, t in pc.tensors(paged.layers[0]).items()}
    rope = rope_table(cfg, lay.capacity, "cpu")
    slots = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.int32)
    positions = torch.tensor([126, 127, 128, 0, 1, 383], dtype=torch.int32)
    qkv = torch.randn(6, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim,
                      generator=gen).bfloat16()
    for cache in (contig, paged):
        KernelOps.prewrite_rows(qkv, positions, slots, cache, 0, rope)
    view = pc.gather(paged.layers[0], table, 128)
    for name, t in pc.tensors(contig.layers[0]).items():
        assert torch.equal(view[name][:2], t[:2]), name
    pages, rows = paging.locate(table, slots, positions, 128)
    written = set(pages.tolist())
    for name, t in pc.tensors(paged.layers[0]).items():
        for page in set(range(lay.storage_pages())) - written:
            assert pc.same_bits(t[page], before[name][page]), f"{name}: page {page} changed"


def test_benchmark_pages_hold_the_contiguous_contents():
    """scripts/bench_paged_attention.py's paged copies (vectorized, its own code) gather back to the contiguous
    cache: the precondition of its bit-equality check and of comparing like with like."""
    import importlib.util
    from pathlib import Path

    from futx.ops import decode_attention as da

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_paged_attention.py"
    spec = importlib.util.spec_from_file_location("bench_paged_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    contig = DecodeCache.allocate("int4", 3, bench.HKV, 512, bench.D, "cpu")
    pc.randomize(contig, torch.Generator().manual_seed(9))
    for p in (128, 256):
        paged, table = bench._paged_copy(da, contig, 3, p, torch.Generator().manual_seed(p))
        assert sorted(table[:3].flatten().tolist()) == list(range(3 * 512 // p))
        view = pc.gather(paged, table, p)
        for name, t in pc.tensors(contig).items():
            assert torch.equal(view[name][:3], t), name
