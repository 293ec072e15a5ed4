"""SwiGLU: out[:, j] = silu(gate_j) * up_j, halving the columns.

layout="interleaved": GEMM column 2j is gate j, 2j+1 is up j (CODA's `linear_swiglu` weight order);
    the pair sits in two adjacent registers of one thread.
layout="split": W = [W_gate; W_up] stacked (gate rows [0, I), up rows [I, 2I)); the mainloop loads
    each 256-column tile as 128 gate rows + the matching 128 up rows, so the pair is again in-thread.
"""

from __future__ import annotations

import math

from epilogues.base import Policy
from epilogues.dsl import cute, Float32

_LOG2E = math.log2(math.e)


class SwiGLU(Policy):
    kind = "pair"

    def __init__(self, layout: str = "interleaved"):
        if layout not in ("interleaved", "split"):
            raise ValueError(f"SwiGLU layout must be 'interleaved' or 'split', got {layout!r}")
        self.layout = layout
        self.name = "swiglu" if layout == "interleaved" else "swiglu_split"

    def check(self, sizes, tensors, tile_n):
        half = sizes["n"] // 2
        if self.layout == "split" and half % (tile_n // 2):
            raise ValueError(f"split SwiGLU needs I = N/2 = {half} to be a multiple of {tile_n // 2}; "
                             "interleave the gate/up rows instead (SwiGLU('interleaved'))")

    @cute.jit
    def combine(self, state, gate, up):
        # silu(g) = g / (1 + 2^(-g log2 e)); exp2 -> inf for very negative g gives g * 0 = -0
        sig = cute.arch.rcp_approx(Float32(1.0) + cute.arch.exp2(gate * Float32(-_LOG2E)))
        return gate * sig * up
