"""The persistent decode layer, first cut (issue 29): one launch runs a layer's task table
(decode.persistent_schedule.task_table, M = 1) on the task loop of decode/persistent_loop.py, each projection task
being the tile GEMV's own body (decode/gemv_tile.py) on the task's 16-channel n-block: QKV and gate/up with the
RMSNorm row factor fused (the M = 1 engine's form, routing rule E2), O and down with the residual epilogue, SwiGLU on
gate/up. A task requests its first weights, then waits on its counter where the standalone kernel waits for the
previous launch (programmatic dependent launch), so its weights stream while its producers finish.

Not in it yet: attention. Attention tasks only wait and signal, and their output `attn` is an input of the kernel;
the row-factor tasks do the same (the factor is fused into the projections that read it). So this kernel measures
what counters save against launch boundaries for the projections, with the same bodies and epilogues as the four
standalone launches: their outputs must be equal bit for bit (tests/test_persistent_layer_gpu.py).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from decode import persistent_loop as loop
from decode.gemv_tile import WARP, GemvTile, GemvTileNorm
from decode.persistent_schedule import KINDS

WARPS = 8                                   # every body runs on the launch's one block size
# CTAs per SM: the four bodies inlined in one kernel take ~248 registers (one CTA of 256 threads per SM; the
# standalone tile GEMV needs 76); bounded to two CTAs per SM ptxas fits them in 125 but spills (~105 local loads and
# stores in SASS). Both are built (tuning space); the H200 decides. The grid must stay co-resident (<= SMs x this):
# a CTA spinning on a counter must never hold the SM its producer waits for.
CTAS_PER_SM = 1
PROJ = {k: KINDS.index(k) for k in ("qkv", "o", "gate_up", "down")}
F = loop.F


class _AsTask:
    """The tile GEMV body as a task of the loop: its n-block and its counter come from the task's table row, which
    the loop stores on the body before running it (values of the traced kernel)."""

    def _tile(self):
        return self.task_nb, Int32(0)

    def _wait_inputs(self) -> None:
        loop.wait(self.task_counters, self.task_wait, self.task_target, self.task_tid)

    def _release_dependents(self) -> None:
        pass   # the loop signals the task's counters once the CTA's writes are done


class NormTask(_AsTask, GemvTileNorm):
    pass


class ResidualTask(_AsTask, GemvTile):
    pass


class PersistentProjections:
    def __init__(self, warps: int = WARPS, ctas_per_sm: int = CTAS_PER_SM):
        self.warps, self.ctas_per_sm = warps, ctas_per_sm
        self.qkv = NormTask("store", warps)
        self.o = ResidualTask("residual", warps)
        self.gate_up = NormTask("swiglu", warps)
        self.down = ResidualTask("residual", warps)

    @cute.jit
    def __call__(self, table: cute.Tensor, counters: cute.Tensor, h: cute.Tensor, w_qkv: cute.Tensor,
                 s_qkv: cute.Tensor, qkv: cute.Tensor, attn: cute.Tensor, w_o: cute.Tensor, s_o: cute.Tensor,
                 hmid: cute.Tensor, w_gu: cute.Tensor, s_gu: cute.Tensor, act: cute.Tensor, w_d: cute.Tensor,
                 s_d: cute.Tensor, h_out: cute.Tensor, eps: Float32, stream):
        smem = cutlass.max(cutlass.max(self.qkv._shape(h, qkv)[1], self.o._shape(attn, hmid)[1]),
                           cutlass.max(self.gate_up._shape(hmid, act)[1], self.down._shape(act, h_out)[1]))
        hints = {"min_blocks_per_mp": self.ctas_per_sm, "preferred_smem_carveout": 100} if self.ctas_per_sm > 1 else {}
        self.kernel(table, counters, h, w_qkv, s_qkv, qkv, attn, w_o, s_o, hmid, w_gu, s_gu, act, w_d, s_d, h_out,
                    eps).launch(grid=(table.shape[0], 1, 1), block=(WARP * self.warps, 1, 1), smem=smem,
                                stream=stream, **hints)

    @cute.kernel
    def kernel(self, table: cute.Tensor, counters: cute.Tensor, h: cute.Tensor, w_qkv: cute.Tensor,
               s_qkv: cute.Tensor, qkv: cute.Tensor, attn: cute.Tensor, w_o: cute.Tensor, s_o: cute.Tensor,
               hmid: cute.Tensor, w_gu: cute.Tensor, s_gu: cute.Tensor, act: cute.Tensor, w_d: cute.Tensor,
               s_d: cute.Tensor, h_out: cute.Tensor, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        j = Int32(0)
        kind = table[cta, 0, F["kind"]]
        while kind != loop.END:
            loop.wait(counters, table[cta, j, F["wait1"]], table[cta, j, F["target1"]], tidx)
            wait0, target0 = table[cta, j, F["wait0"]], table[cta, j, F["target0"]]
            nb = table[cta, j, F["a0"]] // 16
            for body in (self.qkv, self.o, self.gate_up, self.down):
                body.task_nb, body.task_counters, body.task_wait, body.task_target, body.task_tid = (
                    nb, counters, wait0, target0, tidx)
            if kind == PROJ["qkv"]:
                self.qkv._body(h, w_qkv, s_qkv, None, qkv, eps)
            elif kind == PROJ["o"]:
                self.o._body(attn, w_o, s_o, h, hmid, None)
            elif kind == PROJ["gate_up"]:
                self.gate_up._body(hmid, w_gu, s_gu, None, act, eps)
            elif kind == PROJ["down"]:
                self.down._body(act, w_d, s_d, hmid, h_out, None)
            else:   # attention and row factors: not computed here yet (see the module docstring)
                loop.wait(counters, wait0, target0, tidx)
            cute.arch.barrier()   # the task's writes (and its shared-memory reads) done by every thread
            loop.signal(counters, table[cta, j, F["signal0"]], tidx)
            loop.signal(counters, table[cta, j, F["signal1"]], tidx)
            j = j + 1
            kind = table[cta, j, F["kind"]]


def projections_target(warps: int = WARPS, ctas_per_sm: int = CTAS_PER_SM):
    """The tuning space's factory (key decode.persistent.projections.m1): (jit callable, fake arguments)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from decode.persistent_schedule import FIELDS
    from decode.signature import fake_args

    c, r, n = (cute.sym_int() for _ in range(3))
    table = make_fake_compact_tensor(Int32, (c, r, len(FIELDS)), stride_order=(2, 1, 0), assumed_align=4)
    counters = make_fake_compact_tensor(Int32, (n,), assumed_align=4)
    h, w_qkv, s_qkv, _, qkv, _ = fake_args("int4", "store", m=1)
    attn, w_o, s_o, _, hmid, _ = fake_args("int4", "residual", m=1)
    _, w_gu, s_gu, _, act, _ = fake_args("int4", "swiglu", m=1)
    _, w_d, s_d, _, h_out, _ = fake_args("int4", "residual", m=1)
    return PersistentProjections(warps, ctas_per_sm), (table, counters, h, w_qkv, s_qkv, qkv, attn, w_o, s_o, hmid, w_gu, s_gu,
                                          act, w_d, s_d, h_out, Float32(1e-5),
                                          make_fake_stream(use_tvm_ffi_env_stream=True))
