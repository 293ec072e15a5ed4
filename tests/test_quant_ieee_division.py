"""Quantizer divisions are true IEEE divisions (round to nearest even), never x * (1 / scale).

CUDA PyTorch computes `tensor / python_scalar` (and a division by a 0-dim CPU tensor) as a
multiplication by the float32 reciprocal. That differs from the correctly rounded quotient on about
half of the values and flips the quantizer's rounding ties, so the library must divide tensor by
tensor. The CPU performs true divisions either way, so these tests run the quantizers under
`CudaScalarDivision`, a torch-function mode that reproduces CUDA's reciprocal multiplication on the
CPU: any division by a scalar left in the quantize path changes the results (and is listed).
Inputs are built to sit exactly on rounding ties; references are computed in float64 and rounded
once (a float64 quotient of two float32 values rounded to float32 is the correctly rounded quotient).
"""

from __future__ import annotations

import contextlib
import numbers

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from futx.quant import fp8, int4, kv_mirror

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
_DIV = {torch.Tensor.div, torch.Tensor.div_, torch.div, torch.true_divide, torch.Tensor.true_divide,
        torch.Tensor.__truediv__, torch.Tensor.__itruediv__}


class CudaScalarDivision(TorchFunctionMode):
    """Evaluate `tensor / scalar` as CUDA does (tensor * (1 / scalar), the reciprocal in the opmath type).

    A scalar divisor is a Python number, or a 0-dim tensor dividing a tensor with dimensions (on CUDA
    a 0-dim CPU tensor is a scalar; the library never divides by a 0-dim tensor). `hits` records each.
    """

    def __init__(self) -> None:
        super().__init__()
        self.hits: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DIV and len(args) == 2 and not kwargs.get("rounding_mode") and isinstance(args[0], torch.Tensor):
            x, d = args
            scalar = isinstance(d, numbers.Number) or (isinstance(d, torch.Tensor) and d.dim() == 0 and x.dim() > 0)
            if scalar and x.is_floating_point():
                self.hits.append(f"{getattr(func, '__name__', func)}(tensor{tuple(x.shape)}, {float(d)!r})")
                opmath = torch.float64 if x.dtype == torch.float64 else torch.float32
                inv = torch.ones((), dtype=opmath) / torch.full((), float(d), dtype=opmath)
                out = (x.to(opmath) * inv).to(x.dtype)
                if func in (torch.Tensor.div_, torch.Tensor.__itruediv__):
                    return x.copy_(out)
                return out
        return func(*args, **kwargs)


def _f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64).astype(np.float32)


def _div_ref(x, d) -> np.ndarray:
    """Correctly rounded float32 quotient of float32 values."""
    return (np.asarray(x, np.float32).astype(np.float64) / np.asarray(d, np.float32).astype(np.float64)).astype(
        np.float32)


def _short_scales(rng, n: int, bits: int = 19) -> np.ndarray:
    """Random float32 scales with `bits` significant bits: (k + 1/2) * scale (4 bits) and E4M3 midpoints
    times scale (5 bits) stay exact in float32, while 1 / scale is a full-precision reciprocal."""
    mant = rng.integers(2 ** (bits - 1), 2 ** bits, n).astype(np.float64)
    return _f32(mant * 2.0 ** rng.integers(-bits - 6, -bits + 4, n))


def _fp16_midpoints(rng, n: int) -> np.ndarray:
    """float32 values exactly halfway between two neighbouring float16 values (fp16 rounding ties)."""
    a = rng.uniform(1e-3, 1.0, n).astype(np.float16)
    b = np.nextafter(a, np.float16(np.inf))
    return ((a.astype(np.float64) + b.astype(np.float64)) / 2).astype(np.float32)


def _tie_rows(rows: int, width: int, qmax: float, seed: int, fp16_scale: bool = False
              ) -> tuple[torch.Tensor, np.ndarray]:
    """Rows whose elements (after the first) are exactly (k + 1/2) * scale: every quotient is a tie.

    Element 0 holds the row maximum amax = qmax * s (exact), so the correctly rounded fp32(amax / qmax)
    is s itself; a reciprocal multiplication misses it by an ulp on some rows. With `fp16_scale`, s is
    an fp16 rounding tie and the stored scale is fp16(s) (half to even): an ulp off flips it.
    Returns (rows float32 [rows, width], the exact stored scales float32 [rows]).
    """
    rng = np.random.default_rng(seed)
    s = _fp16_midpoints(rng, rows) if fp16_scale else _short_scales(rng, rows)
    amax = _f32(s.astype(np.float64) * qmax)
    assert np.array_equal(_div_ref(amax, np.float32(qmax)), s)
    scale = s.astype(np.float16).astype(np.float32) if fp16_scale else s
    k = rng.integers(-int(qmax), int(qmax) - 1, (rows, width - 1)).astype(np.float64) + 0.5
    want = k * scale.astype(np.float64)[:, None]
    x = want.astype(np.float32)
    assert np.array_equal(x.astype(np.float64), want)  # exact ties
    full = np.concatenate([amax[:, None], x], axis=1)
    sign = np.where(rng.random(rows) < 0.5, -1.0, 1.0).astype(np.float32)
    return torch.from_numpy(full * sign[:, None]), scale


def _e4m3_midpoints() -> np.ndarray:
    """Values halfway between neighbouring finite E4M3 values (all 256 codes decoded)."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8.E4M3).float().numpy().astype(np.float64)
    grid = np.unique(codes[np.isfinite(codes)])
    return (grid[:-1] + grid[1:]) / 2


def _round_half_even(a: np.ndarray) -> np.ndarray:
    return np.round(a)  # numpy rounds half to even


def test_reciprocal_emulation_hits_the_ties():
    """The inputs discriminate: x * fp32(1/s) rounds differently from x / s on many of them."""
    x, _ = _tie_rows(256, 64, 7.0, seed=0)
    s = _div_ref(np.abs(x.numpy()).max(1), np.float32(7.0))
    true_q = _round_half_even(_div_ref(x.numpy(), s[:, None]))
    recip = (x.numpy() * (np.float32(1.0) / s)[:, None]).astype(np.float32)
    assert (np.round(recip) != true_q).sum() > 200  # about 4% of 16k ties flip
    # and the emulation reproduces that reciprocal product
    with CudaScalarDivision() as mode:
        y = x / 7.0
    assert mode.hits and not torch.equal(y, torch.from_numpy(_div_ref(x.numpy(), np.float32(7.0))))


@pytest.mark.parametrize("emulate", [False, True], ids=["plain", "cuda-scalar-division"])
@pytest.mark.parametrize("device", DEVICES)
def test_int4_cache_rows_divide_exactly(emulate, device):
    x, scale = _tie_rows(512, 64, 7.0, seed=1)
    mode = CudaScalarDivision() if emulate else None
    with mode or contextlib.nullcontext():
        q, s = kv_mirror.quantize_int4_rows(x.to(device))
    assert mode is None or mode.hits == []
    assert np.array_equal(s.cpu().numpy(), scale)
    want = np.clip(_round_half_even(_div_ref(x.numpy(), scale[:, None])), -7, 7)
    assert np.array_equal(q.cpu().numpy().astype(np.float64), want)


@pytest.mark.parametrize("emulate", [False, True], ids=["plain", "cuda-scalar-division"])
@pytest.mark.parametrize("device", DEVICES)
def test_e4m3_cache_rows_and_weights_divide_exactly(emulate, device):
    # E4M3 ties: midpoints between neighbouring E4M3 values, e.g. 1.0625 between 1.0 and 1.125
    mids = _e4m3_midpoints()
    rng = np.random.default_rng(2)
    rows, width = 256, 64
    scale = _short_scales(rng, rows)
    amax = _f32(scale.astype(np.float64) * 448.0)
    pick = rng.choice(mids[np.abs(mids) < 440], (rows, width - 1))
    want = pick * scale.astype(np.float64)[:, None]
    x = want.astype(np.float32)
    assert np.array_equal(x.astype(np.float64), want)  # exact ties
    x = torch.from_numpy(np.concatenate([amax[:, None], x], axis=1))
    ref_data = fp8.to_e4m3(torch.from_numpy(_div_ref(x.numpy(), scale[:, None]))).float().numpy()
    mode = CudaScalarDivision() if emulate else None
    with mode or contextlib.nullcontext():
        d, s = kv_mirror.quantize_e4m3_rows(x.to(device))
        w = fp8.quantize_e4m3_weight(x.to(device))
    assert mode is None or mode.hits == []
    assert np.array_equal(s.cpu().numpy(), scale) and np.array_equal(w.scale.cpu().numpy(), scale)
    assert np.array_equal(d.float().cpu().numpy(), ref_data)
    assert np.array_equal(w.data.float().cpu().numpy(), ref_data)


@pytest.mark.parametrize("emulate", [False, True], ids=["plain", "cuda-scalar-division"])
@pytest.mark.parametrize("device", DEVICES)
def test_int4_weights_divide_exactly(emulate, device):
    g = 64
    x, scale = _tie_rows(128 * 4, g, 7.0, seed=3, fp16_scale=True)
    w = x.reshape(128, 4 * g)  # each group of 64 is one tie row: amax first
    mode = CudaScalarDivision() if emulate else None
    with mode or contextlib.nullcontext():
        scales = int4.group_scales(w.to(device), g)
        q = int4.quantize_to_grid(w.to(device), scales, g)
        fake = int4.fake_quantize_int4(w.to(device), g)
    assert mode is None or mode.hits == []
    assert np.array_equal(scales.float().cpu().numpy().reshape(-1), scale)
    want = np.clip(_round_half_even(_div_ref(x.numpy(), scale[:, None])), -8, 7).reshape(128, 4 * g)
    assert np.array_equal(q.cpu().numpy().astype(np.float64), want)
    assert np.array_equal(fake.cpu().numpy(), (want.reshape(-1, g) * scale[:, None]).reshape(128, 4 * g))


@pytest.mark.parametrize("emulate", [False, True], ids=["plain", "cuda-scalar-division"])
@pytest.mark.parametrize("device", DEVICES)
def test_delayed_scaling_divides_exactly(emulate, device):
    rng = np.random.default_rng(4)
    st = fp8.DelayedScaleState()
    s_short = _short_scales(rng, 1)[0]
    first = _f32(rng.uniform(-1, 1, 64) * 448.0 * s_short)
    first[7] = np.float32(448.0 * np.float64(s_short))  # amax: the next scale is s_short exactly
    st.quantize(torch.from_numpy(first).to(device))
    scale32 = np.float32(st.scale)  # the scale the next call uses (float32, as the kernels store it)
    mids = _e4m3_midpoints()
    assert scale32 == s_short
    want = rng.choice(mids[np.abs(mids) < 440], 4096) * np.float64(scale32)
    x = want.astype(np.float32)
    assert np.array_equal(x.astype(np.float64), want)  # exact ties
    ref = fp8.to_e4m3(torch.from_numpy(_div_ref(x, scale32))).float().numpy()
    mode = CudaScalarDivision() if emulate else None
    with mode or contextlib.nullcontext():
        data, used = st.quantize(torch.from_numpy(x).to(device))
    assert mode is None or mode.hits == []
    assert np.float32(used) == scale32 and np.array_equal(data.float().cpu().numpy(), ref)


def test_emulation_catches_a_scalar_division():
    """The old formula (amax / 7 with a Python 7) is flagged and gives different grids under emulation."""
    x, scale = _tie_rows(512, 64, 7.0, seed=5)
    with CudaScalarDivision() as mode:
        s_old = x.abs().amax(-1) / 7
        q_old = torch.round(x / s_old[:, None])
    assert len(mode.hits) == 1  # amax / 7; x / s[:, None] divides by a tensor
    want = _round_half_even(_div_ref(x.numpy(), scale[:, None]))
    assert not (np.array_equal(s_old.numpy(), scale) and np.array_equal(q_old.numpy(), want))
