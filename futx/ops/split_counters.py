"""Arrival counters of the split-K kernels (decode skinny projections, prefill GEMM).

The last CTA of a split tile is the one whose atomic increment reaches `splits - 1`; it resets the counter,
so the kernels leave every counter at zero. One zeroed buffer per (device, stream): kernels on one stream
run one after another, so they can share it.
"""

from __future__ import annotations

import torch

SLOTS = 1 << 14   # one per output tile of a split launch

_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def counters(device: torch.device) -> torch.Tensor:
    key = (device.index, torch.cuda.current_stream(device).stream_id)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(SLOTS, dtype=torch.int32, device=device)
    return _COUNTERS[key]
