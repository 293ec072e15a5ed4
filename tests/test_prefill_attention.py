"""Prefill attention (futx/prefill/attention.py, futx.ops.prefill_attention) on the CPU: the float64
reference of the kernel's exact math agrees with futx's reference model attention on random packed
batches with chunked-prefill starts; a pure-Python model of the kernel's work tiles and row mapping (row i =
token i // G, head h G + i % G; T = 128 // G tokens per tile, rows T G .. 127 idle when G does not divide 128)
and of its dataflow, against that reference; the op's validation (GQA group 1..16); the sm_90a compile and its
SASS (HGMMA, no spills), contiguous and paged (the paged cache's CPU tests: tests/test_paged_prefill.py). The GPU comparison is tests/test_prefill_attention_gpu.py."""

from __future__ import annotations

import math
import os

import pytest
import torch

from futx.ops import checks
from futx.ops import prefill_attention as pa
from futx.runtime import select
from futx.runtime.catalog.prefill_attention import HEAD_DIMS, attn_key


def reference(q, k_cache, v_cache, cu_seqlens, start_pos, slot, scale=None):
    """The kernel's math in float64: row i of request r (position start_pos[r] + i) attends to positions
    [0, start_pos[r] + i] of cache slot slot[r]; query head h reads KV head h // (Hq / Hkv). Returns
    float64 [M, Hq, D]. Reads only positions below start_pos[r] + length (the rest may be NaN)."""
    m, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(m, hq, d, dtype=torch.float64, device=q.device)
    cu, st, sl = (t.tolist() for t in (cu_seqlens.cpu(), start_pos.cpu(), slot.cpu()))
    for r in range(len(st)):
        r0, r1 = cu[r], cu[r + 1]
        n = r1 - r0
        if n == 0:
            continue
        end = st[r] + n
        k = k_cache[sl[r], :, :end].double().repeat_interleave(g, 0)     # [Hq, end, D]
        v = v_cache[sl[r], :, :end].double().repeat_interleave(g, 0)
        qr = q[r0:r1].double().transpose(0, 1)                            # [Hq, n, D]
        s = (qr @ k.transpose(1, 2)) * scale
        pos = st[r] + torch.arange(n, device=q.device)
        s.masked_fill_(torch.arange(end, device=q.device)[None, :] > pos[:, None], float("-inf"))
        out[r0:r1] = (s.softmax(-1) @ v).transpose(0, 1)
    return out


def make_case(lengths, starts, hq, hkv, d, *, slots=None, capacity=None, device="cpu", dtype=torch.bfloat16,
              gen=None, nan_fill=True):
    """Random q and caches (NaN at every position a request does not own), int32 batch vectors."""
    gen = gen or torch.Generator().manual_seed(0)
    r = len(lengths)
    slot_ids = list(range(r))[::-1] if slots is None else slots
    n_slots = max(slot_ids) + 1
    cap = capacity or max(s + n for s, n in zip(starts, lengths)) + 5
    m = sum(lengths)
    q = torch.randn(m, hq, d, generator=gen).to(dtype)
    k = torch.full((n_slots, hkv, cap, d), float("nan") if nan_fill else 0.0)
    v = k.clone()
    for s, n, sl in zip(starts, lengths, slot_ids):
        k[sl, :, :s + n] = torch.randn(hkv, s + n, d, generator=gen)
        v[sl, :, :s + n] = torch.randn(hkv, s + n, d, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    return (to(q), to(k.to(dtype)), to(v.to(dtype)), to(cu), to(torch.tensor(starts, dtype=torch.int32)),
            to(torch.tensor(slot_ids, dtype=torch.int32)))


# ---- the float64 reference against futx's reference model attention ---------------------------------
@pytest.mark.parametrize("lengths,starts,hq,hkv", [
    ([5, 1, 17], [0, 3, 40], 4, 1),
    ([1, 64, 9, 33], [7, 0, 100, 5], 8, 2),
    ([600], [20], 2, 2),       # > QUERY_BLOCK rows: the reference's block loop
    ([3, 3, 3], [4, 4, 4], 8, 1),   # equal lengths and starts: the reference's batched path
])
def test_reference_matches_futx_reference_attention(lengths, starts, hq, hkv):
    from futx.config import LlamaConfig
    from futx.kvcache import KVCache
    from futx.reference.batch import PackedBatch
    from futx.reference.model import attention

    d = 16
    gen = torch.Generator().manual_seed(7)
    cfg = LlamaConfig(name="t", hidden_size=hq * d, intermediate_size=32, num_attention_heads=hq,
                      num_key_value_heads=hkv, head_dim=d, num_hidden_layers=1, vocab_size=8)
    slots = list(range(len(lengths)))[::-1]
    cap = max(s + n for s, n in zip(starts, lengths)) + 3
    cache = KVCache(cfg, len(lengths), cap, dtype=torch.float64)
    q, k, v, cu, st, sl = make_case(lengths, starts, hq, hkv, d, slots=slots, capacity=cap, dtype=torch.float64,
                                    gen=gen)
    for s, n, slot in zip(starts, lengths, slots):
        pos = torch.arange(s + n)
        cache.write(0, torch.full((s + n,), slot), pos, k[slot, :, :s + n].transpose(0, 1),
                    v[slot, :, :s + n].transpose(0, 1))
    batch = PackedBatch.from_lengths(lengths, starts, slots)
    want = attention(cfg, 0, q, batch, cache, "prefill").view(q.shape)
    got = reference(q, k, v, cu, st, sl)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert torch.isfinite(got).all()


# ---- a pure-Python model of the kernel's work decomposition and row mapping -----------------------------
TILE, KEYS = 128, 128   # futx.prefill.attention.TILE_M / TILE_N (no DSL import here)


def kernel_ctas(cu, starts, hq, hkv):
    """What each CTA of futx/prefill/attention.py does, restated line by line from the kernel: the grid, the
    (request, query tile) lookup from blockIdx.x, and per CTA row i: token i // G, head h G + i % G, whether Q
    is loaded / O stored (token < the tile's valid tokens), its causal position, the K/V tiles loaded and
    the unmasked ones. Yields one dict per CTA that owns a tile."""
    group = hq // hkv
    block_t = TILE // group
    num_req = len(starts)
    tiles = (cu[-1] + block_t - 1) // block_t + num_req
    for bidx in range(tiles):
        for head_kv in range(hkv):
            lin = tiles - 1 - bidx
            req, qt, seen = -1, 0, 0
            for r in range(num_req):
                t_r = (cu[r + 1] - cu[r] + block_t - 1) // block_t
                if seen <= lin < seen + t_r:
                    req, qt = r, lin - seen
                seen += t_r
            if req < 0:
                continue
            row0, seqlen, start = cu[req], cu[req + 1] - cu[req], starts[req]
            tok0 = qt * block_t
            n_tok = min(block_t, seqlen - tok0)
            kv_end = start + tok0 + n_tok
            rows = []
            for i in range(TILE):
                tok = i // group
                live = tok < n_tok
                rows.append(dict(row=i, live=live, m=row0 + tok0 + tok if live else None,
                                 head=head_kv * group + i - tok * group if live else None,
                                 pos=start + tok0 + i // group))
            yield dict(req=req, head_kv=head_kv, tok0=tok0, n_tok=n_tok, rows=rows, kv_total=start + seqlen,
                       n_tiles=(kv_end + KEYS - 1) // KEYS, n_plain=(start + tok0 + 1) // KEYS)


@pytest.mark.parametrize("g", [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 16])
def test_row_mapping_covers_every_row_and_head_once(g):
    """Every (row, query head) of the packed output is owned by exactly one live CTA row; the rows T G .. 127
    of a tile (T = 128 // G) are never live; live rows see exactly their causal keys: every key up to their
    position is in a loaded K/V tile, and tiles below n_plain need no mask for any live row."""
    hkv = 2
    hq = g * hkv
    block_t = TILE // g
    lengths = [1, block_t - 1, block_t, block_t + 1, 3 * block_t + 2, 257, 2]
    starts = [0, 5, 128, 0, 1000, 37, 511]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    owner = {}
    n_ctas = 0
    for cta in kernel_ctas(cu, starts, hq, hkv):
        n_ctas += 1
        live = [r for r in cta["rows"] if r["live"]]
        assert len(live) == cta["n_tok"] * g and [r["row"] for r in live] == list(range(cta["n_tok"] * g))
        assert all(not r["live"] for r in cta["rows"][block_t * g:])          # the idle rows of G not | 128
        for r in live:
            key = (r["m"], r["head"])
            assert key not in owner, f"{key} owned twice"
            owner[key] = cta
            assert r["head"] // g == cta["head_kv"]
            assert cu[cta["req"]] <= r["m"] < cu[cta["req"] + 1]
            assert r["pos"] == starts[cta["req"]] + r["m"] - cu[cta["req"]]   # the row's causal position
            assert r["pos"] < cta["n_tiles"] * KEYS and r["pos"] < cta["kv_total"]   # its keys are loaded
            assert cta["n_plain"] * KEYS <= r["pos"] + 1                       # no mask needed below n_plain
        # the tile's tokens are consecutive rows of one request
        assert sorted({r["m"] for r in live}) == list(range(cu[cta["req"]] + cta["tok0"],
                                                             cu[cta["req"]] + cta["tok0"] + cta["n_tok"]))
    assert set(owner) == {(m, h) for m in range(cu[-1]) for h in range(hq)}
    assert n_ctas == hkv * sum(-(-n // block_t) for n in lengths)


def contiguous_tiles(k_cache, v_cache):
    """The contiguous kernel's producer: K/V tile n of slot s is rows [128 n, 128 n + 128) of the slot (TMA fills
    rows past the capacity with zeros)."""
    d = k_cache.shape[3]
    kpad = torch.cat([k_cache.double(), torch.zeros(*k_cache.shape[:2], KEYS, d, dtype=torch.float64)], 2)
    vpad = torch.cat([v_cache.double(), torch.zeros(*v_cache.shape[:2], KEYS, d, dtype=torch.float64)], 2)
    return lambda s, h, n: (kpad[s, h, n * KEYS:(n + 1) * KEYS], vpad[s, h, n * KEYS:(n + 1) * KEYS])


def kernel_model(q, k_cache, v_cache, cu_seqlens, start_pos, slot, scale=None, tiles=None):
    """The kernel's dataflow in float64 on kernel_ctas(): the 128-row Q tile (rows not loaded hold NaN, like
    stale shared memory), 128-key K/V tiles as TMA loads them (unwritten cache rows as they are, zeros past
    the capacity), the causal mask by replacement on the diagonal tiles, online softmax with exp2, V rows
    past the request's cache end zeroed, O / l stored for the live rows only (the rest of out stays NaN).
    tiles(slot, kv_head, n) -> (K, V) tile n as the producer loads it (default: `contiguous_tiles`)."""
    m, hq, d = q.shape
    hkv = k_cache.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    sl2 = scale * math.log2(math.e)
    cu, st, sl = (t.tolist() for t in (cu_seqlens, start_pos, slot))
    out = torch.full((m, hq, d), float("nan"), dtype=torch.float64)
    tiles = tiles or contiguous_tiles(k_cache, v_cache)
    for cta in kernel_ctas(cu, st, hq, hkv):
        rows = cta["rows"]
        sq = torch.full((TILE, d), float("nan"), dtype=torch.float64)
        for r in rows:
            if r["live"]:
                sq[r["row"]] = q[r["m"], r["head"]].double()
        pos = torch.tensor([r["pos"] for r in rows])
        row_max = torch.full((TILE,), float("-inf"), dtype=torch.float64)
        row_sum = torch.zeros(TILE, dtype=torch.float64)
        acc = torch.zeros(TILE, d, dtype=torch.float64)
        s_ = sl[cta["req"]]
        for n in range(cta["n_tiles"]):
            kt, vt = tiles(s_, cta["head_kv"], n)
            kt, vt = kt.double(), vt.double().clone()
            s = sq @ kt.T
            if n >= cta["n_plain"]:
                s[torch.arange(KEYS)[None, :] > (pos - n * KEYS)[:, None]] = float("-inf")
            m_new = torch.maximum(row_max, s.amax(1))
            base = torch.where(m_new == float("-inf"), 0.0, m_new) * sl2
            corr = torch.exp2(row_max * sl2 - base)
            p = torch.exp2(s * sl2 - base[:, None])
            row_max = m_new
            row_sum = row_sum * corr + p.sum(1)
            tail = cta["kv_total"] - n * KEYS
            if tail < KEYS:
                vt[max(tail, 0):] = 0.0
            acc = acc * corr[:, None] + p @ vt
        o = acc * torch.where(row_sum == 0.0, 0.0, 1.0 / row_sum)[:, None]
        for r in rows:
            if r["live"]:
                out[r["m"], r["head"]] = o[r["row"]]
    return out


@pytest.mark.parametrize("g", [3, 5, 6, 7])
def test_kernel_model_matches_reference_for_groups_not_dividing_128(g):
    """With NaN in the idle Q rows and in every cache row a request does not own, the kernel's dataflow
    still writes every output row, each equal to the reference (idle rows never mix into live ones)."""
    hkv = 2
    block_t = TILE // g
    lengths = [1, block_t + 1, 2 * block_t - 1, 131]
    starts = [0, 127, 3, 300]
    gen = torch.Generator().manual_seed(g)
    q, k, v, cu, st, sl = make_case(lengths, starts, g * hkv, hkv, 64, dtype=torch.float64, gen=gen)
    got = kernel_model(q, k, v, cu, st, sl)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference(q, k, v, cu, st, sl), rtol=1e-9, atol=1e-9)


# ---- op validation (before any launch) ------------------------------------------------------------------
def test_op_rejects_cpu_tensors():
    args = make_case([4], [0], 4, 1, 64)
    with pytest.raises(ValueError, match="CUDA"):
        pa.attention(*args)


@pytest.fixture
def cpu_as_cuda(monkeypatch):
    """Let check_inputs run on CPU tensors (its device check is the only CUDA-specific one)."""
    def cuda(name, t, device=None):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if device is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but the other operands are on {device}")
    monkeypatch.setattr(checks, "cuda", cuda)


def _check(q, k, v, cu, st, sl, out=None, scale=0.0):
    pa.check_inputs(q, k, v, cu, st, sl, torch.empty_like(q) if out is None else out, scale)


def test_check_inputs_accepts_a_valid_case(cpu_as_cuda):
    _check(*make_case([4, 9], [0, 3], 8, 2, 128))


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda a: {**a, "q": a["q"].float()}, TypeError, "q must have dtype bfloat16"),
    (lambda a: {**a, "k": a["k"].half()}, TypeError, "k_cache must have dtype"),
    (lambda a: {**a, "cu": a["cu"].long()}, TypeError, "cu_seqlens must have dtype int32"),
    (lambda a: {**a, "st": a["st"].long()}, TypeError, "start_pos must have dtype int32"),
    (lambda a: {**a, "q": a["q"][:, :, :32].contiguous()}, ValueError, "head dim 32"),
    (lambda a: {**a, "q": a["q"].flatten(1)}, ValueError, "q must have shape"),
    (lambda a: {**a, "k": a["k"][0]}, ValueError, "k_cache must have shape"),
    (lambda a: {**a, "v": a["v"][:, :, :-1]}, ValueError, "v_cache must have shape"),
    (lambda a: {**a, "q": a["q"][:, :5].contiguous()}, ValueError, "not a multiple"),
    (lambda a: {**a, "st": a["st"][:1]}, ValueError, "start_pos must have shape"),
    (lambda a: {**a, "sl": a["sl"][:1]}, ValueError, "slot must have shape"),
    (lambda a: {**a, "cu": a["cu"][:1]}, ValueError, "at least one request"),
    (lambda a: {**a, "out": torch.empty(3, 8, 128, dtype=torch.bfloat16)}, ValueError, "out must have shape"),
    (lambda a: {**a, "out": a["q"].float()}, TypeError, "out must have dtype"),
    (lambda a: {**a, "q": a["q"].transpose(0, 1).contiguous().transpose(0, 1)}, ValueError, "contiguous"),
    (lambda a: {**a, "scale": -1.0}, ValueError, "scale"),
    (lambda a: {**a, "scale": float("nan")}, ValueError, "scale"),
])
def test_check_inputs_rejects(cpu_as_cuda, mutate, exc, match):
    q, k, v, cu, st, sl = make_case([4, 9], [0, 3], 8, 2, 128)
    a = mutate(dict(q=q, k=k, v=v, cu=cu, st=st, sl=sl, out=None, scale=0.0))
    with pytest.raises(exc, match=match):
        _check(a["q"], a["k"], a["v"], a["cu"], a["st"], a["sl"], a["out"], a["scale"])


@pytest.mark.parametrize("g", range(1, 17))
def test_check_inputs_accepts_every_group_up_to_16(cpu_as_cuda, g):
    _check(*make_case([4, 3], [0, 5], 2 * g, 2, 64))


@pytest.mark.parametrize("g", [17, 24, 32, 128])
def test_check_inputs_rejects_groups_over_16(cpu_as_cuda, g):
    q, k, v, cu, st, sl = make_case([4], [0], g, 1, 64)
    with pytest.raises(ValueError, match=f"{g} query heads per KV head; the GQA group must be at most 16"):
        _check(q, k, v, cu, st, sl)


def test_check_inputs_rejects_misaligned(cpu_as_cuda):
    q, k, v, cu, st, sl = make_case([4], [0], 4, 1, 64)
    flat = torch.empty(q.numel() + 1, dtype=torch.bfloat16)
    q2 = flat[1:].view(q.shape)
    with pytest.raises(ValueError, match="16-byte boundary"):
        _check(q2, k, v, cu, st, sl)


@pytest.mark.parametrize("cu,starts,slots,match", [
    ([0, 4, 8], [0, 0], [0, 1], None),
    ([1, 4, 8], [0, 0], [0, 1], "rise from 0"),
    ([0, 4, 7], [0, 0], [0, 1], "rise from 0"),
    ([0, 5, 4, 8], [0, 0, 0], [0, 1, 0], "rise from 0"),
    ([0, 4, 8], [-1, 0], [0, 1], "negative start"),
    ([0, 4, 8], [0, 9], [0, 1], "overflow"),
    ([0, 4, 8], [0, 0], [0, 2], "slot out of range"),
    ([0, 4, 8], [0, 0], [-1, 1], "slot out of range"),
])
def test_check_ranges(cu, starts, slots, match):
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    if match is None:
        pa.check_ranges(i32(cu), i32(starts), i32(slots), rows=8, capacity=12, num_slots=2)
    else:
        with pytest.raises(ValueError, match=match):
            pa.check_ranges(i32(cu), i32(starts), i32(slots), rows=8, capacity=12, num_slots=2)


def test_registry_entries():
    from futx.runtime.catalog.prefill_attention import PAGE_SIZES

    keys = [s.key for s in select("prefill.attn.*")]
    assert keys == sorted([attn_key(d) for d in HEAD_DIMS] + [attn_key(d, p) for d in HEAD_DIMS for p in PAGE_SIZES])
    assert PAGE_SIZES == (128, 256)
    for s in select("prefill.attn.*"):
        assert s.expect_sass == ("HGMMA",) and s.module == "futx.prefill.attention"
        assert dict(s.params).get("page_size", 0) == (int(s.key.rsplit(".p", 1)[1]) if ".p" in s.key else 0)


def test_stage_rule_fits_shared_memory():
    from futx.hardware import SMEM_PER_CTA

    pytest.importorskip("cutlass")
    from futx.prefill.attention import TILE_M, TILE_N, stages_for

    assert stages_for(128) == 3 and stages_for(64) == 4
    for d in HEAD_DIMS:
        assert TILE_M * d * 2 + stages_for(d) * 2 * TILE_N * d * 2 + 1024 <= SMEM_PER_CTA


# ---- sm_90a compile: HGMMA in SASS, no local-memory spills ------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("page_size", [0, 128, 256])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_compiles_for_sm90a_with_hgmma(tmp_path, d, page_size):
    pytest.importorskip("cutlass")
    import glob
    import subprocess
    import sys

    # a fresh process: the DSL's SASS-dump switches are read at import
    code = (
        "import os, glob, json\n"
        "import cutlass.cute as cute\n"
        "from futx.prefill.attention import compile_target\n"
        "from futx.runtime.fingerprint import COMPILE_OPTIONS\n"
        "from futx.runtime.compiler import sass_stats\n"
        f"fn, fake = compile_target({d}, {page_size})\n"
        "cute.compile(fn, *fake, options=COMPILE_OPTIONS)\n"
        "s = '\\n'.join(open(p, errors='replace').read() for p in glob.glob(os.environ['CUTE_DSL_DUMP_DIR'] + '/*.sass'))\n"
        "print(json.dumps(sass_stats(s)))\n"
    )
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin,sass", CUTE_DSL_DUMP_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    import json

    stats = json.loads(res.stdout.strip().splitlines()[-1])
    if not glob.glob(str(tmp_path / "*.sass")):
        pytest.skip("no SASS dumped (nvdisasm missing)")
    # Q K^T: D / 16 k-steps, P V: 128 / 16, one 64-row WGMMA per warpgroup each
    assert stats["HGMMA"] == d // 16 + 128 // 16, stats
    assert stats["LDL"] == 0 and stats["STL"] == 0, stats
