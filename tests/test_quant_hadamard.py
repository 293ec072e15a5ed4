"""Block-diagonal Hadamard: orthogonal, and attention is unchanged before quantization."""

import pytest
import torch

from futx.quant import hadamard


@pytest.mark.parametrize("dim,block", [(64, None), (128, 32), (64, 8), (16, 1)])
def test_orthogonal_and_symmetric(dim, block):
    h = hadamard.hadamard_matrix(dim, block)
    assert torch.allclose(h @ h.T, torch.eye(dim, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)
    b = block or dim
    assert torch.allclose(h.abs()[:b, :b], torch.full((b, b), b ** -0.5, dtype=torch.float64))


def test_rotate_matches_matrix_and_inverts(seeded):
    x = torch.randn(3, 5, 128, generator=seeded, dtype=torch.float64)
    for block in (None, 32):
        h = hadamard.hadamard_matrix(128, block)
        assert torch.allclose(hadamard.rotate(x, block), x @ h.T, atol=1e-12)
        assert torch.allclose(hadamard.unrotate(hadamard.rotate(x, block), block), x, atol=1e-12)


def test_attention_equivalence(seeded):
    b, h, t, d = 2, 3, 17, 64
    q = torch.randn(b, h, 1, d, generator=seeded, dtype=torch.float64)
    k = torch.randn(b, h, t, d, generator=seeded, dtype=torch.float64)
    v = torch.randn(b, h, t, d, generator=seeded, dtype=torch.float64)
    ref = torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5, -1) @ v
    for block in (None, 16):
        r = lambda x: hadamard.rotate(x, block)  # noqa: E731
        out = torch.softmax(r(q) @ r(k).transpose(-1, -2) / d ** 0.5, -1) @ r(v)
        assert torch.allclose(hadamard.unrotate(out, block), ref, atol=1e-12)


def test_block_errors():
    with pytest.raises(ValueError, match="power of two"):
        hadamard.hadamard_matrix(96, 48)
    with pytest.raises(ValueError, match="divide"):
        hadamard.rotate(torch.ones(2, 48), 32)
