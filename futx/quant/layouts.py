"""Fragment-order layouts: the single definition of where every packed low-bit value lives.

The torch packer/unpacker below, the simulated-quantization reference and the DSL decode kernels all
derive their index math from the functions in this file; tests tie them together. Nothing else in
futx may restate these orders.

Background: `mma.sync.m16n8k16` (bf16/f16) B operand, a K x N = 16 x 8 tile. Lane l = 4*g + t
(g = l // 4, t = l % 4) holds two 32-bit registers, each two 16-bit values, low half first:
    b0 = (B[2t][g],   B[2t+1][g])        b1 = (B[2t+8][g], B[2t+9][g])
For a projection y = x @ W.T the B operand is W.T, so B[k][n] = W[n][k]; for attention scores
S = q @ K.T it is K.T, so B[k][n] = K[token n][channel k].

INT4 weights (`Int4WeightLayout`)
---------------------------------
A *block* is 16 output channels x 64 reduction elements = 1024 nibbles = 512 bytes, read by one
warp as one 16-byte load per lane. Lane l holds 4 little-endian 32-bit words; word j covers
reduction sub-tile j (k offset 16*j) of both n8 halves of the block. Inside a word, nibble p
(bits 4p..4p+3) belongs to *pair* s = p % 4 and *half* h = p // 4, so that the register trick

    r_s = ((w >> 4*s) & 0x000F000F) | 0x43004300      # bf16x2 (128 + nib_s, 128 + nib_{s+4})
    v_s = fma(r_s, 1.0, -136.0)                       # bf16x2 (q_lo, q_hi), exact, q in [-8, 7]

yields one finished MMA register per shift. Pair s is n8 half s // 2, B register s % 2:
    (n, k) = (8*(s//2) + g,  16*j + 8*(s%2) + 2*t + h)
The same four registers of a word are also the A fragment of `m16n8k16` with the 16 output channels
as rows (a0 = pair 0, a1 = pair 2, a2 = pair 1, a3 = pair 3), for kernels that swap A and B.
Nibbles are stored unsigned (q + 8). Blocks are stored n-block major, k-block minor, so one warp that
owns an n-block streams a contiguous range:   packed[N/16, K/64, 32 lanes, 4 words] (int32).

Group scales (one per output channel and group of G reduction elements, G a multiple of 64) are
float16, stored n-block major as scales[N/16, K/G, 16]: the 16 scales a warp needs per group are
32 contiguous bytes. Dequantized value: W[n, k] = q[n, k] * float(scale[n, k // G]).

INT4 key cache (`Int4KeyLayout`)
--------------------------------
Keys are the B operand of S = q @ K.T (k = channel, n = token). A block is 8 tokens x D channels
(4*D bytes); lane l owns token g of the block and D/8 contiguous bytes: byte b is k16 tile b // 2,
register b % 2, and its low/high nibble are channels 16*(b//2) + 8*(b%2) + 2t + {0, 1}. A byte maps
to one fp16x2 register through the 256-entry lookup table. Nibbles are signed two's complement
(q in [-7, 7], scale = amax / 7 per token and KV head, float32).
   k_packed[slots, kv_heads, capacity/8, 32, D/8] (uint8)
Values (V) stay in natural channel order, two signed nibbles per byte, even channel low:
   v_packed[slots, kv_heads, capacity, D/2] (uint8)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

# Bump when any packed order below changes; saved checkpoints record it (futx.quant.gptq).
LAYOUT_VERSION = 1

# ---- mma.sync.m16n8k16 B fragment -------------------------------------------------------------
MMA_K = 16
MMA_N = 8
WARP = 32


def b_fragment_coord(lane: int, reg: int, half: int) -> tuple[int, int]:
    """(k, n) inside a 16x8 B tile of the value a lane holds in register `reg`, half `half`."""
    g, t = divmod(lane, 4)
    return 2 * t + 8 * reg + half, g


# ---- INT4 weights ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Int4WeightLayout:
    block_n: int = 16
    block_k: int = 64
    words_per_lane: int = 4
    nibbles_per_word: int = 8
    # the register trick's constants (see module docstring)
    pair_mask: int = 0x000F000F
    bf16_128_pair: int = 0x43004300
    bias: float = 136.0  # 128 (the exponent base) + 8 (unsigned nibble offset)
    offset: int = 8      # stored nibble = q + offset

    @property
    def block_bytes(self) -> int:
        return WARP * self.words_per_lane * 4

    @staticmethod
    def nibble_coord(lane: int, word: int, nibble: int) -> tuple[int, int]:
        """(n, k) inside a block of the nibble at bits 4*nibble.. of word `word` of lane `lane`."""
        pair, half = nibble % 4, nibble // 4
        k_in_tile, n_in_tile = b_fragment_coord(lane, pair % 2, half)
        return 8 * (pair // 2) + n_in_tile, 16 * word + k_in_tile

    @staticmethod
    def pair_coord(lane: int, word: int, pair: int) -> tuple[int, int, int]:
        """(n8 half, B register, k16 tile) that the register trick's shift `pair` feeds."""
        return pair // 2, pair % 2, word

    def check_shape(self, n: int, k: int, group_size: int) -> None:
        if n % self.block_n:
            raise ValueError(f"INT4 weight: output features N={n} must be a multiple of {self.block_n}")
        if k % self.block_k:
            raise ValueError(f"INT4 weight: input features K={k} must be a multiple of {self.block_k}")
        if group_size % self.block_k:
            raise ValueError(f"INT4 weight: group size {group_size} must be a multiple of {self.block_k}")
        if k % group_size:
            raise ValueError(f"INT4 weight: input features K={k} must be a multiple of the group size "
                             f"{group_size}")


INT4_WEIGHT = Int4WeightLayout()


@lru_cache(maxsize=None)
def _weight_block_index() -> tuple[np.ndarray, np.ndarray]:
    """For each (lane, word, nibble) of a block: flat index n*block_k + k of its element."""
    lay = INT4_WEIGHT
    src = np.zeros((WARP, lay.words_per_lane, lay.nibbles_per_word), dtype=np.int64)
    for lane in range(WARP):
        for word in range(lay.words_per_lane):
            for nib in range(lay.nibbles_per_word):
                n, k = lay.nibble_coord(lane, word, nib)
                src[lane, word, nib] = n * lay.block_k + k
    assert sorted(src.ravel().tolist()) == list(range(lay.block_n * lay.block_k)), "layout is not a bijection"
    shifts = 4 * np.arange(lay.nibbles_per_word, dtype=np.int64)
    return src, shifts


def weight_block_source() -> np.ndarray:
    """[32 lanes, 4 words, 8 nibbles] -> flat index n*block_k + k inside a 16x64 block (read-only)."""
    src = _weight_block_index()[0].view()
    src.flags.writeable = False
    return src


def pack_int4_weight(q_unsigned: torch.Tensor) -> torch.Tensor:
    """Pack unsigned nibbles q+8 of shape [N, K] (uint8/int values 0..15) into int32 [N/16, K/64, 32, 4]."""
    lay = INT4_WEIGHT
    n, k = q_unsigned.shape
    if n % lay.block_n or k % lay.block_k:
        raise ValueError(f"pack_int4_weight: shape {(n, k)} must be multiples of ({lay.block_n}, {lay.block_k})")
    q = q_unsigned.to(torch.int64)
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("pack_int4_weight: values must be unsigned nibbles in [0, 15]")
    src, shifts = _weight_block_index()
    nb, kb = n // lay.block_n, k // lay.block_k
    blocks = q.reshape(nb, lay.block_n, kb, lay.block_k).permute(0, 2, 1, 3).reshape(nb, kb, -1)
    index = torch.from_numpy(src).reshape(-1).to(q.device)
    gathered = blocks[:, :, index].reshape(nb, kb, WARP, lay.words_per_lane, -1)
    words = (gathered << torch.from_numpy(shifts).to(q.device)).sum(dim=-1)  # disjoint bits: sum == or
    return (words - ((words >> 31) << 32)).to(torch.int32)  # reinterpret as signed 32-bit


def unpack_int4_weight(packed: torch.Tensor) -> torch.Tensor:
    """Exact inverse of `pack_int4_weight`: int32 [N/16, K/64, 32, 4] -> uint8 nibbles [N, K]."""
    lay = INT4_WEIGHT
    if packed.dim() != 4 or packed.shape[2:] != (WARP, lay.words_per_lane):
        raise ValueError(f"unpack_int4_weight: expected [N/16, K/64, 32, 4], got {tuple(packed.shape)}")
    nb, kb = packed.shape[:2]
    src, shifts = _weight_block_index()
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nibs = (words.unsqueeze(-1) >> torch.from_numpy(shifts).to(packed.device)) & 0xF
    out = torch.empty(nb, kb, lay.block_n * lay.block_k, dtype=torch.uint8, device=packed.device)
    out[:, :, torch.from_numpy(src).reshape(-1).to(packed.device)] = nibs.reshape(nb, kb, -1).to(torch.uint8)
    return out.reshape(nb, kb, lay.block_n, lay.block_k).permute(0, 2, 1, 3).reshape(nb * lay.block_n,
                                                                                     kb * lay.block_k)


def pack_weight_scales(scales: torch.Tensor) -> torch.Tensor:
    """Natural [N, K/G] scales -> kernel order [N/16, K/G, 16] (float16)."""
    n, groups = scales.shape
    if n % INT4_WEIGHT.block_n:
        raise ValueError(f"pack_weight_scales: N={n} must be a multiple of {INT4_WEIGHT.block_n}")
    return scales.to(torch.float16).reshape(n // 16, 16, groups).permute(0, 2, 1).contiguous()


def unpack_weight_scales(packed: torch.Tensor) -> torch.Tensor:
    nb, groups, sixteen = packed.shape
    return packed.permute(0, 2, 1).reshape(nb * sixteen, groups)


# ---- INT4 key cache -------------------------------------------------------------------------
@dataclass(frozen=True)
class Int4KeyLayout:
    block_tokens: int = 8

    @staticmethod
    def bytes_per_lane(head_dim: int) -> int:
        return head_dim // 8

    @staticmethod
    def byte_coord(lane: int, byte: int, nibble: int) -> tuple[int, int]:
        """(token in block, channel) of nibble `nibble` (0 = low) of byte `byte` of lane `lane`."""
        k_in_tile, token = b_fragment_coord(lane, byte % 2, nibble)
        return token, 16 * (byte // 2) + k_in_tile

    def check(self, head_dim: int, capacity: int) -> None:
        if head_dim % MMA_K:
            raise ValueError(f"INT4 key cache: head_dim {head_dim} must be a multiple of {MMA_K}")
        if capacity % self.block_tokens:
            raise ValueError(f"INT4 key cache: capacity {capacity} must be a multiple of {self.block_tokens}")


INT4_KEY = Int4KeyLayout()


@lru_cache(maxsize=None)
def _key_block_index(head_dim: int) -> np.ndarray:
    """For each (lane, byte, nibble) of a key block: flat index token*head_dim + channel."""
    nbytes = INT4_KEY.bytes_per_lane(head_dim)
    src = np.zeros((WARP, nbytes, 2), dtype=np.int64)
    for lane in range(WARP):
        for b in range(nbytes):
            for nib in range(2):
                tok, ch = INT4_KEY.byte_coord(lane, b, nib)
                src[lane, b, nib] = tok * head_dim + ch
    assert sorted(src.ravel().tolist()) == list(range(INT4_KEY.block_tokens * head_dim))
    return src


def pack_int4_keys(q: torch.Tensor) -> torch.Tensor:
    """Signed nibbles q in [-8, 7] of shape [..., T, D] (T a multiple of 8) -> uint8 [..., T/8, 32, D/8]."""
    *lead, t, d = q.shape
    INT4_KEY.check(d, t)
    src = torch.from_numpy(_key_block_index(d)).to(q.device)
    blocks = (q.to(torch.int16) & 0xF).reshape(*lead, t // 8, 8 * d)
    g = blocks[..., src.reshape(-1)].reshape(*lead, t // 8, WARP, d // 8, 2)
    return (g[..., 0] | (g[..., 1] << 4)).to(torch.uint8)


def unpack_int4_keys(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4_keys`: uint8 [..., T/8, 32, D/8] -> int8 signed nibbles [..., T, D]."""
    *lead, tb, lanes, nbytes = packed.shape
    if lanes != WARP:
        raise ValueError(f"unpack_int4_keys: expected 32 lanes in dim -2, got {lanes}")
    d = nbytes * 8
    src = torch.from_numpy(_key_block_index(d)).to(packed.device)
    p = packed.to(torch.int16)
    nibs = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*lead, tb, -1)
    out = torch.empty(*lead, tb, 8 * d, dtype=torch.int16, device=packed.device)
    out[..., src.reshape(-1)] = nibs
    out = torch.where(out >= 8, out - 16, out)
    return out.reshape(*lead, tb * 8, d).to(torch.int8)


def pack_int4_values(q: torch.Tensor) -> torch.Tensor:
    """Signed nibbles [..., D] -> uint8 [..., D/2], even channel in the low nibble (natural order)."""
    q16 = q.to(torch.int16) & 0xF
    return (q16[..., 0::2] | (q16[..., 1::2] << 4)).to(torch.uint8)


def unpack_int4_values(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.int16)
    out = torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)
    return torch.where(out >= 8, out - 16, out).to(torch.int8)


@lru_cache(maxsize=None)
def int4_byte_lut_fp16() -> torch.Tensor:
    """The 256-entry table byte -> (fp16(low nibble), fp16(high nibble)) as the kernels use it,
    returned as float16 [256, 2] (signed two's-complement nibbles)."""
    b = torch.arange(256, dtype=torch.int16)
    lo, hi = b & 0xF, b >> 4
    lo = torch.where(lo >= 8, lo - 16, lo)
    hi = torch.where(hi >= 8, hi - 16, hi)
    return torch.stack([lo, hi], dim=-1).to(torch.float16)
