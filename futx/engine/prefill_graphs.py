"""The packed prefill captured as CUDA graphs, one per row-count bucket, for serving.

An eager prefill chunk is host-bound (thousands of launches and Python-side checks per 512 tokens; measured in
docs/results-prefill-engine.md). Here a chunk's batch is validated on the host (`PrefillModel.check_rows`),
its metadata written into one pinned buffer and copied to the device in one transfer, and the graph of its
bucket replayed:

  * rows: the chunk's M rows are padded up to the next bucket (`row_buckets`) by one extra request in the
    cache's scratch slot (positions 0 .. pad - 1), so its K/V and mirror writes never touch a real request.
    Its rows start from a zero embedding and so stay exactly zero through every block (zero K, V, attention
    output, SwiGLU output): they cost GEMM/attention time but add nothing to the delayed FP8 scale's amax, so a
    replay computes the eager prefill of the unpadded batch (bitwise where both pick the same GEMM variants);
  * requests: the kernels read R from the shapes, so every graph holds `max_requests + 1` request entries;
    unused ones have length 0 (the attention kernel gives them no work tile).

A paged cache (PrefillModel: `cache.layout` / `cache.table` set): the graph body translates the rows through the
block table on the device (futx.paging.locate inside the graph), so a replay reads the table as it is then; the
padding request's scratch slot maps every position to the scratch page. The replay path checks slots and
positions against the layout on the host but not page ownership (that needs the table back on the host): the
scheduler allocates a chunk's pages before it runs; the eager path checks them.

Graphs are captured once the model's FP8 scale state is calibrated (the first chunk runs eagerly and
calibrates from real data), largest bucket first into one memory pool. A chunk larger than the largest
bucket or with more requests runs eagerly.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Optional, Sequence

import torch

from futx.reference.batch import PackedBatch

from .graphs import bucket_of, capture_buckets
from .prefill import PrefillModel, _Rows


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """Powers of two from 16, then multiples of 256, up to max_rows, plus max_rows: a chunk pads by < 2x (and by
    < 256 rows above 512)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be positive, got {max_rows}")
    out = {b for b in (16, 32, 64, 128, 256) if b < max_rows}
    out.update(range(512, max_rows, 256))
    out.add(max_rows)
    return tuple(sorted(out))


class MetaLayout:
    """Offsets of the int32 vectors of one batch in a flat buffer (each 16-byte aligned): tokens, row_slot,
    row_pos [rows]; cu [requests + 1]; start, slot, last [requests]."""

    def __init__(self, rows: int, requests: int):
        self.rows, self.requests = rows, requests
        sizes = (("tokens", rows), ("row_slot", rows), ("row_pos", rows), ("cu", requests + 1),
                 ("start", requests), ("slot", requests), ("last", requests))
        self.spans, at = {}, 0
        for name, n in sizes:
            self.spans[name] = (at, at + n)
            at += -(-n // 4) * 4     # every vector starts on a 16-byte boundary (the kernels' alignment rule)
        self.size = at

    def views(self, buf: torch.Tensor, rows: int) -> dict[str, torch.Tensor]:
        """Named views of `buf`; the per-row vectors cut to `rows`."""
        out = {}
        for name, (a, b) in self.spans.items():
            out[name] = buf[a:a + rows] if name in ("tokens", "row_slot", "row_pos") else buf[a:b]
        return out

    def fill(self, buf: torch.Tensor, tokens: torch.Tensor, lengths: Sequence[int], starts: Sequence[int],
             slots: Sequence[int], bucket: int, scratch: int) -> None:
        """Write one batch padded to `bucket` rows (module docstring) into the host buffer `buf`."""
        r, m = len(lengths), sum(lengths)
        v = self.views(buf, bucket)
        v["tokens"][:m].copy_(tokens)
        v["tokens"][m:].zero_()
        pos = [p for st, n in zip(starts, lengths) for p in range(st, st + n)] + list(range(bucket - m))
        v["row_pos"].copy_(torch.tensor(pos, dtype=torch.int32))
        v["row_slot"].copy_(torch.tensor([s for s, n in zip(slots, lengths) for _ in range(n)]
                                         + [scratch] * (bucket - m), dtype=torch.int32))
        cu = [0, *accumulate(lengths)] + [bucket] * (self.requests - r)   # the pad request, then empty ones
        v["cu"].copy_(torch.tensor(cu, dtype=torch.int32))
        v["start"].copy_(torch.tensor(list(starts) + [0] * (self.requests - r), dtype=torch.int32))
        v["slot"].copy_(torch.tensor(list(slots) + [scratch] * (self.requests - r), dtype=torch.int32))
        v["last"].copy_(torch.tensor([c - 1 for c in cu[1:r + 1]] + [0] * (self.requests - r), dtype=torch.int32))


class PrefillGraphs:
    """CUDA graphs of `PrefillModel` on padded buckets; `run` validates, fills, replays."""

    def __init__(self, model: PrefillModel, max_rows: int, max_requests: int, group: object = 0,
                 buckets: Optional[Sequence[int]] = None):
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if model.attention_impl != "kernel":
            raise ValueError("prefill graphs need the prefill attention kernel (the torch attention reads the "
                             "batch on the host)")
        cap = model.capacity
        self.buckets = tuple(buckets) if buckets else row_buckets(max_rows)
        if max(self.buckets) > cap:
            raise ValueError(f"prefill bucket {max(self.buckets)} rows exceeds the cache capacity {cap} "
                             "(the padding rows sit at positions 0.. of the scratch slot)")
        if max_requests < 1:
            raise ValueError(f"max_requests must be positive, got {max_requests}")
        self.model, self.group = model, group
        self.layout = MetaLayout(max(self.buckets), max_requests + 1)
        self.host = torch.zeros(self.layout.size, dtype=torch.int32).pin_memory()
        self.dev = torch.zeros(self.layout.size, dtype=torch.int32, device=model.device)
        self.copied = torch.cuda.Event()
        self.hidden = torch.zeros(self.layout.requests, model.config.hidden_size, dtype=torch.bfloat16,
                                  device=model.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.stream = torch.cuda.Stream(model.device)
        self.replays = self.eager_calls = 0

    # ---- capture ------------------------------------------------------------------------------------------
    def _body(self, bucket: int) -> None:
        v = self.layout.views(self.dev, bucket)
        rows = _Rows(v["row_slot"], v["row_pos"], v["cu"], v["start"], v["slot"], None, v["row_slot"], v["row_pos"])
        pad = v["row_slot"] == self.model.scratch_slot
        x = self.model._run(v["tokens"].long(), rows, self.group, pad)
        self.hidden.copy_(x[v["last"].long()])

    def _scratch_batch(self, bucket: int) -> None:
        """Every row in the scratch slot (what warm-up runs on)."""
        self.layout.fill(self.host, torch.zeros(0, dtype=torch.int32), [], [], [], bucket,
                         self.model.scratch_slot)
        self.dev.copy_(self.host)

    def capture(self) -> None:
        """Capture every bucket (largest first, one pool); the scale state is kept as it was."""
        model = self.model
        state = model.state(self.group) if model.fmt == "e4m3" else None
        if state is not None and not all(state.calibrated):
            raise RuntimeError("capture after the scale state is calibrated (run one eager prefill first)")
        saved = None if state is None else [t.clone() for t in state.tensors()]
        self.graphs = capture_buckets(self.buckets, self.stream, self._scratch_batch, self._body)
        if saved is not None:
            for t, s in zip(state.tensors(), saved):
                t.copy_(s)
        torch.cuda.synchronize(model.device)

    # ---- run ----------------------------------------------------------------------------------------------
    def run(self, tokens: torch.Tensor, lengths: Sequence[int], starts: Sequence[int],
            slots: Sequence[int]) -> torch.Tensor:
        """Prefill requests (tokens: 1-D CPU integer tensor, request b's `lengths[b]` tokens at positions
        starts[b].. of cache slot slots[b]) -> hidden states of each request's last row, bf16 [R, H] (a view of
        a buffer the next call overwrites)."""
        model = self.model
        r, m = len(lengths), int(sum(lengths))
        if r == 0 or min(lengths) < 1:
            raise ValueError("every request needs at least one token")
        state = model.state(self.group) if model.fmt == "e4m3" else None
        calibrated = state is None or all(state.calibrated)
        if not calibrated or m > max(self.buckets) or r >= self.layout.requests:
            self.eager_calls += 1    # model.forward checks the batch on the host
            batch = PackedBatch.from_lengths(list(lengths), list(starts), list(slots), device=model.device)
            return model.forward(tokens, batch, group=self.group).hidden
        model.check_rows(tokens, [0, *accumulate(lengths)], starts, slots)
        if not self.graphs:
            self.capture()
        bucket = bucket_of(m, self.buckets)
        self.copied.synchronize()                    # the previous chunk's copy has left the pinned buffer
        self.layout.fill(self.host, tokens, lengths, starts, slots, bucket, model.scratch_slot)
        self.dev.copy_(self.host, non_blocking=True)
        self.copied.record()
        self.graphs[bucket].replay()
        self.replays += 1
        model.stats.calls += 1
        model.stats.rows += m
        model.stats.padded_rows += bucket - m
        return self.hidden[:r]


__all__ = ["MetaLayout", "PrefillGraphs", "row_buckets"]
