"""Hardware constants of the Hopper target (sm_90a) shared by the kernels and their host code.

No DSL and no torch import at module level: kernel modules, planners and launch code all read the same
numbers. `sm_count` imports torch only when called (launch code, which has a device).
"""

from __future__ import annotations

import functools

SMEM_PER_CTA = 227 * 1024  # opt-in dynamic shared memory per CTA on sm_90 (232448 bytes)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (a torch.device, an index or a string), queried once."""
    import torch

    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)
