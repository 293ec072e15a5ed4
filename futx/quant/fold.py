"""Fold the frozen RMSNorm gains into the next projections (paper section 3.2.2).

RMSNorm(x) W^T = rho * (x * gamma) W^T = rho * x (W * gamma)^T with rho = (mean(x^2) + eps)^-1/2.
So W' = W * gamma (scaling input columns) is quantized instead of W, the norm keeps only its row
factor rho (applied by the kernels in the GEMM epilogue), and the folded model has gain 1.
The final norm is left alone: the LM head runs outside the fused blocks and may be tied.
"""

from __future__ import annotations

import dataclasses

import torch


def fold_gain(w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """W' [N, K] = W * gamma[None, :] in float32 (float64 stays float64)."""
    if gamma.shape != (w.shape[1],):
        raise ValueError(f"fold_gain: gain shape {tuple(gamma.shape)} does not match K={w.shape[1]}")
    dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    return w.to(dtype) * gamma.to(dtype)[None, :]


def rms_row_factor(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rho [...] = (mean(x^2) + eps)^-1/2 over the last dim: what the epilogue multiplies by."""
    xf = x.double() if x.dtype == torch.float64 else x.float()
    return torch.rsqrt(xf.pow(2).mean(dim=-1) + eps)


def fold_layer(layer):
    """A LayerWeights with attn_norm / mlp_norm gains folded into wq, wk, wv and w_gate, w_up."""
    a, m = layer.attn_norm, layer.mlp_norm
    return dataclasses.replace(
        layer,
        attn_norm=torch.ones_like(a), mlp_norm=torch.ones_like(m),
        wq=fold_gain(layer.wq, a), wk=fold_gain(layer.wk, a), wv=fold_gain(layer.wv, a),
        w_gate=fold_gain(layer.w_gate, m), w_up=fold_gain(layer.w_up, m))


def fold_model(weights):
    """ModelWeights with every block's gains folded (embedding, final norm and LM head unchanged)."""
    return dataclasses.replace(weights, layers=[fold_layer(layer) for layer in weights.layers])
