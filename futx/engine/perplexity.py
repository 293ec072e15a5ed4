"""Perplexity through the decode engine (`futx ppl --backend kernels`), one token per step.

Protocols as in `futx.eval.perplexity`: "all-decode" decodes every window from position 0; "serving" fills
the first half of each window by a prefill and decodes the rest on the engine. The prefill is either the
reference path (BF16-valued prefill weights, float32, reading the main copy: exactly the simulated-
quantization model's prefill; its K/V rows written into the engine's cache as the kernels store them), or,
with `prefill_model` (`futx.engine.prefill.PrefillModel` over the engine's cache), futx's packed kernel
prefill (FP8 or BF16; emulated on the emulated backend), which writes the cache itself. Scores use the final hidden
state of each step through the model's own final norm and LM head in float32 (the simulated model leaves
both unchanged), so a difference from `futx.quant.simulated` comes from the decode blocks alone.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from futx.eval.perplexity import PerplexityResult, scored_per_window
from futx.eval.protocols import ENGINE_PROTOCOLS as PROTOCOLS
from futx.kvcache import KVCache
from futx.reference import PackedBatch, forward_hidden, rms_norm
from futx.reference.weights import ModelWeights

from .model import DecodeModel


def _nll(hidden: torch.Tensor, targets: torch.Tensor, head: ModelWeights) -> torch.Tensor:
    h = rms_norm(hidden.float(), head.final_norm.float(), head.config.rms_norm_eps)
    logp = (h @ head.output_weight.float().T).log_softmax(-1)
    return -logp.gather(1, targets[:, None]).squeeze(1).double()


def _prefill(model: DecodeModel, prefill_weights: ModelWeights, tokens: torch.Tensor, length: int) -> None:
    """Reference prefill of tokens[:, :length] into cache slots 0..B-1 of the engine."""
    b = tokens.shape[0]
    cfg = prefill_weights.config
    ref = KVCache(cfg, b, length, dtype=prefill_weights.dtype, device=prefill_weights.device)
    forward_hidden(cfg, prefill_weights, tokens[:, :length].reshape(-1).to(prefill_weights.device),
                   PackedBatch.from_lengths([length] * b, device=prefill_weights.device), ref, phase="prefill")
    dev = model.device
    slots = torch.arange(b, device=dev).repeat_interleave(length)
    positions = torch.arange(length, device=dev).repeat(b)
    for layer in range(cfg.num_hidden_layers):
        k = ref.k[layer][:, :, :length].permute(0, 2, 1, 3).reshape(b * length, cfg.num_key_value_heads, -1)
        v = ref.v[layer][:, :, :length].permute(0, 2, 1, 3).reshape(b * length, cfg.num_key_value_heads, -1)
        model.write_prefix(layer, slots, positions, k.to(dev), v.to(dev))


def _kernel_prefill(prefill_model, tokens: torch.Tensor, length: int, context: Optional[str] = None) -> None:
    """Packed kernel prefill of tokens[:, :length] into cache slots 0..B-1 (one request group). context "main" /
    "mirror": in two chunks, [0, length/2) then the rest; with "mirror" the second chunk reads the first through
    the decode mirror (its main copy replaced by the mirror's values, as a prefix-cache hit reads its prefix on the
    INT4-only cache)."""
    b = tokens.shape[0]
    dev = prefill_model.device
    cuts = (0, length) if context is None else (0, length // 2, length)
    for lo, hi in zip(cuts, cuts[1:]):
        if lo and context == "mirror":
            for s in range(b):
                prefill_model.cache.main_from_mirror(s, lo)
        batch = PackedBatch.from_lengths([hi - lo] * b, [lo] * b, device=dev)
        prefill_model.forward(tokens[:, lo:hi].reshape(-1).to(dev), batch)


def evaluate_engine(model: DecodeModel, windows: torch.Tensor, protocol: str, head: ModelWeights, *,
                    prefill_weights: Optional[ModelWeights] = None, graphs=None, bar=None,
                    prefill_model=None, prefill_context: Optional[str] = None,
                    on_batch: Optional[Callable[[PerplexityResult], None]] = None) -> PerplexityResult:
    """Perplexity of the engine over windows [n, W] (int64), batches of up to model.max_batch windows.
    The serving protocol prefills with `prefill_model` (kernel prefill) if given, else on the reference path
    with `prefill_weights`; prefill_context "main" / "mirror" (kernel prefill only) prefills in two chunks, the
    second reading the first from the main copy or through the mirror (_kernel_prefill). `on_batch` receives the
    running result (the windows so far) after every batch."""
    if prefill_context not in (None, "main", "mirror"):
        raise ValueError(f"prefill_context must be None, 'main' or 'mirror', got {prefill_context!r}")
    if prefill_context is not None and prefill_model is None:
        raise ValueError("prefill_context needs the kernel prefill (prefill_model)")
    if protocol not in PROTOCOLS:
        raise ValueError(f"the engine evaluates protocols {PROTOCOLS} (gptq needs the prefill engine), got "
                         f"{protocol!r}")
    if protocol == "serving" and prefill_weights is None and prefill_model is None:
        raise ValueError("the serving protocol needs the prefill weights (reference path) or a prefill model")
    if prefill_model is not None and prefill_model.cache is not model.cache:
        raise ValueError("the prefill model must write the decode engine's own cache")
    n, w = windows.shape
    if w > model.capacity:
        raise ValueError(f"windows of {w} tokens need a cache of {w} positions; the engine holds {model.capacity}")
    dev = model.device
    windows = windows.to(dev)
    buf = model.buffers
    total = torch.zeros((), dtype=torch.float64, device=dev)
    t0 = time.perf_counter()
    start = w // 2 if protocol == "serving" else 0
    per = scored_per_window(protocol, w)
    with torch.inference_mode():
        for i in range(0, n, model.max_batch):
            tok = windows[i:i + model.max_batch]
            b = tok.shape[0]
            rows = graphs.bucket(b) if graphs is not None else b
            if start and prefill_model is not None:
                _kernel_prefill(prefill_model, tok, start, prefill_context)
            elif start:
                _prefill(model, prefill_weights, tok, start)
            buf.slots[:rows].fill_(model.cache.scratch_slot)
            buf.slots[:b].copy_(torch.arange(b, device=dev, dtype=torch.int32))
            buf.tokens[:rows].zero_()
            buf.positions[:rows].zero_()
            for s in range(start, w - 1):
                buf.tokens[:b].copy_(tok[:, s])
                buf.positions[:b].fill_(s)
                if graphs is not None:
                    graphs.replay(rows)
                else:
                    model.step(rows)
                total += _nll(buf.hidden[:b], tok[:, s + 1], head).sum()
                if bar is not None:
                    bar.update(b)
            result = PerplexityResult(protocol, i + b, w, (i + b) * per, float(total), time.perf_counter() - t0,
                                      f"engine-{model.backend}")
            if on_batch is not None:
                on_batch(result)
    return result
