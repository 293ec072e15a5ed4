"""Gain folding: the folded block equals the original; the row factor is what the epilogue applies."""

import pytest
import torch

from futx.checkpoint.synthetic import random_weights
from futx.config import LlamaConfig
from futx.kvcache import KVCache
from futx.quant import fold
from futx.reference import PackedBatch, forward, rms_norm

CFG = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_hidden_layers=2, vocab_size=97, name="tiny")

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny ops: avoid OpenMP spin-waits


def test_fold_gain_and_row_factor(seeded):
    x = torch.randn(5, 64, generator=seeded, dtype=torch.float64)
    gamma = 1 + 0.1 * torch.randn(64, generator=seeded, dtype=torch.float64)
    w = torch.randn(24, 64, generator=seeded, dtype=torch.float64)
    ref = rms_norm(x, gamma, 1e-5) @ w.T
    rho = fold.rms_row_factor(x, 1e-5)
    assert torch.allclose(rho[:, None] * (x @ fold.fold_gain(w, gamma).T), ref, atol=1e-12)


def test_folded_model_equals_original(seeded):
    w = random_weights(CFG, seed=3, dtype=torch.float64)
    folded = fold.fold_model(w)
    assert all(torch.equal(layer.attn_norm, torch.ones(64, dtype=torch.float64)) for layer in folded.layers)
    assert torch.equal(folded.final_norm, w.final_norm) and folded.lm_head is w.lm_head
    tokens = torch.randint(0, 97, (12,), generator=seeded)
    out = []
    for weights in (w, folded):
        cache = KVCache(CFG, 1, 12, dtype=torch.float64)
        out.append(forward(CFG, weights, tokens, PackedBatch.from_lengths([12]), cache))
    assert torch.allclose(out[0], out[1], atol=1e-10)
