"""The batched attention path for uniform batches (equal lengths and starts, e.g. perplexity windows)
equals running each request alone; PackedBatch keeps its bookkeeping on the host; KVCache.read_batch."""

import pytest
import torch

import futx.reference.model as model
from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.kvcache import KVCache
from futx.reference import PackedBatch, forward
from futx.reference.model import tokens_checked

pytestmark = pytest.mark.usefixtures("single_thread")

CFG = tiny_config()
TOL = dict(rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=5, dtype=torch.float64, std=0.1)


def _mirror(layer, k, v):
    step = 0.25 * (layer + 1)
    return torch.round(k / step) * step, torch.round(v / step) * step


def _alone(weights, tokens, prefill, mirror=None):
    """Prefill `prefill` tokens of one request, then decode the rest one by one (the per-request path)."""
    cache = KVCache(CFG, 1, tokens.numel(), dtype=torch.float64, mirror=mirror)
    out = [forward(CFG, weights, tokens[:prefill], PackedBatch.from_lengths([prefill]), cache)]
    for p in range(prefill, tokens.numel()):
        out.append(forward(CFG, weights, tokens[p:p + 1], PackedBatch.decode([p]), cache, phase="decode"))
    return torch.cat(out)


@pytest.mark.parametrize("query_block,score_bytes", [(512, 2 << 30), (4, 64 * 8 * 3)])
def test_uniform_batch_equals_requests_alone(weights, seeded, monkeypatch, query_block, score_bytes):
    monkeypatch.setattr(model, "QUERY_BLOCK", query_block)
    monkeypatch.setattr(model, "SCORE_BYTES", score_bytes)  # several request groups per step
    b, w, pre = 4, 14, 9
    tokens = torch.randint(0, CFG.vocab_size, (b, w), generator=seeded)
    cache = KVCache(CFG, b, w, dtype=torch.float64, mirror=_mirror)
    batch = PackedBatch.from_lengths([pre] * b)
    assert batch.uniform() == (pre, 0)
    outs = [forward(CFG, weights, tokens[:, :pre].reshape(-1), batch, cache).view(b, pre, -1)]
    with tokens_checked():
        for s, e in ((pre, pre + 2), (pre + 2, pre + 3), (pre + 3, w)):  # a chunk, one token, a chunk
            step = PackedBatch.from_lengths([e - s] * b, [s] * b)
            outs.append(forward(CFG, weights, tokens[:, s:e].reshape(-1), step, cache, "decode").view(b, e - s, -1))
    batched = torch.cat(outs, dim=1)
    for i in range(b):
        torch.testing.assert_close(batched[i], _alone(weights, tokens[i], pre, _mirror), **TOL)


def test_uniform_batch_with_permuted_and_partial_slots(weights, seeded):
    b, w = 3, 10
    tokens = torch.randint(0, CFG.vocab_size, (b, w), generator=seeded)
    cache = KVCache(CFG, 5, w, dtype=torch.float64)
    batch = PackedBatch.from_lengths([w] * b, slots=[4, 0, 2])
    got = forward(CFG, weights, tokens.reshape(-1), batch, cache).view(b, w, -1)
    for i in range(b):
        torch.testing.assert_close(got[i], _alone(weights, tokens[i], w), **TOL)
    k, v = cache.read_batch(0, [4, 0, 2], w)
    assert k.shape == (3, CFG.num_key_value_heads, w, CFG.head_dim)
    for i, slot in enumerate([4, 0, 2]):
        ks, vs = cache.read(0, slot, w)
        assert torch.equal(k[i], ks) and torch.equal(v[i], vs)
    with pytest.raises(ValueError, match="holds 0 positions"):
        cache.read_batch(0, [0, 1], 2)


def test_read_batch_of_all_slots_is_a_view():
    cache = KVCache(CFG, 2, 8)
    cache.write(0, torch.tensor([0, 1]), torch.tensor([0, 0]), torch.ones(2, CFG.num_key_value_heads, CFG.head_dim),
                torch.ones(2, CFG.num_key_value_heads, CFG.head_dim))
    k, _ = cache.read_batch(0, [0, 1], 1)
    assert k.data_ptr() == cache.k[0].data_ptr()


def test_packed_batch_host_metadata():
    batch = PackedBatch.from_lengths([3, 2], [4, 0], slots=[1, 0])
    assert batch.host == ((0, 3, 5), (4, 0), (1, 0))
    assert batch.spans() == ((1, 4, 7), (0, 0, 2))
    assert batch.uniform() is None and batch.num_rows == 5
    assert PackedBatch.decode([7, 7, 7]).uniform() == (1, 7)


def test_spans_checks_match_the_device_checks():
    cache = KVCache(CFG, 2, 4)
    kv = torch.zeros(2, CFG.num_key_value_heads, CFG.head_dim)
    batch = PackedBatch.from_lengths([1, 1], [0, 4])
    with pytest.raises(ValueError, match="overflow.*slot 1 position 4.*capacity 4"):
        cache.write(0, batch.row_slot, batch.row_position, kv, kv, spans=batch.spans())
    batch = PackedBatch.from_lengths([1, 1], [0, 2])
    with pytest.raises(ValueError, match="gap.*holds 0 positions.*start at position 2"):
        cache.write(0, batch.row_slot, batch.row_position, kv, kv, spans=batch.spans())


def test_token_check_and_its_opt_out(weights):
    cache = KVCache(CFG, 1, 4, dtype=torch.float64)
    bad = torch.tensor([CFG.vocab_size])
    with pytest.raises(ValueError, match="token ids must lie"):
        forward(CFG, weights, bad, PackedBatch.from_lengths([1]), cache)
    with tokens_checked():
        assert model._TOKENS_CHECKED.get()
    assert not model._TOKENS_CHECKED.get()
