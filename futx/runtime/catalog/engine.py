"""Small kernels of the decode step that sit between the projections (the engine's glue)."""

from futx.runtime.registry import KernelSpec

SPECS = [
    KernelSpec(key="engine.rms_rows", module="decode.rms_rows", sources=("decode/rms_rows.py",),
               doc="RMSNorm row factor of bf16 rows (gain folded into the next projection)"),
]
