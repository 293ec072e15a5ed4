"""The register dequantization trick, emulated bit for bit, equals the plain dequantized grid."""

import torch

from futx.quant import int4, layouts, regtrick


def test_every_nibble_pair_every_shift():
    # all 256 (low, high) nibble pairs at each of the four shifts
    lo, hi = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    for s in range(4):
        words = (lo.reshape(-1) << (4 * s)) | (hi.reshape(-1) << (4 * s + 16))
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        regs = regtrick.register_dequant(words.reshape(-1, 1))[:, 0, s]  # [256, 2]
        want = torch.stack([lo.reshape(-1) - 8, hi.reshape(-1) - 8], -1).to(torch.bfloat16)
        assert torch.equal(regtrick.bf16_bits(regs), regtrick.bf16_bits(want))


def test_constants_are_bf16_128():
    one = torch.tensor([layouts.INT4_WEIGHT.bf16_128_pair & 0xFFFF])
    assert float(regtrick._bf16_from_bits(one)) == 128.0
    assert layouts.INT4_WEIGHT.bias == 128 + layouts.INT4_WEIGHT.offset


def test_random_packed_weights_bit_exact(seeded):
    n, k, g = 64, 384, 128
    q = torch.randint(-8, 8, (n, k), generator=seeded, dtype=torch.int8)
    s = (torch.rand(n, k // g, generator=seeded) * 0.02 + 1e-3).half()
    packed = int4.pack_int4(q, s, g)
    grid = regtrick.register_dequant_grid(packed)
    assert torch.equal(regtrick.bf16_bits(grid), regtrick.bf16_bits(q.to(torch.bfloat16)))
    assert torch.equal(regtrick.register_dequant_weight(packed), packed.dequantize())


def test_random_words_all_bits(seeded):
    words = torch.randint(-2**31, 2**31 - 1, (4096, 4), generator=seeded, dtype=torch.int64).to(torch.int32)
    regs = regtrick.register_dequant(words)  # [4096, 4, shift, half]
    u = words.to(torch.int64) & 0xFFFFFFFF
    for s in range(4):
        for h in range(2):
            nib = (u >> (4 * (s + 4 * h))) & 0xF
            assert torch.equal(regs[:, :, s, h].float(), (nib - 8).float())


def test_key_lut_registers(seeded):
    q = torch.randint(-7, 8, (2, 16, 64), generator=seeded, dtype=torch.int8)
    kp = layouts.pack_int4_keys(q)
    regs = regtrick.lut_key_registers(kp)  # [2, 2, 32, 8, 2]
    p = kp.to(torch.int16)
    lo, hi = p & 0xF, p >> 4
    assert torch.equal(regs[..., 0].float(), torch.where(lo >= 8, lo - 16, lo).float())
    assert torch.equal(regs[..., 1].float(), torch.where(hi >= 8, hi - 16, hi).float())
