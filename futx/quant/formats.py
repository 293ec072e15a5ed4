"""Registry of decode weight formats and KV-cache formats, by the names the CLI and tables use.

A weight format maps a (gain-folded) float weight [N, K] to the float32 values the kernels compute
with; a cache format builds the mirror callable for the reference KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .fp8 import fake_quantize_e4m3
from .int4 import DEFAULT_GROUP_SIZE, fake_quantize_int4
from .kv_mirror import CacheMirror


@dataclass(frozen=True)
class WeightFormat:
    name: str
    bits: int
    prefill: bool  # usable for the FP8/BF16 prefill GEMMs (INT4 is decode only)
    fake_quantize: Callable[..., torch.Tensor]  # (w [N, K], group_size) -> float32 values


def _bf16(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> torch.Tensor:
    return w.to(torch.bfloat16).float()


def _e4m3(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> torch.Tensor:
    return fake_quantize_e4m3(w)


def _int4(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> torch.Tensor:
    return fake_quantize_int4(w, group_size)


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "bf16": WeightFormat("bf16", 16, True, _bf16),
    "e4m3": WeightFormat("e4m3", 8, True, _e4m3),
    "int4": WeightFormat("int4", 4, False, _int4),
}


@dataclass(frozen=True)
class CacheFormat:
    name: str
    bits: int
    kind: str
    rotate: bool

    def mirror(self, block: int | None = None) -> CacheMirror:
        return CacheMirror(self.kind, rotate=self.rotate, block=block)


CACHE_FORMATS: dict[str, CacheFormat] = {
    "bf16": CacheFormat("bf16", 16, "bf16", False),
    "e4m3": CacheFormat("e4m3", 8, "e4m3", False),
    "int4": CacheFormat("int4", 4, "int4", True),
    "int4-unrotated": CacheFormat("int4-unrotated", 4, "int4", False),
}


def weight_format(name: str) -> WeightFormat:
    try:
        return WEIGHT_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown weight format {name!r}; known: {', '.join(WEIGHT_FORMATS)}") from None


def cache_format(name: str) -> CacheFormat:
    try:
        return CACHE_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown cache format {name!r}; known: {', '.join(CACHE_FORMATS)}") from None
