"""Greedy argmax of the decode step's logits: out[m] = the first index of the largest of x[m, :V] (torch.argmax's
answer: ties to the lowest index, a NaN counts as the largest value), in one launch of many CTAs per row.

torch's argmax reduces a 128k-wide row with a few CTAs and takes ~28 µs a step (H100 and H200 timelines), ten
times the time of reading the row. Here each CTA takes CHUNK consecutive elements of a row (one 16-byte load per
thread, through L2: the logits were written by the LM head while this kernel waited), reduces them to one
(value, index) pair, writes it to the row's partials and counts itself on the row's counter; the last CTA of the
row to arrive reduces the partials and writes the index (decode/split_arrival.py: it also resets the counter).
The pair order is total (NaN above every number, then value, then the lower index), so any reduction order gives
torch's answer. PDL: it releases its dependents at once and waits for the LM head before reading the logits.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory as cmem
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from . import ptx, split_arrival
from .argmax_plan import CHUNK, NO_INDEX, THREADS, VEC

WARPS = THREADS // 32


@dsl_user_op
def _ldg_cg_v4(addr: Int64, *, loc=None, ip=None) -> tuple:
    """16 bytes through L2 only: data the previous kernel wrote while this one was resident (PDL)."""
    res = llvm.inline_asm(ptx._struct(4), [Int64(addr).ir_value(loc=loc, ip=ip)],
                          "ld.global.cg.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", has_side_effects=True,
                          loc=loc, ip=ip)
    return ptx._unpack(res, 4, T.i32(), Int32, loc, ip)


@dsl_user_op
def _bf16x2_to_f32(word: Int32, *, loc=None, ip=None) -> tuple:
    """The two bf16 of a 32-bit word (low half first) as float32 (exact)."""
    res = llvm.inline_asm(ptx._struct(2, "f32"), [Int32(word).ir_value(loc=loc, ip=ip)],
                          "{.reg .b32 a, b; shl.b32 a, $2, 16; and.b32 b, $2, 0xffff0000; mov.b32 $0, a; "
                          "mov.b32 $1, b;}", "=f,=f,r", loc=loc, ip=ip)
    return ptx._unpack(res, 2, T.f32(), Float32, loc, ip)


@cute.jit
def better(v: Float32, i: Int32, bv: Float32, bi: Int32) -> Int32:
    """1 if the pair (v, i) ranks above (bv, bi): a NaN above every number (NaNs equal), then the larger value,
    then the lower index."""
    nan = cutlass.select_(v != v, 1, 0)
    bnan = cutlass.select_(bv != bv, 1, 0)
    lower = cutlass.select_(i < bi, 1, 0)
    by_value = cutlass.select_(v > bv, 1, cutlass.select_(v == bv, lower, 0))
    return cutlass.select_(nan > bnan, 1, cutlass.select_(nan < bnan, 0, cutlass.select_(nan == 1, lower,
                                                                                           by_value)))


@cute.jit
def _take(v, i, bv, bi):
    b = better(v, i, bv, bi)
    return cutlass.select_(b != 0, v, bv), cutlass.select_(b != 0, i, bi)


@cute.jit
def block_best(v: Float32, i: Int32, tid, sv, si):
    """The best pair over the CTA's threads (warp butterflies, then the warps' pairs through shared memory sv / si
    [WARPS]); every thread gets it."""
    for s in (16, 8, 4, 2, 1):
        v, i = _take(cute.arch.shuffle_sync_bfly(v, offset=s), cute.arch.shuffle_sync_bfly(i, offset=s), v, i)
    if tid % 32 == 0:
        sv[tid // 32] = v
        si[tid // 32] = i
    cute.arch.sync_threads()
    bv, bi = sv[0], si[0]
    for w in cutlass.range_constexpr(1, WARPS):
        bv, bi = _take(sv[w], si[w], bv, bi)
    return bv, bi


class ArgmaxRows:
    @cute.jit
    def __call__(self, x: cute.Tensor, out: cute.Tensor, partials: cute.Tensor, counters: cute.Tensor, stream):
        nb = (x.shape[1] + CHUNK - 1) // CHUNK
        self.kernel(x, out, partials, counters).launch(grid=(nb, x.shape[0], 1), block=(THREADS, 1, 1),
                                                       stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, x: cute.Tensor, out: cute.Tensor, partials: cute.Tensor, counters: cute.Tensor):
        cute.arch.griddepcontrol_launch_dependents()
        tid, _, _ = cute.arch.thread_idx()
        blk, row, _ = cute.arch.block_idx()
        nb, _, _ = cute.arch.grid_dim()
        smem = cmem.SmemAllocator()
        sv = smem.allocate_tensor(Float32, cute.make_layout((WARPS,)), byte_alignment=16)
        si = smem.allocate_tensor(Int32, cute.make_layout((WARPS,)), byte_alignment=16)
        flag = smem.allocate_tensor(Int32, cute.make_layout((1,)), byte_alignment=16)
        vocab = x.shape[1]
        first = blk * CHUNK + tid * VEC
        bv, bi = Float32(-float("inf")), Int32(NO_INDEX)
        cute.arch.griddepcontrol_wait()   # the logits are the previous kernel's output
        if first < vocab:                 # vocab % VEC == 0 (the op checks): a load is all in or all out
            words = _ldg_cg_v4(x.iterator.toint() + (Int64(row) * x.stride[0] + first) * 2)
            for w in cutlass.range_constexpr(VEC // 2):
                lo, hi = _bf16x2_to_f32(words[w])
                bv, bi = _take(lo, first + 2 * w, bv, bi)
                bv, bi = _take(hi, first + 2 * w + 1, bv, bi)
        bv, bi = block_best(bv, bi, tid, sv, si)
        base = partials.iterator.toint() + Int64(row) * nb * 8
        if tid == 0:
            ptx.stg_f32x2(base + Int64(blk) * 8, bv, Int32(bi).to(Float32))   # indices < 2^24: exact as float32
            cute.arch.fence_acq_rel_gpu()
            flag[0] = split_arrival.arrive(counters.iterator + row, nb)
        cute.arch.sync_threads()
        if flag[0] != 0:
            cute.arch.fence_acq_rel_gpu()
            bv, bi = Float32(-float("inf")), Int32(NO_INDEX)
            for b in cutlass.range(tid, nb, THREADS, unroll=1):
                v, fi = ptx.ldg_cg_f32x2(base + Int64(b) * 8)
                bv, bi = _take(v, fi.to(Int32), bv, bi)
            cute.arch.sync_threads()   # sv / si are reused
            bv, bi = block_best(bv, bi, tid, sv, si)
            if tid == 0:
                ptx.stg_i64(out.iterator.toint() + Int64(row) * 8, Int64(bi))


def compile_target():
    """Registry factory: (jit callable, fake arguments) for (x bf16 [M, V] with row stride S (V, S multiples of
    8), out int64 [M], partials float32 [M * argmax_plan.blocks_per_row(V) * 2], counters int32 [>= M] (zero),
    stream)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    m, v, s = cute.sym_int(), cute.sym_int(divisibility=VEC), cute.sym_int(divisibility=VEC)
    x = make_fake_tensor(cutlass.BFloat16, (m, v), (s, 1), assumed_align=16)
    out = make_fake_compact_tensor(Int64, (m,), assumed_align=8)
    partials = make_fake_compact_tensor(Float32, (cute.sym_int(),), assumed_align=8)
    counters = make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return ArgmaxRows(), (x, out, partials, counters, stream)
