"""Greedy generation for several prompts on the decode step, with continuous batching over cache slots.

Every step runs one row per live request: the next prompt token while its prompt is being read, else its
last generated token. Requests of different lengths share steps; a finished request (max tokens or EOS)
frees its slot and the next waiting prompt takes it at once. Prompts are read by the decode kernels one
token per step (the packed FP8 prefill path is a separate engine).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Optional, Sequence

from .model import DecodeModel


@dataclass
class Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    pos: int = 0           # position of the row this request feeds next
    slot: int = -1
    done: bool = False

    def next_input(self) -> int:
        return self.prompt[self.pos] if self.pos < len(self.prompt) else self.output[-1]


@dataclass
class GenerationStats:
    steps: int = 0
    rows: int = 0
    generated: int = 0
    seconds: float = 0.0
    step_seconds: list = field(default_factory=list)

    @property
    def ms_per_step(self) -> float:
        s = sorted(self.step_seconds)
        return 1e3 * s[len(s) // 2] if s else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.seconds if self.seconds else float("nan")


def generate(model: DecodeModel, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32,
             eos_ids: Collection[int] = (), graphs=None,
             on_token: Optional[Callable[[int, int], None]] = None) -> tuple[list[list[int]], GenerationStats]:
    """Greedy continuations of `prompts` (token id lists). `graphs`: a GraphSteps to replay (else eager
    steps). `on_token(request_index, token)` is called for every generated token as it appears."""
    import torch

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    reqs = [Request(i, list(p), max_new_tokens) for i, p in enumerate(prompts)]
    for r in reqs:
        if not r.prompt:
            raise ValueError(f"prompt {r.index} is empty")
        need = len(r.prompt) + max_new_tokens - 1
        if need > model.capacity:
            raise ValueError(f"prompt {r.index} needs {need} cache positions ({len(r.prompt)} prompt + "
                             f"{max_new_tokens} new - 1) but the cache holds {model.capacity}")
    waiting = list(reversed(reqs))
    free = list(range(model.max_batch - 1, -1, -1))
    live: list[Request] = []
    stats = GenerationStats()
    t_start = time.perf_counter()
    while waiting or live:
        while waiting and free:
            r = waiting.pop()
            r.slot = free.pop()
            live.append(r)
        tokens = [r.next_input() for r in live]
        positions = [r.pos for r in live]
        slots = [r.slot for r in live]
        t0 = time.perf_counter()
        nxt = (graphs.run(tokens, positions, slots) if graphs is not None
               else model.run(tokens, positions, slots)).tolist()
        stats.step_seconds.append(time.perf_counter() - t0)
        stats.steps += 1
        stats.rows += len(live)
        still = []
        for r, tok in zip(live, nxt):
            r.pos += 1
            if r.pos >= len(r.prompt):      # this row's output is a new token
                r.output.append(tok)
                stats.generated += 1
                if on_token is not None:
                    on_token(r.index, tok)
                if len(r.output) >= r.max_new_tokens or tok in eos_ids:
                    r.done = True
            if r.done:
                free.append(r.slot)
            else:
                still.append(r)
        live = still
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    stats.seconds = time.perf_counter() - t_start
    return [r.output for r in reqs], stats
