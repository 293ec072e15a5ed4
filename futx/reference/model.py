"""The reference Llama forward: the specification every futx kernel is tested against.

Arithmetic runs in the weights' dtype (float64, float32 or bfloat16); RMSNorm statistics and softmax
run in float32, or float64 when the weights are float64. Weights are an argument of every call, so
prefill and decode may use different weight sets (e.g. a simulated-quantization decode model).

phase="prefill": attention reads the cache's main copy; phase="decode": it reads the mirror (which is
the main copy when the cache has no mirror function). Either phase may carry several new tokens per
request; attention is causal within a request and also covers that request's earlier cached positions,
so chunked prefill and multi-token decode chunks are exact re-groupings of token-by-token decoding.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Optional

import torch

from futx.config import LlamaConfig
from futx.kvcache import KVCache
from futx.reference.batch import PackedBatch
from futx.reference.weights import LayerWeights, ModelWeights, layer_shapes
from futx.rope import apply_rope, cos_sin

PHASES = ("prefill", "decode")


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision for norm statistics, softmax and NLL: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """gain * x / sqrt(mean(x^2) + eps), statistics in stat_dtype, result in x's dtype."""
    xs = x.to(stat_dtype(x.dtype))
    normed = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * gain


QUERY_BLOCK = 512  # queries per attention step: bounds the score tensor and skips keys past the block
SCORE_BYTES = 2 << 30  # batched attention: requests per step so that one score tensor stays under 2 GiB


def attention(config: LlamaConfig, layer: int, q: torch.Tensor, batch: PackedBatch, cache: KVCache,
              phase: str) -> torch.Tensor:
    """Causal GQA attention of rotated queries q [M, Hq, D] over the cache; returns [M, Hq*D].

    Query head h reads KV head h // (Hq / Hkv). K/V are read after this call's rows were written.
    Requests with equal lengths and start positions (perplexity windows, a batch of decode steps) are
    computed together (`_attention_uniform`, the same formula batched over requests); others one by one.
    """
    m, hq, d = q.shape
    hkv, g = config.num_key_value_heads, config.group_size
    uniform = batch.uniform() if batch.num_requests > 1 and hasattr(cache, "read_batch") else None
    if uniform is not None:
        return _attention_uniform(config, layer, q, batch, cache, phase, *uniform)
    out = torch.empty_like(q)
    cu, starts, slots = batch.host_lists()
    for b in range(batch.num_requests):
        r0, r1, start = cu[b], cu[b + 1], starts[b]
        k, v = cache.read(layer, slots[b], start + r1 - r0, mirror=(phase == "decode"))
        k, v = k.to(q.dtype), v.to(q.dtype)
        for s in range(r0, r1, QUERY_BLOCK):
            e = min(s + QUERY_BLOCK, r1)
            n, first, stop = e - s, start + s - r0, start + e - r0  # positions [first, stop)
            qb = q[s:e].reshape(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
            scores = (qb @ k[:, :stop].transpose(1, 2)).to(stat_dtype(q.dtype)) * (1.0 / math.sqrt(d))
            query_pos = torch.arange(first, stop, device=q.device).repeat(g)            # [g*n]
            future = torch.arange(stop, device=q.device)[None, :] > query_pos[:, None]  # [g*n, stop]
            probs = scores.masked_fill_(future, float("-inf")).softmax(dim=-1).to(q.dtype)
            out[s:e] = (probs @ v[:, :stop]).reshape(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)
    return out.reshape(m, hq * d)


def _attention_uniform(config: LlamaConfig, layer: int, q: torch.Tensor, batch: PackedBatch, cache: KVCache,
                       phase: str, n: int, start: int) -> torch.Tensor:
    """`attention` for B requests of n new tokens each, all starting at `start`: batched over requests."""
    m, hq, d = q.shape
    hkv, g = config.num_key_value_heads, config.group_size
    b_all = batch.num_requests
    k_all, v_all = cache.read_batch(layer, batch.host_lists()[2], start + n, mirror=(phase == "decode"))
    qv = q.view(b_all, n, hkv, g, d)
    out = torch.empty_like(q).view(b_all, n, hkv, g, d)
    elem = torch.finfo(stat_dtype(q.dtype)).bits // 8
    for s in range(0, n, QUERY_BLOCK):
        e = min(s + QUERY_BLOCK, n)
        nb, first, stop = e - s, start + s, start + e  # positions [first, stop)
        query_pos = torch.arange(first, stop, device=q.device).repeat(g)            # [g*nb]
        future = torch.arange(stop, device=q.device)[None, :] > query_pos[:, None]  # [g*nb, stop]
        step = max(1, SCORE_BYTES // (hkv * g * nb * stop * elem))
        for b0 in range(0, b_all, step):
            b1 = min(b0 + step, b_all)
            k, v = k_all[b0:b1, :, :stop].to(q.dtype), v_all[b0:b1, :, :stop].to(q.dtype)
            qb = qv[b0:b1, s:e].permute(0, 2, 3, 1, 4).reshape(b1 - b0, hkv, g * nb, d)
            scores = (qb @ k.transpose(-1, -2)).to(stat_dtype(q.dtype)) * (1.0 / math.sqrt(d))
            probs = scores.masked_fill_(future, float("-inf")).softmax(dim=-1).to(q.dtype)
            out[b0:b1, s:e] = (probs @ v).reshape(b1 - b0, hkv, g, nb, d).permute(0, 3, 1, 2, 4)
    return out.reshape(m, hq * d)


def block(config: LlamaConfig, weights: LayerWeights, layer: int, x: torch.Tensor, batch: PackedBatch,
          cache: KVCache, phase: str = "prefill",
          rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """One decoder block on the packed residual stream x [M, H]; writes this layer's K/V to `cache`.

    `rope` = cos_sin(config, batch.row_position, x.dtype) may be passed to share it across layers.
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    m = x.shape[0]
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    cos, sin = rope if rope is not None else cos_sin(config, batch.row_position, x.dtype)

    h = rms_norm(x, weights.attn_norm, config.rms_norm_eps)
    q = apply_rope((h @ weights.wq.T).view(m, hq, d), cos, sin)
    k = apply_rope((h @ weights.wk.T).view(m, hkv, d), cos, sin)
    v = (h @ weights.wv.T).view(m, hkv, d)
    cache.write(layer, batch.row_slot, batch.row_position, k, v, spans=batch.spans())
    x = x + attention(config, layer, q, batch, cache, phase) @ weights.wo.T

    h = rms_norm(x, weights.mlp_norm, config.rms_norm_eps)
    z = torch.nn.functional.silu(h @ weights.w_gate.T) * (h @ weights.w_up.T)
    return x + z @ weights.w_down.T


_TOKENS_CHECKED = contextvars.ContextVar("futx_tokens_checked", default=False)


@contextlib.contextmanager
def tokens_checked():
    """Within this context forward calls skip the token-id range check (one device sync per call):
    for callers that validated all their token ids up front, e.g. the perplexity harness."""
    reset = _TOKENS_CHECKED.set(True)
    try:
        yield
    finally:
        _TOKENS_CHECKED.reset(reset)


def _check_inputs(config: LlamaConfig, weights: ModelWeights, tokens: torch.Tensor, batch: PackedBatch,
                  cache: KVCache) -> None:
    if weights.config.replace(name=config.name) != config:
        raise ValueError(f"weights were built for config {weights.config} but forward was given {config}")
    weights.validate()
    if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be a 1-D integer tensor, got dtype {tokens.dtype} shape {tuple(tokens.shape)}")
    if tokens.numel() != batch.num_rows:
        raise ValueError(f"{tokens.numel()} tokens but the batch metadata describes {batch.num_rows} rows")
    if tokens.numel() and not _TOKENS_CHECKED.get():
        lo, hi = torch.stack(torch.aminmax(tokens)).tolist()
        if lo < 0 or hi >= config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {config.vocab_size}), got {lo}..{hi}")
    for name, dev in (("tokens", tokens.device), ("batch", batch.row_position.device), ("cache", cache.device)):
        if dev != weights.device:
            raise ValueError(f"{name} is on {dev} but the weights are on {weights.device}")
    c = cache.config
    if (c.num_hidden_layers, c.num_key_value_heads, c.head_dim) != (
            config.num_hidden_layers, config.num_key_value_heads, config.head_dim):
        raise ValueError("the KV cache was allocated for a different model shape "
                         f"(layers/kv heads/head dim {c.num_hidden_layers}/{c.num_key_value_heads}/{c.head_dim})")
    top = max(batch.host_lists()[2])
    if top >= cache.slots:
        raise ValueError(f"batch uses cache slot {top} but the cache has {cache.slots} slots")


def forward_hidden(config: LlamaConfig, weights: ModelWeights, tokens: torch.Tensor, batch: PackedBatch,
                   cache: KVCache, phase: str = "prefill") -> torch.Tensor:
    """Embedding, all blocks and the final RMSNorm: the normalized last hidden state [M, H]."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    _check_inputs(config, weights, tokens, batch, cache)
    x = weights.embed[tokens]
    rope = cos_sin(config, batch.row_position, x.dtype)
    for i, layer in enumerate(weights.layers):
        x = block(config, layer, i, x, batch, cache, phase, rope)
    return rms_norm(x, weights.final_norm, config.rms_norm_eps)


def logits(weights: ModelWeights, hidden: torch.Tensor) -> torch.Tensor:
    """LM head: [M, H] -> [M, V] in the weights' dtype."""
    return hidden @ weights.output_weight.T


def forward(config: LlamaConfig, weights: ModelWeights, tokens: torch.Tensor, batch: PackedBatch,
            cache: KVCache, phase: str = "prefill") -> torch.Tensor:
    """The whole model on a packed batch: logits [M, V]; K/V of every layer written to `cache`."""
    return logits(weights, forward_hidden(config, weights, tokens, batch, cache, phase))


__all__ = ["PHASES", "attention", "block", "forward", "forward_hidden", "layer_shapes", "logits", "rms_norm",
           "stat_dtype"]
