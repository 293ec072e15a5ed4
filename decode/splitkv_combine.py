"""Merging partial softmax results: across the warps of a CTA and across split-KV CTAs.

A partial result over a set of tokens is (m, l, O) with m the running max of the scores (log2 units),
l = sum 2^(s - m) and O = sum 2^(s - m) v. Two partials merge exactly as
    M = max(m1, m2),  l = 2^(m1-M) l1 + 2^(m2-M) l2,  O = 2^(m1-M) O1 + 2^(m2-M) O2,
and a partial with no tokens is (-inf, 0, 0), whose factor 2^(-inf - M) is 0. Every merged set holds at
least one real token, so M is finite and no NaN can arise. The final row is O / l.

Layouts: the CTA scratch (shared memory) and the split workspace (global, float32) both hold
O[head][channel] rows plus (m, l) per head; one warp merges one head, lane l owning the channels
[n*l, n*l + n) (n = D/32), which is also the layout the Hadamard butterfly and the output store use.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from decode import ptx

NEG_INF = float("-inf")


def merge_warps(scratch: Int32, warps: int, group: int, head_dim: int, head, lane):
    """Merge the `warps` per-warp partials of one head from shared memory.

    scratch layout: O [warps][group][head_dim] f32, then m [warps][group], then l [warps][group].
    Returns (m, l, [O values of this lane's n channels])."""
    n = head_dim // 32
    m_base = scratch + warps * group * head_dim * 4
    l_base = m_base + warps * group * 4
    ms = [ptx.lds_f32(m_base + (w * group + head) * 4) for w in range(warps)]
    big = ms[0]
    for w in range(1, warps):
        big = cute.arch.fmax(big, ms[w])
    facs = [ptx.ex2(ms[w] - big) for w in range(warps)]
    lsum = Float32(0.0)
    outs = [Float32(0.0)] * n
    for w in range(warps):
        lsum = lsum + facs[w] * ptx.lds_f32(l_base + (w * group + head) * 4)
        row = scratch + ((w * group + head) * head_dim + lane * n) * 4
        for i in range(n):
            outs[i] = outs[i] + facs[w] * ptx.lds_f32(row + 4 * i)
    return big, lsum, outs


@cute.jit
def merge_splits(ws_o: cute.Tensor, ws_ml: cute.Tensor, b, kvh, head, lane, n_splits, res: cute.Tensor,
                 head_dim: cutlass.Constexpr):
    """Merge the split partials of one (sequence, KV head, head) from the global workspace into
    res = [O values of this lane's n channels..., l] (rmem, n + 1 floats). Reads go through L2:
    the partials were written by other CTAs of this launch.

    ws_o [B, Hkv, splits, group, D] and ws_ml [B, Hkv, splits, group, 2] (m, l), float32."""
    n = head_dim // 32
    big = Float32(NEG_INF)
    for s in range(n_splits):
        big = cute.arch.fmax(big, ptx.ldg_cg_f32(_addr(ws_ml, (b, kvh, s, head, 0))))
    for i in cutlass.range_constexpr(n + 1):
        res[i] = Float32(0.0)
    for s in range(n_splits):
        f = ptx.ex2(ptx.ldg_cg_f32(_addr(ws_ml, (b, kvh, s, head, 0))) - big)
        res[n] = res[n] + f * ptx.ldg_cg_f32(_addr(ws_ml, (b, kvh, s, head, 1)))
        for i in cutlass.range_constexpr(n):
            res[i] = res[i] + f * ptx.ldg_cg_f32(_addr(ws_o, (b, kvh, s, head, lane * n + i)))


def _addr(t: cute.Tensor, coord):
    """64-bit global byte address of element `coord` of a float32 tensor."""
    off = cute.crd2idx(coord, t.layout)
    return t.iterator.toint() + cutlass.Int64(off) * 4
