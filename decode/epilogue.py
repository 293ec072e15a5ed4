"""Fused epilogues of the decode projections (compile-time choice, applied to float32 results).

    store     y = acc                                   (QKV)
    residual  y = acc + r,  r [M, N] bf16               (O and down: the residual stream)
    swiglu    h = silu(acc[:, 2j]) * acc[:, 2j + 1]     (gate/up with interleaved rows: row 2j is gate j,
              h [M, N/2]                                  row 2j + 1 is up j, as CODA's linear_swiglu)
"""

from __future__ import annotations

import math

import cutlass.cute as cute
from cutlass import Float32

EPILOGUES = ("store", "residual", "swiglu")
LOG2E = 1.0 / math.log(2.0)


def check(epilogue: str) -> str:
    if epilogue not in EPILOGUES:
        raise ValueError(f"unknown decode epilogue {epilogue!r}; known: {', '.join(EPILOGUES)}")
    return epilogue


def out_features(n: int, epilogue: str) -> int:
    return n // 2 if check(epilogue) == "swiglu" else n


def silu_mul(gate: Float32, up: Float32) -> Float32:
    """silu(gate) * up = gate * up / (1 + exp(-gate)), float32 with approximate exp2/rcp."""
    e = cute.arch.exp2(gate * Float32(-LOG2E))
    return gate * up * cute.arch.rcp_approx(e + Float32(1.0))
