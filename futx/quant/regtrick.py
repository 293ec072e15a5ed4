"""Bit-exact torch emulation of the decode kernels' register dequantization of INT4 weights.

Per 32-bit word w and shift s in 0..3 a kernel computes
    r = ((w >> 4s) & pair_mask) | bf16_128_pair     # bf16x2 (128 + nib_s, 128 + nib_{s+4})
    v = fma(r, 1.0, -bias)                          # bf16x2 (q_s, q_{s+4}), bias = 136
using the constants of `layouts.INT4_WEIGHT`. The emulation below performs the same integer ops on
the same words and the FMA with a single rounding (float64 holds (128 + n) * 1 - 136 exactly), so
its bf16 bit patterns are what the hardware produces. `register_dequant_grid` puts the register
values back at their (n, k) with the layout's own index map, for comparison with `unpack_int4`.
"""

from __future__ import annotations

import torch

from . import layouts
from .int4 import Int4Weight

LAY = layouts.INT4_WEIGHT
SHIFTS = LAY.nibbles_per_word // 2  # four shifts, each yielding one bf16x2 register


def _bf16_from_bits(bits16: torch.Tensor) -> torch.Tensor:
    """uint16 patterns held in an int64 tensor -> bfloat16 values with exactly those bits."""
    signed = torch.where(bits16 >= 0x8000, bits16 - 0x10000, bits16).to(torch.int16)
    return signed.view(torch.bfloat16)


def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """The 16-bit patterns of a bfloat16 tensor (int64, 0..65535)."""
    return x.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def register_dequant(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., 4] -> bf16 register values [..., 4 words, 4 shifts, 2 halves] (low half first)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    regs = []
    for s in range(SHIFTS):
        r = ((w >> (4 * s)) & LAY.pair_mask) | LAY.bf16_128_pair
        halves = torch.stack([_bf16_from_bits(r & 0xFFFF), _bf16_from_bits(r >> 16)], dim=-1)
        # fma(r, 1.0, -bias) with one rounding: exact in float64, then a single round to bf16.
        regs.append((halves.double() * 1.0 - LAY.bias).to(torch.bfloat16))
    return torch.stack(regs, dim=-2)


def register_dequant_grid(w: Int4Weight) -> torch.Tensor:
    """The bf16 values the kernel's registers hold, placed at their (n, k): bf16 [N, K]."""
    regs = register_dequant(w.packed)  # [nb, kb, 32, 4, shift, half]
    # nibble p of a word is (shift p % 4, half p // 4): move halves ahead of shifts.
    by_nibble = regs.transpose(-1, -2).reshape(*regs.shape[:-3], LAY.words_per_lane, LAY.nibbles_per_word)
    nb, kb = by_nibble.shape[:2]
    src = torch.from_numpy(layouts.weight_block_source().copy()).reshape(-1)
    out = torch.empty(nb, kb, LAY.block_n * LAY.block_k, dtype=torch.bfloat16)
    out[:, :, src] = by_nibble.reshape(nb, kb, -1)
    n, k = w.shape
    return out.reshape(nb, kb, LAY.block_n, LAY.block_k).permute(0, 2, 1, 3).reshape(n, k)


def register_dequant_weight(w: Int4Weight) -> torch.Tensor:
    """Register values times the group scale, in float32: the weight each MMA group effectively uses."""
    scales = w.natural_scales().float().repeat_interleave(w.group_size, dim=1)
    return register_dequant_grid(w).float() * scales


def lut_key_registers(k_packed: torch.Tensor) -> torch.Tensor:
    """INT4 key-cache bytes -> the fp16x2 registers the 256-entry table yields: [..., bytes, 2]."""
    return layouts.int4_byte_lut_fp16()[k_packed.to(torch.int64)]
