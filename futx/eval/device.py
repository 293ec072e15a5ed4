"""Device set-up for reference-quality evaluation on CPU or GPU.

Reference numbers are float32 arithmetic. On CUDA, PyTorch may run float32 matrix products and
convolutions in TF32 (10-bit mantissa inputs); `setup_device` turns that off, so a GPU run computes
the same float32 model as the CPU (up to summation order).
"""

from __future__ import annotations

import torch


def setup_device(device: str | torch.device | None) -> torch.device:
    """torch.device for `device` (default cpu); on CUDA: TF32 off for matmuls and cuDNN, a clear error
    when CUDA is missing."""
    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {dev} requested but CUDA is not available")
        if dev.index is None:  # tensors report "cuda:N": compare equal to them
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    return dev


def describe(dev: torch.device) -> dict:
    """What the numbers were computed on (for JSON records)."""
    info = {"device": str(dev), "torch": torch.__version__}
    if dev.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(dev), tf32=bool(torch.backends.cuda.matmul.allow_tf32),
                    cudnn_tf32=bool(torch.backends.cudnn.allow_tf32),
                    matmul_precision=torch.get_float32_matmul_precision())
    else:
        info.update(threads=torch.get_num_threads())
    return info
