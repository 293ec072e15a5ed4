"""The NVIDIA GPUs the driver reports, read through its NVML library: no torch, no CUDA context, milliseconds.

For answers that must come before anything loads (futx --version, whether --backend kernels or --device cuda
can run here); torch still decides where work actually runs.
"""

from __future__ import annotations

import ctypes
import functools


@functools.lru_cache(maxsize=None)
def nvml_gpus() -> tuple[tuple[str, tuple[int, int]], ...]:
    """(name, compute capability) of each GPU; OSError saying why when the driver cannot be asked."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        raise OSError("no NVIDIA driver") from None
    if nvml.nvmlInit_v2() != 0:
        raise OSError("the NVIDIA driver's NVML did not initialize")
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            raise OSError("NVML could not count the GPUs")
        gpus = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            name = ctypes.create_string_buffer(96)
            major, minor = ctypes.c_int(), ctypes.c_int()
            if (nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0
                    or nvml.nvmlDeviceGetName(handle, name, len(name)) != 0
                    or nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0):
                raise OSError(f"NVML could not describe GPU {i}")
            gpus.append((name.value.decode(errors="replace"), (major.value, minor.value)))
        return tuple(gpus)
    finally:
        nvml.nvmlShutdown()


def describe() -> str:
    """What is here, in words: 'NVIDIA H200 (sm_90)', 'no NVIDIA driver', ..."""
    try:
        gpus = nvml_gpus()
    except OSError as e:
        return str(e)
    return ", ".join(f"{name} (sm_{a}{b})" for name, (a, b) in gpus) or "no NVIDIA GPU"


def hopper_visible() -> bool:
    """The driver reports a compute capability 9.x GPU (H100/H200)."""
    try:
        return any(cc[0] == 9 for _, cc in nvml_gpus())
    except OSError:
        return False


def any_visible() -> bool:
    try:
        return bool(nvml_gpus())
    except OSError:
        return False
