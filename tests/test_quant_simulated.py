"""The simulated-quantization model and whole-model INT4 quantization (RTN/GPTQ, save/load)."""

import pytest
import torch

from futx.checkpoint.synthetic import random_weights
from futx.config import LlamaConfig
from futx.quant import fold, gptq, int4
from futx.quant.capture import probe
from futx.quant.simulated import QuantSpec, quantized_weights, simulate
from futx.reference import PackedBatch, forward

CFG = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, num_hidden_layers=2, vocab_size=101, name="tiny")

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny ops: avoid OpenMP spin-waits


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=5)


def test_probe_reports_input_and_computes(seeded):
    got = []
    w = torch.randn(8, 4, generator=seeded)
    h = torch.randn(3, 4, generator=seeded)
    y = h @ probe(w, "w", lambda name, x: got.append((name, x))).T
    assert torch.equal(y, h @ w.T) and type(y) is torch.Tensor
    assert len(got) == 1 and got[0][0] == "w" and torch.equal(got[0][1], h)


def test_quantized_weights_are_exact_formats(weights):
    q = quantized_weights(weights, "int4", 64)
    f = fold.fold_model(weights)
    assert torch.equal(q.layers[1].w_up, int4.fake_quantize_int4(f.layers[1].w_up, 64))
    assert torch.equal(q.layers[0].mlp_norm, torch.ones(128))
    assert torch.equal(quantized_weights(weights, "bf16").layers[0].wq, f.layers[0].wq.bfloat16().float())
    with pytest.raises(ValueError, match="INT4 is decode only"):
        QuantSpec(prefill_weights="int4")
    with pytest.raises(ValueError, match="unknown"):
        QuantSpec(cache="int3")


def test_simulated_decode_reads_mirror(weights, seeded):
    tokens = torch.randint(0, 101, (2, 24), generator=seeded)
    batch = PackedBatch.from_lengths([24, 24])
    outs = {}
    for cache in ("bf16", "int4", "int4-unrotated"):
        sm = simulate(weights, QuantSpec("int4", "bf16", cache, group_size=64))
        outs[cache] = forward(CFG, sm.decode, tokens.reshape(-1), batch, sm.new_cache(2, 24), "decode")
        # prefill reads the main copy: the cache format must not matter there
        pre = forward(CFG, sm.decode, tokens.reshape(-1), batch, sm.new_cache(2, 24), "prefill")
        outs[cache + "/prefill"] = pre
    assert torch.equal(outs["int4/prefill"], outs["int4-unrotated/prefill"])
    assert not torch.equal(outs["int4"], outs["int4-unrotated"])
    assert (outs["int4"] - outs["bf16"]).abs().max() < 0.5 * outs["bf16"].abs().max()


def test_rtn_model_matches_packer_and_roundtrips(weights, tmp_path):
    m = gptq.quantize_model(weights, method="rtn", group_size=64)
    f = fold.fold_model(weights)
    ref = int4.quantize_int4(f.layers[0].wk, 64)
    assert torch.equal(m.weights["layers.0.wk"].packed, ref.packed)
    path = tmp_path / "rtn.safetensors"
    gptq.save(m, path)
    back = gptq.load(path)
    assert back.methods == m.methods and back.group_size == 64
    for name, w in m.weights.items():
        assert torch.equal(back.weights[name].packed, w.packed) and torch.equal(back.weights[name].scales, w.scales)


def test_gptq_model_overrides_and_same_packer(weights, seeded, tmp_path):
    calib = torch.randint(0, 101, (3, 32), generator=seeded)
    m = gptq.quantize_model(weights, calib, group_size=64, rtn=["layers.1.down"], progress=False)
    assert m.methods["layers.1.w_down"] == "rtn" and m.methods["layers.0.w_down"] == "gptq"
    f = fold.fold_model(weights)
    assert torch.equal(m.weights["layers.1.w_down"].packed, int4.quantize_int4(f.layers[1].w_down, 64).packed)
    for name, w in m.weights.items():  # the GPTQ grid through the RTN packer: same bytes
        q, s = int4.unpack_int4(w)
        assert torch.equal(int4.pack_int4(q, s, 64).packed, w.packed)
        assert m.methods[name] == "rtn" or m.stats[name] <= 1.0 + 1e-9
    gptq.save(m, tmp_path / "g.safetensors")
    sm = simulate(weights, QuantSpec("int4", group_size=64), gptq.load(tmp_path / "g.safetensors"))
    assert torch.equal(sm.decode.layers[0].wq, m.dequantized("layers.0.wq"))


def test_gptq_model_errors(weights):
    with pytest.raises(ValueError, match="calibration"):
        gptq.quantize_model(weights, None, group_size=64)
    with pytest.raises(ValueError, match="multiple of the group size"):
        gptq.quantize_model(weights, method="rtn", group_size=192)
    with pytest.raises(ValueError, match="bad projection"):
        gptq.projection_name("layers.1.mlp")
    assert gptq.projection_name("layers.2.gate") == "layers.2.w_gate"
