"""QKVPlacement: RoPE on Q and K, and K/V straight into the KV cache (paper 3.2.1).

The QKV projection's N = (Hq + 2 Hkv) * hd columns are [Q heads | K heads | V heads]; D is Q alone,
[M, Hq * hd] = [M, Hq, hd], the layout attention reads. This whole-tile map (placed after
ScaleRestore, before StoreBF16):

  * rotates every Q and K head: channel c < hd/2 pairs with c + hd/2 (rotate-half, HF convention),
        x_c' = x_c cos - x_{c+hd/2} sin,    x_{c+hd/2}' = x_{c+hd/2} cos + x_c sin,
    angle = pos[m] * inv_freq[c];
  * writes K and V (BF16) to cache[slot[m], kv_head, pos[m], channel], the futx.kvcache.KVCache layout
    [slots, Hkv, capacity, hd]; rows >= M and positions outside [0, capacity) are not written.
    QKVPlacement(hd, paged=True), a paged cache (futx.paging): the caller passes the paged layer
    [pages + 1, Hkv, P, hd] and slot[m] = the row's page (futx.paging.locate), pos[m] still the row's true
    position (RoPE's angle needs it: an in-page row would rotate by the wrong angle), and the row is written
    at in-page row pos[m] % P (locate's offset; P = the caches' third extent). The slot ranges (host check,
    in-kernel mask) are then the page extents, and positions have no upper bound here (the block table
    bounded them when the caller looked the pages up).

The store step then writes the Q columns to D (subtiles right of D skip their store).

Register facts used: a thread holds columns 8a + 2q + {0, 1} of every 8-column atom a of its two rows
(q = lane % 4; register i is atom i // 4, row slot (i // 2) % 2, column bit i % 2), so channels c and
c + hd/2 of a head are registers i and i + hd/4 of the same thread: RoPE needs no data movement. A
tile holds whole heads (tile_n % hd == 0; tiles start at multiples of tile_n, heads at multiples of hd).

Angles: pos * inv_freq in FP32 (inv_freq in FP32 like Hugging Face), with the product's rounding
error (FMA residual) and the reduction by 2 pi (two-constant Cody-Waite) carried exactly, then
sin/cos.approx on [-pi, pi] (~1e-6 absolute).
"""

from __future__ import annotations

import math

from typing import Any, NamedTuple

from epilogues.base import Arg, Policy
from epilogues.dsl import cutlass, cute, Float32, Int32, Int64

_INV_2PI = 1.0 / (2.0 * math.pi)
_2PI_HI = 6.28125                       # 8 significant bits: k * _2PI_HI is exact for k < 2^16
_2PI_LO = 2.0 * math.pi - _2PI_HI


def qkv_args(head_dim: int) -> tuple:
    """(name, dtype, shape) of the policy's tensors (also futx/runtime/catalog/prefill.py's table)."""
    return (("inv_freq", "f32", (head_dim // 2,)), ("row_slot", "i32", ("m",)), ("row_pos", "i32", ("m",)),
            ("k_cache", "bf16", ("slots", "hkv", "cap", head_dim)),
            ("v_cache", "bf16", ("slots", "hkv", "cap", head_dim)))


def _capturing() -> bool:
    import torch

    return torch.cuda.is_current_stream_capturing()


def _stack_minmax(pos, slot) -> list:
    import torch

    return torch.stack([pos.min(), pos.max(), slot.min(), slot.max()]).tolist()


@cute.jit
def _cos_sin(pos: Float32, freq: Float32):
    angle = pos * freq
    err = cute.math.fma(pos, freq, -angle)              # exact rounding error of the product
    k = cute.math.roundeven(angle * Float32(_INV_2PI))
    r = cute.math.fma(-k, Float32(_2PI_HI), angle)      # exact (Sterbenz)
    r = cute.math.fma(-k, Float32(_2PI_LO), r) + err
    return cute.math.cos(r, approx=True), cute.math.sin(r, approx=True)


class QKVState(NamedTuple):
    """Per-thread state of QKVPlacement."""

    ctx: Any
    freq: Any          # registers: the RoPE frequencies of this thread's channels
    row_slot: Any      # [M] int32
    row_pos: Any       # [M] int32
    k_cache: Any       # [slots, Hkv, cap, hd] BF16 (written)
    v_cache: Any       # [slots, Hkv, cap, hd] BF16 (written)
    pos: Any           # registers: this tile's positions of the thread's two rows
    slot: Any          # registers: ... and their cache slots


class QKVPlacement(Policy):
    kind = "map"
    whole_tile = True

    def __init__(self, head_dim: int = 128, paged: bool = False):
        if head_dim not in (64, 128, 256):
            raise ValueError(f"QKVPlacement supports head_dim 64, 128 or 256, got {head_dim}")
        self.hd = head_dim
        self.paged = bool(paged)
        self.name = f"qkv{head_dim}" + ("p" if paged else "")
        self.args = tuple(Arg(nm, dt, shape, writes=nm.endswith("cache")) for nm, dt, shape in qkv_args(head_dim))

    def out_width(self, n, tensors):
        return n - 2 * tensors["k_cache"].shape[1] * self.hd   # D = Q: N minus the K and V heads

    def check(self, sizes, tensors, tile_n):
        n, n_out, hd = sizes["n"], sizes["n_out"], self.hd
        if n_out <= 0 or n_out % hd:
            raise ValueError(f"QKV: w has N = {n} rows but the caches hold {sizes['hkv']} KV heads of {hd}: "
                             f"need N = Hq * {hd} + 2 * {sizes['hkv']} * {hd} with Hq >= 1")
        if tile_n % hd:
            raise ValueError(f"QKV: head_dim {hd} must divide the tile width {tile_n}")
        pos, slot, cap, slots = tensors["row_pos"], tensors["row_slot"], sizes["cap"], sizes["slots"]
        capturing = pos.is_cuda and _capturing()
        if pos.numel() and not capturing:   # one host sync (skipped in graph capture); the kernel also masks
            lo_p, hi_p, lo_s, hi_s = _stack_minmax(pos, slot)
            if self.paged:
                if lo_p < 0:
                    raise ValueError(f"QKV (paged): negative position {lo_p}")
                if lo_s < 0 or hi_s >= slots:
                    raise ValueError(f"QKV (paged): pages span [{lo_s}, {hi_s}] but the paged cache has {slots} "
                                     f"pages (the scratch page included)")
                return
            if lo_p < 0 or hi_p >= cap:
                raise ValueError(f"QKV: KV cache overflow: positions span [{lo_p}, {hi_p}] but the cache holds "
                                 f"{cap} positions per slot; allocate a larger cache")
            if lo_s < 0 or hi_s >= slots:
                raise ValueError(f"QKV: cache slots span [{lo_s}, {hi_s}] but the cache has {slots} slots")

    def setup(self, ctx, inv_freq, row_slot, row_pos, k_cache, v_cache):
        if ctx.tile_n % self.hd:
            raise ValueError(f"QKVPlacement(head_dim={self.hd}) needs a tile width divisible by it, got {ctx.tile_n}")
        # this thread's RoPE frequencies: channels 8a + 2q + v (a < hd/16), for the whole kernel
        freq = cute.make_rmem_tensor((self.hd // 8,), Float32)
        for a in range(self.hd // 16):
            for v in range(2):
                freq[2 * a + v] = inv_freq[ctx.tCcD[4 * a + v][1]]
        pos = cute.make_rmem_tensor((2,), Int32)      # per row slot, loaded before each tile's mainloop
        slot = cute.make_rmem_tensor((2,), Int32)
        return QKVState(ctx, freq, row_slot, row_pos, k_cache, v_cache, pos, slot)

    @cute.jit
    def prefetch(self, state, tile):
        ctx = state.ctx
        for s in cutlass.range_constexpr(2):
            r = ctx.row_clamp(tile.row0 + ctx.thread_row(s))
            state.pos[s] = state.row_pos[r]
            state.slot[s] = state.row_slot[r]

    @cute.jit
    def visit(self, state, frag):
        ctx = state.ctx
        hd, tile = self.hd, frag.tile
        heads = ctx.tile_n // hd
        atoms = hd // 8                                    # 8-column atoms per head
        q_end = ctx.n_out                            # D = Q: its width is Hq * hd
        kv_w = (ctx.n - q_end) // 2                  # Hkv * hd
        # ---- RoPE on Q and K heads (V heads get cos 1, sin 0: branch-free) ----
        for s in cutlass.range_constexpr(2):
            p = Float32(state.pos[s])
            for a in cutlass.range_constexpr(hd // 16):
                for v in cutlass.range_constexpr(2):
                    c, sn = _cos_sin(p, state.freq[2 * a + v])
                    for h in cutlass.range_constexpr(heads):
                        rot = tile.col0 + h * hd < q_end + kv_w
                        ch = c if rot else Float32(1.0)
                        sh = sn if rot else Float32(0.0)
                        i = 4 * (h * atoms + a) + 2 * s + v
                        x = frag.vals[i]
                        y = frag.vals[i + hd // 4]
                        frag.vals[i] = x * ch - y * sh
                        frag.vals[i + hd // 4] = y * ch + x * sh
        # ---- K and V heads of this tile -> the cache, as BF16 pairs (4-byte stores) ----
        for h in cutlass.range_constexpr(heads):
            col = tile.col0 + h * hd
            if col >= q_end and col < ctx.n:             # uniform over the warpgroup
                self._store_head(state, frag, h, col - q_end, kv_w)

    @cute.jit
    def _store_head(self, state, frag, h: int, kv: Int32, kv_w: Int32):
        """Tile head h, column kv of the K|V block: its two rows of this thread -> the cache."""
        ctx = state.ctx
        hd, tile = self.hd, frag.tile
        atoms = hd // 8
        n_slots, hkv, cap = state.k_cache.shape[0], state.k_cache.shape[1], state.k_cache.shape[2]
        is_v = kv >= kv_w
        head = (kv - kv_w if is_v else kv) // hd
        base = state.v_cache.iterator.toint() if is_v else state.k_cache.iterator.toint()
        for s in cutlass.range_constexpr(2):
            r = tile.row0 + ctx.thread_row(s)
            p, sl = state.pos[s], state.slot[s]
            off = p                      # the row in the slot's (paged: the page's) positions
            if cutlass.const_expr(self.paged):
                off = p % cap            # futx.paging.locate's offset; sl is already the page
            if r < ctx.m and p >= 0 and off < cap and sl >= 0 and sl < n_slots:
                row = ((Int64(sl) * hkv + head) * cap + off) * hd
                for a in cutlass.range_constexpr(atoms):
                    i = 4 * (h * atoms + a) + 2 * s
                    addr = base + (row + ctx.tCcD[i][1] - h * hd) * 2
                    self._store_pair(addr, frag.vals[i], frag.vals[i + 1])

    @cute.jit
    def _store_pair(self, addr: Int64, x: Float32, y: Float32):
        pair = cute.make_rmem_tensor((2,), Float32)
        pair[0] = x
        pair[1] = y
        dst = cute.make_tensor(cute.make_ptr(cutlass.BFloat16, addr, cute.AddressSpace.gmem, assumed_align=4),
                               cute.make_layout(2))
        dst.store(pair.load().to(cutlass.BFloat16))
