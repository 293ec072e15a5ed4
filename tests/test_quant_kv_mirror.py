"""KV-cache mirrors: per-row scales, packed rows round-trip, rotation, mirror callables."""

import pytest
import torch

from futx.quant import hadamard, kv_mirror, layouts
from futx.quant.formats import CACHE_FORMATS, cache_format


def _rows(gen, *shape):
    return torch.randn(*shape, generator=gen) * 2 + 0.01


def test_int4_rows_independent_formula(seeded):
    x = _rows(seeded, 5, 3, 64)
    q, s = kv_mirror.quantize_int4_rows(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (5, 3)
    assert torch.equal(s, x.abs().amax(-1) / 7)
    assert torch.equal(q.float(), torch.round(x / s[..., None]))
    assert int(q.abs().max()) == 7
    deq = kv_mirror.dequantize_rows(q, s)
    assert (deq - x).abs().le(s[..., None] / 2 * (1 + 1e-6)).all()


def test_e4m3_rows(seeded):
    x = _rows(seeded, 4, 2, 64)
    d, s = kv_mirror.quantize_e4m3_rows(x)
    assert torch.equal(s, x.abs().amax(-1) / 448) and d.dtype == torch.float8_e4m3fn
    assert torch.equal(d.float().abs().amax(-1), torch.full((4, 2), 448.0))


def test_zero_row_and_nan():
    q, s = kv_mirror.quantize_int4_rows(torch.zeros(2, 64))
    assert torch.all(s == 0) and torch.all(q == 0)
    with pytest.raises(ValueError, match="NaN"):
        kv_mirror.quantize_int4_rows(torch.tensor([[1.0, float("nan")]]))


@pytest.mark.parametrize("rotate,block", [(True, None), (True, 16), (False, None)])
def test_packed_cache_matches_mirror(seeded, rotate, block):
    k, v = _rows(seeded, 2, 3, 24, 64), _rows(seeded, 2, 3, 24, 64)
    rows = kv_mirror.pack_int4_cache(k, v, rotate=rotate, block=block)
    assert rows.k_packed.shape == (2, 3, 3, 32, 8) and rows.v_packed.shape == (2, 3, 24, 32)
    k_eff, v_eff = kv_mirror.unpack_int4_cache(rows, rotate=rotate, block=block)
    mirror = kv_mirror.CacheMirror("int4", rotate=rotate, block=block)
    mk, mv = mirror(0, k, v)
    assert torch.allclose(k_eff, mk, atol=1e-6) and torch.allclose(v_eff, mv, atol=1e-6)
    # the kernel's score: (Hq).deq(q(Hk)) equals q.k_eff
    q = torch.randn(64, generator=seeded, dtype=torch.float64)
    kq = layouts.unpack_int4_keys(rows.k_packed).double() * rows.k_scale[..., None].double()
    qr = hadamard.rotate(q, block) if rotate else q
    assert torch.allclose(kq @ qr, mk.double() @ q, atol=1e-4)


def test_rotation_helps_channel_outliers(seeded):
    k = torch.randn(256, 4, 64, generator=seeded)
    k[..., [3, 17, 40, 60]] *= 8
    rel = {}
    for rot in (False, True):
        e = kv_mirror.CacheMirror("int4", rotate=rot).row(k) - k
        rel[rot] = float(e.norm() / k.norm())
    assert rel[True] < 0.6 * rel[False]


def test_mirror_keeps_dtype_and_formats(seeded):
    k = _rows(seeded, 7, 3, 64).double()
    for name, fmt in CACHE_FORMATS.items():
        mk, mv = fmt.mirror()(0, k, k)
        assert mk.dtype == torch.float64 and mk.shape == k.shape
        err = float((mk - k).norm() / k.norm())
        assert err < {"bf16": 0.01, "e4m3": 0.05, "int4": 0.2, "int4-unrotated": 0.2}[name]
    with pytest.raises(ValueError):
        cache_format("int2")
    with pytest.raises(ValueError):
        kv_mirror.CacheMirror("bf16", rotate=True)


def test_pack_cache_shape_errors(seeded):
    with pytest.raises(ValueError, match="capacity"):
        kv_mirror.pack_int4_cache(torch.ones(1, 12, 64), torch.ones(1, 12, 64))


def test_mirror_rows_are_independent(seeded):
    # the KV cache writes rows in chunks of any size: a row's mirror value must not depend on its neighbours
    k = _rows(seeded, 9, 3, 64)
    for fmt in CACHE_FORMATS.values():
        mirror = fmt.mirror(16)
        whole = mirror.row(k)
        assert torch.equal(whole, torch.cat([mirror.row(k[i:i + 1]) for i in range(9)]))
