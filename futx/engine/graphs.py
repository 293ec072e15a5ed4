"""The decode step captured once per batch-size bucket as a CUDA graph, then replayed (`GraphSteps`); the
speculative block step once per (request bucket, block width) (`BlockGraphs`).

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


class BlockGraphs:
    """CUDA graphs of block (speculative verify) steps: one per (request bucket, width = k + 1), width 1 being the
    plain decode step. `run(blocks)` takes DecodeModel.verify's blocks, pads the requests to their bucket and the
    blocks to the step's width (the longest block), replays and returns the BlockStep with its targets."""

    def __init__(self, model: DecodeModel, max_width: int, buckets: Optional[Sequence[int]] = None,
                 warmup: int = 2, widths: Optional[Sequence[int]] = None, max_requests: Optional[int] = None):
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if not 1 <= max_width <= model.max_rows:
            raise ValueError(f"block width must be in [1, {model.max_rows}], got {max_width}")
        self.model = model
        widths = sorted(set(widths or range(1, max_width + 1)))
        requests = min(model.cache.slots, model.max_rows // min(widths), max_requests or model.max_rows)
        self.buckets = buckets_for(requests, buckets or DEFAULT_BUCKETS)
        self.stream = torch.cuda.Stream(model.device)
        # graph key (requests bucket, width) -> rows = requests * width (those within the step's row capacity)
        self.keys = [(b, w) for w in widths for b in self.buckets if b * w <= model.max_rows]
        # capture_buckets takes integer keys and captures the largest first: code rows * 100 + width
        self._key_of = {b * w * 100 + w: (b, w) for b, w in self.keys}
        graphs = capture_buckets(list(self._key_of), self.stream, self._scratch, self._body, warmup)
        self.graphs = {self._key_of[code]: g for code, g in graphs.items()}
        torch.cuda.synchronize(model.device)

    def _scratch(self, code: int) -> None:
        b, w = self._key_of[code]
        buf, rows = self.model.buffers, b * w
        buf.tokens[:rows].zero_()
        buf.positions[:rows].zero_()
        buf.slots[:rows].fill_(self.model.cache.scratch_slot)

    def _body(self, code: int) -> None:
        b, w = self._key_of[code]
        self.model.step(b * w, w)

    def key(self, n: int, width: int) -> tuple[int, int]:
        """The captured (requests bucket, width) for n requests of blocks up to `width` tokens."""
        fits = [(b, w) for b, w in self.keys if b >= n and w >= width]
        if not fits:
            raise ValueError(f"no captured block step holds {n} requests of width {width}")
        return min(fits, key=lambda k: (k[0] * k[1], k[1]))

    def run(self, blocks):
        width = max(len(t) for _, _, t in blocks)
        b, w = self.key(len(blocks), width)
        step = self.model.load_blocks(blocks, w, b)
        self.graphs[(b, w)].replay()
        return self.model.read_targets(step, blocks)
