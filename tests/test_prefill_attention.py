"""Prefill attention (futx/prefill_attention.py, futx.ops.prefill_attention) on the CPU: the float64
reference of the kernel's exact math agrees with futx's reference model attention on random packed
batches with chunked-prefill starts; the op's validation; the sm_90a compile and its SASS (HGMMA, no
spills). The GPU comparison is tests/test_prefill_attention_gpu.py."""

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


def test_check_inputs_rejects_group_not_dividing_tile(cpu_as_cuda):
    q, k, v, cu, st, sl = make_case([4], [0], 3, 1, 64)   # group 3 does not divide 128 rows
    with pytest.raises(ValueError, match="must divide 128"):
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
    keys = [s.key for s in select("prefill.attn.*")]
    assert keys == sorted(attn_key(d) for d in HEAD_DIMS)
    for s in select("prefill.attn.*"):
        assert s.expect_sass == ("HGMMA",) and s.module == "futx.prefill_attention"


def test_stage_rule_fits_shared_memory():
    from futx.hardware import SMEM_PER_CTA

    pytest.importorskip("cutlass")
    from futx.prefill_attention import TILE_M, TILE_N, stages_for

    assert stages_for(128) == 3 and stages_for(64) == 4
    for d in HEAD_DIMS:
        assert TILE_M * d * 2 + stages_for(d) * 2 * TILE_N * d * 2 + 1024 <= SMEM_PER_CTA


# ---- sm_90a compile: HGMMA in SASS, no local-memory spills ------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_compiles_for_sm90a_with_hgmma(tmp_path, d):
    pytest.importorskip("cutlass")
    import glob
    import subprocess
    import sys

    # a fresh process: the DSL's SASS-dump switches are read at import
    code = (
        "import os, glob, json\n"
        "import cutlass.cute as cute\n"
        "from futx.prefill_attention import compile_target\n"
        "from futx.runtime.fingerprint import COMPILE_OPTIONS\n"
        "from futx.runtime.compiler import sass_stats\n"
        f"fn, fake = compile_target({d})\n"
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
