"""The GPTQ error-feedback solve for one weight matrix (Frantar et al. 2023), in the INT4 format.

Choices fixed by the paper: static groups (each group's scale is the fp16 amax/7 of the *original*
weights, computed before any error feedback), no column reordering, damping of 5% of the mean
Hessian diagonal, and the whole solve in float64 (Cholesky factor of the inverse Hessian, the
standard lazy-batch blocking of 128 columns).
"""

from __future__ import annotations

import torch

from .int4 import QMAX, QMIN, check_int4_shape, group_scales

DAMPING = 0.05
BLOCK = 128


class HessianAccumulator:
    """H = (2/n) sum x x^T over the n input rows seen so far, in float64."""

    def __init__(self, k: int, device: torch.device | str = "cpu") -> None:
        self.h = torch.zeros(k, k, dtype=torch.float64, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(device=self.h.device, dtype=torch.float64)
        m = x.shape[0]
        if m == 0:
            return
        self.h *= self.n / (self.n + m)
        self.n += m
        x = x * (2.0 / self.n) ** 0.5
        self.h += x.T @ x


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int, damping: float = DAMPING,
                  block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize W [N, K] with the input Hessian [K, K]. Returns (q int8 [N, K], fp16 scales [N, K/G])."""
    n, k = w.shape
    check_int4_shape(n, k, group_size)
    if hessian.shape != (k, k):
        raise ValueError(f"gptq: Hessian shape {tuple(hessian.shape)} != {(k, k)}")
    scales = group_scales(w, group_size)  # static groups: from the original weights
    dev = hessian.device
    W = w.to(device=dev, dtype=torch.float64).clone()
    H = hessian.to(torch.float64).clone()
    dead = torch.diag(H) == 0  # inputs never seen: their columns cannot matter, quantize as zero
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damping * torch.mean(torch.diag(H)) * torch.eye(k, dtype=torch.float64, device=dev)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    s_cols = scales.to(device=dev, dtype=torch.float64).repeat_interleave(group_size, dim=1)
    Q = torch.zeros(n, k, dtype=torch.float64, device=dev)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = W[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        h1 = hinv[i1:i2, i1:i2]
        s1 = s_cols[:, i1:i2]
        s1_safe = torch.where(s1 > 0, s1, 1.0)  # a zero scale: q is masked to 0 below, q * s = 0 meanwhile
        q1 = torch.empty_like(w1)
        for i in range(i2 - i1):  # one column at a time: few kernels each (on a GPU this loop is launch-bound)
            col, d = w1[:, i], h1[i, i:i + 1]  # d: [1], a device tensor (a true division)
            q = torch.round(col / s1_safe[:, i]).clamp_(QMIN, QMAX)
            q1[:, i] = q
            e = (col - q * s1[:, i]) / d
            w1[:, i:] -= e[:, None] * h1[i, i:][None, :]
            err1[:, i] = e
        Q[:, i1:i2] = torch.where(s1 > 0, q1, 0.0)
        W[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return Q.to(torch.int8).cpu(), scales.cpu()
