"""Thin inline-PTX wrappers for the decode kernels: exactly the instructions we want, nothing implicit.

Addresses are plain integers: Int64 for global memory, Int32 (shared-window offsets from `smem_addr`)
for shared memory. Arithmetic wrappers are side-effect free (LLVM may CSE and schedule them). Loads are marked as having
side effects so that LLVM keeps them where the kernel issues them: weight prefetches must stay ahead of
the work that hides their latency, and shared loads after the barrier that publishes their data.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _struct(n: int, ty: str = "i32") -> ir.Type:
    return ir.Type.parse("!llvm.struct<(" + ", ".join([ty] * n) + ")>")


def _i32(x, loc, ip):
    return Int32(x).ir_value(loc=loc, ip=ip)


def _unpack(res, n, ty, wrap, loc, ip):
    return tuple(wrap(llvm.extractvalue(ty, res, [i], loc=loc, ip=ip)) for i in range(n))


def _asm(ret, args, text, cons, side_effects=False, loc=None, ip=None):
    return llvm.inline_asm(ret, args, text, cons, has_side_effects=side_effects, loc=loc, ip=ip)


# ---- global memory -----------------------------------------------------------------------------
@dsl_user_op
def ldg_stream_v4(addr: Int64, pred, *, loc=None, ip=None) -> tuple:
    """16 bytes of streamed weights, skipped when `pred` is 0 (registers then hold garbage).

    Not kept in L1, full 256-byte L2 sector fetch. `.relaxed.gpu` (a strong load) rather than `.nc`:
    ptxas keeps strong loads where they are issued instead of sinking register prefetches next to
    their use, which would serialize the memory latency with the math."""
    res = _asm(_struct(4), [Int64(addr).ir_value(loc=loc, ip=ip), _i32(pred, loc, ip)],
               "{.reg .pred p; setp.ne.b32 p, $5, 0; "
               "@p ld.relaxed.gpu.global.L1::no_allocate.L2::256B.v4.u32 {$0, $1, $2, $3}, [$4];}",
               "=r,=r,=r,=r,l,r", True, loc, ip)
    return _unpack(res, 4, T.i32(), Int32, loc, ip)


@dsl_user_op
def ldg_f16_to_f32(addr: Int64, pred, *, loc=None, ip=None) -> Float32:
    """One float16 (a group scale) widened to float32; 0 when `pred` is 0. The conversion waits for the
    load where it is issued (see `ldg_u16`); kept for the measured run-1/run-2 designs."""
    res = _asm(T.f32(), [Int64(addr).ir_value(loc=loc, ip=ip), _i32(pred, loc, ip)],
               "{.reg .b16 h; .reg .pred p; setp.ne.b32 p, $2, 0; mov.b16 h, 0; "
               "@p ld.relaxed.gpu.global.b16 h, [$1]; cvt.f32.f16 $0, h;}", "=f,l,r", True, loc, ip)
    return Float32(res)


@dsl_user_op
def ldg_u16(addr: Int64, pred, *, loc=None, ip=None) -> Int32:
    """One 16-bit value (a float16 group scale) as raw bits in a 32-bit register; 0 when `pred` is 0.

    The conversion is left to the consumer (`h16_to_f32`): a conversion inside the load's own asm makes
    ptxas wait for the load in the block that issues it, i.e. a register prefetch would stall the warp
    for a full memory latency at the step that requests it (the INT4 regression of the 2026-11-30 run)."""
    res = _asm(T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip), _i32(pred, loc, ip)],
               "{.reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; "
               "@p ld.relaxed.gpu.global.u16 $0, [$1];}", "=r,l,r", True, loc, ip)
    return Int32(res)


@dsl_user_op
def h16_to_f32(bits: Int32, *, loc=None, ip=None) -> Float32:
    """float16 in the low half of a 32-bit register -> float32 (exact)."""
    res = _asm(T.f32(), [_i32(bits, loc, ip)],
               "{.reg .b16 lo, hi; mov.b32 {lo, hi}, $1; cvt.f32.f16 $0, lo;}", "=f,r", loc=loc, ip=ip)
    return Float32(res)


@dsl_user_op
def ldg_f32(addr: Int64, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.global.nc.f32 $0, [$1];",
                        "=f,l", loc=loc, ip=ip))


@dsl_user_op
def ldg_bf16_to_f32(addr: Int64, *, loc=None, ip=None) -> Float32:
    """One bfloat16 (a residual) widened to float32 (exact: bf16 is the top half of a float32)."""
    res = _asm(T.f32(), [Int64(addr).ir_value(loc=loc, ip=ip)],
               "{.reg .b16 h; ld.global.b16 h, [$1]; cvt.f32.bf16 $0, h;}", "=f,l", loc=loc, ip=ip)
    return Float32(res)


@dsl_user_op
def stg_bf16(addr: Int64, v: Float32, *, loc=None, ip=None) -> None:
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Float32(v).ir_value(loc=loc, ip=ip)],
         "{.reg .b16 h; cvt.rn.bf16.f32 h, $1; st.global.b16 [$0], h;}", "l,f", True, loc, ip)


@dsl_user_op
def stg_f32x2(addr: Int64, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Float32(a).ir_value(loc=loc, ip=ip),
                    Float32(b).ir_value(loc=loc, ip=ip)],
         "st.global.cg.v2.f32 [$0], {$1, $2};", "l,f,f", True, loc, ip)


@dsl_user_op
def ldg_cg_f32x2(addr: Int64, *, loc=None, ip=None) -> tuple:
    """Split-K partials written by other CTAs: bypass L1 (.cg) so we see their stores."""
    res = _asm(_struct(2, "f32"), [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.global.cg.v2.f32 {$0, $1}, [$2];",
               "=f,=f,l", True, loc, ip)
    return _unpack(res, 2, T.f32(), Float32, loc, ip)


# ---- shared memory -----------------------------------------------------------------------------
@dsl_user_op
def smem_addr(ptr, *, loc=None, ip=None) -> Int32:
    """32-bit shared-window address of a shared-memory cute pointer."""
    return Int32(ptr.toint(loc=loc, ip=ip))


@dsl_user_op
def cp_async_16(saddr: Int32, gaddr: Int64, *, loc=None, ip=None) -> None:
    """16-byte global -> shared asynchronous copy, L1 bypassed."""
    _asm(None, [_i32(saddr, loc, ip), Int64(gaddr).ir_value(loc=loc, ip=ip)],
         "cp.async.cg.shared.global [$0], [$1], 16;", "r,l", True, loc, ip)


@dsl_user_op
def lds_v4(saddr: Int32, *, loc=None, ip=None) -> tuple:
    # Side effects on: the read must stay after the barrier that publishes the data.
    res = _asm(_struct(4), [_i32(saddr, loc, ip)], "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];",
               "=r,=r,=r,=r,r", True, loc, ip)
    return _unpack(res, 4, T.i32(), Int32, loc, ip)


@dsl_user_op
def ldsm_x4(saddr: Int32, *, loc=None, ip=None) -> tuple:
    """ldmatrix .x4: lane 8i+r gives the address of row r of matrix i; register i of lane 4g+t
    receives (row g, columns 2t, 2t+1) of matrix i."""
    res = _asm(_struct(4), [_i32(saddr, loc, ip)],
               "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];",
               "=r,=r,=r,=r,r", True, loc, ip)
    return _unpack(res, 4, T.i32(), Int32, loc, ip)


@dsl_user_op
def lds_f16_to_f32(saddr: Int32, *, loc=None, ip=None) -> Float32:
    res = _asm(T.f32(), [_i32(saddr, loc, ip)], "{.reg .b16 h; ld.shared.b16 h, [$1]; cvt.f32.f16 $0, h;}",
               "=f,r", True, loc, ip)
    return Float32(res)


@dsl_user_op
def sts_f32(saddr: Int32, v: Float32, *, loc=None, ip=None) -> None:
    _asm(None, [_i32(saddr, loc, ip), Float32(v).ir_value(loc=loc, ip=ip)], "st.shared.f32 [$0], $1;",
         "r,f", True, loc, ip)


@dsl_user_op
def lds_f32(saddr: Int32, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [_i32(saddr, loc, ip)], "ld.shared.f32 $0, [$1];", "=f,r", True, loc, ip))


@dsl_user_op
def sts_f32x2(saddr: Int32, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    _asm(None, [_i32(saddr, loc, ip), Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
         "st.shared.v2.f32 [$0], {$1, $2};", "r,f,f", True, loc, ip)


@dsl_user_op
def lds_f32x2(saddr: Int32, *, loc=None, ip=None) -> tuple:
    res = _asm(_struct(2, "f32"), [_i32(saddr, loc, ip)], "ld.shared.v2.f32 {$0, $1}, [$2];", "=f,=f,r", True,
               loc, ip)
    return _unpack(res, 2, T.f32(), Float32, loc, ip)


@dsl_user_op
def lds_bf16_to_f32(saddr: Int32, *, loc=None, ip=None) -> Float32:
    res = _asm(T.f32(), [_i32(saddr, loc, ip)], "{.reg .b16 h; ld.shared.b16 h, [$1]; cvt.f32.bf16 $0, h;}",
               "=f,r", True, loc, ip)
    return Float32(res)


@dsl_user_op
def bar_sync(barrier_id: int, threads, *, loc=None, ip=None) -> None:
    """Named CTA barrier over `threads` threads, non-`.aligned`: warps may reach it from different
    (unrolled) instructions, as long as each warp arrives as a whole."""
    _asm(None, [_i32(threads, loc, ip)], f"barrier.sync {barrier_id}, $0;", "r", True, loc, ip)


# ---- arithmetic --------------------------------------------------------------------------------
@dsl_user_op
def lop3(a: Int32, b: Int32, c: Int32, lut: int, *, loc=None, ip=None) -> Int32:
    """Any 3-input bitwise function; `lut` is f(0xF0, 0xCC, 0xAA)."""
    return Int32(_asm(T.i32(), [_i32(a, loc, ip), _i32(b, loc, ip), _i32(c, loc, ip)],
                      f"lop3.b32 $0, $1, $2, $3, {lut & 0xFF};", "=r,r,r,r", loc=loc, ip=ip))


@dsl_user_op
def prmt(a: Int32, b: Int32, selector: int, *, loc=None, ip=None) -> Int32:
    """Byte permute of {b:a} with an immediate selector."""
    return Int32(_asm(T.i32(), [_i32(a, loc, ip), _i32(b, loc, ip)], f"prmt.b32 $0, $1, $2, {selector:#x};",
                      "=r,r,r", loc=loc, ip=ip))


@dsl_user_op
def fma_bf16x2(a: Int32, b: Int32, c: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [_i32(a, loc, ip), _i32(b, loc, ip), _i32(c, loc, ip)],
                      "fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", loc=loc, ip=ip))


@dsl_user_op
def mul_bf16x2(a: Int32, b: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [_i32(a, loc, ip), _i32(b, loc, ip)], "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r",
                      loc=loc, ip=ip))


def imm(value: int) -> Int32:
    """A 32-bit immediate operand (bit pattern; values >= 2^31 wrap to negative Int32)."""
    v = value & 0xFFFFFFFF
    return Int32(v - (1 << 32) if v >= 1 << 31 else v)


@dsl_user_op
def const_b32(value: int, *, loc=None, ip=None) -> Int32:
    """A 32-bit constant kept in a register (packed bf16 operands have no immediate form)."""
    v = value & 0xFFFFFFFF
    return Int32(_asm(T.i32(), [], f"mov.b32 $0, {v:#x};", "=r", loc=loc, ip=ip))


@dsl_user_op
def mma_bf16_16816(a: tuple, b: tuple, c: tuple, *, loc=None, ip=None) -> tuple:
    """D = A * B + C for mma.sync m16n8k16, bf16 inputs, float32 accumulators (row.col)."""
    ops = [_i32(x, loc, ip) for x in a] + [_i32(x, loc, ip) for x in b]
    ops += [Float32(x).ir_value(loc=loc, ip=ip) for x in c]
    res = _asm(_struct(4, "f32"), ops,
               "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
               "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
               "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", loc=loc, ip=ip)
    return _unpack(res, 4, T.f32(), Float32, loc, ip)


@dsl_user_op
def shfl_xor_f32(v: Float32, mask: int, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [Float32(v).ir_value(loc=loc, ip=ip)],
                        f"shfl.sync.bfly.b32 $0, $1, {mask}, 0x1f, 0xffffffff;", "=f,f", True, loc, ip))
