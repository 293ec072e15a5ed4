"""futx's mirror kernel (futx.ops.mirror_rows, decode/mirror_rows.py) on a Hopper GPU: the bytes it stores for
rows of the BF16 main copy equal those of the torch writer (EngineCache.mirror_rows(kernel=False), which
futx.quant defines and the CPU tests tie to layouts and the decode kernel's conventions): INT4 (rotated) and
E4M3, head dims 64 and 128, rows in any order, blocks partly filled, zero rows; bad inputs raise before launch.

    python -m pytest -m gpu -q tests/test_mirror_rows_gpu.py
"""

import pytest
import torch

from futx.checkpoint.synthetic import tiny_config
from futx.engine.cache import EngineCache

pytestmark = pytest.mark.gpu

CASES = [(fmt, d) for fmt in ("int4", "e4m3") for d in (64, 128)]


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("fmt,d", CASES, ids=[f"{f}-d{d}" for f, d in CASES])
def test_kernel_stores_the_torch_writers_bytes(fmt, d):
    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=d, num_hidden_layers=1, vocab_size=64)
    caches = [EngineCache(cfg, fmt, 3, 64, "cuda") for _ in range(2)]
    g = torch.Generator(device="cuda").manual_seed(d)
    main = [(torch.randn(4, 2, 64, d, generator=g, device="cuda") * 3).to(torch.bfloat16) for _ in range(2)]
    main[0][1, 0, 5].zero_()                                       # a zero row: scale 0, zero bytes
    for c in caches:
        for t, src in zip((c.layers[0].k_cache, c.layers[0].v_cache), main):
            t.copy_(src)
        for t in c.layers[0].tensors()[2:]:                         # poison the mirror: every byte is written
            _bytes(t).fill_(0x5A) if t.dtype != torch.float32 else t.fill_(float("nan"))
    slots = torch.tensor([1] * 21 + [0] * 2 + [3] * 4, device="cuda")   # slot 3: the scratch slot
    positions = torch.cat([torch.randperm(21, generator=g, device="cuda"), torch.tensor([40, 5], device="cuda"),
                           torch.tensor([0, 1, 2, 3], device="cuda")])
    caches[0].mirror_rows(0, slots, positions, kernel=False)
    caches[1].mirror_rows(0, slots.int(), positions.int(), kernel=True)
    torch.cuda.synchronize()
    names = ("k_mirror", "k_scale", "v_mirror", "v_scale")
    for name, a, b in zip(names, caches[0].layers[0].tensors()[2:], caches[1].layers[0].tensors()[2:]):
        a, b = _bytes(a), _bytes(b)
        if a.dtype == torch.float32:
            assert torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0)), name
        else:
            assert torch.equal(a, b), name


def test_bad_inputs_raise_before_launch():
    from futx.ops.mirror_rows import mirror_rows

    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=128, num_hidden_layers=1, vocab_size=64)
    c = EngineCache(cfg, "int4", 2, 64, "cuda").layers[0]
    rows = torch.zeros(3, dtype=torch.int32, device="cuda")
    args = [c.k_cache, c.v_cache, c.k_mirror, c.k_scale, c.v_mirror, c.v_scale, rows, rows]
    with pytest.raises(ValueError, match="cache_format"):
        mirror_rows("bf16", *args)
    with pytest.raises((TypeError, ValueError), match="row_slot"):
        mirror_rows("int4", *args[:6], rows.long(), rows)
    with pytest.raises(ValueError, match="k_mirror"):
        mirror_rows("int4", c.k_cache, c.v_cache, c.k_mirror[:, :, :4], *args[3:])
    with pytest.raises(ValueError, match="row_pos"):
        mirror_rows("int4", *args[:7], rows[:2])


@pytest.mark.parametrize("fmt,d", CASES, ids=[f"{f}-d{d}" for f, d in CASES])
@pytest.mark.parametrize("paged", (False, True))
def test_block_rows_kernel_stores_the_torch_prewrites_bytes(fmt, d, paged):
    """futx.ops.qkv_rows (RoPE, main copy, mirror in one launch) against KernelOps.prewrite_rows' torch path (RoPE
    in float32 by split_rope's rule, stores, the mirror kernel): the same bytes in every cache tensor, rows of
    several slots at scattered positions, a paged cache's rows at their table's pages."""
    from futx.engine.backends import KernelOps, rope_table
    from futx.paging import PageLayout

    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=d, num_hidden_layers=1, vocab_size=64)
    lay = PageLayout.for_capacity(128, 8, 3, 256) if paged else None
    caches = [EngineCache(cfg, fmt, 3, 256, "cuda", layout=lay) for _ in range(2)]
    for c in caches:
        if paged:
            for s, pages in enumerate(([5, 1], [0, 7], [3])):
                c.set_pages(s, pages)
        for t in c.layers[0].tensors():
            _bytes(t).fill_(0x5A) if t.dtype != torch.float32 else t.fill_(float("nan"))
    g = torch.Generator(device="cuda").manual_seed(d + paged)
    m = 13
    qkv = torch.randn(m, (4 + 2 * 2) * d, generator=g, device="cuda").to(torch.bfloat16)
    slots = torch.tensor([0] * 5 + [1] * 5 + [2] * 3, device="cuda", dtype=torch.int32)
    positions = torch.cat([torch.arange(126, 131), torch.arange(0, 5), torch.tensor([7, 8, 100])]).int().cuda()
    table = rope_table(cfg, 256, "cuda")
    KernelOps.prewrite_rows(qkv, positions, slots, caches[0], 0, table)
    KernelOps.prewrite_rows(qkv, positions, slots, caches[1], 0, table, kernel=True)
    torch.cuda.synchronize()
    for a, b in zip(caches[0].layers[0].tensors(), caches[1].layers[0].tensors()):
        a, b = _bytes(a), _bytes(b)
        assert torch.equal(a.float().nan_to_num(-1.0), b.float().nan_to_num(-1.0))


@pytest.mark.parametrize("fmt,d", CASES, ids=[f"{f}-d{d}" for f, d in CASES])
def test_mirror_only_block_rows_store_the_same_mirror(fmt, d):
    """futx.ops.qkv_rows on a cache whose mirror holds more pages than its main copy (the INT4-only cache): the
    `.mo` kernel stores the mirror rows the full kernel stores and never touches the 2-page main copy."""
    from futx.engine.backends import rope_table

    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=d, num_hidden_layers=1, vocab_size=64)
    full = EngineCache(cfg, fmt, 3, 256, "cuda").layers[0]
    for t in full.tensors():
        _bytes(t).fill_(0x5A) if t.dtype != torch.float32 else t.fill_(float("nan"))
    mirrors = [t.clone() for t in full.tensors()[2:]]
    main = torch.full((2, *full.k_cache.shape[1:]), float("nan"), dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(d)
    qkv = torch.randn(6, 8, d, generator=g, device="cuda").to(torch.bfloat16)
    positions = torch.tensor([0, 1, 2, 200, 201, 255], dtype=torch.int32, device="cuda")
    slots = torch.tensor([3, 3, 3, 2, 2, 1], dtype=torch.int32, device="cuda")   # slot 3 > the main copy's 2
    table = rope_table(cfg, 256, "cuda")
    torch.ops.futx.qkv_rows_(fmt, qkv, table, positions, slots, positions, *full.tensors())
    torch.ops.futx.qkv_rows_(fmt, qkv, table, positions, slots, positions, main, main.clone(), *mirrors)
    torch.cuda.synchronize()
    for a, b in zip(full.tensors()[2:], mirrors):
        assert torch.equal(_bytes(a).float().nan_to_num(-1.0), _bytes(b).float().nan_to_num(-1.0))
    assert torch.isnan(main).all()
