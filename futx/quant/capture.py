"""Record the inputs of chosen projections while the reference block runs unchanged.

The reference computes every projection as `h @ W.T` (F.linear(h, W) is recognised too). Wrapping W in `_Probe` makes that product
report h (the projection's input) to a callback and then compute as usual, so GPTQ sees exactly the
activations of the reference model without a second copy of the block's code.
"""

from __future__ import annotations

from typing import Callable

import torch


class _Probe(torch.Tensor):
    """A weight that reports the left operand of every matmul it is the right operand of."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, name: str, sink: Callable[[str, torch.Tensor], None]):
        t = torch.Tensor._make_subclass(cls, data)
        t._probe = (name, sink)
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        probe = next((a._probe for a in args if isinstance(a, _Probe) and hasattr(a, "_probe")), None)
        plain = [a.as_subclass(torch.Tensor) if isinstance(a, _Probe) else a for a in args]
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*plain, **kwargs)
        if probe is None:
            return out
        name = getattr(func, "__name__", "")
        if name in ("__get__", "t", "transpose") and isinstance(out, torch.Tensor):
            return _Probe(out, *probe)  # W.T (a property getter) keeps reporting
        if name in ("matmul", "__matmul__") and len(args) == 2 and isinstance(args[1], _Probe):
            probe[1](probe[0], plain[0])  # h @ W.T
        elif name == "linear" and len(args) >= 2 and isinstance(args[1], _Probe):
            probe[1](probe[0], plain[0])  # F.linear(h, W)
        return out


def probe(weight: torch.Tensor, name: str, sink: Callable[[str, torch.Tensor], None]) -> torch.Tensor:
    """`weight` as a tensor that calls sink(name, input) whenever `input @ weight.T` is computed."""
    return _Probe(weight, name, sink)
