"""Build a decode engine from what a user names: a checkpoint (packed on the fly) or a packed-model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from .packed import PackedModel, is_packed_dir, pack_model
from .support import UnsupportedModel


def hopper_available() -> bool:
    """A CUDA device of compute capability 9.x (H100/H200) is present."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def resolve_backend(backend: str) -> str:
    """'auto' -> 'kernels' on a Hopper GPU, else 'reference'; 'kernels' without one is an error."""
    if backend == "auto":
        return "kernels" if hopper_available() else "reference"
    if backend == "kernels" and not hopper_available():
        found = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
        raise UnsupportedModel(f"--backend kernels needs an NVIDIA Hopper GPU (sm_90: H100/H200); found {found}")
    return backend


def packed_source(path: str | Path) -> Optional[str]:
    """The checkpoint a packed directory was made from (for its tokenizer), if recorded."""
    return PackedModel.load_meta(path).get("source", {}).get("model")


def load_packed(spec: Optional[str], weights: str, *, gptq: Optional[str] = None, group_size: Optional[int] = None,
                device="cuda", float_weights=None, progress: bool = True) -> PackedModel:
    """A packed model from a packed directory, or by packing `spec` (a checkpoint; `float_weights` if already
    loaded) in format `weights` (with a saved GPTQ result for INT4)."""
    if spec is not None and is_packed_dir(spec):
        packed = PackedModel.load(spec, device=device)
        if weights and packed.weights != weights:
            raise ValueError(f"{spec} holds {packed.weights} weights, but --weights {weights} was asked for")
        if gptq:
            raise ValueError("--gptq applies when packing a checkpoint, not to an already packed model")
        return packed
    if float_weights is None:
        from futx.checkpoint import load

        float_weights = load(spec, dtype=torch.float32, device=device)
    g = None
    if gptq:
        from futx.quant import gptq as gptq_mod

        g = gptq_mod.load(gptq)
    packed = pack_model(float_weights, weights, group_size=group_size, gptq=g, device=device, progress=progress)
    packed.source["model"] = str(spec) if spec is not None else "smollm2-135m"
    if gptq:
        packed.source["gptq_file"] = str(gptq)
    return packed
