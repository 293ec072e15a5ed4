"""Model weights as plain dataclasses (Hugging Face orientation: y = x @ W.T, rotate-half Q/K rows).

Shapes (H hidden, I FFN width, D head dim, Hq/Hkv query/KV heads, V vocab):
    LayerWeights: attn_norm[H], wq[Hq*D, H], wk[Hkv*D, H], wv[Hkv*D, H], wo[H, Hq*D],
                  mlp_norm[H], w_gate[I, H], w_up[I, H], w_down[H, I]
    ModelWeights: config, embed[V, H], layers (one LayerWeights per layer), final_norm[H],
                  lm_head[V, H] or None when the embedding is tied.
The reference forward takes weights per call, so a caller may substitute any field (dequantized
projections, gains set to 1 after folding) without touching the model code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from futx.config import LlamaConfig

LAYER_FIELDS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def layer_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    h, i = config.hidden_size, config.intermediate_size
    return {"attn_norm": (h,), "wq": (config.q_size, h), "wk": (config.kv_size, h), "wv": (config.kv_size, h),
            "wo": (h, config.q_size), "mlp_norm": (h,), "w_gate": (i, h), "w_up": (i, h), "w_down": (h, i)}


def _move(t: torch.Tensor, dtype, device) -> torch.Tensor:
    return t.to(device=device if device is not None else t.device, dtype=dtype if dtype is not None else t.dtype)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor

    def to(self, dtype: Optional[torch.dtype] = None, device=None) -> "LayerWeights":
        return LayerWeights(**{f: _move(getattr(self, f), dtype, device) for f in LAYER_FIELDS})

    def replace(self, **changes: torch.Tensor) -> "LayerWeights":
        return dataclasses.replace(self, **changes)


@dataclass
class ModelWeights:
    config: LlamaConfig
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Optional[torch.Tensor] = None

    @property
    def output_weight(self) -> torch.Tensor:
        """The LM-head matrix [V, H]: lm_head, or the embedding when tied."""
        return self.embed if self.lm_head is None else self.lm_head

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def to(self, dtype: Optional[torch.dtype] = None, device=None) -> "ModelWeights":
        return ModelWeights(self.config, _move(self.embed, dtype, device), [l.to(dtype, device) for l in self.layers],
                            _move(self.final_norm, dtype, device),
                            None if self.lm_head is None else _move(self.lm_head, dtype, device))

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(field path, tensor) pairs, e.g. ("layers.3.wq", ...), for checks and diagnostics."""
        yield "embed", self.embed
        for i, layer in enumerate(self.layers):
            for f in LAYER_FIELDS:
                yield f"layers.{i}.{f}", getattr(layer, f)
        yield "final_norm", self.final_norm
        if self.lm_head is not None:
            yield "lm_head", self.lm_head

    def validate(self) -> "ModelWeights":
        """Raise ValueError unless every tensor has the config's shape and one floating dtype/device."""
        c = self.config
        if len(self.layers) != c.num_hidden_layers:
            raise ValueError(f"weights have {len(self.layers)} layers, config {c.name!r} says {c.num_hidden_layers}")
        want = {"embed": (c.vocab_size, c.hidden_size), "final_norm": (c.hidden_size,),
                "lm_head": (c.vocab_size, c.hidden_size)}
        per_layer = layer_shapes(c)
        dtype, device = self.embed.dtype, self.embed.device
        for name, t in self.named_tensors():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"weight {name} is {type(t).__name__}, not a torch.Tensor")
            shape = want.get(name) or per_layer[name.rsplit(".", 1)[-1]]
            if tuple(t.shape) != shape:
                raise ValueError(f"weight {name} has shape {tuple(t.shape)}, expected {shape} for config {c.name!r}")
            if not t.dtype.is_floating_point:
                raise ValueError(f"weight {name} has non-floating dtype {t.dtype}")
            if t.dtype != dtype or t.device != device:
                raise ValueError(f"weight {name} is {t.dtype} on {t.device}, but embed is {dtype} on {device}; "
                                 "convert all weights with ModelWeights.to()")
        return self
