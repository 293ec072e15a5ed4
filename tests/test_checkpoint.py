"""Hugging Face checkpoints: save/load round trip (single file and sharded), synthetic writer, errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from futx.checkpoint import load, resolve
from futx.checkpoint.hf import INDEX_FILE, SINGLE_FILE, load_hf, save_hf
from futx.checkpoint.synthetic import random_weights, tiny_config, write_synthetic
from futx.config import LlamaConfig

pytestmark = pytest.mark.usefixtures("single_thread")
CFG = tiny_config()


def same(a, b):
    return all(torch.equal(x, y) for (_, x), (_, y) in zip(a.named_tensors(), b.named_tensors())) and \
        len(list(a.named_tensors())) == len(list(b.named_tensors()))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_single_file(tmp_path, tied, dtype):
    cfg = CFG.replace(tie_word_embeddings=tied)
    w = random_weights(cfg, seed=4, dtype=dtype)
    save_hf(tmp_path, w)
    assert (tmp_path / SINGLE_FILE).is_file() and not (tmp_path / INDEX_FILE).exists()
    back = load_hf(tmp_path, dtype=dtype)
    assert back.config.replace(name="tiny") == cfg and back.config.name == tmp_path.name
    assert (back.lm_head is None) == tied and same(back, w)
    assert load(tmp_path, dtype=dtype).embed.dtype == dtype  # the generic entry dispatches on directories


def test_round_trip_sharded(tmp_path):
    w = random_weights(CFG, seed=5)
    save_hf(tmp_path, w, max_shard_bytes=20_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not list(tmp_path.glob("*.tmp"))
    assert same(load_hf(tmp_path), w)


def test_synthetic_checkpoint_scales(tmp_path):
    write_synthetic(tmp_path, CFG, seed=1, max_shard_bytes=None)
    w = load_hf(tmp_path)
    assert w.embed.dtype == torch.float32  # loaded as requested; stored bf16
    assert load_file(tmp_path / SINGLE_FILE)["model.embed_tokens.weight"].dtype == torch.bfloat16
    proj = torch.cat([l.wq.flatten() for l in w.layers])
    gains = torch.cat([l.attn_norm for l in w.layers])
    assert 0.018 < float(proj.std()) < 0.022 and abs(float(proj.mean())) < 1e-3
    assert 0.75 < float(gains.min()) and float(gains.max()) < 1.25 and 0.03 < float(gains.std()) < 0.07


def test_paper_shape_config_writes(tmp_path):
    # A paper-size layer (1B shape) with a cut-down vocab, streamed into 2 shards.
    from futx.config import preset
    cfg = preset("layer-1b").replace(vocab_size=256)
    write_synthetic(tmp_path, cfg, max_shard_bytes=40 << 20)
    assert json.loads((tmp_path / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    assert load_hf(tmp_path, dtype=torch.bfloat16).layers[0].w_gate.shape == (8192, 2048)


# ---- malformed input ------------------------------------------------------------------------------------
def test_missing_config(tmp_path):
    with pytest.raises(ValueError, match="config.json not found"):
        load_hf(tmp_path)


def test_unknown_architecture(tmp_path):
    save_hf(tmp_path, random_weights(CFG))
    d = json.loads((tmp_path / "config.json").read_text())
    d.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="unsupported architecture.*mistral"):
        load_hf(tmp_path)


def test_missing_config_field(tmp_path):
    save_hf(tmp_path, random_weights(CFG))
    d = json.loads((tmp_path / "config.json").read_text())
    del d["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="missing required field 'intermediate_size'"):
        load_hf(tmp_path)


def test_missing_tensor(tmp_path):
    save_hf(tmp_path, random_weights(CFG))
    tensors = load_file(tmp_path / SINGLE_FILE)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / SINGLE_FILE)
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_hf(tmp_path)


def test_wrong_shape(tmp_path):
    save_hf(tmp_path, random_weights(CFG))
    tensors = load_file(tmp_path / SINGLE_FILE)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.ones(16, 64)
    save_file(tensors, tmp_path / SINGLE_FILE)
    with pytest.raises(ValueError, match=r"k_proj.weight' .* has shape \(16, 64\), expected \(32, 64\)"):
        load_hf(tmp_path)


def test_truncated_file(tmp_path):
    save_hf(tmp_path, random_weights(CFG))
    f = tmp_path / SINGLE_FILE
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match="truncated"):
        load_hf(tmp_path)


def test_missing_shard_and_weights(tmp_path):
    save_hf(tmp_path, random_weights(CFG), max_shard_bytes=20_000)
    next(tmp_path.glob("model-00002-of-*.safetensors")).unlink()
    with pytest.raises(ValueError, match="shard .*model-00002-of-.* does not exist"):
        load_hf(tmp_path)
    for f in tmp_path.glob("model*"):
        f.unlink()
    with pytest.raises(ValueError, match="neither model.safetensors nor"):
        load_hf(tmp_path)


def test_resolve_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        resolve(tmp_path / "nope")
    (tmp_path / "x.bin").write_bytes(b"1")
    with pytest.raises(ValueError, match="neither a checkpoint directory nor a .gguf"):
        resolve(tmp_path / "x.bin")


def test_weights_validate_names_the_problem():
    w = random_weights(CFG)
    w.layers = w.layers[:1]
    with pytest.raises(ValueError, match="1 layers"):
        w.validate()
    assert isinstance(CFG, LlamaConfig)
