"""torch.compile for the prefill's torch glue (glue="compiled": the per-row FP8 quantization of the
activations): fewer launches, close to but not bit for bit the eager glue.

Measured on the H200 (torch 2.11, inductor/Triton), with IEEE division requested below: a division by a constant
is still folded into a multiplication by its reciprocal (per-row scales 1 ulp apart), and Triton's float32 ->
E4M3 conversion does not round ties to even (152 -> 144 where eager gives 160). So the compiled glue's FP8
activations can differ from the eager ones in the last bit; the eager glue and futx's row-quantization kernel
(glue="kernel", the default on the kernels backend) are exact.
"""

from __future__ import annotations


def _numerics_options() -> dict:
    """Inductor options closest to eager rounding: IEEE float32 division between tensors (Triton's x / y is the
    approximate div.full) and rounding at every eager dtype cast. The division option's name changed across
    releases."""
    import torch._inductor.config as cfg

    opts = {"emulate_precision_casts": True}
    if hasattr(cfg, "emulate_divison_rounding"):          # the spelling up to at least 2.11
        opts["emulate_divison_rounding"] = True
    elif hasattr(getattr(cfg, "eager_numerics", None), "division_rounding"):
        opts["eager_numerics.division_rounding"] = True
    return opts


def compile_glue(fn):
    """torch.compile(fn, dynamic=True) with `_numerics_options` (module docstring: not bitwise)."""
    import torch

    return torch.compile(fn, dynamic=True, options=_numerics_options())
