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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from futx.reference import rms_norm

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

    @classmethod
    def allocate(cls, rows: int, hidden: int, device) -> "StepBuffers":
        return cls(torch.zeros(rows, dtype=torch.int64, device=device),
                   torch.zeros(rows, dtype=torch.int32, device=device),
                   torch.zeros(rows, dtype=torch.int32, device=device),
                   torch.zeros(rows, hidden, dtype=torch.bfloat16, device=device),
                   torch.zeros(rows, dtype=torch.int64, device=device))


class DecodeModel:
    """A packed model, its KV cache and the decode step on one backend ("kernels" or "emulated")."""

    def __init__(self, packed: PackedModel, cache: str = "int4", *, max_batch: int = 8, capacity: int = 2048,
                 backend: str = "kernels", device=None, glue: str = "fused",
                 shared_cache: Optional[EngineCache] = None):
        check_formats(packed.weights, cache)
        check_model(packed.config, packed.weights, packed.group_size)
        check_batch(max_batch)
        self.device = torch.device(device) if device is not None else packed.device
        if backend == "kernels" and self.device.type != "cuda":
            raise ValueError("the kernel backend needs a CUDA (Hopper) device; use backend='emulated' elsewhere")
        self.packed = packed if packed.device == self.device else packed.to(self.device)
        self.config = packed.config
        self.backend = backend
        self.ops = make_ops(backend, glue)
        self.capacity = round_capacity(capacity)
        self.max_batch = max_batch
        if shared_cache is not None:  # several models over one cache (benchmarks)
            if (shared_cache.fmt, shared_cache.slots, shared_cache.capacity) != (cache, max_batch, self.capacity):
                raise ValueError("the shared cache's format, slots or capacity differ from this model's")
            self.cache = shared_cache
        else:
            self.cache = EngineCache(self.config, cache, max_batch, self.capacity, self.device,
                                     keep_values=backend == "emulated")
        self.rope = rope_table(self.config, self.capacity, self.device)
        self.buffers = StepBuffers.allocate(max_batch, self.config.hidden_size, self.device)
        c = self.config
        self._attn_out = torch.zeros(max_batch, c.num_attention_heads, c.head_dim, dtype=torch.bfloat16,
                                     device=self.device)

    # ---- the step --------------------------------------------------------------------------------
    def step(self, rows: int) -> None:
        """One decode step over buffers[:rows] (inputs tokens/positions/slots; outputs hidden/next_tokens)."""
        b = self.buffers
        positions, slots = b.positions[:rows], b.slots[:rows]
        x = self.packed.embed[b.tokens[:rows]]
        for i in range(len(self.packed.layers)):
            x = self.layer(i, x, positions, slots)
        b.hidden[:rows].copy_(x)
        b.next_tokens[:rows].copy_(self.logits(x).argmax(dim=-1))

    def layer(self, i: int, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Decoder block i on the residual stream x [M, H] (writes this layer's K/V rows)."""
        ops, w, eps = self.ops, self.packed.layers[i], self.config.rms_norm_eps
        attn = self._attn_out[:x.shape[0]]
        qkv = ops.norm_linear(x, w.qkv, "store", eps)
        ops.attention(qkv, positions, slots, self.cache, i, self.rope, attn)
        x = ops.linear(attn.view(x.shape[0], self.config.q_size), w.o, "residual", x)
        z = ops.norm_linear(x, w.gateup, "swiglu", eps)
        return ops.linear(z, w.down, "residual", x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """BF16 logits [M, V] of the final residual stream x (final RMSNorm with its gain, BF16 LM head)."""
        h = rms_norm(x, self.packed.final_norm.to(torch.bfloat16), self.config.rms_norm_eps)
        return self.ops.head(h, self.packed.lm_head)

    # ---- host-side convenience ---------------------------------------------------------------------
    def load_inputs(self, tokens, positions, slots, rows: Optional[int] = None) -> int:
        """Copy one step's inputs into the static buffers; rows past len(tokens) (up to `rows`) are padding
        that reads and writes only the scratch slot. Returns the row count to run."""
        n = len(tokens)
        rows = n if rows is None else rows
        if not 1 <= n <= rows <= self.max_batch:
            raise ValueError(f"a step takes 1..{self.max_batch} rows, got {n} (bucket {rows})")
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

    def write_prefix(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """Rows computed by another path (a reference prefill) into the cache, as the kernels store them."""
        self.cache.write_rows(layer, slots, positions, k, v)
