"""The reference block and model against an independent float64 formula, plus input validation."""

import math

import pytest
import torch

from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.kvcache import KVCache
from futx.reference import PackedBatch, block, forward
from futx.rope import inv_freq

pytestmark = pytest.mark.usefixtures("single_thread")

CFG = tiny_config()


# ---- independent float64 formulas (explicit loops, complex-number RoPE) -------------------------------
def np_rms(x, g, eps):
    return [xi * g_i / math.sqrt(sum(v * v for v in x) / len(x) + eps) for xi, g_i in zip(x, g)]


def rope_vec(x, pos, freqs):
    half = len(x) // 2
    out = list(x)
    for i in range(half):
        c, s = math.cos(pos * freqs[i]), math.sin(pos * freqs[i])
        out[i], out[i + half] = x[i] * c - x[i + half] * s, x[i] * s + x[i + half] * c
    return out


def matvec(w, x):
    return [sum(a * b for a, b in zip(row, x)) for row in w]


def formula_block(cfg, lw, xs, positions):
    """One block for ONE request whose tokens xs (lists) sit at `positions` (0..n-1), float64 lists."""
    d, g = cfg.head_dim, cfg.group_size
    freqs = inv_freq(cfg).tolist()
    W = {k: getattr(lw, k).tolist() for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
    qs, ks, vs = [], [], []
    for x, p in zip(xs, positions):
        h = np_rms(x, lw.attn_norm.tolist(), cfg.rms_norm_eps)
        q, k, v = matvec(W["wq"], h), matvec(W["wk"], h), matvec(W["wv"], h)
        qs.append([rope_vec(q[i * d:(i + 1) * d], p, freqs) for i in range(cfg.num_attention_heads)])
        ks.append([rope_vec(k[i * d:(i + 1) * d], p, freqs) for i in range(cfg.num_key_value_heads)])
        vs.append([v[i * d:(i + 1) * d] for i in range(cfg.num_key_value_heads)])
    out = []
    for t, x in enumerate(xs):
        o = []
        for hh in range(cfg.num_attention_heads):
            kv = hh // g
            s = [sum(a * b for a, b in zip(qs[t][hh], ks[u][kv])) / math.sqrt(d) for u in range(t + 1)]
            mx = max(s)
            e = [math.exp(si - mx) for si in s]
            z = sum(e)
            o += [sum(e[u] / z * vs[u][kv][c] for u in range(t + 1)) for c in range(d)]
        x1 = [a + b for a, b in zip(x, matvec(W["wo"], o))]
        h = np_rms(x1, lw.mlp_norm.tolist(), cfg.rms_norm_eps)
        gate, up = matvec(W["w_gate"], h), matvec(W["w_up"], h)
        z = [a / (1 + math.exp(-a)) * b for a, b in zip(gate, up)]
        out.append([a + b for a, b in zip(x1, matvec(W["w_down"], z))])
    return out


def test_block_matches_formula(seeded):
    cfg = CFG.replace(num_hidden_layers=1)
    w = random_weights(cfg, seed=3, dtype=torch.float64, std=0.1)
    x = torch.randn(6, cfg.hidden_size, generator=seeded, dtype=torch.float64)
    cache = KVCache(cfg, 1, 8, dtype=torch.float64)
    got = block(cfg, w.layers[0], 0, x, PackedBatch.from_lengths([6]), cache)
    expect = torch.tensor(formula_block(cfg, w.layers[0], x.tolist(), list(range(6))), dtype=torch.float64)
    assert torch.allclose(got, expect, rtol=1e-11, atol=1e-11)
    assert (got - x).abs().max() > 1e-2  # the block did something


def test_model_matches_formula(seeded):
    w = random_weights(CFG, seed=5, dtype=torch.float64, std=0.1)
    tokens = torch.randint(0, CFG.vocab_size, (5,), generator=seeded)
    logits = forward(CFG, w, tokens, PackedBatch.from_lengths([5]), KVCache(CFG, 1, 5, dtype=torch.float64))
    xs = w.embed[tokens].tolist()
    for lw in w.layers:
        xs = formula_block(CFG, lw, xs, list(range(5)))
    expect = [matvec(w.lm_head.tolist(), np_rms(x, w.final_norm.tolist(), CFG.rms_norm_eps)) for x in xs]
    assert torch.allclose(logits, torch.tensor(expect, dtype=torch.float64), rtol=1e-11, atol=1e-11)


def test_tied_embedding_is_used_as_lm_head(seeded):
    cfg = CFG.replace(tie_word_embeddings=True)
    w = random_weights(cfg, seed=1, dtype=torch.float64)
    assert w.lm_head is None and w.output_weight is w.embed
    tokens = torch.randint(0, cfg.vocab_size, (4,), generator=seeded)
    a = forward(cfg, w, tokens, PackedBatch.from_lengths([4]), KVCache(cfg, 1, 4, dtype=torch.float64))
    w2 = w.to()
    w2.lm_head = w.embed.clone()
    w2.config = cfg.replace(tie_word_embeddings=False)
    b = forward(w2.config, w2, tokens, PackedBatch.from_lengths([4]), KVCache(cfg, 1, 4, dtype=torch.float64))
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 5e-2)])
def test_low_precision_tracks_float64(seeded, dtype, tol):
    w = random_weights(CFG, seed=2, dtype=torch.float64, std=0.1)
    tokens = torch.randint(0, CFG.vocab_size, (9,), generator=seeded)
    batch = PackedBatch.from_lengths([4, 5])
    ref = forward(CFG, w, tokens, batch, KVCache(CFG, 2, 8, dtype=torch.float64))
    low = forward(CFG, w.to(dtype), tokens, batch, KVCache(CFG, 2, 8, dtype=dtype))
    assert low.dtype == dtype
    rel = (low.double() - ref).norm() / ref.norm()
    assert rel < tol


def test_batch_metadata_from_prefix_sum():
    b = PackedBatch.from_lengths([3, 1, 2], start_positions=[0, 7, 4], slots=[2, 0, 1])
    assert b.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert b.row_request.tolist() == [0, 0, 0, 1, 2, 2]
    assert b.row_slot.tolist() == [2, 2, 2, 0, 1, 1]
    assert b.row_position.tolist() == [0, 1, 2, 7, 4, 5]
    d = PackedBatch.decode([5, 9])
    assert d.row_position.tolist() == [5, 9] and d.row_slot.tolist() == [0, 1]


@pytest.mark.parametrize("kwargs,msg", [
    ({"cu_seqlens": [0, 2, 2]}, "strictly increase"),
    ({"cu_seqlens": [1, 3]}, "start at 0"),
    ({"cu_seqlens": [0, 2], "slots": [0, 1]}, "1 start positions and slots"),
    ({"cu_seqlens": [0, 2, 3], "slots": [1, 1]}, "own cache slot"),
    ({"cu_seqlens": [0.0, 2.0]}, "integer"),
    ({"cu_seqlens": [0, 2], "start_positions": [-1]}, "non-negative"),
])
def test_batch_metadata_errors(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        PackedBatch.from_cu_seqlens(**kwargs)


def test_forward_input_errors(seeded):
    w = random_weights(CFG, seed=0)
    batch = PackedBatch.from_lengths([3])
    tokens = torch.tensor([1, 2, 3])
    cache = KVCache(CFG, 1, 4)
    with pytest.raises(ValueError, match="phase"):
        forward(CFG, w, tokens, batch, cache, phase="train")
    with pytest.raises(ValueError, match="integer"):
        forward(CFG, w, tokens.float(), batch, cache)
    with pytest.raises(ValueError, match="2 tokens but"):
        forward(CFG, w, tokens[:2], batch, cache)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 101\)"):
        forward(CFG, w, torch.tensor([1, 2, 101]), batch, cache)
    with pytest.raises(ValueError, match="different model shape"):
        forward(CFG, w, tokens, batch, KVCache(CFG.replace(num_hidden_layers=1), 1, 4))
    with pytest.raises(ValueError, match="cache slot 1"):
        forward(CFG, w, tokens, PackedBatch.from_lengths([3], slots=[1]), cache)
    with pytest.raises(ValueError, match="overflow"):
        forward(CFG, w, torch.arange(5), PackedBatch.from_lengths([5]), cache)
    bad = w.to()
    bad.layers[1] = bad.layers[1].replace(wk=bad.layers[1].wk[:, :-1])
    with pytest.raises(ValueError, match=r"layers.1.wk has shape \(32, 63\)"):
        forward(CFG, bad, tokens, batch, cache)
    mixed = w.to()
    mixed.final_norm = mixed.final_norm.double()
    with pytest.raises(ValueError, match="final_norm is torch.float64"):
        forward(CFG, mixed, tokens, batch, cache)
    with pytest.raises(ValueError, match="weights were built for config"):
        forward(CFG.replace(rope_theta=5.0), w, tokens, batch, cache)
