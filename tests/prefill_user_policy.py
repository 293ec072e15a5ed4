"""The worked example of README.md and epilogues/README.md, verbatim: a user-written policy (bias add)
and its chain. tests/test_prefill_cpu.py builds it (`futx build --chain`) and checks its keys;
tests/test_prefill_gpu.py runs it."""

from typing import Any, NamedTuple

from epilogues.base import Arg, Chain, Policy
from epilogues.dsl import cute, cutlass      # the DSL's names; importable without it (AOT-only machines)
from epilogues.scale import ScaleRestore
from epilogues.store import StoreBF16


class BiasState(NamedTuple):
    ctx: Any                                      # the kernel's context (clamps, coordinates, sizes)
    bias: Any                                     # the bias tensor


class BiasAdd(Policy):
    kind = "map"                                  # elementwise, in registers
    name = "bias"
    args = (Arg("bias", "f32", ("n",)),)          # one FP32 per GEMM column, passed as bias=...

    def setup(self, ctx, bias):                   # once per thread, before the tile loop
        return BiasState(ctx, bias)

    @cute.jit
    def visit(self, state, frag):                 # every subtile: 16-32 values of this thread
        for i in cutlass.range_constexpr(frag.size):
            _, col = frag.coord(i)                # global column of value i
            frag.vals[i] = frag.vals[i] + state.bias[state.ctx.col_clamp(col)]


def scale_bias_bf16() -> Chain:
    return Chain(ScaleRestore(), BiasAdd(), StoreBF16())
