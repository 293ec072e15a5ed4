"""Store steps: the last policy of every chain decides the dtype written to D."""

from __future__ import annotations

from epilogues.base import Policy
from epilogues.dsl import cutlass, cute


class StoreBF16(Policy):
    """Round to BF16 and store D (the plain GEMM output)."""

    kind = "store"
    out_dtype = "bf16"
    name = "bf16"

    @cute.jit
    def convert(self, state, frag):
        return frag.vals.load().to(cutlass.BFloat16)
