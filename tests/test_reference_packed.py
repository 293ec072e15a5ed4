"""Packed prefill == per-request prefill == token-by-token decode (logits and cache contents);
chunked prefill and multi-token decode chunks == token by token; phases read main vs mirror."""

import pytest
import torch

from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.kvcache import KVCache
from futx.reference import PackedBatch, forward

pytestmark = pytest.mark.usefixtures("single_thread")

CFG = tiny_config()
LENGTHS = [5, 3, 7]
CAP = 12
TOL = dict(rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=11, dtype=torch.float64, std=0.1)


@pytest.fixture
def prompts(seeded):
    return [torch.randint(0, CFG.vocab_size, (n,), generator=seeded) for n in LENGTHS]


def quarter_mirror(layer, k, v):
    """A stand-in for quantize->dequantize: per-row rounding, different for each layer."""
    step = 0.25 * (layer + 1)
    return torch.round(k / step) * step, torch.round(v / step) * step


def cache_rows(cache, slot, n):
    return [torch.cat(cache.read(layer, slot, n)) for layer in range(CFG.num_hidden_layers)]


def run_alone(weights, tokens):
    cache = KVCache(CFG, 1, CAP, dtype=torch.float64)
    return forward(CFG, weights, tokens, PackedBatch.from_lengths([len(tokens)]), cache), cache


def run_token_by_token(weights, tokens, mirror=None, prefill=1):
    """Prefill `prefill` tokens, then decode the rest one token per call (phase decode)."""
    cache = KVCache(CFG, 1, CAP, dtype=torch.float64, mirror=mirror)
    out = [forward(CFG, weights, tokens[:prefill], PackedBatch.from_lengths([prefill]), cache)]
    for p in range(prefill, len(tokens)):
        out.append(forward(CFG, weights, tokens[p:p + 1], PackedBatch.decode([p]), cache, phase="decode"))
    return torch.cat(out), cache


def test_packed_prefill_equals_alone_equals_token_by_token(weights, prompts):
    cache = KVCache(CFG, 3, CAP, dtype=torch.float64)
    # Requests in slots 2, 0, 1: the slot map must not matter.
    packed = forward(CFG, weights, torch.cat(prompts), PackedBatch.from_lengths(LENGTHS, slots=[2, 0, 1]), cache)
    cu = [0, 5, 8, 15]
    for b, (tokens, slot) in enumerate(zip(prompts, [2, 0, 1])):
        alone, alone_cache = run_alone(weights, tokens)
        stepped, step_cache = run_token_by_token(weights, tokens)
        assert torch.allclose(packed[cu[b]:cu[b + 1]], alone, **TOL)
        assert torch.allclose(stepped, alone, **TOL)
        for a, s, p in zip(cache_rows(alone_cache, 0, len(tokens)), cache_rows(step_cache, 0, len(tokens)),
                           cache_rows(cache, slot, len(tokens))):
            assert torch.allclose(p, a, **TOL) and torch.allclose(s, a, **TOL)
        assert int(cache.lengths[0, slot]) == len(tokens)


def test_chunked_prefill_and_mixed_batches(weights, prompts):
    """Chunks of different requests at different offsets in one packed call == one prefill each."""
    cache = KVCache(CFG, 3, CAP, dtype=torch.float64)
    first = [2, 1, 4]
    forward(CFG, weights, torch.cat([p[:n] for p, n in zip(prompts, first)]), PackedBatch.from_lengths(first), cache)
    rest = [n - f for n, f in zip(LENGTHS, first)]
    second = forward(CFG, weights, torch.cat([p[f:] for p, f in zip(prompts, first)]),
                     PackedBatch.from_lengths(rest, start_positions=first), cache)
    r0 = 0
    for tokens, f, r in zip(prompts, first, rest):
        alone, _ = run_alone(weights, tokens)
        assert torch.allclose(second[r0:r0 + r], alone[f:], **TOL)
        r0 += r


def test_decode_batch_of_requests_at_different_positions(weights, prompts):
    cache = KVCache(CFG, 3, CAP, dtype=torch.float64)
    forward(CFG, weights, torch.cat([p[:-1] for p in prompts]), PackedBatch.from_lengths([n - 1 for n in LENGTHS]),
            cache)
    last = forward(CFG, weights, torch.stack([p[-1] for p in prompts]), PackedBatch.decode([n - 1 for n in LENGTHS]),
                   cache, phase="decode")
    for b, tokens in enumerate(prompts):
        assert torch.allclose(last[b], run_alone(weights, tokens)[0][-1], **TOL)


@pytest.mark.parametrize("chunks", [[3, 4], [1, 6], [7]])
def test_multi_token_decode_chunk_equals_token_by_token(weights, prompts, chunks):
    """Decode-phase chunks (causal, reading the mirror) == one token per call, with a real mirror."""
    tokens = prompts[2]
    stepped, step_cache = run_token_by_token(weights, tokens, quarter_mirror)
    cache = KVCache(CFG, 1, CAP, dtype=torch.float64, mirror=quarter_mirror)
    out = [forward(CFG, weights, tokens[:1], PackedBatch.from_lengths([1]), cache)]
    start = 1
    for n in chunks:
        n = min(n, len(tokens) - start)
        if n <= 0:
            break
        out.append(forward(CFG, weights, tokens[start:start + n], PackedBatch.from_lengths([n], [start]), cache,
                           phase="decode"))
        start += n
    assert torch.allclose(torch.cat(out), stepped, **TOL)
    for layer in range(CFG.num_hidden_layers):
        for mirror in (False, True):
            a = cache.read(layer, 0, len(tokens), mirror=mirror)
            b = step_cache.read(layer, 0, len(tokens), mirror=mirror)
            assert torch.allclose(torch.cat(a), torch.cat(b), **TOL)


def test_prefill_reads_main_and_decode_reads_mirror(weights, prompts):
    tokens = prompts[0]
    plain, _ = run_token_by_token(weights, tokens)
    mirrored, cache = run_token_by_token(weights, tokens, quarter_mirror)
    # Token 0 is prefilled (reads main: unaffected); decoded tokens read the rounded mirror.
    assert torch.allclose(mirrored[0], plain[0], **TOL)
    assert (mirrored[1:] - plain[1:]).abs().max() > 1e-3
    # The main copy holds exact K/V: layer 0 (whose input does not depend on attention) matches a prefill.
    _, exact = run_alone(weights, tokens)
    assert torch.allclose(torch.cat(cache.read(0, 0, len(tokens))), torch.cat(exact.read(0, 0, len(tokens))), **TOL)
    assert not torch.allclose(torch.cat(cache.read(0, 0, len(tokens), mirror=True)),
                              torch.cat(exact.read(0, 0, len(tokens))), **TOL)


def test_prefill_and_decode_with_different_weights(weights, prompts):
    """Weights are per call: prefill with one set, decode with another (the simulated-quantization use)."""
    other = weights.to()
    other.layers = [l.replace(wo=l.wo * 1.5) for l in weights.layers]
    tokens = prompts[1]
    cache = KVCache(CFG, 1, CAP, dtype=torch.float64)
    forward(CFG, weights, tokens[:2], PackedBatch.from_lengths([2]), cache)
    mixed = forward(CFG, other, tokens[2:], PackedBatch.from_lengths([1], [2]), cache, phase="decode")
    assert not torch.allclose(mixed, run_alone(weights, tokens)[0][2:], **TOL)
    assert not torch.allclose(mixed, run_alone(other, tokens)[0][2:], **TOL)


def test_query_blocking_is_exact(weights, prompts, monkeypatch):
    """Attention processes queries in blocks of QUERY_BLOCK; tiny blocks must give the same result."""
    import futx.reference.model as model

    batch = PackedBatch.from_lengths(LENGTHS, start_positions=[0, 0, 0])
    whole = forward(CFG, weights, torch.cat(prompts), batch, KVCache(CFG, 3, CAP, dtype=torch.float64))
    monkeypatch.setattr(model, "QUERY_BLOCK", 2)
    blocked = forward(CFG, weights, torch.cat(prompts), batch, KVCache(CFG, 3, CAP, dtype=torch.float64))
    assert torch.allclose(blocked, whole, **TOL)
