"""The engine's KV cache: per layer the BF16 main copy and the decode mirror, in the kernels' layout.

Slots [0, slots) hold requests; one extra *scratch* slot at index `slots` absorbs the padded rows of a
CUDA-graph bucket (they write and read only there, so real requests are never touched).

Decode steps write their new rows inside the attention kernel. `write_rows` is the checked writer for rows
computed elsewhere (a prefill on the reference path), `mirror_rows` the unchecked, CUDA-graph-capturable one
for rows a prefill kernel already put in the main copy: both store exactly what the attention kernel would
have stored for the same BF16 row (main copy, then rotation, per-row scale, quantization and fragment-order
packing from `futx.quant`), so decode cannot tell who wrote a row. `read` returns the
values decode attention uses (mirror dequantized, rotation undone), for the emulated backend and tests.
"""

from __future__ import annotations

from typing import Optional

import torch

from futx.config import LlamaConfig
from futx.ops.decode_attention import DecodeCache
from futx.quant import hadamard, layouts
from futx.quant.kv_mirror import dequantize_rows, pack_int4_key_rows, quantize_e4m3_rows, quantize_int4_rows

from .support import check_capacity


class EngineCache:
    def __init__(self, config: LlamaConfig, fmt: str, slots: int, capacity: int, device="cuda",
                 keep_values: bool = False):
        check_capacity(fmt, capacity)
        if slots < 1:
            raise ValueError(f"the cache needs at least one slot, got {slots}")
        self.config, self.fmt, self.slots, self.capacity = config, fmt, slots, capacity
        self.device = torch.device(device)
        self.rotate = fmt == "int4"
        hkv, d = config.num_key_value_heads, config.head_dim
        shape = (slots + 1, hkv, capacity, d)  # + the scratch slot
        # per layer the tensors of futx.ops.decode_attention, in its layout (E4M3 mirrors as float8)
        self.layers: list[DecodeCache] = [DecodeCache.allocate(fmt, slots + 1, hkv, capacity, d, self.device)
                                          for _ in range(config.num_hidden_layers)]
        # keep_values: also keep what decode attention reads as float32 [S, Hkv, C, D] per layer, so the
        # emulated backend reads slices instead of unpacking the mirror every step
        self.values: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None
        if keep_values:
            self.values = [(torch.zeros(shape, device=self.device), torch.zeros(shape, device=self.device))
                           for _ in range(config.num_hidden_layers)]

    @property
    def scratch_slot(self) -> int:
        return self.slots

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.layers for t in c.tensors() if t is not None)

    def read_bytes_per_token(self) -> int:
        """Bytes decode attention reads per cached token and layer (keys, values, their scales)."""
        return self.layers[0].cache_bytes([1])

    def randomize(self, seed: int = 0) -> None:
        """Random contents in every copy (benchmarks: never time on zeros)."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for c in self.layers:
            for t in c.tensors():
                if t is None:
                    continue
                if t.dtype == torch.float8_e4m3fn:
                    t = t.view(torch.uint8)
                if t.dtype == torch.uint8:
                    r = torch.randint(0, 256, t.shape, generator=gen, device=self.device, dtype=torch.uint8)
                    t.copy_(torch.where(r & 0x7F == 0x7F, r ^ 1, r))  # no E4M3 NaN codes
                elif t.dtype == torch.float32:  # per-row scales
                    t.copy_(torch.rand(t.shape, generator=gen, device=self.device) * 0.1 + 0.01)
                else:
                    t.copy_(torch.randn(t.shape, generator=gen, device=self.device, dtype=t.dtype))

    # ---- writes of rows computed outside the decode attention kernel ----------------------------------
    def write_rows(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> None:
        """Store rows k, v [M, Hkv, D] of (slots[m], positions[m]) as the attention kernel would (checked on
        the host first: this reads the indices back)."""
        m = k.shape[0]
        if m == 0:
            return
        if int(positions.max()) >= self.capacity or int(positions.min()) < 0:
            raise ValueError(f"KV cache overflow: position {int(positions.max())} does not fit capacity "
                             f"{self.capacity}")
        if int(slots.min()) < 0 or int(slots.max()) > self.slots:
            raise ValueError(f"cache slot out of range [0, {self.slots}]")
        c = self.layers[layer]
        slots, positions = slots.to(self.device, torch.long), positions.to(self.device, torch.long)
        kb, vb = k.to(self.device, torch.bfloat16), v.to(self.device, torch.bfloat16)
        c.k_cache[slots, :, positions] = kb
        c.v_cache[slots, :, positions] = vb
        self._store_mirror(layer, slots, positions, kb.float(), vb.float(), check_finite=True)

    def mirror_rows(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, kernel: bool = False) -> None:
        """The mirror (and kept values) of rows already in the main copy (a prefill's QKV epilogue wrote them),
        slots / positions integer [M] on the device. No checks of their ranges and no host synchronization (the
        caller validated the indices on the host), so a CUDA graph can capture it. kernel: futx's mirror kernel
        (futx.ops.mirror_rows: one launch, the decode kernel's own code) instead of the torch ops."""
        if self.fmt == "bf16" and self.values is None:
            return
        c = self.layers[layer]
        if kernel:
            if self.values is not None:
                raise ValueError("the mirror kernel keeps no float values (a cache made with keep_values=True)")
            from futx.ops.mirror_rows import mirror_rows

            i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
            mirror_rows(self.fmt, c.k_cache, c.v_cache, c.k_mirror, c.k_scale, c.v_mirror, c.v_scale, i32(slots),
                        i32(positions))
            return
        slots, positions = slots.long(), positions.long()
        self._store_mirror(layer, slots, positions, c.k_cache[slots, :, positions].float(),
                           c.v_cache[slots, :, positions].float(), check_finite=False)

    def _store_mirror(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, kf: torch.Tensor,
                      vf: torch.Tensor, check_finite: bool) -> None:
        c = self.layers[layer]
        if self.fmt == "bf16":
            if self.values is not None:
                self.values[layer][0][slots, :, positions] = kf
                self.values[layer][1][slots, :, positions] = vf
            return
        if self.fmt == "e4m3":
            for i, (x, mir, sc) in enumerate(((kf, c.k_mirror, c.k_scale), (vf, c.v_mirror, c.v_scale))):
                data, scale = quantize_e4m3_rows(x, check_finite)
                mir[slots, :, positions] = data
                sc[slots, :, positions] = scale
                if self.values is not None:
                    self.values[layer][i][slots, :, positions] = dequantize_rows(data, scale)
            return
        q, s = quantize_int4_rows(hadamard.rotate(torch.stack([kf, vf])), check_finite)   # K and V in one pass
        if self.values is not None:
            for i in range(2):
                self.values[layer][i][slots, :, positions] = hadamard.unrotate(dequantize_rows(q[i], s[i]))
        c.k_scale[slots, :, positions] = s[0]
        c.v_scale[slots, :, positions] = s[1]
        c.v_mirror[slots, :, positions] = layouts.pack_int4_values(q[1])
        # a key row fills 4 of the 32 lanes of its 8-token block: lanes 4 (p % 8) + j
        lanes = 4 * (positions % 8)[:, None] + torch.arange(4, device=positions.device)[None, :]   # [M, 4]
        c.k_mirror[slots[:, None], :, (positions // 8)[:, None], lanes] = pack_int4_key_rows(q[0]).transpose(1, 2)

    # ---- what decode attention reads -------------------------------------------------------------------
    def read(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) float32 [Hkv, length, D]: the values decode attention uses for positions [0, length)."""
        c = self.layers[layer]
        if self.values is not None:
            return self.values[layer][0][slot, :, :length], self.values[layer][1][slot, :, :length]
        if self.fmt == "bf16":
            return c.k_cache[slot, :, :length].float(), c.v_cache[slot, :, :length].float()
        if self.fmt == "e4m3":
            return (dequantize_rows(c.k_mirror[slot, :, :length], c.k_scale[slot, :, :length]),
                    dequantize_rows(c.v_mirror[slot, :, :length], c.v_scale[slot, :, :length]))
        blocks = -(-length // 8)
        kq = layouts.unpack_int4_keys(c.k_mirror[slot, :, :blocks])[:, :length]
        vq = layouts.unpack_int4_values(c.v_mirror[slot, :, :length])
        k = dequantize_rows(kq, c.k_scale[slot, :, :length])
        v = dequantize_rows(vq, c.v_scale[slot, :, :length])
        return hadamard.unrotate(k), hadamard.unrotate(v)
