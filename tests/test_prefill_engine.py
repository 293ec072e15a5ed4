"""The packed prefill block (futx.engine.prefill) on the CPU: the emulated backend (the kernels' dataflow in
PyTorch) against the reference model, the cache rows it leaves for decode, chunked and padded prefill, the
delayed FP8 scale state, prefill + decode greedy tokens, the serving/ppl wiring and input validation."""

import pytest
import torch

from futx import cli
from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.engine import DecodeModel, pack_model
from futx.engine.cache import EngineCache
from futx.engine.packed import dequantize_weight
from futx.engine.perplexity import evaluate_engine
from futx.engine.prefill import (EmulatedPrefillOps, PrefillModel, ScaleState, pack_prefill, prefill_from_packed,
                                 prefill_tokens, quantize_rows)
from futx.kvcache import KVCache
from futx.quant.fold import fold_layer
from futx.quant.formats import weight_format
from futx.quant.simulated import quantized_weights
from futx.reference import PackedBatch, forward_hidden
from teacher_forcing import forced_decode_logits

pytestmark = pytest.mark.usefixtures("single_thread")
CFG = tiny_config(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, num_hidden_layers=2, vocab_size=300)
LENGTHS = [13, 7, 1, 22]   # odd lengths, a single-token request


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=3, std=0.1)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in lengths]


def _model(weights, fmt, cache_fmt="int4", slots=4, capacity=48, **kw):
    cache = EngineCache(CFG, cache_fmt, slots, capacity, "cpu", keep_values=True)
    return PrefillModel(pack_prefill(weights, fmt), cache, "emulated", **kw)


def _reference(weights, fmt, prompts, starts=None, cache=None):
    """Reference forward on the simulated-quantization prefill weights (gains folded, fmt-valued, float32)."""
    lengths = [len(p) for p in prompts]
    batch = PackedBatch.from_lengths(lengths, starts)
    cache = cache if cache is not None else KVCache(CFG, len(prompts), 48)
    h = forward_hidden(CFG, quantized_weights(weights, fmt), torch.tensor(sum(prompts, [])), batch, cache)
    last = torch.tensor(batch.host_lists()[0][1:]) - 1
    return h[last], cache


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("fmt", ["e4m3", "bf16"])
def test_prefill_weights_are_folded_and_laid_out(weights, fmt):
    pw = pack_prefill(weights, fmt)
    quant = weight_format(fmt).fake_quantize
    for layer, p in zip(weights.layers, pw.layers):
        f = fold_layer(layer)
        torch.testing.assert_close(dequantize_weight(p.qkv), quant(torch.cat([f.wq, f.wk, f.wv]), 64), rtol=0, atol=0)
        gu = dequantize_weight(p.gateup)
        torch.testing.assert_close(gu[0::2], quant(f.w_gate, 64), rtol=0, atol=0)
        torch.testing.assert_close(gu[1::2], quant(f.w_up, 64), rtol=0, atol=0)
        torch.testing.assert_close(dequantize_weight(p.down), quant(f.w_down, 64), rtol=0, atol=0)
    packed = pack_model(weights, fmt, progress=False)
    shared = prefill_from_packed(packed)
    for a, b in zip(pw.layers, shared.layers):
        torch.testing.assert_close(dequantize_weight(a.o), dequantize_weight(b.o), rtol=0, atol=0)
    with pytest.raises(ValueError, match="int4"):
        prefill_from_packed(pack_model(weights, "int4", progress=False))


# Relative error of the final normed hidden state vs the reference on the same (fmt-valued) weights, measured
# (seed 3, std 0.1): bf16 0.5 %; e4m3 9.5 % (2.7 % without the per-row activation quantization; for scale, the
# reference itself moves 8.7 % between BF16- and E4M3-valued weights: this random model amplifies errors).
@pytest.mark.parametrize("fmt,tol", [("bf16", 0.02), ("e4m3", 0.15)])
def test_emulated_prefill_matches_the_reference(weights, fmt, tol):
    prompts = _prompts(LENGTHS)
    pm = _model(weights, fmt, cache_fmt="bf16")
    out = prefill_tokens(pm, prompts, want_logits=True)
    ref, ref_cache = _reference(weights, fmt, prompts)
    assert out.normed.shape == (4, CFG.hidden_size) and out.logits.shape == (4, CFG.vocab_size)
    assert _rel(out.normed, ref) < tol
    # the K/V main copy of every request, every layer (RoPE'd K, V), and nothing past the prompt
    for layer in range(CFG.num_hidden_layers):
        lc = pm.cache.layers[layer]
        for b, n in enumerate(LENGTHS):
            assert _rel(lc.k_cache[b, :, :n], ref_cache.k[layer][b, :, :n]) < tol
            assert _rel(lc.v_cache[b, :, :n], ref_cache.v[layer][b, :, :n]) < tol
            assert not lc.k_cache[b, :, n:].any() and not lc.v_cache[b, :, n:].any()


@pytest.mark.parametrize("cache_fmt,tol", [("e4m3", 0.15), ("int4", 0.25)])
def test_mirror_rows_are_what_write_rows_stores(weights, cache_fmt, tol):
    """The decode mirror of the prefilled rows equals EngineCache.write_rows of the main-copy rows (so decode
    reads what it would after a reference prefill) and is close to the reference K/V."""
    prompts = _prompts(LENGTHS)
    pm = _model(weights, "e4m3", cache_fmt=cache_fmt)
    prefill_tokens(pm, prompts)
    other = EngineCache(CFG, cache_fmt, 4, 48, "cpu", keep_values=True)
    _, ref_cache = _reference(weights, "e4m3", prompts)
    for layer in range(CFG.num_hidden_layers):
        lc = pm.cache.layers[layer]
        for b, n in enumerate(LENGTHS):
            sl, ps = torch.full((n,), b), torch.arange(n)
            other.write_rows(layer, sl, ps, lc.k_cache[sl, :, ps], lc.v_cache[sl, :, ps])
        for t_got, t_want in zip(lc.tensors(), other.layers[layer].tensors()):
            assert torch.equal(t_got.view(torch.uint8) if t_got.dtype == torch.float8_e4m3fn else t_got,
                               t_want.view(torch.uint8) if t_want.dtype == torch.float8_e4m3fn else t_want)
        for b, n in enumerate(LENGTHS):
            k, v = pm.cache.read(layer, b, n)
            assert _rel(k, ref_cache.k[layer][b, :, :n]) < tol and _rel(v, ref_cache.v[layer][b, :, :n]) < tol


@pytest.mark.parametrize("fmt", ["e4m3", "bf16"])
def test_chunked_prefill_continues_from_the_cache(weights, fmt):
    """Prompts prefilled in two chunks (the second at start > 0, reading the first from the cache) = at once."""
    prompts = _prompts([21, 9, 14], seed=4)
    whole = prefill_tokens(_model(weights, fmt, slots=3, initial_amax=8.0), prompts)
    pm = _model(weights, fmt, slots=3, initial_amax=8.0)   # fixed SwiGLU scales: every call uses the same
    first_scales = [s.clone() for s in pm.state().scale]
    cut = [8, 4, 13]
    prefill_tokens(pm, [p[:c] for p, c in zip(prompts, cut)])
    for s, s0 in zip(pm.state().scale, first_scales):
        s.copy_(s0)
    second = prefill_tokens(pm, [p[c:] for p, c in zip(prompts, cut)], starts=cut)
    assert _rel(second.normed, whole.normed) < 0.01
    ref, _ = _reference(weights, fmt, prompts)
    assert _rel(second.normed, ref) < (0.02 if fmt == "bf16" else 0.15)


def test_padded_path_equals_packed(weights):
    prompts = _prompts([17, 3, 9], seed=5)
    packed = prefill_tokens(_model(weights, "bf16", slots=3), prompts, want_logits=True)
    pm = _model(weights, "bf16", slots=3)
    padded = pm.forward_padded(prompts, want_logits=True)
    assert pm.stats.padded_rows == 3 * 17 - 29
    assert _rel(padded.normed, packed.normed) < 1e-2
    assert (padded.logits.argmax(-1) == packed.logits.argmax(-1)).all()
    for layer in range(CFG.num_hidden_layers):   # the mirror holds only the real rows
        assert not pm.cache.values[layer][0][1, :, 3:].any()


def test_delayed_scale_state(weights):
    prompts = _prompts(LENGTHS)
    pm = _model(weights, "e4m3")
    st = pm.state(0)
    assert st.calibrated == [False, False]
    prefill_tokens(pm, prompts)
    assert st.calibrated == [True, True] and st.saturations() == 0
    # after a call, the scale is that call's amax * margin / 448
    for i in range(2):
        torch.testing.assert_close(st.scale[i], st.amax[i] * 2.0 / 448, rtol=1e-6, atol=0)
    s1 = [s.clone() for s in st.scale]
    prefill_tokens(pm, prompts, group=1)          # another request group: its own state
    assert pm.state(1) is not st and all(torch.equal(a, b) for a, b in zip(s1, st.scale))
    # a stale scale saturates and is counted
    st.scale[0].fill_(1e-6)
    prefill_tokens(pm, prompts)
    assert st.saturations() > 0
    with pytest.raises(ValueError, match="margin"):
        ScaleState(2, "cpu", margin=0.5)
    fixed = ScaleState(1, "cpu", initial_amax=448.0, margin=1.0)
    assert fixed.calibrated == [True] and float(fixed.scale[0]) == 1.0
    fixed.amax[0].zero_()
    fixed.next_scale(0)                            # an all-zero output keeps the previous scale
    assert float(fixed.scale[0]) == 1.0


def test_quantize_rows():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    x[2] = 0
    q, s = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5,) and float(s[2]) == 1.0
    assert float(q.float().abs().amax(1)[torch.arange(5) != 2].min()) == 448.0
    back = q.float() * s[:, None]
    assert float(((back - x.float()).abs() - x.float().abs() / 16).max()) <= 1e-6


def test_emulated_rms_partials_sum_to_the_row_sum():
    g = torch.Generator().manual_seed(1)
    a, w = torch.randn(7, 64, generator=g).bfloat16(), torch.randn(576, 64, generator=g).bfloat16()
    res = torch.randn(7, 576, generator=g).bfloat16()
    for variant, tiles in (("n256.pp", 3), ("n128", 5)):
        sumsq = torch.full((tiles, 7), float("nan"))
        out = EmulatedPrefillOps().gemm(a, w, "res_bf16", residual=res)
        out2 = EmulatedPrefillOps().gemm(a.float().to(torch.float8_e4m3fn), w.float().to(torch.float8_e4m3fn),
                                         "scale_res_rms_bf16", variant=variant, a_scale=torch.ones(7),
                                         b_scale=torch.ones(576), residual=res, sumsq=sumsq)
        assert out.dtype == out2.dtype == torch.bfloat16
        torch.testing.assert_close(sumsq.sum(0), out2.float().pow(2).sum(1), rtol=1e-5, atol=0)


@pytest.mark.parametrize("fmt,min_agree,max_gap", [("bf16", 0.85, 0.3), ("e4m3", 0.6, 0.5)])
def test_prefill_then_decode_greedy_tokens(weights, fmt, min_agree, max_gap):
    """Kernel prefill (emulated) + engine decode (E4M3 weights, INT4 cache) vs the reference BF16 prefill + the
    same decode, 8 prompts x 8 teacher-forced steps: the greedy token agrees at >= min_agree of the positions,
    and every disagreement is a near tie of the reference (top-2 logit gap < max_gap logit standard deviations).
    Measured: bf16 58/64 agree (disagreements at gaps <= 0.14), e4m3 46/64 (gaps <= 0.34); the median gap of
    this random model is only 0.25, so its argmax flips easily (decode logits move 7 % / 20 %)."""
    prompts = _prompts([12, 5, 19, 8, 23, 2, 15, 9], seed=7)
    cont = torch.randint(0, CFG.vocab_size, (8, 8), generator=torch.Generator().manual_seed(1))
    ref = forced_decode_logits(weights, "reference", prompts, cont)
    got = forced_decode_logits(weights, fmt, prompts, cont)
    differ = got.argmax(-1) != ref.argmax(-1)
    top = ref.topk(2, dim=-1).values
    gap = (top[..., 0] - top[..., 1]) / ref.std(dim=-1)
    assert 1 - float(differ.float().mean()) >= min_agree
    assert not differ.any() or float(gap[differ].max()) < max_gap


def test_serving_engine_prefills_through_the_kernel_path(weights):
    from futx.serve.engines import Chunk, DecodeEngine

    model = DecodeModel(pack_model(weights, "int4", progress=False), "int4", max_batch=2, capacity=48,
                        backend="emulated", device="cpu")
    pm = PrefillModel(pack_prefill(weights, "e4m3"), model.cache, "emulated")
    eng = DecodeEngine(model, None, None, pm)
    assert eng.prefills and "emulated kernel prefill (e4m3" in eng.describe()
    prompts = _prompts([10, 6], seed=8)
    eng.prefill([Chunk(0, prompts[0][:4], 0, 10), Chunk(1, prompts[1], 0, 6)])
    eng.prefill([Chunk(0, prompts[0][4:], 4, 10)])
    assert pm.stats.calls == 2 and pm.stats.rows == 16
    other = DecodeModel(pack_model(weights, "int4", progress=False), "int4", max_batch=2, capacity=48,
                        backend="emulated", device="cpu")
    prefill_tokens(PrefillModel(pack_prefill(weights, "e4m3"), other.cache, "emulated"), prompts)
    for layer in range(CFG.num_hidden_layers):
        assert _rel(model.cache.values[layer][0][:2, :, :10], other.cache.values[layer][0][:2, :, :10]) < 0.05
    with pytest.raises(ValueError, match="own cache"):
        DecodeEngine(model, None, None, PrefillModel(pack_prefill(weights, "bf16"), other.cache, "emulated"))


def test_engine_perplexity_with_the_kernel_prefill(weights):
    windows = torch.randint(0, CFG.vocab_size, (3, 32), generator=torch.Generator().manual_seed(5))
    res = {}
    for kind in ("reference", "e4m3", "bf16"):
        model = DecodeModel(pack_model(weights, "int4", progress=False), "int4", max_batch=2, capacity=32,
                            backend="emulated", device="cpu")
        pm = None if kind == "reference" else PrefillModel(pack_prefill(weights, kind), model.cache, "emulated")
        res[kind] = evaluate_engine(model, windows, "serving", weights, prefill_weights=quantized_weights(
            weights, "bf16") if pm is None else None, prefill_model=pm)
    for kind in ("e4m3", "bf16"):
        assert res[kind].tokens == res["reference"].tokens
        assert abs(res[kind].mean_nll - res["reference"].mean_nll) < 0.01 * res["reference"].mean_nll


def test_inputs_are_checked(weights):
    pm = _model(weights, "e4m3", slots=2, capacity=16)
    with pytest.raises(ValueError, match="token ids"):
        prefill_tokens(pm, [[300]])
    with pytest.raises(ValueError, match="slot"):
        prefill_tokens(pm, [[1, 2]], slots=[2])
    with pytest.raises(ValueError, match="overflow"):
        prefill_tokens(pm, [[1] * 10], starts=[7])
    with pytest.raises(ValueError, match="rows"):
        pm.forward(torch.tensor([1, 2, 3]), PackedBatch.from_lengths([2]))
    with pytest.raises(ValueError, match="1-D integer"):
        pm.forward(torch.tensor([1.0, 2.0]), PackedBatch.from_lengths([2]))
    with pytest.raises(ValueError, match="CUDA"):
        PrefillModel(pack_prefill(weights, "bf16"), pm.cache, "kernels")
    with pytest.raises(ValueError, match="format"):
        pack_prefill(weights, "int4")
    with pytest.raises(ValueError, match="another model shape"):
        PrefillModel(pack_prefill(weights, "bf16"), EngineCache(CFG.replace(num_hidden_layers=1), "bf16", 1, 16,
                                                                "cpu"), "emulated")
    with pytest.raises(ValueError, match="16"):
        pack_prefill(random_weights(CFG.replace(hidden_size=120), seed=0), "e4m3")


@pytest.mark.parametrize("hq,hkv", [(9, 3), (6, 1), (7, 1), (16, 1)])
def test_attention_kernel_for_every_group_up_to_16(hq, hkv):
    """GQA groups 1..16 use the attention kernel, also those not dividing its 128-row tile (SmolLM2-135M: 9 query
    heads over 3 KV heads); attention="torch" still forces the fallback."""
    cfg = CFG.replace(num_attention_heads=hq, num_key_value_heads=hkv)
    w = random_weights(cfg, seed=1, std=0.1)
    pm = PrefillModel(pack_prefill(w, "bf16"), EngineCache(cfg, "bf16", 1, 16, "cpu"), "emulated")
    assert pm.attention_impl == "kernel" and "attention in torch" not in pm.describe()
    pm = PrefillModel(pack_prefill(w, "bf16"), EngineCache(cfg, "bf16", 1, 16, "cpu"), "emulated", attention="torch")
    assert pm.attention_impl == "torch"


def test_attention_fallback_for_groups_the_kernel_cannot_take():
    """GQA group 17 is past the attention kernel's largest group (16): attention runs in torch."""
    cfg = CFG.replace(num_attention_heads=17, num_key_value_heads=1)
    w = random_weights(cfg, seed=1, std=0.1)
    pm = PrefillModel(pack_prefill(w, "bf16"), EngineCache(cfg, "bf16", 1, 16, "cpu"), "emulated")
    assert pm.attention_impl == "torch" and "attention in torch" in pm.describe()
    with pytest.raises(ValueError, match="group of 1..16"):
        PrefillModel(pack_prefill(w, "bf16"), EngineCache(cfg, "bf16", 1, 16, "cpu"), "emulated", attention="kernel")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, weights):
    from tiny_checkpoint import save_tiny_hf

    return save_tiny_hf(tmp_path_factory.mktemp("prefill-tiny"), weights)


def test_cli_ppl_and_generate_with_the_kernel_prefill(model_dir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("some words to score " * 40)
    assert cli.main(["ppl", "--model", str(model_dir), "--backend", "emulated", "--text", str(text), "--window",
                     "32", "--max-windows", "2", "--protocol", "serving", "--no-progress", "--max-batch", "2",
                     "--prefill", "kernels", "--prefill-format", "bf16", "--json", str(tmp_path / "r.json")]) == 0
    out, _ = capsys.readouterr()
    assert "| serving | 2 | 32 |" in out and "emulated kernel prefill (bf16" in out
    assert '"prefill": "kernels-bf16"' in (tmp_path / "r.json").read_text()
    assert cli.main(["generate", "--model", str(model_dir), "--backend", "emulated", "--prompt", "the heat",
                     "--max-new-tokens", "3", "--ignore-eos", "--prefill", "kernels"]) == 0
    _, err = capsys.readouterr()
    assert "emulated kernel prefill (e4m3" in err and "prompt tokens prefilled" in err
    assert cli.main(["serve", "--model", str(model_dir), "--backend", "reference", "--prefill", "kernels"]) == 2
    assert "--prefill kernels" in capsys.readouterr().err
