"""The prefill path over a paged KV cache (futx.paging) on the CPU.

  * attention: the float64 reference through the block table equals the contiguous reference on random data
    with random page permutations (and garbage, NaN or Inf, in page rows past each request's end and in the pages
    nobody owns); the kernel's dataflow model (tests/test_prefill_attention.py) with the paged producer's tile
    coordinates (tile n = in-page tile n % (P / 128) of page table[slot, n // (P / 128)]) equals the contiguous
    model bit for bit, for odd lengths and chunked starts across page boundaries;
  * the op's paged argument checks (table dtype / shape / device, page size a built multiple of 128 matching the
    caches, positions past max_pages * P, table entries outside the cache) before any launch;
  * the QKV placement: the "p" chains and their registry entries, the paged host checks (page extents, positions
    unbounded), and the emulated placement's writes at (page, offset) = futx.paging.locate;
  * the engine glue (emulated backend): a paged EngineCache (layout and table set) gives the contiguous prefill's
    hidden states and cache contents bit for bit, chunked and padded; unowned pages are refused;
  * futx.engine.paged_kv.dequantize_pages: the main copy gets the mirror's values (EngineCache.read) at [0, n)
    only.

GPU counterparts: tests/test_paged_prefill_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from futx import paging
from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.engine.cache import EngineCache
from futx.engine.paged_kv import dequantize_slot, gather
from futx.engine.prefill import EmulatedPrefillOps, PrefillModel, pack_prefill, prefill_tokens
from futx.ops import prefill_attention as pa
from test_prefill_attention import KEYS, cpu_as_cuda, kernel_model, make_case, reference  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


# ---- paged copies of a contiguous case ----------------------------------------------------------------------
def to_pages(k, v, used, page_size, gen, spare=3, tail="nan"):
    """Paged copies of contiguous caches k, v [S, Hkv, cap, D]: slot s's first used[s] positions on
    pages_for(used[s]) randomly permuted pages (+ `spare` pages nobody owns), table [S + 1, max_pages] with the
    scratch page elsewhere. Page rows past a slot's used positions, spare pages and the scratch page hold
    `tail`: "nan", "inf" (+-Inf) or "big" (finite 1e4-sized garbage). Returns (k_pages, v_pages, table, layout)."""
    s_n, hkv, cap, d = k.shape
    max_pages = paging.pages_for(cap, page_size)
    need = [paging.pages_for(int(u), page_size) for u in used]
    pages = sum(need) + spare
    layout = paging.PageLayout(page_size, pages, s_n, max_pages)
    table = layout.new_table()
    perm = torch.randperm(pages, generator=gen).tolist()
    shape = (pages + 1, hkv, page_size, d)

    def garbage():
        if tail == "nan":
            return torch.full(shape, float("nan"), dtype=torch.float64)
        if tail == "inf":
            return torch.where(torch.rand(shape, generator=gen) < 0.5, float("inf"), float("-inf")).double()
        return torch.randn(shape, generator=gen, dtype=torch.float64) * 1e4

    kp, vp = garbage().to(k.dtype), garbage().to(k.dtype)
    for s in range(s_n):
        for j in range(need[s]):
            page = perm.pop()
            table[s, j] = page
            rows = slice(j * page_size, min((j + 1) * page_size, int(used[s])))
            n = rows.stop - rows.start
            kp[page, :, :n] = k[s, :, rows]
            vp[page, :, :n] = v[s, :, rows]
    return kp, vp, table, layout


def paged_case(lengths, starts, hq, hkv, d, page_size, seed=0, tail="nan", dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, cu, st, sl = make_case(lengths, starts, hq, hkv, d, dtype=dtype, gen=gen,
                                    capacity=max(s + n for s, n in zip(starts, lengths)) + 5)
    used = [0] * k.shape[0]
    for s, n, slot in zip(starts, lengths, sl.tolist()):
        used[slot] = s + n
    kp, vp, table, layout = to_pages(k, v, used, page_size, gen, tail=tail)
    return (q, k, v, cu, st, sl), (kp, vp, table, layout)


def paged_reference(q, kp, vp, cu, st, sl, table, page_size, scale=None):
    """The reference through the block table: each slot's positions gathered by futx.paging.locate."""
    span = table.shape[1] * page_size
    kc = torch.stack([gather(kp, table, s, span, page_size) for s in range(table.shape[0])])
    vc = torch.stack([gather(vp, table, s, span, page_size) for s in range(table.shape[0])])
    return reference(q, kc, vc, cu, st, sl, scale)


def paged_tiles(kp, vp, table, page_size):
    """The paged kernel's producer (futx/prefill/attention.py, produce_paged): tile n of slot s is in-page tile
    n % (P / 128) of page table[s, min(n // (P / 128), max_pages - 1)]."""
    per = page_size // KEYS

    def tiles(s, h, n):
        page = int(table[s, min(n // per, table.shape[1] - 1)])
        rows = slice((n % per) * KEYS, (n % per + 1) * KEYS)
        return kp[page, h, rows], vp[page, h, rows]
    return tiles


# lengths 1, 63, 127, 128, 129, 1000; chunked starts on, just before and just past page boundaries
LENGTHS = [1, 63, 127, 128, 129, 1000, 5]
STARTS = [0, 255, 1, 128, 127, 300, 383]


@pytest.mark.parametrize("page_size", [128, 256])
@pytest.mark.parametrize("tail", ["nan", "inf", "big"])
def test_paged_reference_equals_contiguous(page_size, tail):
    (q, k, v, cu, st, sl), (kp, vp, table, _) = paged_case(LENGTHS, STARTS, 8, 2, 32, page_size, seed=page_size,
                                                           tail=tail)
    want = reference(q, k, v, cu, st, sl)
    got = paged_reference(q, kp, vp, cu, st, sl, table, page_size)
    assert torch.isfinite(want).all() and torch.equal(got, want)


@pytest.mark.parametrize("page_size,g", [(128, 1), (128, 3), (256, 4), (256, 8), (128, 16)])
def test_paged_kernel_model_equals_contiguous(page_size, g):
    """The paged producer's tiles in the kernel's dataflow give the contiguous kernel's output bit for bit (the
    consumers see the same valid rows; garbage past a request's end is masked and zeroed in V)."""
    hkv = 2
    lengths, starts = ([1, 63, 127, 128, 129, 1000], [0, 255, 1, 128, 127, 300]) if g < 8 else \
        ([1, 129, 200], [383, 127, 256])
    (q, k, v, cu, st, sl), (kp, vp, table, _) = paged_case(lengths, starts, g * hkv, hkv, 64, page_size, seed=g,
                                                           tail="inf")
    want = kernel_model(q, k, v, cu, st, sl)
    got = kernel_model(q, kp, vp, cu, st, sl, tiles=paged_tiles(kp, vp, table, page_size))
    assert torch.isfinite(got).all() and torch.equal(got, want)
    torch.testing.assert_close(got, reference(q, k, v, cu, st, sl), rtol=1e-9, atol=1e-9)


# ---- the op's paged arguments ---------------------------------------------------------------------------------
def _bf16_case(page_size=128):
    (q, *_), (kp, vp, table, layout) = paged_case([5, 130], [0, 100], 8, 2, 128, page_size, dtype=torch.bfloat16)
    _, _, _, cu, st, sl = make_case([5, 130], [0, 100], 8, 2, 128)
    return q, kp, vp, cu, st, sl, table, layout


def test_check_table_accepts_a_paged_case(cpu_as_cuda):
    q, kp, vp, cu, st, sl, table, layout = _bf16_case()
    pa.check_inputs(q, kp, vp, cu, st, sl, torch.empty_like(q), 0.0)
    pa.check_table(table, 128, kp, q.device)
    pa.check_table(None, 0, kp, q.device)
    pa.check_ranges(cu, st, sl, q.shape[0], layout.capacity, table.shape[0], table, 128, kp.shape[0])


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda a: {**a, "table": None}, ValueError, "page_size 128 without a block table"),
    (lambda a: {**a, "page_size": 0}, ValueError, "page size must be a positive multiple of 128"),
    (lambda a: {**a, "page_size": 100}, ValueError, "page size must be a positive multiple of 128"),
    (lambda a: {**a, "page_size": 384}, ValueError, "no paged variant for page size 384"),
    (lambda a: {**a, "page_size": 256}, ValueError, "pages of 128 positions .* page_size is 256"),
    (lambda a: {**a, "table": a["table"].long()}, TypeError, "table must have dtype int32"),
    (lambda a: {**a, "table": a["table"].flatten()}, ValueError, "table must have shape"),
    (lambda a: {**a, "table": a["table"][:, :0]}, ValueError, "table must have shape"),
    (lambda a: {**a, "table": a["table"].t().contiguous().t()}, ValueError, "contiguous"),
])
def test_check_table_rejects(cpu_as_cuda, mutate, exc, match):
    q, kp, vp, cu, st, sl, table, _ = _bf16_case()
    a = mutate(dict(table=table, page_size=128))
    with pytest.raises(exc, match=match):
        pa.check_table(a["table"], a["page_size"], kp, q.device)


def test_check_table_rejects_a_table_on_another_device(cpu_as_cuda):
    q, kp, *_, table, _ = _bf16_case()
    with pytest.raises(ValueError, match="table is on meta"):
        pa.check_table(table.to("meta"), 128, kp, q.device)


def test_paged_range_checks():
    q, kp, vp, cu, st, sl, table, layout = _bf16_case()
    rows, pages = q.shape[0], kp.shape[0]
    args = lambda st_, sl_, tab: (cu, st_, sl_, rows, layout.capacity, tab.shape[0], tab, 128, pages)  # noqa: E731
    pa.check_ranges(*args(st, sl, table))
    over = st.clone()
    over[1] = layout.capacity - 129          # the 130-row request ends one past the last page
    with pytest.raises(ValueError, match=rf"overflow: request 1 reaches position {layout.capacity + 1} but the "
                                         rf"capacity is {layout.capacity} \(2 pages of 128\)"):
        pa.check_ranges(*args(over, sl, table))
    with pytest.raises(ValueError, match="slot out of range"):
        pa.check_ranges(*args(st, sl + table.shape[0], table))
    for bad in (pages, -1):
        t = table.clone()
        t[int(sl[1]), 1] = bad              # the second page of the 130-row request (positions 128..229)
        with pytest.raises(ValueError, match=f"request 1: block table row {int(sl[1])} names page {bad}"):
            pa.check_ranges(*args(st, sl, t))
    t = table.clone()
    t[int(sl[0]), 1] = pages + 7            # a page the 5-row request never reaches: not read, not checked
    pa.check_ranges(*args(st, sl, t))


def test_launch_picks_the_paged_variant_with_the_table_after_slot(cpu_as_cuda, monkeypatch):
    """The paged kernel's argument order (futx/prefill/attention.py compile_target): ..., slot, table, out, scale."""
    q, kp, vp, cu, st, sl, table, layout = _bf16_case()
    calls = []
    monkeypatch.setattr(pa, "get_kernel", lambda key: (lambda *args: calls.append((key, args))))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)   # a CPU-only torch has none
    out = torch.empty_like(q)
    pa._launch(q, kp, vp, cu, st, sl, out, 0.0, True, table, 128)
    pa._launch(q, kp, vp, cu, st, sl, out, 0.5, False, None, 0)
    (k1, a1), (k2, a2) = calls
    assert k1 == "prefill.attn.bf16.d128.p128" and k2 == "prefill.attn.bf16.d128"
    assert a1[6] is table and a1[7] is out and a1[8] == pytest.approx(128 ** -0.5) and len(a1) == 9
    assert a2[6] is out and a2[7] == 0.5 and len(a2) == 8


def test_op_signature_takes_the_table():
    import futx.ops  # noqa: F401

    for op in (torch.ops.futx.prefill_attention, torch.ops.futx.prefill_attention_):
        schema = str(op.default._schema)
        assert "Tensor? table=None" in schema and "page_size=0" in schema


# ---- the QKV placement into a paged cache -------------------------------------------------------------------
def test_paged_qkv_chains_and_registry():
    from epilogues.qkv import QKVPlacement
    from futx.runtime import select
    from futx.runtime.catalog.prefill import SHIPPED, VARIANTS, chain_of, kernel_key

    for ab, fp8 in (("e4m3", True), ("bf16", False)):
        for hd in (64, 128):
            name = f"{'scale_' if fp8 else ''}rho_qkv{hd}p_bf16"
            assert name in SHIPPED[ab]
            place = [s for s in chain_of(name).steps if isinstance(s, QKVPlacement)]
            assert len(place) == 1 and place[0].paged and place[0].hd == hd and place[0].name == f"qkv{hd}p"
            contiguous = chain_of(name.replace("p_bf16", "_bf16"))
            assert contiguous.fingerprint() != chain_of(name).fingerprint()
            assert [a.name for a in contiguous.args()] == [a.name for a in chain_of(name).args()]
            keys = {s.key for s in select(f"prefill.gemm.{ab}.{name}*")}
            # the shipped variants (a tuning space registered by an earlier test may add its own keys)
            assert {kernel_key(ab, name, v) for v in VARIANTS} <= keys


def _qkv_check(policy, pos, slot, slots=5, cap=128):
    sizes = dict(n=4 * 64 + 2 * 2 * 64, n_out=4 * 64, hkv=2, cap=cap, slots=slots)
    policy.check(sizes, dict(row_pos=torch.tensor(pos, dtype=torch.int32),
                             row_slot=torch.tensor(slot, dtype=torch.int32)), 128)


def test_paged_qkv_host_checks_are_the_page_extents():
    from epilogues.qkv import QKVPlacement

    paged, contiguous = QKVPlacement(64, paged=True), QKVPlacement(64)
    _qkv_check(paged, [0, 127, 128, 5000], [0, 4, 4, 2])          # positions past a page: in-page row pos % P
    with pytest.raises(ValueError, match="overflow"):
        _qkv_check(contiguous, [0, 128], [0, 1])
    with pytest.raises(ValueError, match=r"QKV \(paged\): pages span \[0, 5\] but the paged cache has 5 pages"):
        _qkv_check(paged, [0, 1], [0, 5])
    with pytest.raises(ValueError, match="negative position -1"):
        _qkv_check(paged, [-1, 1], [0, 1])


def test_emulated_paged_qkv_writes_land_at_locate():
    """Q equal to the contiguous placement's; K/V rows at (table[slot, p // P], p % P) with the contiguous
    placement's values; every other page row untouched."""
    gen = torch.Generator().manual_seed(4)
    hq, hkv, d, size = 4, 2, 64, 128
    lengths, starts, slots = [3, 130, 1], [126, 0, 255], [2, 0, 1]
    rows_slot = torch.tensor([s for s, n in zip(slots, lengths) for _ in range(n)], dtype=torch.int32)
    rows_pos = torch.tensor([p for st, n in zip(starts, lengths) for p in range(st, st + n)], dtype=torch.int32)
    m, k_in = rows_pos.numel(), 64
    a = torch.randn(m, k_in, generator=gen).to(torch.bfloat16)
    w = torch.randn((hq + 2 * hkv) * d, k_in, generator=gen).to(torch.bfloat16)
    rho = torch.rand(m, generator=gen) + 0.5
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ops = EmulatedPrefillOps()
    kc = torch.full((3, hkv, 384, d), float("nan"), dtype=torch.bfloat16)
    vc = kc.clone()
    q_want = ops.qkv(a, w, kc, vc, rows_slot, rows_pos, inv_freq, rho=rho)
    layout = paging.PageLayout(size, pages=10, slots=3, max_pages=3)
    table = layout.new_table()
    table[:3] = torch.randperm(10, generator=gen)[:9].view(3, 3).to(torch.int32)
    kp = torch.full((11, hkv, size, d), float("nan"), dtype=torch.bfloat16)
    vp = kp.clone()
    page, off = paging.locate(table, rows_slot, rows_pos, size)
    q = ops.qkv(a, w, kp, vp, page, rows_pos, inv_freq, rho=rho, paged=True)
    assert torch.equal(q, q_want)
    pl, ol = page.long(), off.long()
    assert torch.equal(kp[pl, :, ol], kc[rows_slot.long(), :, rows_pos.long()])
    assert torch.equal(vp[pl, :, ol], vc[rows_slot.long(), :, rows_pos.long()])
    written = torch.zeros(11, size, dtype=torch.bool)
    written[pl, ol] = True
    assert torch.isnan(kp.float().permute(0, 2, 1, 3)[~written]).all()
    assert torch.isnan(vp.float().permute(0, 2, 1, 3)[~written]).all()


# ---- the engine glue (emulated backend) ------------------------------------------------------------------------
CFG = tiny_config(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, num_hidden_layers=2, vocab_size=300)
SIZE, MAX_PAGES, SLOTS = 128, 3, 4


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=3, std=0.1)


def paged_engine_cache(fmt, gen, keep_values=True, owned=None, config=CFG, device="cpu", size=SIZE,
                       max_pages=MAX_PAGES):
    """The engine's paged EngineCache (futx.engine.cache with `layout`: page-mode layers of DecodeCache.allocate(
    fmt, pages + 1, Hkv, P, D) and the block table) for SLOTS requests of max_pages pages; slot s owns owned[s]
    randomly permuted pages (default: all max_pages), given through EngineCache.set_pages."""
    owned = [max_pages] * SLOTS if owned is None else owned
    pages = SLOTS * max_pages + 2
    layout = paging.PageLayout(size, pages, SLOTS, max_pages)
    cache = EngineCache(config, fmt, SLOTS, size * max_pages, device, keep_values=keep_values, layout=layout)
    perm = torch.randperm(pages, generator=gen).tolist()
    for s in range(SLOTS):
        cache.set_pages(s, [perm.pop() for _ in range(owned[s])])
    return cache


def _pair(weights, fmt, cache_fmt, seed=0, attention="auto"):
    pw = pack_prefill(weights, fmt)
    flat = EngineCache(CFG, cache_fmt, SLOTS, SIZE * MAX_PAGES, "cpu", keep_values=True)
    paged = paged_engine_cache(cache_fmt, torch.Generator().manual_seed(seed))
    return (PrefillModel(pw, flat, "emulated", attention=attention),
            PrefillModel(pw, paged, "emulated", attention=attention))


def _assert_same_cache(flat, paged, lengths):
    """Every written position of every slot: main copy, mirror, scales and kept values equal bit for bit."""
    table, size = paged.table, paged.layout.page_size
    for i, (a, b) in enumerate(zip(flat.layers, paged.layers)):
        for s, n in lengths.items():
            for name in ("k_cache", "v_cache", "k_scale", "v_scale", "v_mirror") + \
                    (("k_mirror",) if flat.fmt == "e4m3" else ()):
                x, y = getattr(a, name), getattr(b, name)
                if x is None:
                    continue
                x = x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x
                y = y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y
                assert torch.equal(gather(y, table, s, n, size), x[s, :, :n]), (i, s, name)
            if flat.fmt == "int4":   # key blocks of 8 tokens: block b of slot s sits at (page, offset // 8)
                pages, offs = paging.locate(table, torch.full((n // 8,), s), torch.arange(0, n - n % 8, 8), size)
                assert torch.equal(b.k_mirror[pages.long(), :, offs.long() // 8], a.k_mirror[s, :, :n // 8].transpose(0, 1))
            for j in range(2):
                assert torch.equal(gather(paged.values[i][j], table, s, n, size), flat.values[i][j][s, :, :n])


CALLS = [([130, 7, 1, 22], [0, 0, 0, 0], [0, 1, 2, 3]),        # a prompt across a page boundary
         ([200, 121, 5], [130, 7, 1], [0, 1, 2]),              # chunks continuing across pages 1 and 2
         ([3, 9], [330, 128], [0, 1])]                         # slot 1 continues exactly on a page boundary


@pytest.mark.parametrize("fmt,cache_fmt,attention", [("bf16", "int4", "auto"), ("e4m3", "e4m3", "auto"),
                                                     ("bf16", "bf16", "torch"), ("e4m3", "int4", "torch")])
def test_paged_prefill_equals_contiguous(weights, fmt, cache_fmt, attention):
    flat, paged = _pair(weights, fmt, cache_fmt, seed=len(fmt), attention=attention)
    g = torch.Generator().manual_seed(1)
    lengths = {}
    for lens, starts, slots in CALLS:
        prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in lens]
        want = prefill_tokens(flat, prompts, starts, slots).hidden
        got = prefill_tokens(paged, prompts, starts, slots).hidden
        assert torch.equal(got, want)
        for n, st, s in zip(lens, starts, slots):
            lengths[s] = st + n
    _assert_same_cache(flat.cache, paged.cache, lengths)


def test_paged_padded_path_equals_packed(weights):
    _, paged = _pair(weights, "bf16", "int4")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (129, 4, 60)]
    packed = prefill_tokens(paged, prompts, [0, 200, 5], [0, 1, 2]).hidden
    padded = paged.forward_padded(prompts, [0, 200, 5], [0, 1, 2]).hidden
    assert torch.equal(packed, padded)


def test_paged_geometry_and_refusals(weights):
    pw = pack_prefill(weights, "bf16")
    cache = paged_engine_cache("int4", torch.Generator().manual_seed(0), owned=[1, 3, 3, 3])
    model = PrefillModel(pw, cache, "emulated")
    assert (model.slots, model.capacity, model.scratch_slot) == (SLOTS, SIZE * MAX_PAGES, SLOTS)
    with pytest.raises(ValueError, match="no page"):   # slot 0 owns one page: position 128 has none
        prefill_tokens(model, [[1] * 10], [125], [0])
    with pytest.raises(ValueError, match="overflow"):
        prefill_tokens(model, [[1] * 10], [SIZE * MAX_PAGES - 5], [1])
    with pytest.raises(ValueError, match="slot 4 out of range"):
        prefill_tokens(model, [[1]], [0], [4])


# ---- dequantize_pages: mirror -> main copy ---------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["int4", "e4m3"])
def test_dequantize_pages_writes_what_decode_reads(fmt):
    gen = torch.Generator().manual_seed(5)
    cache = paged_engine_cache(fmt, gen, keep_values=False)
    hkv, d, size = CFG.num_key_value_heads, CFG.head_dim, SIZE
    slot, n = 2, 300
    pos = torch.arange(n)
    for i in range(CFG.num_hidden_layers):
        k, v = torch.randn(2, n, hkv, d, generator=gen)
        cache.write_rows(i, torch.full((n,), slot), pos, k, v)   # (slot, position): the cache locates the rows
        lc = cache.layers[i]
        lc.k_cache.fill_(float("nan"))   # the main copy dropped
        lc.v_cache.fill_(float("nan"))
    dequantize_slot(cache, slot, n - 10)
    for i, lc in enumerate(cache.layers):
        for t, (main, want) in enumerate(zip((lc.k_cache, lc.v_cache), cache.read(i, slot, n))):
            got = gather(main, cache.table, slot, n, size)
            assert torch.equal(got[:, :n - 10], want[:, :n - 10].to(torch.bfloat16)), (i, t)
            assert torch.isnan(got[:, n - 10:].float()).all()   # the rows past n are left alone


def test_dequantize_slot_checks_and_bf16_noop():
    gen = torch.Generator().manual_seed(6)
    cache = paged_engine_cache("bf16", gen, keep_values=False)
    cache.layers[0].k_cache.fill_(3.0)
    dequantize_slot(cache, 0, 100)           # a BF16 cache: the main copy is what decode reads
    assert bool((cache.layers[0].k_cache == 3.0).all())
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_slot(cache, 0, SIZE * MAX_PAGES + 1)
    with pytest.raises(ValueError, match="slot 9 out of range"):
        dequantize_slot(cache, 9, 1)
    with pytest.raises(ValueError, match="paged EngineCache"):
        dequantize_slot(EngineCache(CFG, "int4", 2, 128, "cpu"), 0, 1)
