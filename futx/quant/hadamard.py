"""Normalized block-diagonal Walsh-Hadamard rotation of the cache rows (paper section 3.3.3).

H = diag(H_b, ..., H_b) with H_b the Sylvester Hadamard matrix of order b divided by sqrt(b);
H is symmetric and orthogonal, so H^-1 = H^T = H and (Hq).(Hk) = q.k. The block is the head dim by
default; any power of two that divides the head dim is allowed.
"""

from __future__ import annotations

from functools import lru_cache

import torch


def _check_block(dim: int, block: int) -> None:
    if block < 1 or block & (block - 1):
        raise ValueError(f"Hadamard block {block} must be a power of two")
    if dim % block:
        raise ValueError(f"Hadamard block {block} must divide the head dim {dim}")


@lru_cache(maxsize=None)
def _sylvester(block: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / block ** 0.5


def hadamard_matrix(dim: int, block: int | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The normalized block-diagonal Hadamard matrix [dim, dim]."""
    block = dim if block is None else block
    _check_block(dim, block)
    return torch.block_diag(*[_sylvester(block)] * (dim // block)).to(dtype)


def rotate(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """H x over the last dim (x as column vectors), in x's floating dtype.

    Computed as the kernels do: a Walsh-Hadamard butterfly (log2(block) stages of a + b, a - b), then one
    multiply by 1/sqrt(block). Only elementwise ops, so a row's result never depends on how many rows
    are transformed together (a matmul's blocking could), which keeps chunked decoding exact.
    """
    if not x.is_floating_point():
        raise ValueError(f"Hadamard rotation needs a floating tensor, got {x.dtype}")
    d = x.shape[-1]
    block = d if block is None else block
    _check_block(d, block)
    y = x.reshape(-1, d // block, block)
    h = 1
    while h < block:
        pairs = y.reshape(y.shape[0], d // block, block // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2)
        h *= 2
    return (y.reshape(x.shape) * (1.0 / block ** 0.5)).to(x.dtype)


def unrotate(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """H^T x, the inverse of `rotate` (equal to it, since H is symmetric; named for the reader)."""
    return rotate(x, block)
