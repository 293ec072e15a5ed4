"""Model configuration for Llama-style decoders, with named presets.

One frozen dataclass describes a model; everything else (reference model, quantization, kernels,
benchmarks) reads its shapes from here. Presets: the paper's single-layer shapes (Table 1) and two
complete models (Llama-3.1-8B, SmolLM2-135M).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency scaling ("rope_type": "llama3" in Hugging Face configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    name: str = "custom"

    def __post_init__(self) -> None:
        positive = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "num_hidden_layers", "vocab_size", "max_position_embeddings")
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{field} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(N, K) of the four projection GEMMs of one block (gate/up fused as one GEMM)."""
        h, i = self.hidden_size, self.intermediate_size
        return {"qkv": (self.qkv_size, h), "o": (h, self.q_size), "gate_up": (2 * i, h), "down": (h, i)}

    @property
    def projection_params_per_layer(self) -> int:
        return sum(n * k for n, k in self.projection_shapes().values())

    def replace(self, **changes: Any) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json ----------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], name: str = "custom") -> "LlamaConfig":
        arch = d.get("architectures") or []
        model_type = d.get("model_type")
        if model_type not in (None, "llama") or (arch and not any("Llama" in a for a in arch)):
            raise ValueError(
                f"unsupported architecture: model_type={model_type!r} architectures={arch!r}; "
                "futx loads Llama-style decoders (model_type 'llama')")
        try:
            hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
            scaling = d.get("rope_scaling")
            rope_scaling = None
            if scaling:
                kind = scaling.get("rope_type", scaling.get("type"))
                if kind != "llama3":
                    raise ValueError(f"unsupported rope_scaling type {kind!r} (only 'llama3' is implemented)")
                rope_scaling = RopeScaling(
                    factor=float(scaling["factor"]),
                    low_freq_factor=float(scaling["low_freq_factor"]),
                    high_freq_factor=float(scaling["high_freq_factor"]),
                    original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
            return cls(
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads", heads)),
                head_dim=int(d.get("head_dim") or hidden // heads),
                num_hidden_layers=int(d["num_hidden_layers"]),
                vocab_size=int(d["vocab_size"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta", 10000.0)),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                name=name,
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_hidden_layers,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "bfloat16",
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        return d


def _layer_shape(name: str, hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int) -> LlamaConfig:
    # The paper's labels are single-layer shapes; vocab/RoPE follow Llama-3.1 so a synthetic model runs.
    return LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, num_hidden_layers=1,
                       vocab_size=128256, rope_theta=500000.0, rope_scaling=RopeScaling(),
                       max_position_embeddings=131072, name=name)


PRESETS: dict[str, LlamaConfig] = {
    # Paper Table 1 (one layer each).
    "layer-1b": _layer_shape("layer-1b", 2048, 8192, 32, 8, 64),
    "layer-8b": _layer_shape("layer-8b", 4096, 14336, 32, 8, 128),
    "layer-70b": _layer_shape("layer-70b", 8192, 28672, 64, 8, 128),
    "layer-405b": _layer_shape("layer-405b", 16384, 53248, 128, 8, 128),
    # Complete models.
    "llama-3.1-8b": LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                num_key_value_heads=8, head_dim=128, num_hidden_layers=32, vocab_size=128256,
                                rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=RopeScaling(),
                                tie_word_embeddings=False, max_position_embeddings=131072,
                                name="llama-3.1-8b"),
    "smollm2-135m": LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                num_key_value_heads=3, head_dim=64, num_hidden_layers=30, vocab_size=49152,
                                rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None,
                                tie_word_embeddings=True, max_position_embeddings=8192,
                                name="smollm2-135m"),
}


def preset(name: str) -> LlamaConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
