"""Per-request sampling: greedy (the engine's own argmax) or temperature / top-p on the host from the logits row."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0     # 0: greedy
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()   # stop strings: the text ends before the first one
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0):
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> Optional[torch.Generator]:
        if self.greedy:
            return None
        return torch.Generator().manual_seed(self.seed if self.seed is not None else secrets.randbits(63))


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """One token from a logits row [V] (any device; sampled in float32 on the host)."""
    probs = torch.softmax(logits.detach().float().cpu() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        p, idx = probs.sort(descending=True)
        keep = p.cumsum(0) - p < params.top_p  # the smallest prefix whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter_(0, idx[keep], p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))
