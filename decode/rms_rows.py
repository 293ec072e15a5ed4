"""RMSNorm row factor of the decode step: y[m] = bf16(x[m] * rsqrt(mean(x[m]^2) + eps)), one CTA per row.

The norm's gain is folded into the next projection's weights (futx.quant.fold), so only the row factor
is left; it runs between the residual epilogue that produced x and the projection that reads y. With `gain`
(the final norm before the LM head, whose gain is not folded: `engine.rms_rows.gain`) it is the reference's
RMSNorm, y = bf16(bf16(x * r) * g) with g bf16 [K] (futx.reference.rms_norm: the row rounded, then times the gain),
one kernel instead of the reference's chain of elementwise ones. Loads
are coalesced across the CTA (thread t reads elements t, t + 256, ...); the second pass re-reads x from
L1/L2 (a row is at most 32 KB). PDL: it signals its dependents at once (the next projection's weight
stream overlaps it) and waits for the previous kernel before reading x (docs/routing.md E1).
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

from .block_reduce import block_reduce

THREADS = 256
WARPS = THREADS // 32


class RmsRows:
    @cute.jit
    def __call__(self, x: cute.Tensor, y: cute.Tensor, eps: Float32, stream):
        self.kernel(x, y, None, eps).launch(grid=(x.shape[0], 1, 1), block=(THREADS, 1, 1), stream=stream,
                                            use_pdl=True)

    @cute.jit
    def with_gain(self, x: cute.Tensor, g: cute.Tensor, y: cute.Tensor, eps: Float32, stream):
        self.kernel(x, y, g, eps).launch(grid=(x.shape[0], 1, 1), block=(THREADS, 1, 1), stream=stream,
                                         use_pdl=True)

    @cute.kernel
    def kernel(self, x: cute.Tensor, y: cute.Tensor, g: Optional[cute.Tensor], eps: Float32):
        cute.arch.griddepcontrol_launch_dependents()   # the next projection may start streaming its weights
        cute.arch.griddepcontrol_wait()                # x is the previous kernel's output
        tid, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        k = x.shape[1]
        ss = Float32(0.0)
        for c in cutlass.range(tid, k, THREADS, unroll=4):
            v = x[row, c].to(Float32)
            ss = ss + v * v
        total = block_reduce(ss, lambda a, b: a + b, tid, WARPS)
        r = cute.math.rsqrt(total / Float32(k) + eps)
        for c in cutlass.range(tid, k, THREADS, unroll=4):
            v = (x[row, c].to(Float32) * r).to(BFloat16)
            if cutlass.const_expr(g is not None):
                v = (v.to(Float32) * g[c].to(Float32)).to(BFloat16)
            y[row, c] = v


def compile_target(gain: bool = False):
    """Registry factory: (jit callable, fake arguments) for bf16 rows [M, K] (M and K dynamic): (x, y, eps, stream),
    with `gain` (x, g [K], y, eps, stream)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    m, k = cute.sym_int(), cute.sym_int()
    x = make_fake_compact_tensor(BFloat16, (m, k), stride_order=(1, 0), assumed_align=16)
    y = make_fake_compact_tensor(BFloat16, (m, k), stride_order=(1, 0), assumed_align=16)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    if gain:
        g = make_fake_compact_tensor(BFloat16, (k,), stride_order=(0,), assumed_align=16)
        return RmsRows().with_gain, (x, g, y, Float32(1e-5), stream)
    return RmsRows(), (x, y, Float32(1e-5), stream)
