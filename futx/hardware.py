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


def _device_index(device) -> int:
    """The CUDA index of a torch.device, an index or a string (no index: the current device)."""
    import torch

    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (a torch.device, an index or a string), queried once."""
    return _sm_count(_device_index(device))


# A kernel with no body, loaded from PTX by the driver: the cluster-occupancy query needs a function whose
# launch uses the persistent kernels' resources (one CTA per SM: all of SMEM_PER_CTA).
_PROBE_PTX = b""".version 8.0
.target sm_90a
.address_size 64
.visible .entry futx_cluster_probe() { ret; }
\0"""


@functools.lru_cache(maxsize=None)
def _cluster_slots(index: int, cluster_size: int, threads: int) -> int:
    import torch
    from cuda.bindings import driver as cu

    def ok(ret):
        err, *val = ret if isinstance(ret, tuple) else (ret,)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cluster occupancy query failed: {err}")
        return val[0] if val else None

    with torch.cuda.device(index):
        torch.cuda.init()
        torch.empty(1, device="cuda")   # the primary context exists and is current on this thread
        module = ok(cu.cuModuleLoadData(_PROBE_PTX))
        try:
            func = ok(cu.cuModuleGetFunction(module, b"futx_cluster_probe"))
            ok(cu.cuFuncSetAttribute(func, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                     SMEM_PER_CTA))
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster_size, 1, 1
            cfg = cu.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = cluster_size * _sm_count(index), 1, 1
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
            cfg.sharedMemBytes = SMEM_PER_CTA
            cfg.attrs, cfg.numAttrs = [attr], 1
            clusters = ok(cu.cuOccupancyMaxActiveClusters(func, cfg))
        finally:
            cu.cuModuleUnload(module)
    return clusters * cluster_size


def cluster_slots(device, cluster_size: int, threads: int = 384) -> int:
    """CTAs of a one-CTA-per-SM kernel that run at once in clusters of `cluster_size`: what a persistent grid may
    hold so that every cluster is resident. A cluster must fit in one GPC, and how many SMs each GPC keeps
    varies from chip to chip, so clusters of 4 can leave SMs idle; this asks the driver (cuda-python). Clusters of
    1 or 2 (one TPC) take every SM."""
    if cluster_size <= 2:
        return sm_count(device)
    return _cluster_slots(_device_index(device), cluster_size, threads)
