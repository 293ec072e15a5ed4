"""Weight streaming shared by the decode kernels (gemv.py, gemv_tile.py, skinny.py).

A *unit* is what one step consumes: one scale group of INT4 blocks (G/64 blocks), or one block of a
natural-layout format. `load_unit` issues a lane's 16-byte loads (and its two group scales) for one
unit of one 16-channel n-block; `mma_unit` turns them into MMAs against activation fragments and folds
the result into the float32 accumulators: per group, scale * partial (INT4), or the partial itself.

`raw_scales`: the group scales stay float16 bits in the prefetch registers and are converted where the
unit is consumed. With `raw_scales=False` the conversion sits next to the load, and ptxas waits for the
load in the basic block that issues it: a prefetch that is requested and then immediately waited for
(see ptx.ldg_u16). The persistent GEMV and the tile GEMV's "rolling" pipeline keep the scales raw; the
tile GEMV's routed "batch" pipeline converts at the load (its batch waits at the loop end anyway), as does
the GEMV's tuning variant `r2` (docs/routing.md P4).
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int64

from . import ptx
from .dequant import BLOCK_K, WORDS


def units_of(fmt) -> tuple[int, int]:
    """(blocks per unit, reduction elements per unit)."""
    bpu = fmt.blocks_per_group if fmt.grouped else 1
    return bpu, BLOCK_K * bpu


def load_unit(fmt, bpu: int, lane_base: Int64, u, valid, offsets, k, s_base, nb, n_groups, g,
              raw_scales: bool = False) -> tuple:
    """Issue unit u's weight loads (and group scales), predicated off unless `valid`."""
    regs = []
    for b in range(bpu):
        addr = lane_base + Int64(u * bpu + b) * fmt.block_stride(k)
        for off in offsets:
            regs += list(ptx.ldg_stream_v4(addr + off, valid))
    if cutlass.const_expr(fmt.grouped):
        lo, hi = fmt.scale_addrs(s_base, nb, u, n_groups, g)
        load = ptx.ldg_u16 if raw_scales else ptx.ldg_f16_to_f32
        regs += [load(lo, valid), load(hi, valid)]
    return tuple(regs)


def mma_unit(fmt, bpu: int, cur: tuple, b_ops: list, accs: list, valid, consts, sums=None,
             raw_scales: bool = False, chains: int = 0) -> list:
    """accs[mt] += unit contribution for each 8-token group mt; b_ops[b][mt] are the (b0, b1) pairs of
    block b of the unit. A unit that is not `valid` adds exactly zero (its registers are garbage).
    `sums[mt]` (INT4 with fold): this lane's two token columns' sums of the group's activations.
    `raw_scales`: cur's two scales are float16 bits (load_unit(raw_scales=True)).
    `chains`: independent MMA accumulation chains per token group (0: two with one token group, which
    halves the dependent-MMA latency of a unit, else one)."""
    per_block = 4 * fmt.loads_per_block
    zero = Float32(0.0)
    chains = chains or (2 if len(accs) == 1 else 1)
    parts = [[(zero,) * 4 for _ in range(chains)] for _ in accs]
    step = 0
    for b in range(bpu):
        a_ops = fmt.a_operands(cur[b * per_block:(b + 1) * per_block], consts)
        for j in range(WORDS):
            for mt in range(len(accs)):
                c = step % chains
                parts[mt][c] = ptx.mma_16816(a_ops[j], b_ops[b][mt][j], parts[mt][c], "bf16")
            step += 1
    parts = [tuple(p[0][e] + p[1][e] for e in range(4)) if chains == 2 else p[0] for p in parts]
    if cutlass.const_expr(fmt.grouped):
        s_lo, s_hi = cur[-2], cur[-1]  # channels g (c0, c1) and g + 8 (c2, c3)
        if cutlass.const_expr(raw_scales):
            s_lo, s_hi = ptx.h16_to_f32(s_lo), ptx.h16_to_f32(s_hi)
    out = []
    for mt, (acc, part) in enumerate(zip(accs, parts)):
        if cutlass.const_expr(fmt.fold):
            nb = Float32(-fmt.bias)  # c0/c2 hold token column 2t, c1/c3 column 2t + 1
            s0, s1 = sums[mt]
            part = (part[0] + nb * s0, part[1] + nb * s1, part[2] + nb * s0, part[3] + nb * s1)
        part = tuple(cutlass.select_(valid != 0, p, zero) for p in part)  # garbage may be NaN
        if cutlass.const_expr(fmt.grouped):
            out.append((acc[0] + s_lo * part[0], acc[1] + s_lo * part[1],
                        acc[2] + s_hi * part[2], acc[3] + s_hi * part[3]))
        else:
            out.append(tuple(a + p for a, p in zip(acc, part)))
    return out
