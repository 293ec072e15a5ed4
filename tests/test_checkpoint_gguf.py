"""GGUF: Q/K un-permutation (against interleaved RoPE), save/load round trip, errors, real SmolLM2-135M."""

import math

import pytest
import torch

from futx.checkpoint import load
from futx.checkpoint.gguf import load_gguf, permute_rows, save_gguf, unpermute_rows
from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.config import preset
from futx.reference.weights import ModelWeights
from futx.rope import apply_rope, cos_sin, inv_freq

pytestmark = pytest.mark.usefixtures("single_thread")
CFG = tiny_config(rope_scaling=None)


def test_unpermute_index_map():
    heads, d = 3, 8
    w = torch.arange(heads * d, dtype=torch.float64)[:, None]
    hf = unpermute_rows(w, heads)
    for h in range(heads):
        for i in range(d // 2):
            for j in range(2):  # GGUF row h*D + 2i + j holds HF row h*D + j*D/2 + i
                assert hf[h * d + j * d // 2 + i, 0] == w[h * d + 2 * i + j, 0]
    assert torch.equal(permute_rows(hf, heads), w)
    with pytest.raises(ValueError, match="un-permute"):
        unpermute_rows(torch.ones(10, 2), 3)


def interleaved_rope(x, positions, freqs):
    """llama.cpp's NORM RoPE: channel pairs (2i, 2i+1) rotated by position * freq_i."""
    out = x.clone()
    ang = positions.double()[:, None] * freqs[None, :]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
    return out


def test_unpermuted_rows_with_rotate_half_equal_gguf_rows_with_interleaved_rope(seeded):
    """Attention scores are what matter: q.k from GGUF-order rows + interleaved RoPE must equal q.k from
    un-permuted rows + rotate-half RoPE (the two orders differ only by a per-head channel permutation)."""
    cfg = preset("smollm2-135m")
    heads, d = cfg.num_key_value_heads, cfg.head_dim
    w_gguf = torch.randn(heads * d, 32, generator=seeded, dtype=torch.float64)
    x = torch.randn(6, 32, generator=seeded, dtype=torch.float64)
    pos = torch.tensor([0, 3, 17, 200, 1000, 4000])
    a = interleaved_rope((x @ w_gguf.T).view(6, heads, d), pos, inv_freq(cfg))
    cos, sin = cos_sin(cfg, pos, torch.float64)
    b = apply_rope((x @ unpermute_rows(w_gguf, heads).T).view(6, heads, d), cos, sin)
    scores_a = torch.einsum("mhd,nhd->hmn", a, a)
    scores_b = torch.einsum("mhd,nhd->hmn", b, b)
    assert torch.allclose(scores_a, scores_b, rtol=1e-12, atol=1e-10)
    assert not torch.allclose(b, a)  # the layouts really differ


@pytest.mark.parametrize("tied", [False, True])
def test_f32_round_trip(tmp_path, tied):
    cfg = CFG.replace(tie_word_embeddings=tied)
    w = random_weights(cfg, seed=2)
    path = save_gguf(tmp_path / "m.gguf", w)
    back = load(path)
    assert back.config.replace(name=cfg.name) == cfg
    for (name, a), (_, b) in zip(w.named_tensors(), back.named_tensors()):
        assert torch.equal(a, b), name
    assert (back.lm_head is None) == tied


def test_q8_0_round_trip(tmp_path):
    w = random_weights(CFG.replace(hidden_size=64, intermediate_size=128), seed=3)
    back = load_gguf(save_gguf(tmp_path / "q8.gguf", w, qtype="Q8_0"), dtype=torch.float64)
    for (name, a), (_, b) in zip(w.named_tensors(), back.named_tensors()):
        rel = float((a.double() - b).norm() / a.double().norm())
        assert rel < (1e-7 if a.dim() == 1 else 1e-2), name  # norms stay F32; matrices 8-bit


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_gguf(tmp_path / "none.gguf")
    path = save_gguf(tmp_path / "m.gguf", random_weights(CFG))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(ValueError, match="cut.gguf"):
        load_gguf(cut)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="junk.gguf"):
        load_gguf(tmp_path / "junk.gguf")

    import gguf
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.ones(4, 4).numpy())
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_gguf(tmp_path / "gpt2.gguf")

    w = random_weights(CFG)
    w.named_tensors = lambda: (x for x in ModelWeights.named_tensors(w) if x[0] != "layers.1.wv")
    save_gguf(tmp_path / "missing.gguf", w)
    with pytest.raises(ValueError, match="missing tensor 'blk.1.attn_v.weight'"):
        load_gguf(tmp_path / "missing.gguf")


# ---- the real checkpoint ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load("smollm2-135m")


def test_smollm2_published_shapes(smollm2):
    c = smollm2.config
    assert c.replace(name="smollm2-135m") == preset("smollm2-135m")
    assert smollm2.embed.shape == (49152, 576) and smollm2.lm_head is None
    l0 = smollm2.layers[0]
    assert (l0.wq.shape, l0.wk.shape, l0.wv.shape, l0.wo.shape) == ((576, 576), (192, 576), (192, 576), (576, 576))
    assert (l0.w_gate.shape, l0.w_up.shape, l0.w_down.shape) == ((1536, 576), (1536, 576), (576, 1536))
    assert len(smollm2.layers) == 30
    n = sum(t.numel() for _, t in smollm2.named_tensors())
    assert n == 134_515_008  # SmolLM2-135M's published parameter count


def test_smollm2_perplexity_in_expected_range(smollm2):
    """Two 256-token WikiText-2 windows: a wrong Q/K order or RoPE gives perplexity in the hundreds."""
    from futx.eval.data import default_text
    from futx.eval import Runner, evaluate, join_rows, make_windows, read_rows
    from futx.tokenizer import load_tokenizer

    text = default_text()
    if text is None:
        pytest.skip("../shared/data/wikitext-2-raw/wiki.test.raw is not beside the repository")
    windows = make_windows(load_tokenizer().encode(join_rows(read_rows(text)[:40])), 256, 2)
    with torch.inference_mode():
        r = evaluate(Runner(smollm2), windows, "gptq", progress=False)
    assert (r.windows, r.tokens) == (2, 510)
    assert 15 < r.ppl < 45 and math.isfinite(r.mean_nll)
