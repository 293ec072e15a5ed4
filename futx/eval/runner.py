"""The model interface the perplexity harness drives.

A runner owns two weight sets (prefill and decode), makes KV caches (optionally with a decode mirror)
and turns final hidden states into token NLLs. The quantization engineer substitutes
dequantized decode weights and a quantize->dequantize mirror; a GPU model can subclass and override
`prefill`/`decode` to run kernels behind the same protocols.
"""

from __future__ import annotations

from typing import Optional

import torch

from futx.kvcache import KVCache, MirrorFn
from futx.reference import PackedBatch, forward_hidden, stat_dtype
from futx.reference.weights import ModelWeights

NLL_ROWS = 1024  # LM-head rows per step on the CPU: a [1024, V] logit block instead of [M, V]
NLL_ROWS_CUDA = 8192  # on a GPU (a [8192, 49152] float32 block is 1.6 GB)


class Runner:
    """Reference runner: prefill with `prefill_weights`, decode with `decode_weights` (default: the same)."""

    def __init__(self, prefill_weights: ModelWeights, decode_weights: Optional[ModelWeights] = None, *,
                 cache_dtype: Optional[torch.dtype] = None, mirror: Optional[MirrorFn] = None):
        self.prefill_weights = prefill_weights
        self.decode_weights = prefill_weights if decode_weights is None else decode_weights
        self.config = prefill_weights.config
        if self.decode_weights.config.replace(name=self.config.name) != self.config:
            raise ValueError("prefill and decode weights must describe the same model shape")
        self.cache_dtype = cache_dtype or prefill_weights.dtype
        self.mirror = mirror

    @property
    def device(self) -> torch.device:
        return self.prefill_weights.device

    def new_cache(self, slots: int, capacity: int) -> KVCache:
        return KVCache(self.config, slots, capacity, dtype=self.cache_dtype, device=self.device, mirror=self.mirror)

    def prefill(self, tokens: torch.Tensor, batch: PackedBatch, cache: KVCache) -> torch.Tensor:
        """Final hidden states [M, H] of a packed prefill (attention reads the main cache)."""
        return forward_hidden(self.config, self.prefill_weights, tokens, batch, cache, phase="prefill")

    def decode(self, tokens: torch.Tensor, batch: PackedBatch, cache: KVCache) -> torch.Tensor:
        """Final hidden states [M, H] of decode-phase tokens (attention reads the mirror)."""
        return forward_hidden(self.config, self.decode_weights, tokens, batch, cache, phase="decode")

    def nll(self, hidden: torch.Tensor, targets: torch.Tensor, phase: str) -> torch.Tensor:
        """Per-row negative log-likelihood [M] (float64) of `targets` under the phase's LM head."""
        weights = self.prefill_weights if phase == "prefill" else self.decode_weights
        head = weights.output_weight
        out = torch.empty(hidden.shape[0], dtype=torch.float64, device=hidden.device)
        step = NLL_ROWS_CUDA if hidden.device.type == "cuda" else NLL_ROWS
        for r in range(0, hidden.shape[0], step):
            logits = (hidden[r:r + step] @ head.T).to(stat_dtype(head.dtype))
            logp = logits.log_softmax(dim=-1).gather(1, targets[r:r + step, None]).squeeze(1)
            out[r:r + step] = -logp.to(torch.float64)
        return out
