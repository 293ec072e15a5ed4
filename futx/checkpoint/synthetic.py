"""Random Llama weights for any config: in memory, or streamed into a Hugging Face checkpoint.

Scales resemble a trained model's: projections and embedding N(0, std^2) with std 0.02, RMSNorm gains
1 + N(0, 0.05^2) (near 1 but not exactly, so a test notices a gain that is dropped or applied twice).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import torch

from futx.config import LlamaConfig
from futx.reference.weights import LAYER_FIELDS, LayerWeights, ModelWeights, layer_shapes

GAIN_STD = 0.05


def _tensor(shape: tuple[int, ...], is_gain: bool, gen: torch.Generator, std: float, dtype) -> torch.Tensor:
    t = torch.randn(shape, generator=gen, dtype=torch.float32)
    t = 1.0 + GAIN_STD * t if is_gain else std * t
    return t.to(dtype)


def iter_random_tensors(config: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                        std: float = 0.02) -> Iterator[tuple[str, torch.Tensor]]:
    """(field path, tensor) in ModelWeights.named_tensors order, one tensor alive at a time."""
    gen = torch.Generator().manual_seed(seed)
    yield "embed", _tensor((config.vocab_size, config.hidden_size), False, gen, std, dtype)
    shapes = layer_shapes(config)
    for i in range(config.num_hidden_layers):
        for f in LAYER_FIELDS:
            yield f"layers.{i}.{f}", _tensor(shapes[f], f.endswith("norm"), gen, std, dtype)
    yield "final_norm", _tensor((config.hidden_size,), True, gen, std, dtype)
    if not config.tie_word_embeddings:
        yield "lm_head", _tensor((config.vocab_size, config.hidden_size), False, gen, std, dtype)


def random_weights(config: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                   std: float = 0.02) -> ModelWeights:
    """A ModelWeights of random values (reproducible from `seed`)."""
    tensors = dict(iter_random_tensors(config, seed, dtype, std))
    layers = [LayerWeights(**{f: tensors[f"layers.{i}.{f}"] for f in LAYER_FIELDS})
              for i in range(config.num_hidden_layers)]
    return ModelWeights(config, tensors["embed"], layers, tensors["final_norm"], tensors.get("lm_head"))


def write_synthetic(path: str | Path, config: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                    std: float = 0.02, max_shard_bytes: Optional[int] = 2 << 30) -> Path:
    """Write a random-weight HF checkpoint (config.json + safetensors, sharded past max_shard_bytes).

    Tensors are generated and written shard by shard, so paper-size shapes fit in memory.
    """
    from futx.checkpoint.hf import save_tensors, hf_name

    named = ((hf_name(field), t) for field, t in iter_random_tensors(config, seed, dtype, std))
    return save_tensors(path, config, named, max_shard_bytes=max_shard_bytes)


def tiny_config(**overrides) -> LlamaConfig:
    """A small GQA config with Llama-3.1 RoPE scaling, for fast CPU tests (override any field)."""
    from futx.config import RopeScaling

    fields = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_hidden_layers=2, vocab_size=101, rms_norm_eps=1e-5, rope_theta=10000.0,
                  rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=64),
                  tie_word_embeddings=False, max_position_embeddings=4096, name="tiny")
    fields.update(overrides)
    return LlamaConfig(**fields)
