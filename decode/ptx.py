"""Thin inline-PTX wrappers for the decode kernels (projections and attention): exactly the instructions we
want, nothing implicit.

Addresses are plain integers: Int64 for global memory, Int32 (shared-window offsets from `smem_addr` or
`ptr.toint()`) for shared memory. Arithmetic wrappers are side-effect free (LLVM may CSE and schedule them).
Memory instructions are marked as having side effects so that LLVM keeps them where the kernel issues them:
weight prefetches must stay ahead of the work that hides their latency, shared loads after the barrier
(or async-copy wait) that publishes their data.
"""

from __future__ import annotations

from enum import IntEnum

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


class Barrier(IntEnum):
    """Named CTA barrier ids of the decode kernels (0 is __syncthreads)."""

    GEMV_ROUND = 1  # decode/gemv.py: the warps of a round meet before its epilogue
    WS_CONSUMERS = 2  # decode/skinny_ws.py: the consumer warpgroups' split-K exchange (the producer has left)
    PERSISTENT_CONSUMERS = 3  # decode/persistent_ring.py: the consumer warps (the producer warp runs ahead)


def _struct(n: int, ty: str = "i32") -> ir.Type:
    return ir.Type.parse("!llvm.struct<(" + ", ".join([ty] * n) + ")>")


def _i32(x, loc, ip):
    return Int32(x).ir_value(loc=loc, ip=ip)


def _u32(x, loc, ip):
    return Uint32(x).ir_value(loc=loc, ip=ip)


def _f32(x, loc, ip):
    return Float32(x).ir_value(loc=loc, ip=ip)


def _unpack(res, n, ty, wrap, loc, ip):
    return tuple(wrap(llvm.extractvalue(ty, res, [i], loc=loc, ip=ip)) for i in range(n))


def _asm(ret, args, text, cons, side_effects=False, loc=None, ip=None):
    return llvm.inline_asm(ret, args, text, cons, has_side_effects=side_effects, loc=loc, ip=ip)


@dsl_user_op
def opaque_i32(x, *, loc=None, ip=None) -> Int32:
    """x through an inline-asm move the compiler cannot see through nor hoist: values derived from it stay where
    they are computed (the persistent kernel's task loop, where hoisting every task body's invariants out of the
    loop keeps them all live at once)."""
    return Int32(_asm(T.i32(), [_i32(x, loc, ip)], "mov.b32 $0, $1;", "=r,r", True, loc, ip))


# ---- global memory --------------------------------------------------------------------------------------
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
    load where it is issued (see `ldg_u16`): the tile GEMV's "batch" pipeline, whose loop-carried copy waits
    for the next batch at the loop end anyway, and the GEMV's tuning variant `r2` (stream.load_unit)."""
    res = _asm(T.f32(), [Int64(addr).ir_value(loc=loc, ip=ip), _i32(pred, loc, ip)],
               "{.reg .b16 h; .reg .pred p; setp.ne.b32 p, $2, 0; mov.b16 h, 0; "
               "@p ld.relaxed.gpu.global.b16 h, [$1]; cvt.f32.f16 $0, h;}", "=f,l,r", True, loc, ip)
    return Float32(res)


@dsl_user_op
def ldg_u16(addr: Int64, pred, *, loc=None, ip=None) -> Int32:
    """One 16-bit value (a float16 group scale) as raw bits in a 32-bit register; 0 when `pred` is 0.

    The conversion is left to the consumer (`h16_to_f32`): a conversion inside the load's own asm makes
    ptxas wait for the load in the block that issues it, i.e. a register prefetch would stall the warp
    for a full memory latency at the step that requests it (measured: docs/routing.md P4, `r2`)."""
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
def ldg_v4(addr: Int64, *, loc=None, ip=None) -> tuple:
    """16 bytes through L1 (read again soon: a row kernel's second pass)."""
    res = _asm(_struct(4), [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.global.v4.u32 {$0, $1, $2, $3}, [$4];",
               "=r,=r,=r,=r,l", True, loc, ip)
    return _unpack(res, 4, T.i32(), Int32, loc, ip)


@dsl_user_op
def stg_b32x2(addr: Int64, a, b, *, loc=None, ip=None) -> None:
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), _u32(a, loc, ip), _u32(b, loc, ip)],
         "st.global.v2.b32 [$0], {$1, $2};", "l,r,r", True, loc, ip)


@dsl_user_op
def ldg_bf16_to_f32(addr: Int64, *, loc=None, ip=None) -> Float32:
    """One bfloat16 (a residual) widened to float32 (exact: bf16 is the top half of a float32)."""
    res = _asm(T.f32(), [Int64(addr).ir_value(loc=loc, ip=ip)],
               "{.reg .b16 h; ld.global.b16 h, [$1]; cvt.f32.bf16 $0, h;}", "=f,l", loc=loc, ip=ip)
    return Float32(res)


@dsl_user_op
def globaltimer(*, loc=None, ip=None) -> Int64:
    """The GPU's global nanosecond timer (the same clock on every SM; a task trace's timestamps)."""
    return Int64(_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l", True, loc, ip))


@dsl_user_op
def stg_i64(addr: Int64, v: Int64, *, loc=None, ip=None) -> None:
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Int64(v).ir_value(loc=loc, ip=ip)],
         "st.global.b64 [$0], $1;", "l,l", True, loc, ip)


@dsl_user_op
def ldg_cg_bf16_to_f32(addr: Int64, *, loc=None, ip=None) -> Float32:
    """ldg_bf16_to_f32 through L2 and kept in program order (a residual another CTA wrote during this launch, read
    after the wait that orders it: decode/persistent_ring.py)."""
    res = _asm(T.f32(), [Int64(addr).ir_value(loc=loc, ip=ip)],
               "{.reg .b16 h; ld.global.cg.b16 h, [$1]; cvt.f32.bf16 $0, h;}", "=f,l", True, loc, ip)
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


@dsl_user_op
def stg_cg_f32x4(addr: Int64, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> None:
    """16 bytes of a split-K partial, kept in L2 (.cg) for the CTA that reduces them."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)] + [Float32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c, d)],
         "st.global.cg.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f", True, loc, ip)


@dsl_user_op
def ldg_cg_f32x4(addr: Int64, *, loc=None, ip=None) -> tuple:
    """16 bytes of split-K partials written by other CTAs during this launch: L2 only (L1 is not coherent)."""
    res = _asm(_struct(4, "f32"), [Int64(addr).ir_value(loc=loc, ip=ip)],
               "ld.global.cg.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l", True, loc, ip)
    return _unpack(res, 4, T.f32(), Float32, loc, ip)


# ---- shared memory --------------------------------------------------------------------------------------
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
def cp_async_stream_16(saddr: Int32, gaddr: Int64, pred, *, loc=None, ip=None) -> None:
    """16 bytes of streamed weights global -> shared (L1 bypassed, 256-byte L2 sector fetch), skipped when
    `pred` is 0 (the shared bytes then keep what they held)."""
    _asm(None, [_i32(saddr, loc, ip), Int64(gaddr).ir_value(loc=loc, ip=ip), _i32(pred, loc, ip)],
         "{.reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.cg.shared.global.L2::256B [$0], [$1], 16;}",
         "r,l,r", True, loc, ip)


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
def bar_sync(barrier_id: Barrier, threads, *, loc=None, ip=None) -> None:
    """Named CTA barrier over `threads` threads, non-`.aligned`: warps may reach it from different
    (unrolled) instructions, as long as each warp arrives as a whole."""
    _asm(None, [_i32(threads, loc, ip)], f"barrier.sync {int(barrier_id)}, $0;", "r", True, loc, ip)


# ---- thread-block cluster: distributed shared memory (decode/skinny.py's cluster split-K) ---------------
@dsl_user_op
def mapa(saddr: Int32, rank, *, loc=None, ip=None) -> Int32:
    """The shared::cluster address of this CTA's shared offset `saddr` in the cluster's CTA `rank`."""
    return Int32(_asm(T.i32(), [_i32(saddr, loc, ip), _i32(rank, loc, ip)], "mapa.shared::cluster.u32 $0, $1, $2;",
                      "=r,r,r", False, loc, ip))


@dsl_user_op
def ld_cluster_f32x4(caddr: Int32, *, loc=None, ip=None) -> tuple:
    """Four float32 at a shared::cluster address (`mapa`): a peer CTA's shared memory, after a cluster barrier."""
    res = _asm(_struct(4, "f32"), [_i32(caddr, loc, ip)], "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [$4];",
               "=f,=f,=f,=f,r", True, loc, ip)
    return _unpack(res, 4, T.f32(), Float32, loc, ip)


@dsl_user_op
def sts_f32x4(saddr: Int32, a, b, c, d, *, loc=None, ip=None) -> None:
    _asm(None, [_i32(saddr, loc, ip)] + [Float32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c, d)],
         "st.shared.v4.f32 [$0], {$1, $2, $3, $4};", "r,f,f,f,f", True, loc, ip)


# ---- arithmetic -----------------------------------------------------------------------------------------
@dsl_user_op
def lop3(a: Int32, b: Int32, c: Int32, lut: int, *, loc=None, ip=None) -> Int32:
    """Any 3-input bitwise function; `lut` is f(0xF0, 0xCC, 0xAA)."""
    return Int32(_asm(T.i32(), [_i32(a, loc, ip), _i32(b, loc, ip), _i32(c, loc, ip)],
                      f"lop3.b32 $0, $1, $2, $3, {lut & 0xFF};", "=r,r,r,r", loc=loc, ip=ip))


@dsl_user_op
def prmt(a, b, selector: int, dtype=Int32, *, loc=None, ip=None):
    """Byte permute of {b:a} (a = bytes 0-3) with an immediate selector, as `dtype` (Int32 or Uint32)."""
    return dtype(_asm(T.i32(), [dtype(a).ir_value(loc=loc, ip=ip), dtype(b).ir_value(loc=loc, ip=ip)],
                      f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r", loc=loc, ip=ip))


@dsl_user_op
def prmt_r(a, b, selector, *, loc=None, ip=None) -> Int32:
    """Byte permute of {b:a} with a selector in a register (a lane-dependent permutation): byte i of the result is
    byte (selector >> 4i) & 7 of {b:a} (selector bit 4i + 3 clear)."""
    return Int32(_asm(T.i32(), [_i32(a, loc, ip), _i32(b, loc, ip), _i32(selector, loc, ip)],
                      "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", loc=loc, ip=ip))


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
def const_b32(value: int, dtype=Int32, *, loc=None, ip=None):
    """A 32-bit constant kept in a register, as `dtype` (Int32 or Uint32). Opaque to LLVM, so it is
    materialized once instead of folded: packed operands have no immediate form, and SASS LOP3 / HFMA2
    take at most one immediate, so a constant written inside each asm would be re-moved on every use."""
    v = value & 0xFFFFFFFF
    return dtype(_asm(T.i32(), [], f"mov.b32 $0, {v:#x};", "=r", loc=loc, ip=ip))


@dsl_user_op
def shfl_xor_f32(v: Float32, mask: int, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [Float32(v).ir_value(loc=loc, ip=ip)],
                        f"shfl.sync.bfly.b32 $0, $1, {mask}, 0x1f, 0xffffffff;", "=f,f", True, loc, ip))


# ---- tensor cores ---------------------------------------------------------------------------------------
@dsl_user_op
def mma_16816(a, b, c, kind: str = "f16", *, loc=None, ip=None):
    """D = A (16x16) * B (16x8) + C with f32 accumulation; a: 4 regs, b: 2 regs, c: 4 floats.

    kind "f16" or "bf16" names the operand type of A and B (packed pairs, low half first)."""
    res = _asm(llvm.StructType.get_literal([T.f32()] * 4),
               [_u32(x, loc, ip) for x in (*a, *b)] + [_f32(x, loc, ip) for x in c],
               f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
               "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
               "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", False, loc, ip)
    return _unpack(res, 4, T.f32(), Float32, loc, ip)


# ---- warpgroup MMA (decode/skinny_wgmma.py) ---------------------------------------------------------------
# wgmma.mma_async with A in registers: warp w of the warpgroup holds rows 16w .. 16w + 15 of the 64-row A tile
# in the m16n8k16 A-fragment order (a0: row g, k 2t..2t+1; a1: row g + 8; a2, a3: k + 8), and D row 16w + g /
# + 8 in the m16n8 C-fragment order of each 8-column chunk j: d[4j], d[4j+1] = row g, columns 8j + 2t, + 1;
# d[4j+2], d[4j+3] = row g + 8. B is read from shared memory through a matrix descriptor.
GMMA_CORE_BYTES = 128   # one 8 x 16-byte core matrix, stored contiguously (no swizzle)


GMMA_SWIZZLE_128B = 1  # descriptor layout type of a K-major tile in the 128-byte swizzle (TMA's SWIZZLE_128B)


def gmma_desc_lo(saddr: Int32, lbo: int) -> Int32:
    """The low word of `gmma_desc`: the start address field of a shared address below 256 KB (so a later start
    `saddr + d` is this word + d >> 4 for d a multiple of 16) and the LBO field."""
    return ((Int32(saddr) >> 4) & 0x3FFF) | ((lbo >> 4) << 16)


@dsl_user_op
def gmma_desc_from_lo(lo: Int32, sbo: int, layout: int = 0, *, loc=None, ip=None) -> Int64:
    """The descriptor of `gmma_desc_lo`'s word `lo` (possibly advanced) with its SBO and layout type."""
    res = _asm(T.i64(), [_i32(lo, loc, ip), _i32((sbo >> 4) | (layout << 30), loc, ip)], "mov.b64 $0, {$1, $2};",
               "=l,r,r", False, loc, ip)
    return Int64(res)


@dsl_user_op
def gmma_desc(saddr: Int32, lbo: int, sbo: int, layout: int = 0, *, loc=None, ip=None) -> Int64:
    """Shared-memory matrix descriptor of a tile starting at `saddr` (16-byte aligned): `lbo` bytes between core
    matrices adjacent along K, `sbo` along M/N (bits 0-13 start >> 4, 16-29 LBO >> 4, 32-45 SBO >> 4, the layout
    type in bits 62-63: 0 no swizzle, GMMA_SWIZZLE_128B: rows of 128 bytes whose 16-byte chunks are XOR-permuted by
    the row within each 1024-byte atom, `sbo` = 1024 between 8-row groups; a k16 step inside the atom moves the
    start by 32 bytes)."""
    lo = ((Int32(saddr) >> 4) & 0x3FFF) | ((lbo >> 4) << 16)
    hi = (sbo >> 4) | (layout << 30)
    res = _asm(T.i64(), [_i32(lo, loc, ip), _i32(hi, loc, ip)], "mov.b64 $0, {$1, $2};", "=l,r,r",
               False, loc, ip)
    return Int64(res)


@dsl_user_op
def cp_async_bulk_g2s(saddr: Int32, gaddr: Int64, nbytes: int, mbar: Int32, *, loc=None, ip=None) -> None:
    """Bulk copy of `nbytes` (a multiple of 16; both addresses 16-byte aligned) global -> shared by the copy
    engine, completing `nbytes` transaction bytes on the mbarrier at shared address `mbar`. One thread issues it."""
    _asm(None, [_i32(saddr, loc, ip), Int64(gaddr).ir_value(loc=loc, ip=ip), _i32(mbar, loc, ip)],
         f"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], {nbytes}, [$2];",
         "r,l,r", True, loc, ip)


@dsl_user_op
def wgmma_fence(*, loc=None, ip=None) -> None:
    """Orders this warpgroup's register writes (A operands, accumulators) before the wgmma that reads them."""
    _asm(None, [], "wgmma.fence.sync.aligned;", "", True, loc, ip)


@dsl_user_op
def wgmma_commit(*, loc=None, ip=None) -> None:
    _asm(None, [], "wgmma.commit_group.sync.aligned;", "", True, loc, ip)


@dsl_user_op
def wgmma_wait(pending: int, *, loc=None, ip=None) -> None:
    """Wait until at most `pending` committed wgmma groups of this warpgroup are in flight."""
    _asm(None, [], f"wgmma.wait_group.sync.aligned {pending};", "", True, loc, ip)


@dsl_user_op
def reg_fence(v: Float32, *, loc=None, ip=None) -> Float32:
    """An empty instruction that 'rewrites' v: reads of the result cannot move above the last side-effecting
    instruction (a wgmma wait) that precedes it (CUTLASS's warpgroup_fence_operand)."""
    return Float32(_asm(T.f32(), [_f32(v, loc, ip)], "", "=f,0", True, loc, ip))


@dsl_user_op
def wgmma_bf16_rs(acc: tuple, a: tuple, desc: Int64, scale_d, *, loc=None, ip=None) -> tuple:
    """acc (64 x N f32, N = 2 * len(acc)) = A (registers, 4 bf16x2) @ B (16 x N, K-major, descriptor)
    + (acc if scale_d else 0). Asynchronous: commit, then wait before reading acc or rewriting a."""
    n_acc = len(acc)
    d = ",".join(f"${i}" for i in range(n_acc))
    a_ = ",".join(f"${n_acc + i}" for i in range(4))
    text = ("{.reg .pred p; setp.ne.b32 p, $%d, 0; "
            "wgmma.mma_async.sync.aligned.m64n%dk16.f32.bf16.bf16 {%s}, {%s}, $%d, p, 1, 1, 0;}"
            % (n_acc + 5, 2 * n_acc, d, a_, n_acc + 4))
    cons = ",".join(["=f"] * n_acc + ["r"] * 4 + ["l", "r"] + [str(i) for i in range(n_acc)])
    res = _asm(llvm.StructType.get_literal([T.f32()] * n_acc),
               [_u32(x, loc, ip) for x in a] + [Int64(desc).ir_value(loc=loc, ip=ip), _i32(scale_d, loc, ip)]
               + [_f32(x, loc, ip) for x in acc], text, cons, True, loc, ip)
    return _unpack(res, n_acc, T.f32(), Float32, loc, ip)


@dsl_user_op
def fence_proxy_async_shared(*, loc=None, ip=None) -> None:
    """Makes this thread's completed generic-proxy shared writes (cp.async) visible to the async proxy (wgmma)."""
    _asm(None, [], "fence.proxy.async.shared::cta;", "", True, loc, ip)


@dsl_user_op
def movmatrix_trans(x, *, loc=None, ip=None):
    """Transpose an 8x8 b16 matrix held in fragment order (lane (g, t) holds row g, columns 2t, 2t+1):
    afterwards lane (g, t) holds row g, columns 2t, 2t+1 of the transpose."""
    return Uint32(_asm(T.i32(), [_u32(x, loc, ip)], "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r",
                       True, loc, ip))


# ---- attention: asynchronous copies ---------------------------------------------------------------------
@dsl_user_op
def cp_async_16_zfill(smem_addr, gmem_addr, src_bytes, *, loc=None, ip=None):
    """Copy 16 bytes global -> shared, reading only `src_bytes` (0..16) and zero-filling the rest,
    so rows past the context end arrive as zeros (finite) instead of whatever the cache holds."""
    _asm(T.i32(), [_i32(smem_addr, loc, ip), Int64(gmem_addr).ir_value(loc=loc, ip=ip),
                   _i32(src_bytes, loc, ip)],
         "cp.async.cg.shared.global [$1], [$2], 16, $3;\n\tmov.u32 $0, 0;", "=r,r,l,r", True, loc, ip)


# ---- attention: shared memory ---------------------------------------------------------------------------
@dsl_user_op
def lds32(addr, *, loc=None, ip=None):
    return Uint32(_asm(T.i32(), [_i32(addr, loc, ip)], "ld.shared.b32 $0, [$1];", "=r,r", True, loc, ip))


@dsl_user_op
def lds_i32(addr, *, loc=None, ip=None) -> Int32:
    """A signed 32-bit word from shared memory (table fields, -1 meaning none)."""
    return Int32(_asm(T.i32(), [_i32(addr, loc, ip)], "ld.shared.b32 $0, [$1];", "=r,r", True, loc, ip))


@dsl_user_op
def lds64(addr, *, loc=None, ip=None):
    res = _asm(llvm.StructType.get_literal([T.i32()] * 2), [_i32(addr, loc, ip)],
               "ld.shared.v2.b32 {$0,$1}, [$2];", "=r,=r,r", True, loc, ip)
    return _unpack(res, 2, T.i32(), Uint32, loc, ip)


@dsl_user_op
def lds128(addr, *, loc=None, ip=None):
    res = _asm(llvm.StructType.get_literal([T.i32()] * 4), [_i32(addr, loc, ip)],
               "ld.shared.v4.b32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,r", True, loc, ip)
    return _unpack(res, 4, T.i32(), Uint32, loc, ip)


@dsl_user_op
def sts32(addr, value, *, loc=None, ip=None):
    _asm(T.i32(), [_i32(addr, loc, ip), _u32(value, loc, ip)],
         "st.shared.b32 [$1], $2;\n\tmov.u32 $0, 0;", "=r,r,r", True, loc, ip)


@dsl_user_op
def sts128(addr, v0, v1, v2, v3, *, loc=None, ip=None):
    _asm(T.i32(), [_i32(addr, loc, ip)] + [_u32(v, loc, ip) for v in (v0, v1, v2, v3)],
         "st.shared.v4.b32 [$1], {$2,$3,$4,$5};\n\tmov.u32 $0, 0;", "=r,r,r,r,r,r", True, loc, ip)


@dsl_user_op
def sts_f32_def(addr, value, *, loc=None, ip=None):
    """`sts_f32` as the attention kernel issues it: like sts32 / sts128 it also defines a dummy register.
    Dropping that definition changes ptxas's register allocation (and the attention objects)."""
    _asm(T.i32(), [_i32(addr, loc, ip), _f32(value, loc, ip)],
         "st.shared.f32 [$1], $2;\n\tmov.u32 $0, 0;", "=r,r,f", True, loc, ip)


@dsl_user_op
def ldmatrix_x4_trans(addr, *, loc=None, ip=None):
    """Four transposed 8x8 b16 matrices: lane 8i+r supplies row r of matrix i; lane (g, t) receives
    element pairs (row 2t, 2t+1) of column g of each matrix."""
    res = _asm(llvm.StructType.get_literal([T.i32()] * 4), [_i32(addr, loc, ip)],
               "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0,$1,$2,$3}, [$4];",
               "=r,=r,=r,=r,r", True, loc, ip)
    return _unpack(res, 4, T.i32(), Uint32, loc, ip)


# ---- attention: global memory ---------------------------------------------------------------------------
@dsl_user_op
def ldg_cg_f32(addr, *, loc=None, ip=None):
    """Load through L2 only: partial results another CTA wrote during this launch (L1 is not coherent)."""
    return Float32(_asm(T.f32(), [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.global.cg.f32 $0, [$1];",
                        "=f,l", True, loc, ip))


@dsl_user_op
def atomic_add_acq_rel_gpu(addr, value, *, loc=None, ip=None):
    return Int32(_asm(T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip), _i32(value, loc, ip)],
                      "atom.acq_rel.gpu.global.add.u32 $0, [$1], $2;", "=r,l,r", True, loc, ip))


# ---- attention: conversions and bit manipulation --------------------------------------------------------
@dsl_user_op
def pack_f16x2(lo, hi, *, loc=None, ip=None):
    """(fp16(lo), fp16(hi)) in one register, lo in the low half (round to nearest even)."""
    return Uint32(_asm(T.i32(), [_f32(hi, loc, ip), _f32(lo, loc, ip)], "cvt.rn.f16x2.f32 $0, $1, $2;",
                       "=r,f,f", False, loc, ip))


@dsl_user_op
def pack_bf16x2(lo, hi, *, loc=None, ip=None):
    return Uint32(_asm(T.i32(), [_f32(hi, loc, ip), _f32(lo, loc, ip)], "cvt.rn.bf16x2.f32 $0, $1, $2;",
                       "=r,f,f", False, loc, ip))


@dsl_user_op
def bf16x2_to_f32(word, *, loc=None, ip=None):
    """Unpack a bf16 pair (exact: bf16 is the top half of an f32)."""
    res = _asm(llvm.StructType.get_literal([T.f32()] * 2), [_u32(word, loc, ip)],
               "{\n\t.reg .b32 lo, hi;\n\tshl.b32 lo, $2, 16;\n\tand.b32 hi, $2, 0xffff0000;\n\t"
               "mov.b32 $0, lo;\n\tmov.b32 $1, hi;\n\t}", "=f,=f,r", False, loc, ip)
    return _unpack(res, 2, T.f32(), Float32, loc, ip)


@dsl_user_op
def e4m3x4_to_f16x2x2(word, *, loc=None, ip=None):
    """Four E4M3 bytes -> two f16 pairs (bytes 0,1) and (bytes 2,3), exact."""
    res = _asm(llvm.StructType.get_literal([T.i32()] * 2), [_u32(word, loc, ip)],
               "{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, $2;\n\t"
               "cvt.rn.f16x2.e4m3x2 $0, lo;\n\tcvt.rn.f16x2.e4m3x2 $1, hi;\n\t}", "=r,=r,r", False, loc, ip)
    return _unpack(res, 2, T.i32(), Uint32, loc, ip)


@dsl_user_op
def f32x4_to_e4m3x4(x0, x1, x2, x3, *, loc=None, ip=None):
    """Round four floats to E4M3 (nearest even, saturating to +-448), x0 in the lowest byte."""
    return Uint32(_asm(T.i32(), [_f32(x, loc, ip) for x in (x0, x1, x2, x3)],
                       "{\n\t.reg .b16 lo, hi;\n\tcvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n\t"
                       "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n\tmov.b32 $0, {lo, hi};\n\t}",
                       "=r,f,f,f,f", False, loc, ip))


@dsl_user_op
def lut_offset(word, byte: int, lane4, *, loc=None, ip=None):
    """128 * byte_`byte`(word) | lane4: the shared-memory offset of this lane's copy of the table
    entry (entries 128 bytes apart, lane copies 4 bytes apart). Kept as one asm block so that it
    stays a shift and one LOP3 instead of being re-associated into adds."""
    shift = f"shl.b32 t, $1, 7;" if byte == 0 else f"shr.u32 t, $1, {8 * byte - 7};"
    return Int32(_asm(T.i32(), [_u32(word, loc, ip), _u32(lane4, loc, ip)],
                      "{\n\t.reg .b32 t;\n\t" + shift + "\n\tand.b32 t, t, 0x7f80;\n\tor.b32 $0, t, $2;\n\t}",
                      "=r,r,r", False, loc, ip))


# signed nibble n (two's complement) -> offset binary n + 8 by xor 8; placed in the mantissa of f16 1024.0,
# it reads 1024 + n + 8 (low nibble of a half) or 1024 + 16 (n + 8) (high nibble); one f16x2 FMA removes it.
# The constants come in as registers (ALU_CONSTANTS, materialized once by the caller): SASS LOP3 and
# HFMA2 take at most one immediate, so constants written inside the asm would be re-moved on every use.
ALU_CONSTANTS = {
    "magic": 0x64006400,      # f16x2 (1024, 1024)
    "v_sub": 0x64086408,      # (1032, 1032)
    "v_mul": 0x2C002C00,      # (1/16, 1/16)
    "v_add": 0xD480D480,      # (-72, -72)
    "v_lo": 0x000F000F,
    "v_hi": 0x00F000F0,
    # the "pair" dequantization (below): nibble (xor 8) under an f16 exponent whose unit is exactly 1
    "p_lo": 0x64086408,       # f16x2 (1024 + 8, ...): low nibble of each half, bits 0-3 (unit 1)
    "p_hi": 0x54805480,       # f16x2 (64 + 8, ...): high nibble of each half, bits 4-7 (unit 16/16 = 1)
}


@dsl_user_op
def int4_token_pair_to_f16x2_alu(w_even_x8, w_odd_x8, byte: int, c: dict, *, loc=None, ip=None):
    """Arithmetic V dequantization: byte `byte` of two value words (tokens 2t, 2t+1, both xor 0x88888888)
    -> (f16x2 of the even channel for both tokens, f16x2 of the odd channel). prmt + 2 lop3 + 2 f16x2."""
    sel = byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12)  # token 2t -> bytes 0,1; 2t+1 -> 2,3
    res = _asm(llvm.StructType.get_literal([T.i32()] * 2),
               [_u32(w_even_x8, loc, ip), _u32(w_odd_x8, loc, ip)]
               + [_u32(c[k], loc, ip) for k in ("magic", "v_sub", "v_mul", "v_add", "v_lo", "v_hi")],
               "{\n\t.reg .b32 x, lo, hi;\n\t"
               f"prmt.b32 x, $2, $3, {sel};\n\t"
               "and.b32 lo, x, $8;\n\tor.b32 lo, lo, $4;\n\t"
               "and.b32 hi, x, $9;\n\tor.b32 hi, hi, $4;\n\t"
               "sub.f16x2 $0, lo, $5;\n\tfma.rn.f16x2 $1, hi, $6, $7;\n\t}",
               "=r,=r,r,r,r,r,r,r,r,r", False, loc, ip)
    return _unpack(res, 2, T.i32(), Uint32, loc, ip)


@dsl_user_op
def rint_s32(x, *, loc=None, ip=None):
    """Round to the nearest integer, ties to even (torch.round), as int32."""
    return Int32(_asm(T.i32(), [_f32(x, loc, ip)], "cvt.rni.s32.f32 $0, $1;", "=r,f", False, loc, ip))


@dsl_user_op
def div_rn(a, b, *, loc=None, ip=None):
    """IEEE single-precision division (what torch computes), independent of fast-math settings."""
    return Float32(_asm(T.f32(), [_f32(a, loc, ip), _f32(b, loc, ip)], "div.rn.f32 $0, $1, $2;", "=f,f,f",
                        False, loc, ip))


@dsl_user_op
def ex2(x, *, loc=None, ip=None):
    return Float32(_asm(T.f32(), [_f32(x, loc, ip)], "ex2.approx.ftz.f32 $0, $1;", "=f,f", False, loc, ip))


@dsl_user_op
def bits_f32(word, *, loc=None, ip=None):
    return Float32(_asm(T.f32(), [_u32(word, loc, ip)], "mov.b32 $0, $1;", "=f,r", False, loc, ip))


@dsl_user_op
def f32_bits(x, *, loc=None, ip=None):
    return Uint32(_asm(T.i32(), [_f32(x, loc, ip)], "mov.b32 $0, $1;", "=r,f", False, loc, ip))


# ---- "pair" dequantization: two instructions per f16x2 register, no table, no xor pass ------------------
# A nibble n (two's complement) sits at bits 0-3 (or 4-7) of each 16-bit half. (x & mask) ^ C with
# C = magic | (8 << shift) places n ^ 8 = n + 8 under the f16 exponent of 1024 (bits 0-3, unit 1) or of 64
# (bits 4-7, unit 1/16, so 16 (n + 8) reads n + 8); subtracting C as an f16x2 (1032 or 72) leaves n,
# exactly. One LOP3 and one HADD2 per register (the constant C is both the xor mask and the subtrahend).
@dsl_user_op
def int4_word_to_f16x2x4_pair(word, c: dict, *, loc=None, ip=None):
    """Key word (4 bytes = 8 nibbles n0..n7, n_k at bits 4k) -> four f16x2 registers
    (n0, n4), (n1, n5), (n2, n6), (n3, n7): the halves of a register are nibbles 16 bits apart, i.e.
    bytes b and b + 2 of the word, same nibble; the query fragment is permuted to match
    (attn_plan.int4_pair_key_channels)."""
    res = _asm(llvm.StructType.get_literal([T.i32()] * 4),
               [_u32(word, loc, ip), _u32(c["p_lo"], loc, ip), _u32(c["p_hi"], loc, ip)],
               "{\n\t.reg .b32 s, a, b, e, f;\n\t"
               "shr.b32 s, $4, 8;\n\t"
               "and.b32 a, $4, 0x000F000F;\n\txor.b32 a, a, $5;\n\t"
               "and.b32 b, $4, 0x00F000F0;\n\txor.b32 b, b, $6;\n\t"
               "and.b32 e, s, 0x000F000F;\n\txor.b32 e, e, $5;\n\t"
               "and.b32 f, s, 0x00F000F0;\n\txor.b32 f, f, $6;\n\t"
               "sub.f16x2 a, a, $5;\n\tsub.f16x2 b, b, $6;\n\tsub.f16x2 e, e, $5;\n\tsub.f16x2 f, f, $6;\n\t"
               "mov.b32 $0, a;\n\tmov.b32 $1, b;\n\tmov.b32 $2, e;\n\tmov.b32 $3, f;\n\t}",
               "=r,=r,=r,=r,r,r,r", False, loc, ip)
    return _unpack(res, 4, T.i32(), Uint32, loc, ip)


@dsl_user_op
def int4_token_pair_to_f16x2_pair(w_even, w_odd, byte: int, c: dict, *, loc=None, ip=None):
    """Value words of tokens 2t, 2t+1 (raw, natural channel order), byte `byte` -> (f16x2 of the even channel
    2 byte of both tokens, f16x2 of the odd channel): prmt + 2 x (lop3 + hadd2), no xor pass."""
    sel = byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12)  # token 2t -> bytes 0,1; 2t+1 -> 2,3
    res = _asm(llvm.StructType.get_literal([T.i32()] * 2),
               [_u32(w_even, loc, ip), _u32(w_odd, loc, ip), _u32(c["p_lo"], loc, ip), _u32(c["p_hi"], loc, ip)],
               "{\n\t.reg .b32 x, a, b;\n\t"
               f"prmt.b32 x, $2, $3, {sel};\n\t"
               "and.b32 a, x, 0x000F000F;\n\txor.b32 a, a, $4;\n\t"
               "and.b32 b, x, 0x00F000F0;\n\txor.b32 b, b, $5;\n\t"
               "sub.f16x2 a, a, $4;\n\tsub.f16x2 b, b, $5;\n\t"
               "mov.b32 $0, a;\n\tmov.b32 $1, b;\n\t}",
               "=r,=r,r,r,r,r", False, loc, ip)
    return _unpack(res, 2, T.i32(), Uint32, loc, ip)
