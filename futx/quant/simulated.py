"""The simulated-quantization model: the reference forward with exactly the values the kernels use.

Per projection the kernels multiply by fold(gamma) * W in the chosen format, dequantized (`formats`);
the norms keep only their row factor (gain 1). Prefill weights are BF16 or E4M3 (INT4 is decode
only); decode weights are any weight format; decode attention reads the cache mirror
(`kv_mirror.CacheMirror`), prefill attention the main copy. Embedding, final norm and LM head are
unchanged (they run outside the fused blocks). Activations of the FP8 prefill GEMMs are not
quantized here: this model isolates the stored-weight and cache formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from futx.config import LlamaConfig
from futx.kvcache import KVCache
from futx.reference.weights import ModelWeights

from .fold import fold_model
from .formats import cache_format, weight_format
from .gptq import PROJECTIONS, Int4Model
from .int4 import DEFAULT_GROUP_SIZE
from .kv_mirror import CacheMirror


@dataclass(frozen=True)
class QuantSpec:
    decode_weights: str = "bf16"     # bf16 | e4m3 | int4
    prefill_weights: str = "bf16"    # bf16 | e4m3
    cache: str = "bf16"              # bf16 | e4m3 | int4 | int4-unrotated
    group_size: int = DEFAULT_GROUP_SIZE
    hadamard_block: Optional[int] = None  # None: the head dim

    def __post_init__(self) -> None:
        weight_format(self.decode_weights), cache_format(self.cache)  # raise on unknown names
        if not weight_format(self.prefill_weights).prefill:
            raise ValueError(f"prefill weights cannot be {self.prefill_weights!r} (INT4 is decode only)")


def quantized_weights(weights: ModelWeights, fmt: str, group_size: int = DEFAULT_GROUP_SIZE,
                      int4: Optional[Int4Model] = None) -> ModelWeights:
    """Gains folded, every block projection replaced by its dequantized `fmt` values.

    For fmt='int4', `int4` (e.g. a GPTQ result) supplies the grid; without it round-to-nearest is used.
    """
    quant = weight_format(fmt).fake_quantize
    if int4 is not None and fmt != "int4":
        raise ValueError(f"an INT4 grid was given for weight format {fmt!r}")
    if int4 is not None and int4.group_size != group_size:
        raise ValueError(f"INT4 grid has group size {int4.group_size}, spec says {group_size}")
    folded = fold_model(weights)
    layers = []
    for i, layer in enumerate(folded.layers):
        new = {}
        for f in PROJECTIONS:
            w = getattr(layer, f)
            q = int4.dequantized(f"layers.{i}.{f}") if int4 is not None else quant(w, group_size)
            new[f] = q.to(device=weights.device, dtype=weights.dtype)  # a GPTQ grid unpacks on the CPU
        layers.append(layer.replace(attn_norm=layer.attn_norm.to(weights.dtype),
                                    mlp_norm=layer.mlp_norm.to(weights.dtype), **new))
    return ModelWeights(weights.config, weights.embed, layers, weights.final_norm, weights.lm_head)


@dataclass
class SimulatedModel:
    spec: QuantSpec
    prefill: ModelWeights
    decode: ModelWeights
    mirror: Optional[CacheMirror]  # None: decode reads the main copy (a BF16-valued cache)

    @property
    def config(self) -> LlamaConfig:
        return self.decode.config

    def new_cache(self, slots: int, capacity: int, dtype: Optional[torch.dtype] = None, device="cpu") -> KVCache:
        return KVCache(self.config, slots, capacity, dtype=dtype or self.decode.dtype, device=device,
                       mirror=self.mirror)


def simulate(weights: ModelWeights, spec: QuantSpec, int4: Optional[Int4Model] = None) -> SimulatedModel:
    decode = quantized_weights(weights, spec.decode_weights, spec.group_size,
                               int4 if spec.decode_weights == "int4" else None)
    prefill = decode if spec.prefill_weights == spec.decode_weights else quantized_weights(
        weights, spec.prefill_weights, spec.group_size)
    mirror = cache_format(spec.cache).mirror(spec.hadamard_block)
    return SimulatedModel(spec, prefill, decode, mirror)
