"""The skinny decode projection (M up to 64 rows) with the weights streamed straight into registers:
y[M, N] = x[M, K] @ W[N, K]^T.

The skinny kernel (skinny.py) sends the weights through its shared-memory ring with the activations, which
makes the ring ~100 KB per CTA (two CTAs, 8 warps per SM) and adds a shared-memory round trip per weight;
run 7 measured it bound by the dependency chains of those 2 warps per scheduler. Here, as in the tile GEMV,
each warp requests the next batch of `prefetch` units of its n-blocks' weights (and group scales) into
registers before it consumes the current one, so the weight bytes in flight live in registers; the ring
holds only the activation tiles, a batch per stage (9 KB per unit at M = 32, 4 KB at M = 16), and the CTA
meets at one barrier per batch instead of per unit. The first batch of weights is requested before the PDL
wait (weights never depend on the previous kernel). The same 128-channel tiles (routed: 8 warps of one
n-block; `rw4`: 4 warps of two), split-K, MMAs per unit and epilogues as the skinny kernel, so the outputs are
bitwise its outputs. Routed for INT4 g128 at 9..32 rows (decode.plan.SKINNY_ROUTED_VARIANTS, docs/routing.md
P15) and for every format at 33..64 rows (P16: there the ring kernel spills); at M = 16 it is issue-bound on the
INT4 expansion (docs/results-decode-linear.md run 21).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import ptx, stream
from .skinny import Skinny

DEFAULT_PREFETCH = 2   # units per batch
DEFAULT_STAGES = 3     # activation batches in the ring (two in flight while one is read)


class SkinnyRegs(Skinny):
    tensor_cores_read_ring = False   # True where wgmma (the async proxy) reads the ring: the copies are then fenced

    def __init__(self, fmt: str, group_size: int = 128, epilogue: str = "store", m_tiles: int = 4,
                 stages: int = 0, warps: int = 4, nb_per_warp: int = 2, prefetch: int = 0, chains: int = 0,
                 reduce: str = "global", min_ctas: int = 0):
        super().__init__(fmt, group_size, epilogue, m_tiles, stages or DEFAULT_STAGES, warps, nb_per_warp, chains,
                         reduce)
        if min_ctas:   # a register bound for ptxas (the 64-row bucket's tuning variant "rwwb": two CTAs per SM)
            self.launch_hints = {"min_blocks_per_mp": min_ctas, "preferred_smem_carveout": 100}
        if self.stages < 2:
            raise ValueError("the register-weights skinny kernel needs a ring of at least 2 stages")
        self.prefetch = prefetch or DEFAULT_PREFETCH
        self.w_bytes = self.s_bytes = 0
        self.stage_bytes = self.prefetch * self.x_bytes   # the batch's activation tiles, unit after unit

    @cute.jit
    def _stage_batch(self, x_base, m, k, u0, ub, slot: Int32, tid):
        """cp.async the activation tiles of the batch's units u0 .. u0 + prefetch - 1 below ub."""
        for i in cutlass.range_constexpr(self.prefetch):
            if u0 + i < ub:
                self._stage_x(x_base, m, k, u0 + i, slot + i * self.x_bytes, tid)

    def _load_batch(self, u0, ub, wheres, nb_ok) -> tuple:
        """Registers of units u0 .. u0 + prefetch - 1 of each of the warp's n-blocks ([unit][n-block]);
        loads past ub or of a missing n-block are predicated off."""
        out = []
        for i in range(self.prefetch):
            u = u0 + i
            row = []
            for j in range(self.nbw):
                lane_base, offsets, k, s_base, nb, n_units, g = wheres[j]
                valid = Int32(u < ub) * nb_ok[j]
                row.append(stream.load_unit(self.fmt, self.bpu, lane_base, u, valid, offsets, k, s_base, nb,
                                            n_units, g))
            out.append(tuple(row))
        return tuple(out)

    @cute.jit
    def _prologue(self, x_base, m, k, ua, ub, xs, tid, wheres, nb_ok):
        """Request the first batch's weights (before the PDL wait: weights never depend on the previous kernel), then
        the activations of the ring's first stages - 1 batches. Returns the first batch's registers."""
        cur = self._load_batch(ua, ub, wheres, nb_ok)
        cute.arch.griddepcontrol_wait()
        for st in cutlass.range_constexpr(self.stages - 1):
            self._stage_batch(x_base, m, k, ua + st * self.prefetch, ub, xs + st * self.stage_bytes, tid)
            cute.arch.cp_async_commit_group()
        return cur

    @cute.jit
    def _advance(self, x_base, m, k, it, ua, ub, xs, tid, wheres, nb_ok):
        """Head of batch `it`: wait for its activations and meet at the barrier (batch it - 1's slot is then free),
        request the activations of batch it + stages - 1 and the weights of batch it + 1. Returns (batch it + 1's
        registers, batch it's slot)."""
        SX, P = self.stages, self.prefetch
        u0 = ua + it * P
        cute.arch.cp_async_wait_group(SX - 2)
        if cutlass.const_expr(self.tensor_cores_read_ring):
            ptx.fence_proxy_async_shared()   # this thread's copies, visible to the tensor cores' reads
        cute.arch.sync_threads()
        self._stage_batch(x_base, m, k, u0 + (SX - 1) * P, ub, xs + ((it + SX - 1) % SX) * self.stage_bytes, tid)
        cute.arch.cp_async_commit_group()
        return self._load_batch(u0 + P, ub, wheres, nb_ok), xs + (it % SX) * self.stage_bytes

    @cute.jit
    def _mainloop(self, x_base, m, k, ua, ub, xs, tid, warp, lane, wheres, nb_ok, consts):
        """Units [ua, ub) in batches: the weights of batch b + 1 requested into registers and the activations of
        batch b + stages - 1 into the ring before batch b is consumed."""
        fmt, P, NBW = self.fmt, self.prefetch, self.nbw
        cur = self._prologue(x_base, m, k, ua, ub, xs, tid, wheres, nb_ok)
        xs_lane = fmt.x_lane_offset(lane, self.row_bytes)
        accs = [[(Float32(0.0),) * 4 for _ in range(self.m_tiles)] for _ in range(NBW)]
        for it in cutlass.range((ub - ua + P - 1) // P, unroll=1):
            u0 = ua + it * P
            nxt, slot = self._advance(x_base, m, k, it, ua, ub, xs, tid, wheres, nb_ok)
            for i in cutlass.range_constexpr(P):
                b_ops = [self._x_frags(slot + i * self.x_bytes + xs_lane, b) for b in range(self.bpu)]
                for j in cutlass.range_constexpr(NBW):
                    accs[j] = stream.mma_unit(fmt, self.bpu, cur[i][j], b_ops, accs[j],
                                              Int32(u0 + i < ub) * nb_ok[j], consts, chains=self.chains)
            cur = nxt
        return accs
