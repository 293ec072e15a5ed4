"""A deliberately tiny kernel (y = alpha * x + y over a flat bf16 tensor) that exercises the whole
runtime path — registry, CPU compile, export, link, AOT load, JIT, CUDA-graph capture, host overhead —
without depending on any real kernel family."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

THREADS = 256


@cute.kernel
def _axpy_kernel(x: cute.Tensor, y: cute.Tensor, alpha: cutlass.Float32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * THREADS + tidx
    if i < x.shape[0]:
        y[i] = (alpha * x[i].to(cutlass.Float32) + y[i].to(cutlass.Float32)).to(y.element_type)


@cute.jit
def _axpy(x: cute.Tensor, y: cute.Tensor, alpha: cutlass.Float32, stream):
    n = x.shape[0]
    _axpy_kernel(x, y, alpha).launch(grid=((n + THREADS - 1) // THREADS, 1, 1), block=(THREADS, 1, 1),
                                     stream=stream)


def compile_target(dtype: str = "bf16"):
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    element = {"bf16": cutlass.BFloat16, "f32": cutlass.Float32}[dtype]
    n = cute.sym_int()
    x = make_fake_compact_tensor(element, (n,), assumed_align=16)
    y = make_fake_compact_tensor(element, (n,), assumed_align=16)
    return _axpy, (x, y, cutlass.Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True))
