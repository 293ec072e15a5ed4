"""KV-cache mirrors: the low-precision copies the decode attention reads (paper sections 3.3.2-3.3.3).

Each cache row (one token, one KV head, D channels) gets its own float32 scale:
    INT4: scale = amax / 7, q = clamp(round(x / scale), -7, 7)  (IEEE division, round half to even)
    E4M3: scale = amax / 448, data = e4m3(x / scale)
A zero row has scale 0 and decodes to zeros. With rotation, K and V are multiplied by the
block-diagonal Hadamard H before quantization; the kernel multiplies the query by H and the output by
H^T, so the values attention effectively uses are k_eff = H^T deq(q(H k)) (likewise v_eff). The
mirror callables below return exactly those values, for the reference KV cache's `mirror` hook.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from . import hadamard, layouts
from .fp8 import E4M3_MAX, ieee_div, to_e4m3

INT4_CACHE_QMAX = 7


def _row_scale(x: torch.Tensor, qmax: float, check_finite: bool = True) -> torch.Tensor:
    # the finiteness check reads a flag back to the host: callers inside a CUDA graph (rows a kernel just
    # wrote, like the decode attention kernel's own mirror writes) skip it
    if check_finite and not torch.isfinite(x).all():
        raise ValueError("KV mirror: cache rows contain NaN or Inf")
    amax = x.float().abs().amax(dim=-1)
    return ieee_div(amax, qmax)


def _safe_div(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale per row (a true IEEE division, tensor by tensor); a zero scale gives 0."""
    s = scale.unsqueeze(-1)
    return torch.where(s > 0, x.float() / torch.where(s > 0, s, 1.0), 0.0)


def quantize_int4_rows(x: torch.Tensor, check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (signed nibbles int8 [..., D] in [-7, 7], float32 scale [...])."""
    scale = _row_scale(x, INT4_CACHE_QMAX, check_finite)
    q = torch.round(_safe_div(x, scale)).clamp(-INT4_CACHE_QMAX, INT4_CACHE_QMAX)
    return q.to(torch.int8), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q (int8 or float8) [..., D] times its row scale, in float32."""
    return q.float() * scale.unsqueeze(-1)


def quantize_e4m3_rows(x: torch.Tensor, check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (float8_e4m3fn [..., D], float32 scale [...])."""
    scale = _row_scale(x, E4M3_MAX, check_finite)
    return to_e4m3(_safe_div(x, scale)), scale


# ---- packed INT4 cache rows (what the kernels store) -----------------------------------------
@dataclass(frozen=True)
class Int4CacheRows:
    k_packed: torch.Tensor  # uint8 [..., T/8, 32, D/8]  (layouts.pack_int4_keys)
    k_scale: torch.Tensor   # float32 [..., T]
    v_packed: torch.Tensor  # uint8 [..., T, D/2]        (layouts.pack_int4_values)
    v_scale: torch.Tensor   # float32 [..., T]


def pack_int4_cache(k: torch.Tensor, v: torch.Tensor, rotate: bool = True,
                    block: int | None = None) -> Int4CacheRows:
    """K, V [..., T, D] (T a multiple of 8) -> packed INT4 rows, rotated by H first if `rotate`."""
    if k.shape != v.shape:
        raise ValueError(f"pack_int4_cache: K {tuple(k.shape)} and V {tuple(v.shape)} differ")
    layouts.INT4_KEY.check(k.shape[-1], k.shape[-2])
    if rotate:
        k, v = hadamard.rotate(k.float(), block), hadamard.rotate(v.float(), block)
    kq, ks = quantize_int4_rows(k)
    vq, vs = quantize_int4_rows(v)
    return Int4CacheRows(layouts.pack_int4_keys(kq), ks, layouts.pack_int4_values(vq), vs)


@lru_cache(maxsize=None)
def _key_lane_channels(head_dim: int, device: torch.device) -> torch.Tensor:
    """Channel of each (lane j, byte, nibble) of a token's 4 lanes in its key block, long [4, D/8, 2], on the
    device once. In `layouts.INT4_KEY` lane L holds token L // 4, in a channel pattern that depends on L % 4
    only (asserted here)."""
    src = layouts._key_block_index(head_dim)                    # [32, D/8, 2]: token * D + channel
    lane = np.arange(layouts.WARP)[:, None, None]
    channel = src % head_dim
    assert (src // head_dim == lane // 4).all() and (channel == channel[lane[:, 0, 0] % 4]).all()
    return torch.from_numpy(channel[:4].copy()).to(device)


def pack_int4_key_rows(q: torch.Tensor) -> torch.Tensor:
    """Signed nibbles of single key rows [..., D] -> uint8 [..., 4, D/8]: the bytes of the 4 lanes (4 (p % 8) + j)
    that hold the row's token p in its 8-token key block (what `layouts.pack_int4_keys` puts there)."""
    g = (q.to(torch.int16) & 0xF)[..., _key_lane_channels(q.shape[-1], q.device)]   # [..., 4, D/8, 2]
    return (g[..., 0] | (g[..., 1] << 4)).to(torch.uint8)


def unpack_int4_cache(rows: Int4CacheRows, rotate: bool = True,
                      block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows -> (k_eff, v_eff) float32 [..., T, D], rotated back to the model's basis."""
    k = dequantize_rows(layouts.unpack_int4_keys(rows.k_packed), rows.k_scale)
    v = dequantize_rows(layouts.unpack_int4_values(rows.v_packed), rows.v_scale)
    if rotate:
        k, v = hadamard.unrotate(k, block), hadamard.unrotate(v, block)
    return k, v


# ---- mirror callables for the reference KV cache ---------------------------------------------
def _fake_int4(x: torch.Tensor) -> torch.Tensor:
    return dequantize_rows(*quantize_int4_rows(x))


def _fake_e4m3(x: torch.Tensor) -> torch.Tensor:
    return dequantize_rows(*quantize_e4m3_rows(x))


def _fake_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


_QUANTIZERS = {"bf16": _fake_bf16, "int4": _fake_int4, "e4m3": _fake_e4m3}


class CacheMirror:
    """fn(layer, k, v) -> (k_eff, v_eff): the values decode attention reads, rows over the last dim.

    `kind` in {"bf16", "int4", "e4m3"}; `rotate` applies H before quantization and H^T after.
    Quantization is per row, so applying it to the whole cache or to each new row gives the same values.
    """

    def __init__(self, kind: str, rotate: bool = False, block: int | None = None) -> None:
        if kind not in _QUANTIZERS:
            raise ValueError(f"unknown cache mirror kind {kind!r}; known: {sorted(_QUANTIZERS)}")
        if rotate and kind == "bf16":
            raise ValueError("a BF16 cache is not rotated")
        self.kind, self.rotate, self.block = kind, rotate, block

    def row(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.rotate:
            x = hadamard.rotate(x.double() if dtype == torch.float64 else x.float(), self.block)
        y = _QUANTIZERS[self.kind](x)
        if self.rotate:
            y = hadamard.unrotate(y.to(x.dtype), self.block)
        return y.to(dtype)

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.row(k), self.row(v)

    def __repr__(self) -> str:
        return f"CacheMirror({self.kind!r}, rotate={self.rotate}, block={self.block})"
