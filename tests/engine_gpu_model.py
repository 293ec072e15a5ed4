"""The small model the engine's and speculative decoding's GPU tests share: odd-ish sizes on the kernels'
granularity (K = 192 / 320, GQA group 3), head dims 64 and 128, three layers."""

import pytest

from futx.checkpoint.synthetic import random_weights, tiny_config

FORMATS = ("bf16", "e4m3", "int4")


def small_config(head_dim):
    return tiny_config(hidden_size=192, intermediate_size=320, num_attention_heads=6, num_key_value_heads=2,
                       head_dim=head_dim, num_hidden_layers=3, vocab_size=512)


@pytest.fixture(scope="module", params=[64, 128])
def weights(request):
    """The small model's random weights on the GPU, at each head dim."""
    return random_weights(small_config(request.param), seed=7, std=0.05).to(device="cuda")
