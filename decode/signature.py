"""The argument list every decode projection kernel takes, as fake tensors for compilation:

    (x [M, K] bf16, w, s, r, y, stream)
    w, s   int4: packed int32 [N/16, K/64, 32, 4], float16 scales [N/16, K/G, 16]
           e4m3: bytes [N, K] (float8_e4m3fn viewed as uint8), float32 per-channel scales [N]
           bf16: bf16 [N, K], s = None
    r      residual bf16 [M, N] for the residual epilogue, else None
    y      bf16 [M, N], or [M, N/2] for SwiGLU
Sizes are dynamic; K carries its divisibility contract (a multiple of 64).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from futx.quant import layouts

from .epilogue import make as make_epilogue


def _rowmajor(dtype, shape):
    return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))),
                                    assumed_align=16)


def fake_args(fmt: str, epilogue: str, m=None) -> tuple:
    """`m`: a static row count (1 for the GEMV) or None for a dynamic one."""
    lay = layouts.INT4_WEIGHT
    m = cute.sym_int() if m is None else m
    k = cute.sym_int(divisibility=lay.block_k)
    x = _rowmajor(cutlass.BFloat16, (m, k))
    if fmt == "int4":
        w = _rowmajor(cutlass.Int32, (cute.sym_int(), cute.sym_int(), layouts.WARP, lay.words_per_lane))
        s = _rowmajor(cutlass.Float16, (cute.sym_int(), cute.sym_int(), lay.block_n))
    elif fmt == "e4m3":
        w = _rowmajor(cutlass.Uint8, (cute.sym_int(), cute.sym_int(divisibility=lay.block_k)))
        s = _rowmajor(cutlass.Float32, (cute.sym_int(),))
    elif fmt == "bf16":
        w = _rowmajor(cutlass.BFloat16, (cute.sym_int(), cute.sym_int(divisibility=lay.block_k)))
        s = None
    else:
        raise ValueError(f"unknown decode weight format {fmt!r}")
    r = _rowmajor(cutlass.BFloat16, (m, cute.sym_int())) if make_epilogue(epilogue).residual else None
    y = _rowmajor(cutlass.BFloat16, (m, cute.sym_int()))
    return (x, w, s, r, y, make_fake_stream(use_tvm_ffi_env_stream=True))


def fake_split_args() -> tuple:
    """Split-K workspace (float32, flat) and per-tile arrival counters (int32, zero between calls)."""
    ws = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),), assumed_align=16)
    counters = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=16)
    return ws, counters
