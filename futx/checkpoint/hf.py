"""Hugging Face Llama checkpoints: config.json + model.safetensors, or shards with an index.

Loading reads one tensor at a time (safetensors memory-maps the files), converting to the requested
dtype as it goes, so a bf16 Llama-3.1-8B loads in bf16 without a float32 copy of the whole model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from futx.config import LlamaConfig
from futx.reference.weights import LAYER_FIELDS, LayerWeights, ModelWeights, layer_shapes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_LAYER_NAMES = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
                "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
                "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
_TOP_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def hf_name(field: str) -> str:
    """ModelWeights field path ("embed", "layers.3.wq", ...) -> Hugging Face tensor name."""
    if field in _TOP_NAMES:
        return _TOP_NAMES[field]
    parts = field.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.weight"
    raise ValueError(f"no Hugging Face name for weight field {field!r}")


def read_config(path: str | Path) -> LlamaConfig:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path} is not a Hugging Face checkpoint directory: config.json not found")
    try:
        d = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
    return LlamaConfig.from_hf_dict(d, name=path.resolve().name)


class _TensorSource:
    """Name -> tensor over one file or an index of shards, with errors that name the problem."""

    def __init__(self, path: Path):
        self.path = path
        index = path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index} is malformed (need a JSON object with 'weight_map'): {e}") from None
            self.files = {name: path / f for name, f in weight_map.items()}
        elif (path / SINGLE_FILE).is_file():
            self.files = None
        else:
            raise ValueError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._open: dict[Path, object] = {}

    def _handle(self, file: Path):
        if file not in self._open:
            if not file.is_file():
                raise ValueError(f"checkpoint shard {file} (named in {INDEX_FILE}) does not exist")
            try:
                self._open[file] = safe_open(str(file), framework="pt")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise ValueError(f"cannot read {file}: {e} (truncated or corrupt safetensors file?)") from None
        return self._open[file]

    def file_of(self, name: str) -> Optional[Path]:
        if self.files is None:
            f = self.path / SINGLE_FILE
            return f if name in self._handle(f).keys() else None
        return self.files.get(name)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        file = self.file_of(name)
        if file is None:
            raise ValueError(f"checkpoint {self.path} is missing tensor {name!r}")
        handle = self._handle(file)
        if name not in handle.keys():
            raise ValueError(f"{file} does not contain tensor {name!r} although {INDEX_FILE} says so")
        try:
            t = handle.get_tensor(name)
        except Exception as e:
            raise ValueError(f"cannot read tensor {name!r} from {file}: {e} (truncated file?)") from None
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {name!r} in {file} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(device=device, dtype=dtype)


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> ModelWeights:
    """Load a Llama-architecture HF checkpoint directory as ModelWeights in `dtype` on `device`."""
    path = Path(path)
    config = read_config(path)
    src = _TensorSource(path)
    h, v = config.hidden_size, config.vocab_size
    shapes = layer_shapes(config)
    layers = []
    for i in range(config.num_hidden_layers):
        layers.append(LayerWeights(**{
            f: src.get(hf_name(f"layers.{i}.{f}"), shapes[f], dtype, device) for f in LAYER_FIELDS}))
    embed = src.get(_TOP_NAMES["embed"], (v, h), dtype, device)
    final_norm = src.get(_TOP_NAMES["final_norm"], (h,), dtype, device)
    lm_head = None if config.tie_word_embeddings else src.get(_TOP_NAMES["lm_head"], (v, h), dtype, device)
    return ModelWeights(config, embed, layers, final_norm, lm_head)


def save_tensors(path: str | Path, config: LlamaConfig, named: Iterable[tuple[str, torch.Tensor]],
                 max_shard_bytes: Optional[int] = None) -> Path:
    """Write config.json and the (HF-named) tensors; shard when the total passes max_shard_bytes."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    shards: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if pending:
            save_file(pending, str(path / f"shard-{len(shards)}.tmp"), metadata={"format": "pt"})
            shards.append(list(pending))
            pending, pending_bytes = {}, 0

    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and pending and pending_bytes + nbytes > max_shard_bytes:
            flush()
        pending[name] = t.detach().contiguous().cpu()
        pending_bytes += nbytes
        total += nbytes
    flush()
    for stale in [path / SINGLE_FILE, path / INDEX_FILE, *path.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        os.replace(path / "shard-0.tmp", path / SINGLE_FILE)
        return path
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(path / f"shard-{i}.tmp", path / fname)
        weight_map.update({n: fname for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return path


def save_hf(path: str | Path, weights: ModelWeights, max_shard_bytes: Optional[int] = None) -> Path:
    """Write ModelWeights as an HF checkpoint (tensors keep their dtype)."""
    weights.validate()
    named = ((hf_name(field), t) for field, t in weights.named_tensors())
    return save_tensors(path, weights.config, named, max_shard_bytes)
