"""The decode step captured once per batch-size bucket as a CUDA graph, then replayed.

Buckets follow vLLM (1, 2, 4, then steps of 8) up to the model's max batch; a batch is padded up to the
next bucket, padded rows pointing at the cache's scratch slot. Graphs are captured largest first into
one memory pool, so the smaller ones reuse its workspace (as SGLang does).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .model import DecodeModel

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def buckets_for(max_batch: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The buckets <= max_batch, plus max_batch itself (so every batch size has a bucket)."""
    out = sorted({b for b in buckets if 1 <= b <= max_batch} | {max_batch})
    return tuple(out)


def bucket_of(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"batch of {n} rows exceeds the largest captured bucket {max(buckets)}")


def fresh_cublas_workspace() -> None:
    """Drop torch's cached cuBLAS workspaces, so that a cuBLAS call in the capture allocates its workspace inside
    the graph's own pool (as torch.compile's CUDA-graph trees do). A graph that captured the shared workspace
    faults once anyone frees it: torch.compile's graph trees free every workspace before they capture."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def capture_buckets(buckets: Sequence[int], stream, prepare: Callable[[int], None], body: Callable[[int], None],
                    warmup: int = 1) -> dict:
    """{bucket: CUDA graph of body(bucket)}, captured largest first into one memory pool (the smaller graphs reuse
    its workspace); prepare(bucket) fills the static inputs first, the warm-up runs on the capture stream (kernels
    load, buffers exist, compiled code specializes)."""
    graphs, pool = {}, None
    for b in sorted(buckets, reverse=True):
        prepare(b)
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                body(b)
        stream.synchronize()
        fresh_cublas_workspace()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream):
            body(b)
        pool = g.pool()
        graphs[b] = g
    return graphs


class GraphSteps:
    """CUDA graphs of `model.step(rows)` for each bucket; `run` pads, replays and returns next tokens."""

    def __init__(self, model: DecodeModel, buckets: Optional[Sequence[int]] = None, warmup: int = 2):
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.buckets = buckets_for(model.max_batch, buckets or DEFAULT_BUCKETS)
        self.stream = torch.cuda.Stream(model.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = capture_buckets(self.buckets, self.stream,
                                                                       self._scratch_inputs, model.step, warmup)
        torch.cuda.synchronize(model.device)

    def _scratch_inputs(self, rows: int) -> None:
        b = self.model.buffers
        b.tokens[:rows].zero_()
        b.positions[:rows].zero_()
        b.slots[:rows].fill_(self.model.cache.scratch_slot)

    def bucket(self, n: int) -> int:
        return bucket_of(n, self.buckets)

    def replay(self, rows: int) -> None:
        """Replay the graph of bucket `rows` on the current stream (inputs already in the buffers)."""
        self.graphs[rows].replay()

    def run(self, tokens, positions, slots) -> torch.Tensor:
        n = len(tokens)
        rows = self.model.load_inputs(tokens, positions, slots, self.bucket(n))
        self.graphs[rows].replay()
        return self.model.buffers.next_tokens[:n]
