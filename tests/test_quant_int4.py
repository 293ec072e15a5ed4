"""INT4 weights: quantizer bounds, packing order against the layout's coordinates, shape errors."""

import pytest
import torch

from futx.quant import int4, layouts


def _w(gen, n, k, scale=0.05):
    return torch.randn(n, k, generator=gen) * scale + 1e-3  # random, never zero


@pytest.mark.parametrize("n,k,g", [(16, 64, 64), (48, 192, 64), (80, 576, 64), (32, 384, 128)])
def test_roundtrip_and_error_bound(seeded, n, k, g):
    w = _w(seeded, n, k)
    packed = int4.quantize_int4(w, g)
    assert packed.packed.shape == (n // 16, k // 64, 32, 4) and packed.packed.dtype == torch.int32
    assert packed.scales.shape == (n // 16, k // g, 16) and packed.scales.dtype == torch.float16
    q, s = int4.unpack_int4(packed)
    # independent formula: scale = fp16(group amax / 7), q = round(w / s)
    amax = w.abs().reshape(n, k // g, g).amax(-1)
    assert torch.equal(s, (amax / 7).half())
    s_full = s.float().repeat_interleave(g, 1)
    assert torch.equal(q.float(), torch.round(w / s_full).clamp(-8, 7))
    deq = packed.dequantize()
    assert torch.equal(deq, q.float() * s_full)  # exact in float32
    assert (deq - w).abs().le(s_full * 0.5 * (1 + 1e-3)).all()  # half a step, fp16 scale rounding aside
    assert torch.equal(deq, int4.fake_quantize_int4(w, g))


def test_pack_matches_layout_coordinates(seeded):
    # independent of the vectorised packer: place every nibble with Int4WeightLayout.nibble_coord
    n, k, g = 32, 128, 64
    q = torch.randint(-8, 8, (n, k), generator=seeded, dtype=torch.int8)
    s = (torch.rand(n, k // g, generator=seeded) + 0.1).half()
    packed = int4.pack_int4(q, s, g).packed
    lay = layouts.INT4_WEIGHT
    for nb in range(n // 16):
        for kb in range(k // 64):
            for lane in range(32):
                for word in range(4):
                    val = int(packed[nb, kb, lane, word]) & 0xFFFFFFFF
                    for nib in range(8):
                        dn, dk = lay.nibble_coord(lane, word, nib)
                        assert (val >> 4 * nib) & 0xF == int(q[16 * nb + dn, 64 * kb + dk]) + 8


@pytest.mark.parametrize("n,k,g", [(16, 64, 64), (112, 320, 64), (48, 768, 256)])
def test_pack_unpack_identity_odd_shapes(seeded, n, k, g):
    q = torch.randint(-8, 8, (n, k), generator=seeded, dtype=torch.int8)
    s = (torch.rand(n, k // g, generator=seeded) + 0.01).half()
    q2, s2 = int4.unpack_int4(int4.pack_int4(q, s, g))
    assert torch.equal(q, q2) and torch.equal(s, s2)


def test_grid_uses_full_range_symmetrically(seeded):
    w = _w(seeded, 16, 128)
    q = int4.quantize_int4(w, 64).q()
    assert int(q.max()) == 7 and int(q.min()) >= -8 and int(q.min()) <= -6


def test_zero_group_gives_zero_scale_and_grid(seeded):
    w = _w(seeded, 16, 128)
    w[3, :64] = 0
    packed = int4.quantize_int4(w, 64)
    assert float(packed.natural_scales()[3, 0]) == 0 and torch.all(packed.dequantize()[3, :64] == 0)


@pytest.mark.parametrize("shape,g,msg", [((16, 576), 128, "multiple of the group size"),
                                         ((20, 128), 64, "multiple of 16"),
                                         ((16, 96), 64, "multiple of 64"),
                                         ((16, 128), 96, "group size")])
def test_shape_errors(shape, g, msg):
    with pytest.raises(ValueError, match=msg):
        int4.quantize_int4(torch.ones(shape), g)


def test_nonfinite_and_overflow_errors():
    w = torch.ones(16, 64)
    w[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        int4.quantize_int4(w, 64)
    with pytest.raises(ValueError, match="float16"):
        int4.quantize_int4(torch.full((16, 64), 1e6), 64)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        int4.pack_int4(torch.full((16, 64), 9, dtype=torch.int8), torch.ones(16, 1).half(), 64)
