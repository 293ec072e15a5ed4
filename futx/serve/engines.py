"""What the scheduler steps: one decode step over rows at their own positions and cache slots, and prefill
chunks that write a prompt's K/V rows into a slot.

`ReferenceEngine`: the PyTorch reference model (float, any device) over a slotted KVCache; prefill chunks of
several requests run packed in one forward.

`DecodeEngine`: futx's decode engine (DecodeModel, CUDA graphs on a GPU). Its prefill is either futx's
packed kernel prefill (`prefill_model`, a `futx.engine.prefill.PrefillModel` over the engine's cache: the
chunks of all requests in one packed batch, FP8 or BF16 GEMMs with fused epilogues, K/V and the mirror
rows written straight into the cache; emulated in PyTorch on the emulated backend), or the serving
protocol of `futx.engine.perplexity`: the BF16 reference prefill (float32, BF16-valued folded weights) of
the prompt, its K/V rows written into the engine's cache as the kernels store them (`write_prefix`),
request by request. Without either (a packed model whose checkpoint is not at hand) prompts are read by
the decode step one token per step instead.

Both prefill prompt[:-1]; the last prompt token is the request's first decode row, whose output is its
first generated token.

Paged caches (`layout`, a futx.paging.PageLayout; None: one contiguous slot per request): the scheduler owns the
page bookkeeping (futx.engine.pages) and tells the engine which pages a slot's request holds (`set_pages`,
before any step writes them); `release` points the slot's table row back at the scratch page. `prefix_ok`: the
engine can start a request's prefill at a position whose K/V another request wrote (its prefill reads earlier
positions from the cache; the per-request reference prefill of DecodeEngine keeps its own float K/V instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from futx.kvcache import KVCache
from futx.paged_kvcache import PagedKVCache
from futx.paging import PageLayout
from futx.reference import PackedBatch, forward, forward_hidden


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens [start, start + len(tokens)) of the request in `slot`, whose prefill spans [0, total)."""
    slot: int
    tokens: list[int]
    start: int
    total: int


class ReferenceEngine:
    name = "reference"
    prefills = True
    prefix_ok = True
    prefill_is_decode = True   # one model for both phases: a preempted request's tokens may all be prefilled

    def __init__(self, weights, max_batch: int, capacity: int, layout: Optional[PageLayout] = None):
        """layout: a paged cache (futx.paged_kvcache) of layout.pages pages for max_batch slots."""
        self.weights, self.config = weights, weights.config
        self.max_batch, self.capacity = max_batch, capacity
        self.device = weights.device
        self.layout = layout
        if layout is None:
            self.cache = KVCache(self.config, max_batch, capacity, dtype=weights.dtype, device=self.device)
        else:
            if layout.slots != max_batch or layout.capacity < capacity:
                raise ValueError("the page layout does not match the engine's slots and capacity")
            self.cache = PagedKVCache(self.config, layout, dtype=weights.dtype, device=self.device)

    def set_pages(self, slot: int, pages: list[int], filled: Optional[int] = None) -> None:
        self.cache.set_pages(slot, pages, filled)

    def describe(self) -> str:
        return f"{self.config.name} on the reference path ({self.weights.dtype} on {self.device})"

    def prefill(self, chunks: list[Chunk]) -> None:
        toks = torch.tensor([t for c in chunks for t in c.tokens], device=self.device)
        batch = PackedBatch.from_lengths([len(c.tokens) for c in chunks], [c.start for c in chunks],
                                         [c.slot for c in chunks], device=self.device)
        forward_hidden(self.config, self.weights, toks, batch, self.cache, phase="prefill")

    def step(self, tokens, positions, slots, want_logits: bool):
        """Next greedy tokens (list) and, if asked, the logits rows [n, V]."""
        batch = PackedBatch.decode(positions, slots, device=self.device)
        logits = forward(self.config, self.weights, torch.tensor(tokens, device=self.device), batch, self.cache,
                         phase="decode")
        return logits.argmax(-1).tolist(), (logits if want_logits else None)

    def release(self, slot: int) -> None:
        self.cache.reset(slot)


class DecodeEngine:
    def __init__(self, model, graphs=None, prefill_weights=None, prefill_model=None, prefill_graphs=None):
        if prefill_model is not None and prefill_model.cache is not model.cache:
            raise ValueError("the prefill model must write the decode engine's own cache")
        if prefill_graphs is not None and prefill_graphs.model is not prefill_model:
            raise ValueError("the prefill graphs must be those of the engine's prefill model")
        from futx.engine.graphs import BlockGraphs

        self.block_graphs = graphs if isinstance(graphs, BlockGraphs) else None   # speculative block steps
        if self.block_graphs is not None:
            graphs = None
        self.model, self.graphs, self.prefill_weights = model, graphs, prefill_weights
        self.prefill_model, self.prefill_graphs = prefill_model, prefill_graphs
        self.config = model.config
        self.name = model.backend
        self.max_batch, self.capacity = model.max_batch, model.capacity
        self.max_rows = model.max_rows
        self.prefills = prefill_weights is not None or prefill_model is not None
        self.layout = model.cache.layout
        self.prefix_ok = prefill_model is not None or not self.prefills
        self._ref: dict[int, KVCache] = {}  # per slot: the prompt's reference K/V while it is being prefilled

    def set_pages(self, slot: int, pages: list[int], filled: Optional[int] = None) -> None:
        self.model.cache.set_pages(slot, pages)

    def stage(self, slot: int, shared: list[int], staging: list[int], filled: int) -> None:
        """INT4-only cache: slot `slot` is prefilled on `staging` pages; the main copy of the first of them gets the
        attached cached pages `shared` (its positions [0, filled)) dequantized from their mirror, so the prefill
        attends to them as the kernels read them. Their mirror is not copied: nothing reads it on the staging
        pages, and unstage moves only the rows past them."""
        from futx.engine.paged_kv import STAGE_KERNEL_FORMATS, dequantize_pages_into

        cache = self.model.cache
        cache.set_pages(slot, staging)
        if filled:   # the prefill reads only the main copy of these rows: their mirror stays on the shared pages
            kernel = self.model.backend == "kernels" and cache.fmt in STAGE_KERNEL_FORMATS
            dequantize_pages_into(cache, shared, staging[:len(shared)], filled, kernel=kernel)

    def unstage(self, slot: int, staging: list[int], pages: list[int], keep: int) -> None:
        """INT4-only cache: slot `slot`'s prefill is done: the mirror rows of its staging pages past the first
        `keep` (the attached prefix, already in pages[:keep]) to its own pages, its table row to them."""
        cache = self.model.cache
        cache.copy_pages(staging[keep:], pages[keep:len(staging)])
        cache.set_pages(slot, pages)

    def describe(self) -> str:
        m = self.model
        g = ("CUDA graphs" if self.graphs is not None else
             "CUDA graphs of block steps" if self.block_graphs is not None else "eager")
        if self.prefill_model is not None:
            pre = self.prefill_model.describe()
            if self.prefill_graphs is not None:
                pre += f", CUDA graphs of {len(self.prefill_graphs.buckets)} row buckets up to " \
                       f"{max(self.prefill_graphs.buckets)}"
        elif self.prefills:
            pre = "prefill on the BF16 reference path"
        else:
            pre = "prompts read one token per decode step (no checkpoint for the reference prefill)"
        return (f"{self.config.name} on the {m.backend} path ({g}), weights {m.packed.weights}, cache "
                f"{m.cache.fmt}; {pre}")

    def prefill(self, chunks: list[Chunk]) -> None:
        if self.prefill_model is not None:  # every request's chunk in one packed batch, one scale group
            pm = self.prefill_model
            toks = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.int64)
            if self.prefill_graphs is not None:
                self.prefill_graphs.run(toks, [len(c.tokens) for c in chunks], [c.start for c in chunks],
                                        [c.slot for c in chunks])
                return
            batch = PackedBatch.from_lengths([len(c.tokens) for c in chunks], [c.start for c in chunks],
                                             [c.slot for c in chunks], device=pm.device)
            pm.forward(toks, batch)
            return
        w = self.prefill_weights
        cfg, dev = self.config, self.model.device
        for c in chunks:  # one request at a time: each has its own reference cache
            if c.start == 0:
                self._ref[c.slot] = KVCache(cfg, 1, c.total, dtype=w.dtype, device=w.device)
            ref = self._ref[c.slot]
            n, end = len(c.tokens), c.start + len(c.tokens)
            forward_hidden(cfg, w, torch.tensor(c.tokens, device=w.device),
                           PackedBatch.from_lengths([n], [c.start], [0], device=w.device), ref, phase="prefill")
            slots = torch.full((n,), c.slot, dtype=torch.int64, device=dev)
            positions = torch.arange(c.start, end, device=dev)
            for layer in range(cfg.num_hidden_layers):
                k = ref.k[layer][0, :, c.start:end].transpose(0, 1)
                v = ref.v[layer][0, :, c.start:end].transpose(0, 1)
                self.model.write_prefix(layer, slots, positions, k.to(dev), v.to(dev))
            if end == c.total:
                del self._ref[c.slot]

    def step(self, tokens, positions, slots, want_logits: bool):
        m = self.model
        if self.graphs is not None:
            nxt = self.graphs.run(tokens, positions, slots).tolist()
        elif self.block_graphs is not None:   # built for block steps: the plain step is their width-1 graph
            st = self.block_graphs.run([(s, p, [t]) for t, p, s in zip(tokens, positions, slots)])
            nxt = [t[0] for t in st.targets]
        else:
            nxt = m.run(tokens, positions, slots).tolist()
        logits = m.logits(m.buffers.hidden[:len(tokens)]) if want_logits else None
        return nxt, logits

    def verify(self, blocks):
        """A block (speculative verify) step over blocks of (slot, start, tokens): futx.engine.model.BlockStep."""
        if self.block_graphs is not None:
            return self.block_graphs.run(blocks)
        return self.model.verify(blocks)

    def row_logits(self, rows: list[int]) -> torch.Tensor:
        """Logits [len(rows), V] of buffer rows of the last step."""
        m = self.model
        return m.logits(m.buffers.hidden[torch.tensor(rows, device=m.device)])

    def row_hidden(self, rows: list[int]) -> torch.Tensor:
        m = self.model
        return m.buffers.hidden[torch.tensor(rows, device=m.device)].clone()

    def release(self, slot: int) -> None:
        self._ref.pop(slot, None)  # the engine's cache rows are simply overwritten by the next request
        if self.layout is not None:
            self.model.cache.set_pages(slot, [])
