"""futx::main_rows_ (decode/main_rows.py) on the GPU: the INT4-only cache's stage by the kernel equals the torch
definition (futx.engine.paged_kv) bit for bit, for INT4 (rotated) and E4M3 mirrors at head dims 64 and 128, from
mirror-only pages into staging pages, odd lengths; rows past n and other pages untouched; bad input refused before
any launch."""

from __future__ import annotations

import pytest
import torch

from futx.checkpoint.synthetic import tiny_config
from futx.engine.cache import EngineCache
from futx.engine.paged_kv import dequantize_pages_into
from futx.paging import PageLayout

pytestmark = pytest.mark.gpu
P = 128


def _cache(fmt: str, d: int, n: int, seed: int):
    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=d, num_hidden_layers=3, vocab_size=64)
    pages = -(-n // P)
    lay = PageLayout.for_capacity(P, pages=2 * pages + 1, slots=2, capacity=pages * P, staging=pages + 1)
    cache = EngineCache(cfg, fmt, 2, pages * P, "cuda", layout=lay)
    own = [lay.first_page + 2 * i + 1 for i in range(pages)]     # scattered mirror-only pages
    cache.set_pages(1, own)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for i in range(cfg.num_hidden_layers):
        k, v = (torch.randn(n, 2, d, generator=g, device="cuda") * 3 for _ in range(2))
        cache.write_rows(i, torch.ones(n, dtype=torch.long, device="cuda"), torch.arange(n, device="cuda"), k, v)
    return cache, own, list(range(pages, 0, -1))                  # staging pages in reverse order


@pytest.mark.parametrize("fmt", ("int4", "e4m3"))
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("n", (1, 77, 2 * P + 9))
def test_main_rows_kernel_equals_the_torch_stage(fmt, d, n):
    cache, own, staging = _cache(fmt, d, n, seed=n + d)
    mains = [t for c in cache.layers for t in (c.k_cache, c.v_cache)]
    for t in mains:
        t.fill_(float("nan"))
    dequantize_pages_into(cache, own, staging, n)
    want = [t.clone() for t in mains]
    for t in mains:
        t.fill_(float("nan"))
    dequantize_pages_into(cache, own, staging, n, kernel=True)
    torch.cuda.synchronize()
    for got, exp in zip(mains, want):
        assert torch.equal(got.view(torch.int16), exp.view(torch.int16))   # bits: NaN where nothing was written
    c = cache.layers[0]
    page, row = staging[(n - 1) // P], (n - 1) % P
    assert not c.k_cache[page, :, row].isnan().any() and not c.v_cache[page, :, row].isnan().any()
    if row + 1 < P:
        assert c.k_cache[page, :, row + 1:].isnan().all()                  # rows past n untouched


def test_main_rows_refuses_bad_input():
    from futx.ops.main_rows import main_rows

    cache, own, staging = _cache("int4", 128, 40, seed=1)
    c = cache.layers[0]
    rows = torch.zeros(4, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="dst_pos"):
        main_rows("int4", c.k_cache, c.v_cache, c.k_mirror, c.k_scale, c.v_mirror, c.v_scale, rows, rows, rows,
                  rows[:3])
    with pytest.raises((TypeError, ValueError), match="int32"):
        main_rows("int4", c.k_cache, c.v_cache, c.k_mirror, c.k_scale, c.v_mirror, c.v_scale, rows, rows,
                  rows.long(), rows)
    with pytest.raises(ValueError, match="cache_format"):
        main_rows("bf16", c.k_cache, c.v_cache, c.k_mirror, c.k_scale, c.v_mirror, c.v_scale, rows, rows, rows, rows)
