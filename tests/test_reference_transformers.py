"""The reference against transformers' LlamaForCausalLM (an independent implementation), if installed."""

import pytest
import torch

from futx.checkpoint.hf import hf_name
from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.kvcache import KVCache
from futx.reference import PackedBatch, forward

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")


def hf_model(weights):
    cfg = transformers.LlamaConfig(**{k: v for k, v in weights.config.to_hf_dict().items()
                                      if k not in ("architectures", "model_type", "torch_dtype")})
    model = transformers.LlamaForCausalLM(cfg).to(torch.float64).eval()
    state = {hf_name(f): t for f, t in weights.named_tensors()}
    if weights.lm_head is None:
        state["lm_head.weight"] = weights.embed
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers(seeded, tied):
    # Positions past original_max_position_embeddings (64) exercise all three Llama-3.1 RoPE regimes.
    cfg = tiny_config(tie_word_embeddings=tied)
    w = random_weights(cfg, seed=7, dtype=torch.float64, std=0.1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 90), generator=seeded)
    with torch.no_grad():
        expect = hf_model(w)(input_ids=tokens).logits
    got = forward(cfg, w, tokens.reshape(-1), PackedBatch.from_lengths([90, 90]), KVCache(cfg, 2, 90, dtype=torch.float64))
    # transformers forms RMSNorm statistics and RoPE angles in float32 even for a float64 model, so the
    # two agree to float32 rounding (observed ~1e-6), not to float64.
    assert (got.view(2, 90, -1) - expect).abs().max() < 1e-5 * expect.abs().max()
