"""Per-row dynamic E4M3 quantization of BF16 activations, one CTA per row: the prefill block's glue between an
epilogue that stores BF16 and the next FP8 GEMM (futx.engine.prefill.quantize_rows defines it in torch):

    scale[m] = amax_m / 448 (IEEE division; 1 for an all-zero row),  q[m, k] = e4m3(x[m, k] / scale[m])

(E4M3 by cvt.rn.satfinite: round to nearest even, saturating to +-448, which equals the torch clamp + cast.)
Two passes over the row: the absolute maximum (warp shuffles, one shared-memory exchange), then the quantized
row; the second pass re-reads the row from L1/L2 (a row is at most 32 KB). Rows of a multiple of 8 values go 16
bytes per load and 8 per store (8 values per thread and step); other rows (K a multiple of 4) four values at a
time, element by element. The maximum is exact in any order, so both paths store the same bytes.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int64, Uint8

from decode import ptx
from decode.block_reduce import block_reduce

THREADS = 256
WARPS = THREADS // 32
E4M3_MAX = 448.0
VEC = 8          # bf16 values per 16-byte load


class RowQuantE4M3:
    @cute.jit
    def __call__(self, x: cute.Tensor, q: cute.Tensor, scale: cute.Tensor, stream):
        self.kernel(x, q, scale).launch(grid=(x.shape[0], 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, q: cute.Tensor, scale: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        k = x.shape[1]
        amax = Float32(0.0)
        x_row = x.iterator.toint() + Int64(row) * k * 2
        q_row = q.iterator.toint() + Int64(row) * k
        wide = k % VEC == 0
        if wide:
            for c in cutlass.range(tid * VEC, k, THREADS * VEC, unroll=2):
                for word in ptx.ldg_v4(x_row + c * 2):
                    lo, hi = ptx.bf16x2_to_f32(word)
                    amax = cute.arch.fmax(amax, cute.arch.fmax(cute.math.absf(lo), cute.math.absf(hi)))
        else:
            for c in cutlass.range(tid, k, THREADS, unroll=4):
                amax = cute.arch.fmax(amax, cute.math.absf(x[row, c].to(Float32)))
        total = block_reduce(amax, cute.arch.fmax, tid, WARPS)
        sc = cutlass.select_(total > Float32(0.0), ptx.div_rn(total, Float32(E4M3_MAX)), Float32(1.0))
        if tid == 0:
            scale[row] = sc
        if wide:
            for c in cutlass.range(tid * VEC, k, THREADS * VEC, unroll=2):
                v = []
                for word in ptx.ldg_v4(x_row + c * 2):
                    lo, hi = ptx.bf16x2_to_f32(word)
                    v += [ptx.div_rn(lo, sc), ptx.div_rn(hi, sc)]
                ptx.stg_b32x2(q_row + c, ptx.f32x4_to_e4m3x4(*v[:4]), ptx.f32x4_to_e4m3x4(*v[4:]))
        else:
            for c in cutlass.range(tid * 4, k, THREADS * 4, unroll=2):
                v = [ptx.div_rn(x[row, c + i].to(Float32), sc) for i in range(4)]
                word = ptx.f32x4_to_e4m3x4(v[0], v[1], v[2], v[3])
                for i in cutlass.range_constexpr(4):
                    q[row, c + i] = Uint8((word >> (8 * i)) & 0xFF)


def compile_target():
    """Registry factory: (jit callable, fake arguments) for bf16 rows [M, K] -> uint8 (E4M3 bits) [M, K] and
    float32 scales [M] (M and K dynamic)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    m, k = cute.sym_int(), cute.sym_int()
    x = make_fake_compact_tensor(BFloat16, (m, k), stride_order=(1, 0), assumed_align=16)
    q = make_fake_compact_tensor(Uint8, (m, k), stride_order=(1, 0), assumed_align=16)
    s = make_fake_compact_tensor(Float32, (m,), assumed_align=4)
    return RowQuantE4M3(), (x, q, s, make_fake_stream(use_tvm_ffi_env_stream=True))
