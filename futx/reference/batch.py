"""Packed-batch metadata: which request and position each row of a packed token batch belongs to.

Requests' new tokens are concatenated; request b owns rows [cu_seqlens[b], cu_seqlens[b+1]) at
positions start_positions[b], start_positions[b] + 1, ... in cache slot slots[b]. Prefill, chunked
prefill, single-token decode and multi-token decode chunks all use this one description.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional, Sequence

import torch


def _as_index(x, name: str, device) -> torch.Tensor:
    t = torch.as_tensor(x, device=device)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D integer sequence, got dtype {t.dtype} shape {tuple(t.shape)}")
    return t.to(torch.int64)


@dataclass(frozen=True)
class PackedBatch:
    """slots [B], cu_seqlens [B+1] (prefix sum of new-token counts), start_positions [B];
    derived: row_request [M], row_slot [M], row_position [M] with M = cu_seqlens[-1].

    The constructors validate and derive everything on the host and then move the tensors to
    `device`, keeping a host copy of the per-request metadata (`host`: cu_seqlens, start positions
    and slots as tuples of ints). Attention and the KV cache read that copy, so a forward on a GPU
    makes no device-to-host synchronisation for batch bookkeeping.
    """

    slots: torch.Tensor
    cu_seqlens: torch.Tensor
    start_positions: torch.Tensor
    row_request: torch.Tensor
    row_slot: torch.Tensor
    row_position: torch.Tensor
    host: Optional[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = field(
        default=None, compare=False, repr=False)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens, start_positions=None, slots=None, device="cpu") -> "PackedBatch":
        target, device = torch.device(device), "cpu"  # validate and derive on the host, then move
        cu = _as_index(cu_seqlens, "cu_seqlens", device)
        if cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] <= cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must start at 0 and strictly increase (every request has a token), "
                             f"got {cu.tolist()}")
        b = cu.numel() - 1
        start = (torch.zeros(b, dtype=torch.int64, device=device) if start_positions is None
                 else _as_index(start_positions, "start_positions", device))
        slot = torch.arange(b, device=device) if slots is None else _as_index(slots, "slots", device)
        if start.numel() != b or slot.numel() != b:
            raise ValueError(f"{b} requests need {b} start positions and slots, "
                             f"got {start.numel()} and {slot.numel()}")
        if bool((start < 0).any()) or bool((slot < 0).any()):
            raise ValueError("start positions and slots must be non-negative")
        if torch.unique(slot).numel() != b:
            raise ValueError(f"each request of a batch needs its own cache slot, got {slot.tolist()}")
        m = int(cu[-1])
        rows = torch.arange(m, device=device)
        # Prefix sum -> owner: the number of request ends at or before row m.
        request = torch.searchsorted(cu[1:], rows, right=True)
        position = start[request] + rows - cu[request]
        host = (tuple(cu.tolist()), tuple(start.tolist()), tuple(slot.tolist()))
        if target.type == "cpu":
            move = lambda t: t  # noqa: E731
        elif target.type == "cuda":  # pinned + non_blocking: a plain .to(cuda) would synchronise the stream
            move = lambda t: t.pin_memory().to(target, non_blocking=True)  # noqa: E731
        else:
            move = lambda t: t.to(target)  # noqa: E731
        return cls(move(slot), move(cu), move(start), move(request), move(slot[request]), move(position), host)

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], start_positions: Optional[Sequence[int]] = None,
                     slots: Optional[Sequence[int]] = None, device="cpu") -> "PackedBatch":
        """Requests with `lengths` new tokens each (prefill, or a decode chunk when starts > 0)."""
        n = _as_index(lengths, "lengths", "cpu")
        if n.numel() == 0 or bool((n <= 0).any()):
            raise ValueError(f"every request needs at least one token, got lengths {n.tolist()}")
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)])
        return cls.from_cu_seqlens(cu, start_positions, slots, device)

    @classmethod
    def decode(cls, positions: Sequence[int], slots: Optional[Sequence[int]] = None, device="cpu") -> "PackedBatch":
        """One new token per request, at `positions` (= tokens already cached for that request)."""
        pos = _as_index(positions, "positions", "cpu")
        return cls.from_lengths([1] * pos.numel(), pos, slots, device)

    @property
    def num_requests(self) -> int:
        return self.slots.numel()

    @property
    def num_rows(self) -> int:
        return self.host_lists()[0][-1]

    def host_lists(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(cu_seqlens, start_positions, slots) as tuples of ints, without a device sync when known."""
        if self.host is None:
            return (tuple(self.cu_seqlens.tolist()), tuple(self.start_positions.tolist()),
                    tuple(self.slots.tolist()))
        return self.host

    def spans(self) -> tuple[tuple[int, int, int], ...]:
        """Per request (slot, first position, end position) on the host: the cache rows it writes."""
        return self._spans

    def uniform(self) -> Optional[tuple[int, int]]:
        """(new tokens per request, start position) when every request has the same of both, else None."""
        return self._uniform

    # computed once per batch (every layer asks): cached_property writes the instance dict directly
    @cached_property
    def _spans(self) -> tuple[tuple[int, int, int], ...]:
        cu, start, slots = self.host_lists()
        return tuple((slots[b], start[b], start[b] + cu[b + 1] - cu[b]) for b in range(len(slots)))

    @cached_property
    def _uniform(self) -> Optional[tuple[int, int]]:
        cu, start, _ = self.host_lists()
        n = cu[1] - cu[0]
        if all(cu[b + 1] - cu[b] == n for b in range(len(start))) and all(s == start[0] for s in start):
            return n, start[0]
        return None

    def lengths(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]
