"""The prefill path over a paged KV cache (futx.paging) on a Hopper GPU, against the contiguous path.

  * prefill attention, paged variant (AOT prefill.attn.bf16.d{64,128}.p{128,256}): bit for bit the contiguous
    kernel's output on the same data with randomly permuted pages, for packed batches of odd lengths
    (1, 63, 127, 128, 129, 1000), chunked starts on and across page boundaries, GQA groups 1..16, head dims 64 and
    128; page rows past each request's end and unowned pages hold NaN, +-Inf or large garbage; the output is
    poisoned with NaN before the launch (every row must be written); a CUDA graph replays it reading the table
    as it is at replay time; range errors before the launch;
  * the engine's prefill chunk (PrefillModel on the kernels, QKV "p" chains, the mirror kernel on translated
    rows, paged attention) on a paged EngineCache: the contiguous chunk's hidden states and cache bytes, bit for
    bit, over chunked calls across pages; the same through PrefillGraphs (rows translated inside the graph);
  * dequantize_pages captured in a CUDA graph (E4M3 and INT4 mirrors) equals its eager run.

    python -m pytest -m gpu -q tests/test_paged_prefill_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from futx import paging
from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.engine.cache import EngineCache
from futx.engine.paged_kv import dequantize_pages, gather
from futx.engine.prefill import PrefillModel, pack_prefill, prefill_tokens
from futx.engine.prefill_graphs import PrefillGraphs
from test_paged_prefill import paged_case, paged_engine_cache
from test_prefill_attention import reference

pytestmark = pytest.mark.gpu

DEV = "cuda"


@pytest.fixture(scope="module")
def attn():
    import futx.ops  # noqa: F401
    from futx.ops import prefill_attention as pa

    return pa.attention


def _on(dev, *ts):
    return tuple(t.to(dev) for t in ts)


def run_pair(attn, lengths, starts, hq, hkv, d, size, seed=0, tail="nan"):
    """(paged, contiguous) outputs on one random case; both NaN-poisoned before the launch."""
    (q, k, v, cu, st, sl), (kp, vp, table, _) = paged_case(lengths, starts, hq, hkv, d, size, seed=seed, tail=tail,
                                                           dtype=torch.bfloat16)
    q, k, v, cu, st, sl, kp, vp, table = _on(DEV, q, k, v, cu, st, sl, kp, vp, table)
    flat = torch.full_like(q, float("nan"))
    paged = torch.full_like(q, float("nan"))
    attn(q, k, v, cu, st, sl, out=flat)
    attn(q, kp, vp, cu, st, sl, out=paged, table=table, page_size=size)
    torch.cuda.synchronize()
    assert torch.isfinite(paged).all(), "rows left unwritten or poisoned by garbage past a request's end"
    assert torch.equal(paged, flat)
    want = reference(q, k, v, cu, st, sl)
    assert ((paged.double() - want).abs() <= 2e-2 + 2e-2 * want.abs()).all()
    return paged


LENGTHS = [1, 63, 127, 128, 129, 1000, 2]
STARTS = [0, 255, 1, 128, 127, 300, 511]     # on, before and past page boundaries (128 and 256)


@pytest.mark.parametrize("size", [128, 256])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("g", [1, 3, 4, 8])
def test_paged_equals_contiguous_packed_chunked(attn, size, d, g):
    run_pair(attn, LENGTHS, STARTS, 2 * g, 2, d, size, seed=10 * g + d + size)


@pytest.mark.parametrize("tail", ["nan", "inf", "big"])
@pytest.mark.parametrize("size", [128, 256])
def test_garbage_past_the_end_never_leaks(attn, tail, size):
    run_pair(attn, [1, 129, 255, 257, 64], [0, 0, 1, 127, 383], 8, 2, 128, size, seed=3, tail=tail)


@pytest.mark.parametrize("g", range(1, 17))
def test_every_group(attn, g):
    t = 128 // g
    run_pair(attn, [t - 1 or 1, t, t + 1, 2 * t + 1, 300], [0, 127, 128, 250, 129], 2 * g, 2, 64, 128, seed=g)


def test_llama_shapes(attn):
    run_pair(attn, [2048, 700, 1], [0, 1500, 3000], 32, 8, 128, 128, seed=7)


def test_graph_replay_reads_the_table_at_replay(attn):
    """Capture once, then move every page elsewhere and rewrite the table in place: the replay follows it."""
    (q, k, v, cu, st, sl), (kp, vp, table, layout) = paged_case([40, 300], [100, 0], 32, 8, 128, 128,
                                                                dtype=torch.bfloat16, seed=4)
    q, k, v, cu, st, sl, kp, vp, table = _on(DEV, q, k, v, cu, st, sl, kp, vp, table)
    out = torch.full_like(q, float("nan"))
    attn(q, kp, vp, cu, st, sl, out=out, table=table, page_size=128)   # warm-up (loads the kernel)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn(q, kp, vp, cu, st, sl, out=out, table=table, page_size=128)
    perm = torch.randperm(layout.pages, generator=torch.Generator().manual_seed(1)).to(DEV)
    perm = torch.cat([perm, perm.new_full((1,), layout.scratch_page)])    # the scratch page stays
    moved = torch.full_like(kp, float("nan")), torch.full_like(vp, float("nan"))
    for src, dst in zip((kp, vp), moved):
        dst[perm] = src                                                    # page i -> perm[i]
    table.copy_(perm[table.long()].to(torch.int32))
    kp.copy_(moved[0])
    vp.copy_(moved[1])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    ref = torch.empty_like(out)
    attn(q, k, v, cu, st, sl, out=ref)
    assert torch.equal(out, ref)


def test_paged_range_errors_before_launch(attn):
    (q, _, _, cu, st, sl), (kp, vp, table, layout) = paged_case([5, 130], [0, 100], 8, 2, 64, 128,
                                                                dtype=torch.bfloat16)
    q, cu, st, sl, kp, vp, table = _on(DEV, q, cu, st, sl, kp, vp, table)
    with pytest.raises(ValueError, match="overflow"):
        attn(q, kp, vp, cu, st + layout.capacity, sl, table=table, page_size=128)
    bad = table.clone()
    bad[int(sl[1]), 0] = kp.shape[0]
    with pytest.raises(ValueError, match="names page"):
        attn(q, kp, vp, cu, st, sl, table=bad, page_size=128)
    with pytest.raises(ValueError, match="page_size is 256"):
        attn(q, kp, vp, cu, st, sl, table=table, page_size=256)


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("hd", [64, 128])
def test_paged_qkv_epilogue_equals_contiguous(fp8, hd):
    """futx.ops.prefill.qkv(paged=True) (the "p" chains): Q bit for bit, K/V rows at locate's (page, offset) bit
    for bit the contiguous chain's, RoPE from the true positions (up to 3 pages in)."""
    from futx.ops import prefill
    from futx.quant.fp8 import quantize_e4m3_weight
    from futx.rope import inv_freq as rope_inv_freq

    cfg = CFGS[hd]
    gen = torch.Generator().manual_seed(hd)
    hq, hkv, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
    lengths, starts, slots = [77, 1, 300], [0, 127, 80], [2, 0, 1]
    row_slot = torch.tensor([s for s, n in zip(slots, lengths) for _ in range(n)], dtype=torch.int32, device=DEV)
    row_pos = torch.tensor([p for st, n in zip(starts, lengths) for p in range(st, st + n)], dtype=torch.int32,
                           device=DEV)
    m = row_pos.numel()
    x = torch.randn(m, h, generator=gen).to(DEV, torch.bfloat16)
    w = (torch.randn((hq + 2 * hkv) * hd, h, generator=gen) * 0.05).to(DEV)
    rho = (torch.rand(m, generator=gen) + 0.5).to(DEV)
    kw = dict(rho=rho)
    if fp8:
        wq = quantize_e4m3_weight(w)
        amax = x.float().abs().amax(1)
        a_scale = amax / 448
        x = (x.float() / a_scale[:, None]).to(torch.float8_e4m3fn)
        w, kw = wq.data.contiguous(), dict(rho=rho, a_scale=a_scale.contiguous(), b_scale=wq.scale.contiguous())
    else:
        w = w.to(torch.bfloat16)
    inv = rope_inv_freq(cfg).float().to(DEV)
    layout = paging.PageLayout(SIZE, pages=10, slots=3, max_pages=MAX_PAGES)
    table = layout.new_table(DEV)
    table[:3] = torch.randperm(10, generator=gen)[:9].view(3, 3).to(DEV, torch.int32)
    kc = torch.full((3, hkv, SIZE * MAX_PAGES, hd), float("nan"), dtype=torch.bfloat16, device=DEV)
    vc = kc.clone()
    kp = torch.full((11, hkv, SIZE, hd), float("nan"), dtype=torch.bfloat16, device=DEV)
    vp = kp.clone()
    q_want = prefill.qkv(x, w, kc, vc, row_slot, row_pos, inv, **kw)
    page, off = paging.locate(table, row_slot, row_pos, SIZE)
    q = prefill.qkv(x, w, kp, vp, page, row_pos, inv, paged=True, **kw)
    torch.cuda.synchronize()
    assert torch.equal(q, q_want)
    pl, ol, sl, ps = page.long(), off.long(), row_slot.long(), row_pos.long()
    assert torch.equal(kp[pl, :, ol], kc[sl, :, ps]) and torch.equal(vp[pl, :, ol], vc[sl, :, ps])
    written = torch.zeros(11, SIZE, dtype=torch.bool, device=DEV)
    written[pl, ol] = True
    assert torch.isnan(kp.float().permute(0, 2, 1, 3)[~written]).all()


# ---- the engine's prefill chunk --------------------------------------------------------------------------------
CFGS = {hd: tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=hd, num_hidden_layers=2, vocab_size=512) for hd in (64, 128)}
SIZE, MAX_PAGES = 128, 3
CALLS = [([130, 7, 1, 22], [0, 0, 0, 0], [0, 1, 2, 3]),
         ([200, 121, 5], [130, 7, 1], [0, 1, 2]),
         ([3, 1, 9], [330, 22, 128], [0, 3, 1])]     # slot 1 continues exactly on a page boundary
CASES = [(64, "e4m3", "int4"), (128, "e4m3", "int4"), (128, "bf16", "e4m3"), (64, "bf16", "bf16")]


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _models(hd, fmt, cache_fmt, seed=0):
    w = random_weights(CFGS[hd], seed=5, std=0.05).to(device=DEV)
    pw = pack_prefill(w, fmt)
    flat = EngineCache(w.config, cache_fmt, 4, SIZE * MAX_PAGES, DEV)
    paged = paged_engine_cache(cache_fmt, torch.Generator().manual_seed(seed), keep_values=False, config=w.config,
                               device=DEV, size=SIZE, max_pages=MAX_PAGES)
    return PrefillModel(pw, flat, "kernels"), PrefillModel(pw, paged, "kernels"), w.config


def _same_cache(flat, paged, lengths):
    for a, b in zip(flat.layers, paged.layers):
        for s, n in lengths.items():
            for name in ("k_cache", "v_cache", "k_scale", "v_scale", "v_mirror") + \
                    (("k_mirror",) if flat.fmt == "e4m3" else ()):
                x, y = getattr(a, name), getattr(b, name)
                if x is not None:
                    assert torch.equal(gather(_bytes(y), paged.table, s, n, SIZE), _bytes(x)[s, :, :n]), (s, name)
            if flat.fmt == "int4":
                blocks = torch.arange(0, n - n % 8, 8, device=DEV)
                pages, offs = paging.locate(paged.table, torch.full_like(blocks, s), blocks, SIZE)
                assert torch.equal(b.k_mirror[pages.long(), :, offs.long() // 8],
                                   a.k_mirror[s, :, :n // 8].transpose(0, 1))


def _prompts(cfg, seed=1, calls=CALLS):
    g = torch.Generator().manual_seed(seed)
    for lens, starts, slots in calls:
        yield [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens], lens, starts, slots


@pytest.mark.parametrize("hd,fmt,cache_fmt", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_paged_chunk_equals_contiguous(hd, fmt, cache_fmt):
    flat, paged, cfg = _models(hd, fmt, cache_fmt)
    lengths = {}
    for prompts, lens, starts, slots in _prompts(cfg):
        want = prefill_tokens(flat, prompts, starts, slots).hidden
        got = prefill_tokens(paged, prompts, starts, slots).hidden
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        lengths.update({s: st + n for n, st, s in zip(lens, starts, slots)})
    _same_cache(flat.cache, paged.cache, lengths)


@pytest.mark.parametrize("hd,fmt,cache_fmt", CASES[:3], ids=["-".join(map(str, c)) for c in CASES[:3]])
def test_paged_graphs_equal_contiguous_graphs(hd, fmt, cache_fmt):
    """Both through PrefillGraphs (the paged rows translated inside the graph; its padding in the scratch page)."""
    flat, paged, cfg = _models(hd, fmt, cache_fmt, seed=3)
    g_flat = PrefillGraphs(flat, max_rows=256, max_requests=4)
    g_paged = PrefillGraphs(paged, max_rows=256, max_requests=4)
    lengths = {}
    # CALLS' first two run eagerly (4 requests, a batch past the buckets; an E4M3 model calibrates then): two more
    # small calls so that every case replays at least twice
    for prompts, lens, starts, slots in _prompts(cfg, seed=2, calls=CALLS + [([5, 2], [333, 23], [0, 3])]):
        toks = torch.tensor(sum(prompts, []))
        want = g_flat.run(toks, lens, starts, slots).clone()
        got = g_paged.run(toks, lens, starts, slots)
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        lengths.update({s: st + n for n, st, s in zip(lens, starts, slots)})
    assert g_paged.replays == g_flat.replays and g_paged.replays >= 2
    _same_cache(flat.cache, paged.cache, lengths)
    with pytest.raises(ValueError, match="overflow"):
        g_paged.run(torch.zeros(4, dtype=torch.int64), [4], [SIZE * MAX_PAGES - 2], [0])


@pytest.mark.parametrize("fmt", ["e4m3", "int4"])   # INT4: its key index stays on the device after a first call
def test_dequantize_pages_captures_in_a_graph(fmt):
    cfg = CFGS[128]
    cache = paged_engine_cache(fmt, torch.Generator().manual_seed(2), keep_values=False, config=cfg, device=DEV,
                               size=SIZE, max_pages=MAX_PAGES)
    lc, n, slot = cache.layers[0], 300, 1
    pos = torch.arange(n, device=DEV)
    k, v = torch.randn(2, n, cfg.num_key_value_heads, cfg.head_dim, device=DEV)
    cache.write_rows(0, torch.full_like(pos, slot), pos, k, v)   # (slot, position): the cache locates the rows
    dequantize_pages(lc, cache.table, SIZE, slot, n)
    want = lc.k_cache.clone(), lc.v_cache.clone()
    lc.k_cache.fill_(float("nan"))
    lc.v_cache.fill_(float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            dequantize_pages(lc, cache.table, SIZE, slot, n)
    torch.cuda.current_stream().wait_stream(s)
    graph.replay()
    torch.cuda.synchronize()
    for got, exp in zip((lc.k_cache, lc.v_cache), want):
        assert torch.equal(gather(got, cache.table, slot, n, SIZE), gather(exp, cache.table, slot, n, SIZE))
