"""KV cache: the addressing function is the storage layout; mirror, overflow, gaps and bad input."""

import pytest
import torch

from futx.checkpoint.synthetic import tiny_config
from futx.kvcache import KVCache

pytestmark = pytest.mark.usefixtures("single_thread")

CFG = tiny_config()


def rows(m, gen, scale=1.0):
    return scale * torch.randn(m, CFG.num_key_value_heads, CFG.head_dim, generator=gen, dtype=torch.float64)


def test_offset_is_the_storage_address(seeded):
    cache = KVCache(CFG, slots=3, capacity=10, dtype=torch.float64)
    k, v = rows(4, seeded), rows(4, seeded)
    slots, pos = torch.tensor([2, 2, 0, 1]), torch.tensor([0, 1, 0, 0])
    cache.write(1, slots, pos, k, v)
    flat = cache.k[1].view(-1)
    for m in range(4):
        for h in range(CFG.num_key_value_heads):
            for c in (0, 5, CFG.head_dim - 1):
                off = cache.offset(int(slots[m]), h, int(pos[m]), c)
                assert flat[off] == k[m, h, c] == cache.k[1][slots[m], h, pos[m], c]
    assert cache.lengths[1].tolist() == [1, 1, 2] and cache.lengths[0].tolist() == [0, 0, 0]


def test_read_returns_written_rows_head_major(seeded):
    cache = KVCache(CFG, slots=2, capacity=8, dtype=torch.float64)
    k, v = rows(5, seeded), rows(5, seeded)
    cache.write(0, torch.ones(5, dtype=torch.int64), torch.arange(5), k, v)
    rk, rv = cache.read(0, 1, 5)
    assert torch.equal(rk, k.transpose(0, 1)) and torch.equal(rv, v.transpose(0, 1))
    rk3, _ = cache.read(0, 1, 3, mirror=True)  # no mirror function: the mirror is the main copy
    assert torch.equal(rk3, k[:3].transpose(0, 1))


def test_mirror_stores_fn_values_and_main_keeps_exact(seeded):
    calls = []

    def mirror(layer, k, v):
        calls.append((layer, k.shape[0]))
        return torch.round(k * 4) / 4, torch.round(v * 4) / 4

    cache = KVCache(CFG, slots=1, capacity=4, dtype=torch.float64, mirror=mirror)
    k, v = rows(3, seeded), rows(3, seeded)
    cache.write(1, torch.zeros(3, dtype=torch.int64), torch.arange(3), k, v)
    assert calls == [(1, 3)]
    mk, mv = cache.read(1, 0, 3, mirror=True)
    assert torch.equal(mk, (torch.round(k * 4) / 4).transpose(0, 1))
    assert torch.equal(mv, (torch.round(v * 4) / 4).transpose(0, 1))
    assert torch.equal(cache.read(1, 0, 3)[0], k.transpose(0, 1))


def test_cache_dtype_conversion(seeded):
    cache = KVCache(CFG, slots=1, capacity=4, dtype=torch.bfloat16)
    k = rows(2, seeded)
    cache.write(0, torch.zeros(2, dtype=torch.int64), torch.arange(2), k, k)
    assert torch.equal(cache.read(0, 0, 2)[0], k.to(torch.bfloat16).transpose(0, 1))


def test_overflow_raises_and_leaves_cache_untouched(seeded):
    cache = KVCache(CFG, slots=2, capacity=4, dtype=torch.float64)
    k = rows(5, seeded)
    with pytest.raises(ValueError, match="overflow.*slot 1 position 4.*capacity 4"):
        cache.write(0, torch.ones(5, dtype=torch.int64), torch.arange(5), k, k)
    assert cache.lengths.sum() == 0 and torch.isnan(cache.k[0]).all()


def test_gap_and_rewind(seeded):
    cache = KVCache(CFG, slots=1, capacity=8, dtype=torch.float64)
    k = rows(2, seeded)
    cache.write(0, torch.zeros(2, dtype=torch.int64), torch.arange(2), k, k)
    with pytest.raises(ValueError, match="gap.*holds 2 positions.*start at position 3"):
        cache.write(0, torch.zeros(1, dtype=torch.int64), torch.tensor([3]), k[:1], k[:1])
    cache.write(0, torch.zeros(1, dtype=torch.int64), torch.tensor([1]), k[:1], k[:1])  # rewind: allowed
    assert int(cache.lengths[0, 0]) == 2
    cache.reset(0)
    with pytest.raises(ValueError, match="holds 0 positions"):
        cache.read(0, 0, 1)


def test_bad_inputs(seeded):
    cache = KVCache(CFG, slots=2, capacity=4, dtype=torch.float64)
    k = rows(2, seeded)
    idx = torch.arange(2)
    with pytest.raises(ValueError, match="shape"):
        cache.write(0, idx, idx, k[:, :1], k)
    with pytest.raises(ValueError, match="slot out of range"):
        cache.write(0, torch.tensor([0, 2]), idx, k, k)
    with pytest.raises(ValueError, match="layer 5 out of range"):
        cache.write(5, idx, idx, k, k)
    with pytest.raises(ValueError, match="negative position"):
        cache.write(0, idx, torch.tensor([-1, 0]), k, k)
    with pytest.raises(ValueError, match="floating"):
        cache.write(0, idx, idx, k.long(), k)
    with pytest.raises(ValueError, match="cannot read 3"):
        cache.read(0, 0, 3)
    with pytest.raises(ValueError, match="mirror function returned shapes"):
        bad = KVCache(CFG, slots=1, capacity=4, mirror=lambda layer, k, v: (k[:1], v))
        bad.write(0, torch.zeros(2, dtype=torch.int64), idx, k.float(), k.float())
    for kwargs, msg in (({"slots": 0, "capacity": 4}, "slots"), ({"slots": 1, "capacity": 0}, "capacity"),
                        ({"slots": 1, "capacity": 4, "dtype": torch.int32}, "floating")):
        with pytest.raises(ValueError, match=msg):
            KVCache(CFG, **kwargs)
