"""FP8 E4M3 weights (one float32 scale per output channel) and the delayed per-tensor scaling state
that the producer-side FP8 epilogue uses (paper section 3.2.3).

Delayed scaling: invocation t quantizes with the scale derived from the amax seen in invocation
t - 1 and records its own amax for t + 1. The state defines the first scale (`initial_amax`), keeps
the previous scale when a tensor is all zero (amax 0 would give scale 0), counts saturated elements,
and refuses NaN input (an E4M3 NaN would otherwise flow on silently). +-Inf is clamped to +-448 and
counted as a saturation; it never enters the amax. One state per request group (`DelayedScaling`).

Every division here and in `int4` / `kv_mirror` is a true IEEE division (round to nearest even), as
the kernels' div.rn: `ieee_div` divides tensor by tensor, because CUDA PyTorch evaluates
`tensor / python_scalar` as tensor * fp32(1 / scalar), which differs in the last bit on about half of
the values and then flips rounding ties of the quantizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

E4M3_MAX = 448.0
E4M3 = torch.float8_e4m3fn


def ieee_div(x: torch.Tensor, divisor) -> torch.Tensor:
    """x / divisor, a true IEEE division on every device (never a multiplication by a reciprocal).

    `divisor`: a Python number or a tensor broadcastable to x. CUDA PyTorch turns a division by a CPU
    scalar (a Python number or a 0-dim CPU tensor) into x * (1 / divisor); dividing by a tensor on x's
    device that has at least one dimension keeps the true division. Numbers become a [1, ..., 1]
    tensor made on the device (torch.full launches a fill: no host-device copy, no sync).
    """
    if isinstance(divisor, torch.Tensor):
        if divisor.dim() == 0:
            divisor = divisor.to(device=x.device).reshape((1,) * max(x.dim(), 1))
        return x / divisor
    return x / torch.full((1,) * x.dim(), float(divisor), dtype=x.dtype, device=x.device)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to E4M3 (nearest even) after clamping to +-448, so no value becomes NaN."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


@dataclass(frozen=True)
class E4M3Weight:
    data: torch.Tensor   # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [N]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * self.scale[:, None]).to(dtype)


def quantize_e4m3_weight(w: torch.Tensor) -> E4M3Weight:
    """Per output channel: scale = amax / 448 (float32), data = e4m3(W / scale); zero rows get scale 1."""
    if w.dim() != 2:
        raise ValueError(f"E4M3 weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("E4M3 weight contains NaN or Inf")
    amax = w.float().abs().amax(dim=1)
    scale = torch.where(amax > 0, ieee_div(amax, E4M3_MAX), torch.ones_like(amax))
    return E4M3Weight(data=to_e4m3(w.float() / scale[:, None]), scale=scale)


def fake_quantize_e4m3(w: torch.Tensor) -> torch.Tensor:
    return quantize_e4m3_weight(w).dequantize()


@dataclass
class DelayedScaleState:
    """Per-tensor delayed scale for one producer output of one request group."""

    initial_amax: float = E4M3_MAX  # first call's scale = initial_amax / 448 (1.0 by default)
    margin: float = 1.0             # headroom factor on the previous amax (>= 1)
    scale: float = field(init=False)
    last_amax: float = field(init=False, default=0.0)
    calls: int = field(init=False, default=0)
    saturated: int = field(init=False, default=0)   # elements clamped to +-448 (Inf included)
    nonfinite: int = field(init=False, default=0)   # +-Inf inputs seen

    def __post_init__(self) -> None:
        if not (self.initial_amax > 0 and self.initial_amax < float("inf")):
            raise ValueError(f"initial_amax must be positive and finite, got {self.initial_amax}")
        if not self.margin >= 1.0:
            raise ValueError(f"margin must be >= 1, got {self.margin}")
        self.scale = self.initial_amax / E4M3_MAX

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Quantize x with the current scale; returns (e4m3 data, scale used). Updates the state."""
        if torch.isnan(x).any():
            raise ValueError("FP8 delayed scaling: NaN in the producer output")
        xf = x.float()
        finite = torch.isfinite(xf)
        scale = self.scale
        scaled = ieee_div(xf, scale)  # float32(scale), true division (as on the CPU, also on CUDA)
        n_sat = int((scaled.abs() > E4M3_MAX).sum())  # counts Inf too
        data = to_e4m3(scaled)
        amax = float(xf.abs().masked_fill(~finite, 0).amax()) if xf.numel() else 0.0
        self.calls += 1
        self.saturated += n_sat
        self.nonfinite += int((~finite).sum())
        self.last_amax = amax
        if amax > 0:  # an all-zero tensor keeps the previous scale
            self.scale = amax * self.margin / E4M3_MAX
        return data, scale


class DelayedScaling:
    """Independent delayed-scale states keyed by (request group, tensor name)."""

    def __init__(self, initial_amax: float = E4M3_MAX, margin: float = 1.0) -> None:
        self.initial_amax, self.margin = initial_amax, margin
        self._states: dict[tuple[object, str], DelayedScaleState] = {}

    def state(self, group: object, name: str = "down_in") -> DelayedScaleState:
        key = (group, name)
        if key not in self._states:
            self._states[key] = DelayedScaleState(self.initial_amax, self.margin)
        return self._states[key]

    def quantize(self, group: object, name: str, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        return self.state(group, name).quantize(x)

    def saturations(self) -> dict[tuple[object, str], int]:
        return {k: s.saturated for k, s in self._states.items()}
