"""The worked example of epilogues/README.md, verbatim: a user-written policy (bias add) and its chain.
tests/test_prefill_cpu.py compiles it through `register_policy`; tests/test_prefill_gpu.py runs it."""

import cutlass
import cutlass.cute as cute

from epilogues.base import Arg, Chain, Policy
from epilogues.scale import ScaleRestore
from epilogues.store import StoreBF16


class BiasAdd(Policy):
    kind = "map"                                  # elementwise, in registers
    name = "bias"
    args = (Arg("bias", "f32", ("n",)),)          # one FP32 per GEMM column, passed as bias=...

    def setup(self, ctx, bias):                   # once per thread, before the tile loop
        return ctx, bias

    @cute.jit
    def visit(self, state, frag):                 # every subtile: 16-32 values of this thread
        ctx, bias = state
        for i in cutlass.range_constexpr(frag.size):
            _, col = frag.coord(i)                # global column of value i
            frag.vals[i] = frag.vals[i] + bias[ctx.col_clamp(col)]


def scale_bias_bf16() -> Chain:
    return Chain(ScaleRestore(), BiasAdd(), StoreBF16())
