"""The reference KV cache: one addressing function, a main copy and an optional decode mirror.

Storage: per layer, K and V tensors [slots, kv_heads, capacity, head_dim] (the *main* copy, which
prefill-phase attention reads). `offset(slot, kv_head, position, channel)` is the only place that
says where an element lives; reads and writes go through it, so a paged layout replaces that one
method (and the allocation) and nothing else. Layout contract every replacement must keep: the D
channels of one (slot, head, position) are contiguous and start at a multiple of D, so whole rows
move at `offset(..., 0) // D`.

The *mirror* holds what decode-phase attention reads. With no mirror function it is the main copy
itself (same tensors). With `mirror=fn`, every write also stores `fn(layer, k, v)`: the quantization
engineer plugs in quantize -> dequantize (Hadamard rotation undone), so the reference reads exactly
the values the INT4 decode kernels will read. `fn` gets the new rows k, v [M, kv_heads, D] in the
compute dtype and must treat each (token, head) row independently -- a cache row is written once,
which is what makes chunked decoding equal to token-by-token decoding.

Unwritten storage is NaN, so reading a position that was never written cannot go unnoticed.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from futx.config import LlamaConfig

MirrorFn = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class KVCache:
    """K/V storage for `slots` concurrent requests of up to `capacity` positions each.

    Attributes: k, v (main) and k_mirror, v_mirror: lists over layers of [slots, Hkv, capacity, D];
    lengths [layers, slots] (int64): positions written so far per layer and slot.
    """

    def __init__(self, config: LlamaConfig, slots: int, capacity: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", mirror: Optional[MirrorFn] = None):
        if not isinstance(slots, int) or slots <= 0:
            raise ValueError(f"KVCache slots must be a positive integer, got {slots!r}")
        if not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"KVCache capacity must be a positive integer, got {capacity!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"KVCache dtype must be floating point, got {dtype}")
        self.config = config
        self.slots, self.capacity, self.dtype = slots, capacity, dtype
        self.device = torch.device(device)
        self.kv_heads, self.head_dim = config.num_key_value_heads, config.head_dim
        self.mirror_fn = mirror
        shape = (slots, self.kv_heads, capacity, self.head_dim)

        def alloc() -> list[torch.Tensor]:
            return [torch.full(shape, float("nan"), dtype=dtype, device=self.device)
                    for _ in range(config.num_hidden_layers)]

        self.k, self.v = alloc(), alloc()
        # No mirror function: decode reads the main copy itself.
        self.k_mirror, self.v_mirror = (self.k, self.v) if mirror is None else (alloc(), alloc())
        self.lengths = torch.zeros(config.num_hidden_layers, slots, dtype=torch.int64)

    # ---- addressing -----------------------------------------------------------------------------
    def offset(self, slot, kv_head, position, channel):
        """Element offset into a layer's flat storage (ints or broadcastable integer tensors).

        Contiguous per request slot: [slot][kv_head][position][channel].
        """
        return ((slot * self.kv_heads + kv_head) * self.capacity + position) * self.head_dim + channel

    def _rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Row indices [M, Hkv] (units of D elements) of (slot_m, head, position_m)."""
        heads = torch.arange(self.kv_heads, device=self.device)
        return self.offset(slots[:, None], heads[None, :], positions[:, None], 0) // self.head_dim

    # ---- writes ---------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows k, v [M, Hkv, D] of token m at (slots[m], positions[m]) in main and mirror.

        A slot's new positions may start anywhere up to its current length (appending, or rewinding
        to overwrite); a gap would leave unwritten positions inside the attended range and is an error,
        as is any position at or beyond capacity.
        """
        self._check_layer(layer)
        m = k.shape[0]
        want = (m, self.kv_heads, self.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"KV write expects k and v of shape {want}, got {tuple(k.shape)} and {tuple(v.shape)}")
        if not (k.dtype.is_floating_point and v.dtype.is_floating_point):
            raise ValueError(f"KV write expects floating k and v, got {k.dtype} and {v.dtype}")
        for name, t in (("k", k), ("v", v), ("slots", slots), ("positions", positions)):
            if t.device != self.device:
                raise ValueError(f"KV write: {name} is on {t.device}, the cache on {self.device}")
        if slots.shape != (m,) or positions.shape != (m,):
            raise ValueError(f"KV write expects slots and positions of shape ({m},), "
                             f"got {tuple(slots.shape)} and {tuple(positions.shape)}")
        if m == 0:
            return
        if int(slots.min()) < 0 or int(slots.max()) >= self.slots:
            raise ValueError(f"KV write: request slot out of range [0, {self.slots}): "
                             f"{int(slots.min())}..{int(slots.max())}")
        if int(positions.min()) < 0:
            raise ValueError(f"KV write: negative position {int(positions.min())}")
        if int(positions.max()) >= self.capacity:
            bad = int(positions.argmax())
            raise ValueError(
                f"KV cache overflow: request slot {int(slots[bad])} position {int(positions[bad])} does not fit "
                f"capacity {self.capacity}; allocate a larger cache")
        slots_cpu, pos_cpu = slots.cpu(), positions.cpu()
        first = torch.full((self.slots,), self.capacity, dtype=torch.int64).scatter_reduce(
            0, slots_cpu, pos_cpu, "amin")
        end = torch.zeros(self.slots, dtype=torch.int64).scatter_reduce(0, slots_cpu, pos_cpu + 1, "amax")
        touched = end > 0
        gap = touched & (first > self.lengths[layer])
        if bool(gap.any()):
            s = int(gap.nonzero()[0])
            raise ValueError(f"KV write would leave a gap: slot {s} holds {int(self.lengths[layer, s])} positions "
                             f"but the new tokens start at position {int(first[s])}")

        rows = self._rows(slots, positions).reshape(-1)
        self._store(self.k[layer], rows, k)
        self._store(self.v[layer], rows, v)
        if self.mirror_fn is not None:
            k_eff, v_eff = self.mirror_fn(layer, k, v)
            if tuple(k_eff.shape) != want or tuple(v_eff.shape) != want:
                raise ValueError(f"mirror function returned shapes {tuple(k_eff.shape)}, {tuple(v_eff.shape)}; "
                                 f"expected {want}")
            self._store(self.k_mirror[layer], rows, k_eff)
            self._store(self.v_mirror[layer], rows, v_eff)
        self.lengths[layer, touched] = end[touched]

    def _store(self, storage: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        storage.view(-1, self.head_dim).index_copy_(0, rows, values.reshape(-1, self.head_dim).to(self.dtype))

    # ---- reads ----------------------------------------------------------------------------------
    def read(self, layer: int, slot: int, stop: int, *, mirror: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [Hkv, stop, D] of positions [0, stop) of `slot`, from the mirror or the main copy."""
        self._check_layer(layer)
        if not 0 <= slot < self.slots:
            raise ValueError(f"KV read: slot {slot} out of range [0, {self.slots})")
        if not 0 < stop <= int(self.lengths[layer, slot]):
            raise ValueError(f"KV read: slot {slot} of layer {layer} holds {int(self.lengths[layer, slot])} "
                             f"positions, cannot read {stop}")
        positions = torch.arange(stop, device=self.device)
        rows = self._rows(torch.full_like(positions, slot), positions).t().reshape(-1)  # head-major
        k_store, v_store = (self.k_mirror, self.v_mirror) if mirror else (self.k, self.v)
        shape = (self.kv_heads, stop, self.head_dim)
        return (k_store[layer].view(-1, self.head_dim).index_select(0, rows).view(shape),
                v_store[layer].view(-1, self.head_dim).index_select(0, rows).view(shape))

    def reset(self, slot: Optional[int] = None) -> None:
        """Forget what a slot (or every slot) holds; storage is reused as is."""
        if slot is None:
            self.lengths.zero_()
        else:
            self.lengths[:, slot] = 0

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.config.num_hidden_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.config.num_hidden_layers})")
