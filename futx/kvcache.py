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
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" -> "cuda:N", as tensors report it
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.kv_heads, self.head_dim = config.num_key_value_heads, config.head_dim
        self.mirror_fn = mirror
        shape = self._storage_shape()

        def alloc() -> list[torch.Tensor]:
            return [torch.full(shape, float("nan"), dtype=dtype, device=self.device)
                    for _ in range(config.num_hidden_layers)]

        self.k, self.v = alloc(), alloc()
        # No mirror function: decode reads the main copy itself.
        self.k_mirror, self.v_mirror = (self.k, self.v) if mirror is None else (alloc(), alloc())
        self.lengths = torch.zeros(config.num_hidden_layers, slots, dtype=torch.int64)

    def _storage_shape(self) -> tuple:
        """One layer's K (or V) tensor: [slots, Hkv, capacity, D] here (futx.paged_kvcache: pages)."""
        return (self.slots, self.kv_heads, self.capacity, self.head_dim)

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
              k: torch.Tensor, v: torch.Tensor, *, spans=None) -> None:
        """Store rows k, v [M, Hkv, D] of token m at (slots[m], positions[m]) in main and mirror.

        A slot's new positions may start anywhere up to its current length (appending, or rewinding
        to overwrite); a gap would leave unwritten positions inside the attended range and is an error,
        as is any position at or beyond capacity.

        `spans`: optional host-side description of the same rows, one (slot, first position, end
        position) per request with consecutive positions (PackedBatch.spans()). With it the checks
        run on the host; without it they read slots/positions back from the device (a sync).
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
        if spans is not None:
            if sum(e - f for _, f, e in spans) != m:
                raise ValueError(f"KV write: spans describe {sum(e - f for _, f, e in spans)} rows, k has {m}")
            span_slots = torch.tensor([s for s, _, _ in spans], dtype=torch.int64)
            span_first = torch.tensor([f for _, f, _ in spans], dtype=torch.int64)
            span_last = torch.tensor([e - 1 for _, _, e in spans], dtype=torch.int64)
            slot_lo, slot_hi = int(span_slots.min()), int(span_slots.max())
            pos_lo, pos_hi = int(span_first.min()), int(span_last.max())
            hi = int(span_last.argmax())
            bad_slot, bad_pos = int(span_slots[hi]), pos_hi
        else:
            slot_lo, slot_hi = int(slots.min()), int(slots.max())
            pos_lo, pos_hi = int(positions.min()), int(positions.max())
            if pos_hi >= self.capacity:
                hi = int(positions.argmax())
                bad_slot, bad_pos = int(slots[hi]), int(positions[hi])
        if slot_lo < 0 or slot_hi >= self.slots:
            raise ValueError(f"KV write: request slot out of range [0, {self.slots}): {slot_lo}..{slot_hi}")
        if pos_lo < 0:
            raise ValueError(f"KV write: negative position {pos_lo}")
        if pos_hi >= self.capacity:
            raise ValueError(
                f"KV cache overflow: request slot {bad_slot} position {bad_pos} does not fit "
                f"capacity {self.capacity}; allocate a larger cache")
        if spans is not None:
            slots_cpu, first_cpu, end_cpu = span_slots, span_first, span_last + 1
        else:
            slots_cpu, pos_cpu = slots.cpu(), positions.cpu()
            first_cpu, end_cpu = pos_cpu, pos_cpu + 1
        first = torch.full((self.slots,), self.capacity, dtype=torch.int64).scatter_reduce(
            0, slots_cpu, first_cpu, "amin")
        end = torch.zeros(self.slots, dtype=torch.int64).scatter_reduce(0, slots_cpu, end_cpu, "amax")
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

    def read_batch(self, layer: int, slots, stop: int, *, mirror: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [B, Hkv, stop, D] of positions [0, stop) of each slot in `slots` (a host sequence).

        The batched counterpart of `read` for requests of equal length. With this contiguous layout
        (the contract above: a slot's rows are [kv_head][position] blocks) every slot in order is a
        view of the storage (no copy); other slot lists are gathered. A paged layout replaces
        this method together with `offset`.
        """
        self._check_layer(layer)
        slots = [int(s) for s in slots]
        if not slots or min(slots) < 0 or max(slots) >= self.slots:
            raise ValueError(f"KV read: slots {slots[:8]}... out of range [0, {self.slots})")
        held = self.lengths[layer, slots]
        if not 0 < stop <= int(held.min()):
            s = slots[int(held.argmin())]
            raise ValueError(f"KV read: slot {s} of layer {layer} holds {int(self.lengths[layer, s])} "
                             f"positions, cannot read {stop}")
        k_store, v_store = (self.k_mirror, self.v_mirror) if mirror else (self.k, self.v)
        k, v = k_store[layer][:, :, :stop], v_store[layer][:, :, :stop]
        if slots == list(range(len(slots))):
            return k[:len(slots)], v[:len(slots)]
        index = torch.tensor(slots, dtype=torch.int64).to(self.device)
        return k.index_select(0, index), v.index_select(0, index)

    def reset(self, slot: Optional[int] = None) -> None:
        """Forget what a slot (or every slot) holds; storage is reused as is."""
        if slot is None:
            self.lengths.zero_()
        else:
            self.lengths[:, slot] = 0

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.config.num_hidden_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.config.num_hidden_layers})")
