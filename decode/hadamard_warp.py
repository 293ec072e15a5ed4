"""Normalized block-diagonal Walsh-Hadamard transform of one D-vector held by a warp.

Lane l holds the n = D/32 consecutive elements [n*l, n*l + n). Stage s = 1, 2, 4, ..., block/2 maps
each pair (i, i+s) with bit s of i clear to (x_i + x_{i+s}, x_i - x_{i+s}); pairs inside a lane
(s < n) are combined in registers, the others through one butterfly shuffle with lane ^ (s/n).
After the last stage every element is multiplied once by float32(1/sqrt(block)).

This is H = diag(H_b, ...) with H_b[i][j] = (-1)^popcount(i & j) / sqrt(b), the Sylvester matrix of
futx.quant.hadamard. The fp32 operation order above is the kernel's definition of the rotation
(a torch mirror that wants bit-identical cache bytes must apply the same stages in the same order).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


def inv_sqrt(block: int) -> float:
    return 1.0 / math.sqrt(block)


def _shuffle(v, m):
    return cute.arch.shuffle_sync_bfly(v, offset=m)


def _select(c, a, b):
    return Float32(cutlass.select_(c, a, b))


def butterfly(x: list, lane: Int32, block: int, shuffle=_shuffle, select=_select) -> list:
    """Unnormalized transform of the warp-distributed vector (list of this lane's n Float32 values).

    Straight-line code (no dynamic control flow): callable from any kernel body. `shuffle(v, m)` (value of
    lane ^ m) and `select(c, a, b)` are parameters only so that a CPU test can run this very schedule
    on 32 emulated lanes and compare it bit for bit with futx.quant.hadamard.rotate."""
    n = len(x)
    x = list(x)
    s = 1
    while s < block:
        if s < n:
            for i in range(n):
                if i & s == 0:
                    a, b = x[i], x[i + s]
                    x[i], x[i + s] = a + b, a - b
        else:
            m = s // n
            upper = (lane & m) != 0
            for i in range(n):
                other = shuffle(x[i], m)
                # this lane holds element i+s of the pair when its bit is set: (other - mine)
                x[i] = select(upper, other - x[i], x[i] + other)
        s *= 2
    return x


def rotate(x: list, lane: Int32, block: int) -> list:
    """H x (the kernel rotates one block of head_dim channels)."""
    y = butterfly(x, lane, block)
    f = Float32(inv_sqrt(block))
    return [v * f for v in y]
