"""The kernel-path Llama decode step, top to bottom.

One step takes one new token per row (request), at its own position and cache slot:

    x = embed[token]                                            BF16 residual stream [M, H]
    per layer:
        h    = rms_rows(x)                                      row factor only (gain folded into qkv); at
                                                                M = 1 inside the QKV and gate/up kernels
        qkv  = h @ Wqkv^T                                       decode projection
        a    = attention(qkv)                                   RoPE on q/k, new K/V row written (main copy +
                                                                quantized, rotated mirror), GQA over [0, pos]
        x    = a @ Wo^T + x                                     residual epilogue
        h    = rms_rows(x)
        z    = silu(h @ Wgate^T) * (h @ Wup^T)                  SwiGLU epilogue (gate/up rows interleaved)
        x    = z @ Wdown^T + x                                  residual epilogue
    hidden = x;  logits = rms_norm(x, final_norm) @ lm_head^T;  next = argmax(logits)

Inputs and outputs live in static device buffers (`StepBuffers`), so the same step can be captured as a
CUDA graph and replayed (`futx.engine.graphs`). Rows past the live batch point at the cache's scratch slot.

A *block* step (speculative verification, `verify`) runs `width` consecutive rows per request: the request's
last accepted token and its drafts at positions start .. start + width - 1 of one slot, attending causally
inside the block (row j sees the block's rows 0..j). Its row capacity (`max_rows`, up to the projections' 64)
is decoupled from the cache's slot count (`max_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from futx import paging

from .backends import make_ops, rope_table
from .cache import EngineCache
from .packed import PackedModel
from .support import check_batch, check_formats, check_model, round_capacity


@dataclass
class StepBuffers:
    """Static inputs/outputs of a step for up to `rows` rows (what a CUDA graph reads and writes)."""

    tokens: torch.Tensor     # int64 [rows]
    positions: torch.Tensor  # int32 [rows]
    slots: torch.Tensor      # int32 [rows]
    hidden: torch.Tensor     # bf16 [rows, H]: the residual stream after the last layer
    next_tokens: torch.Tensor  # int64 [rows]: greedy argmax
    logits: Optional[torch.Tensor] = None  # bf16 [rows, V] where the model keeps them (sampling, verification)

    @classmethod
    def allocate(cls, rows: int, hidden: int, device, vocab: Optional[int] = None) -> "StepBuffers":
        return cls(torch.zeros(rows, dtype=torch.int64, device=device),
                   torch.zeros(rows, dtype=torch.int32, device=device),
                   torch.zeros(rows, dtype=torch.int32, device=device),
                   torch.zeros(rows, hidden, dtype=torch.bfloat16, device=device),
                   torch.zeros(rows, dtype=torch.int64, device=device),
                   None if vocab is None else torch.zeros(rows, vocab, dtype=torch.bfloat16, device=device))


@dataclass
class BlockStep:
    """What a block (verify) step ran: `requests` request rows of `width` rows each (request i at rows
    i * width .. i * width + width - 1 of the buffers), and per real request the target's argmax at each of
    its rows (row j: the prediction for the token after input j)."""

    width: int
    requests: int
    targets: list[list[int]]

    @property
    def rows(self) -> int:
        return self.width * self.requests

    def row(self, request: int, j: int) -> int:
        return request * self.width + j


class DecodeModel:
    """A packed model, its KV cache and the decode step on one backend ("kernels" or "emulated")."""

    def __init__(self, packed: PackedModel, cache: str = "int4", *, max_batch: int = 8, capacity: int = 2048,
                 backend: str = "kernels", device=None, glue: str = "fused",
                 shared_cache: Optional[EngineCache] = None, max_rows: Optional[int] = None,
                 keep_logits: bool = False, pages: Optional[int] = None, page_size: int = paging.DEFAULT_PAGE_SIZE,
                 staging: int = 0, persistent: Union[None, bool, str] = False):
        """max_batch: cache slots (requests); max_rows: rows of one step (default max_batch; more for block
        steps: requests x (drafts + 1)); keep_logits: also keep each step's logits in buffers.logits.
        pages: a paged cache of that many pages of page_size positions (futx.paging; None: contiguous slots of
        `capacity` positions); requests still reach at most `capacity` positions, the caller fills the block
        table (EngineCache.set_pages). staging: the INT4-only cache's staging pages (futx.paging; 0: every page
        keeps its main copy). persistent: steps of 1..8 rows run their layers on the persistent layer kernel
        (futx.engine.persistent, up to the rows its shared memory fits; True raises where it does not fit, None
        uses it where it fits; "ring": the ring layer, a producer warp streaming the weights, raising where it does
        not fit)."""
        check_formats(packed.weights, cache)
        check_model(packed.config, packed.weights, packed.group_size)
        check_batch(max_batch)
        max_rows = max_batch if max_rows is None else max_rows
        check_batch(max_rows)
        self.device = torch.device(device) if device is not None else packed.device
        if backend == "kernels" and self.device.type != "cuda":
            raise ValueError("the kernel backend needs a CUDA (Hopper) device; use backend='emulated' elsewhere")
        self.packed = packed if packed.device == self.device else packed.to(self.device)
        self.config = packed.config
        self.backend = backend
        self.ops = make_ops(backend, glue)
        self.capacity = round_capacity(capacity)
        self.max_batch = max_batch
        self.max_rows = max_rows
        if staging and pages is None:
            raise ValueError("staging pages need a paged cache (pages=...)")
        layout = None if pages is None else paging.PageLayout.for_capacity(page_size, pages, max_batch,
                                                                            self.capacity, staging)
        if shared_cache is not None:  # several models over one cache (benchmarks)
            if (shared_cache.fmt, shared_cache.slots, shared_cache.capacity, shared_cache.layout) != (
                    cache, max_batch, self.capacity, layout):
                raise ValueError("the shared cache's format, slots, capacity or pages differ from this model's")
            self.cache = shared_cache
        else:
            self.cache = EngineCache(self.config, cache, max_batch, self.capacity, self.device,
                                     keep_values=backend == "emulated", layout=layout)
        self.rope = rope_table(self.config, self.capacity, self.device)
        self._final_gain = self.packed.final_norm.to(torch.bfloat16)   # once, not a conversion kernel every step
        self.buffers = StepBuffers.allocate(max_rows, self.config.hidden_size, self.device,
                                            self.config.vocab_size if keep_logits else None)
        c = self.config
        self._attn_out = torch.zeros(max_rows, c.num_attention_heads, c.head_dim, dtype=torch.bfloat16,
                                     device=self.device)
        self.persistent = None
        if persistent not in (None, False, True, "ring"):
            raise ValueError(f"persistent must be None, False, True or 'ring', got {persistent!r}")
        if persistent or persistent is None:
            from futx.engine import persistent as pers

            if persistent or pers.unsupported(self) is None:
                self.persistent = pers.PersistentStep(self, body="ring" if persistent == "ring" else "tiles")

    # ---- the step --------------------------------------------------------------------------------
    def step(self, rows: int, width: int = 1) -> None:
        """One decode step over buffers[:rows] (inputs tokens/positions/slots; outputs hidden/next_tokens).
        width > 1: a block step, `width` consecutive rows per request sharing its slot (see `verify`)."""
        b = self.buffers
        positions, slots = b.positions[:rows], b.slots[:rows]
        x = self.packed.embed[b.tokens[:rows]]
        if width == 1 and self.persistent is not None and rows <= self.persistent.max_rows:
            x = self.persistent.run(x, positions, slots)
        else:
            for i in range(len(self.packed.layers)):
                x = self.layer(i, x, positions, slots, width)
        b.hidden[:rows].copy_(x)
        logits = self.logits(x)
        if b.logits is not None:
            b.logits[:rows].copy_(logits)
        self.ops.argmax(logits, b.next_tokens[:rows])   # (written in place: no copy kernel)

    def layer(self, i: int, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              width: int = 1) -> torch.Tensor:
        """Decoder block i on the residual stream x [M, H] (writes this layer's K/V rows)."""
        ops, w, eps = self.ops, self.packed.layers[i], self.config.rms_norm_eps
        attn = self._attn_out[:x.shape[0]]
        qkv = ops.norm_linear(x, w.qkv, "store", eps)
        if width > 1:
            ops.attention_block(qkv, positions, slots, self.cache, i, self.rope, attn, width)
        else:
            ops.attention(qkv, positions, slots, self.cache, i, self.rope, attn)
        x = ops.linear(attn.view(x.shape[0], self.config.q_size), w.o, "residual", x)
        z = ops.norm_linear(x, w.gateup, "swiglu", eps)
        return ops.linear(z, w.down, "residual", x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """BF16 logits [M, V] of the final residual stream x (final RMSNorm with its gain, BF16 LM head)."""
        h = self.ops.final_norm(x, self._final_gain, self.config.rms_norm_eps)
        return self.ops.head(h, self.packed.lm_head)

    # ---- host-side convenience ---------------------------------------------------------------------
    def load_inputs(self, tokens, positions, slots, rows: Optional[int] = None) -> int:
        """Copy one step's inputs into the static buffers; rows past len(tokens) (up to `rows`) are padding
        that reads and writes only the scratch slot. Returns the row count to run."""
        n = len(tokens)
        rows = n if rows is None else rows
        if not 1 <= n <= rows <= self.max_rows:
            raise ValueError(f"a step takes 1..{self.max_rows} rows, got {n} (bucket {rows})")
        pos = torch.as_tensor(positions, dtype=torch.int32)
        if int(pos.max()) >= self.capacity or int(pos.min()) < 0:
            bad = int(pos.argmax())
            raise ValueError(f"KV cache overflow: row {bad} writes position {int(pos[bad])} but the capacity is "
                             f"{self.capacity}")
        slt = torch.as_tensor(slots, dtype=torch.int32)
        if int(slt.min()) < 0 or int(slt.max()) >= self.cache.slots or torch.unique(slt).numel() != n:
            raise ValueError(f"slots must be distinct and in [0, {self.cache.slots}), got {slt.tolist()}")
        b = self.buffers
        tok = torch.as_tensor(tokens, dtype=torch.int64)
        if int(tok.min()) < 0 or int(tok.max()) >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        pad = rows - n
        b.tokens[:rows].copy_(torch.cat([tok, tok.new_zeros(pad)]), non_blocking=True)
        b.positions[:rows].copy_(torch.cat([pos, pos.new_zeros(pad)]), non_blocking=True)
        b.slots[:rows].copy_(torch.cat([slt, slt.new_full((pad,), self.cache.scratch_slot)]), non_blocking=True)
        return rows

    def run(self, tokens, positions, slots) -> torch.Tensor:
        """Eager step on host lists; returns next tokens [n] (device)."""
        rows = self.load_inputs(tokens, positions, slots)
        self.step(rows)
        return self.buffers.next_tokens[:rows]

    def load_blocks(self, blocks: Sequence[tuple[int, int, Sequence[int]]], width: Optional[int] = None,
                    requests: Optional[int] = None) -> BlockStep:
        """Copy a block step's inputs into the static buffers. blocks: per request (slot, start, tokens), tokens
        1..width ids fed at positions start, start + 1, ... of the slot (a verification: the last accepted token,
        then the drafts; requests may have different draft counts). width: rows per request (default the longest
        block); requests: request rows to run (default len(blocks); the extra ones are padding). Rows a block
        leaves unused, and padding requests, read and write only the scratch slot. Everything is checked here on
        the host, before any launch: a block that would write past the cache's capacity is an error (the caller
        drafts fewer tokens there), never a silent overwrite."""
        n = len(blocks)
        width = max((len(t) for _, _, t in blocks), default=1) if width is None else width
        requests = n if requests is None else requests
        if not 1 <= n <= requests or width < 1 or requests * width > self.max_rows:
            raise ValueError(f"a block step takes 1..{self.max_rows} rows (requests x width), got {n} requests "
                             f"(padded to {requests}) of width {width}")
        slots = [int(s) for s, _, _ in blocks]
        if min(slots) < 0 or max(slots) >= self.cache.slots or len(set(slots)) != n:
            raise ValueError(f"slots must be distinct and in [0, {self.cache.slots}), got {slots}")
        scratch = self.cache.scratch_slot
        tok = torch.zeros(requests, width, dtype=torch.int64)
        pos = torch.zeros(requests, width, dtype=torch.int32)
        slt = torch.full((requests, width), scratch, dtype=torch.int32)
        for i, (slot, start, tokens) in enumerate(blocks):
            m = len(tokens)
            if not 1 <= m <= width:
                raise ValueError(f"block {i} has {m} tokens; a block takes 1..{width}")
            if start < 0 or start + m > self.capacity:
                raise ValueError(f"KV cache overflow: block {i} writes positions {start}..{start + m - 1} but the "
                                 f"capacity is {self.capacity}")
            t = torch.as_tensor(list(tokens), dtype=torch.int64)
            if int(t.min()) < 0 or int(t.max()) >= self.config.vocab_size:
                raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
            tok[i, :m] = t
            pos[i, :m] = torch.arange(start, start + m, dtype=torch.int32)
            slt[i, :m] = slot
        b, rows = self.buffers, requests * width
        b.tokens[:rows].copy_(tok.view(-1), non_blocking=True)
        b.positions[:rows].copy_(pos.view(-1), non_blocking=True)
        b.slots[:rows].copy_(slt.view(-1), non_blocking=True)
        return BlockStep(width, requests, [])

    def read_targets(self, step: BlockStep, blocks: Sequence[tuple[int, int, Sequence[int]]]) -> BlockStep:
        """Fill step.targets from next_tokens after the step ran (one device-to-host copy)."""
        nxt = self.buffers.next_tokens[:step.rows].view(step.requests, step.width).tolist()
        step.targets = [nxt[i][:len(t)] for i, (_, _, t) in enumerate(blocks)]
        return step

    def verify(self, blocks: Sequence[tuple[int, int, Sequence[int]]], width: Optional[int] = None) -> BlockStep:
        """Eager block step (a speculative verification) over blocks of (slot, start, tokens); returns the
        BlockStep with the target's argmax at every row. hidden (and logits, with keep_logits) of request i's
        row j are at buffers row step.row(i, j). Rolling back rejected drafts is the caller's length only: their
        rows stay in the cache past the request's length, never read (attention reads [0, pos]), and are
        overwritten by the request's next step."""
        step = self.load_blocks(blocks, width)
        self.step(step.rows, step.width)
        return self.read_targets(step, blocks)

    def write_prefix(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """Rows computed by another path (a reference prefill) into the cache, as the kernels store them."""
        self.cache.write_rows(layer, slots, positions, k, v)
