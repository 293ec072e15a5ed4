"""Input validation shared by every futx op: each check raises before any kernel launch."""

from __future__ import annotations

from typing import Iterable

import torch


def cuda(name: str, t: torch.Tensor, device: torch.device | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other operands are on {device}")


def dtype(name: str, t: torch.Tensor, allowed: torch.dtype | Iterable[torch.dtype]) -> None:
    allowed = (allowed,) if isinstance(allowed, torch.dtype) else tuple(allowed)
    if t.dtype not in allowed:
        names = ", ".join(str(a).replace("torch.", "") for a in allowed)
        raise TypeError(f"{name} must have dtype {names}, got {str(t.dtype).replace('torch.', '')}")


def shape(name: str, t: torch.Tensor, expected: tuple) -> None:
    """`expected` entries are ints or None (any size)."""
    ok = t.dim() == len(expected) and all(e is None or s == e for s, e in zip(t.shape, expected))
    if not ok:
        pretty = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name} must have shape {pretty}, got {list(t.shape)}")


def contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()); strides {t.stride()}")


def aligned(name: str, t: torch.Tensor, nbytes: int = 16) -> None:
    if t.data_ptr() % nbytes:
        raise ValueError(f"{name} must start on a {nbytes}-byte boundary (data_ptr % {nbytes} = "
                         f"{t.data_ptr() % nbytes}); slice-free or .clone() it")


def multiple(name: str, value: int, of: int, what: str) -> None:
    if value % of:
        raise ValueError(f"{name}: {what} = {value} must be a multiple of {of}")


def in_range(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise ValueError(f"{name} = {value} is outside the supported range [{lo}, {hi}]")
