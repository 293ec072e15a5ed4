"""The persistent decode layer (issue 29): one launch runs a layer's tasks (decode.persistent_schedule.task_table,
for 1..8 rows) on the task loop of decode/persistent_loop.py, each task being a standalone kernel's own body on the
task's piece: the projections the tile GEMV's (decode/gemv_tile.py; for several rows its multi-token form) on a
16-channel n-block, QKV and gate/up with the RMSNorm row factor fused (the M = 1 engine's form, routing rule E2), O
and down with the residual epilogue, SwiGLU on gate/up; attention decode/attention.py's split-KV partial of one
(row, KV head, split) with its RoPE and new cache row, and the partials' combine. A projection task requests its first weights, then waits on its counter where the
standalone kernel waits for the previous launch (programmatic dependent launch), so its weights stream while its
producers finish.

`PersistentLayer`: the whole layer; launched once per layer on a table of all the step's layers (cumulative
counter targets, zeroed once per step), each launch running its layer's rows of every CTA's list. It triggers its
dependents at once, so the next layer's CTAs take each SM as this layer's CTA there exits and stream their first
weights while this layer finishes (their data waits are the counters; only layer 0 waits for the launch before it).

Measured on the H200 it is correct but twice as slow as the shipped step (one CTA per SM: its registers; the
engine keeps it off by default, routing rule E3; docs/persistent.md says why and what would win).

`PersistentProjections`: the four projections only (attention and row-factor tasks wait and signal, `attn` is an
input): what counters save against launch boundaries for the projections alone, bit for bit against the four
standalone launches (tests/test_persistent_layer_gpu.py); tuning space.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from decode import persistent_loop as loop
from decode import ptx
from decode.attention import LOG2E, AttnTensors, DecodeAttention
from decode.attn_plan import AttnPlan
from decode.gemv_tile import WARP, GemvTile, GemvTileNorm
from decode.persistent_host import LAYER_WARPS, layer_plan
from decode.persistent_schedule import KINDS

WARPS = LAYER_WARPS                         # every body runs on the launch's one block size
# CTAs per SM: the four bodies inlined in one kernel take ~219 registers (one CTA of 256 threads per SM; the
# standalone tile GEMV needs 76; 248 before the bodies' thread index was made opaque to the task loop, whose
# hoisting keeps every body's invariants live at once); bounded to two CTAs per SM ptxas fits them in 128 but spills. Both lose to the four standalone launches on the H200 (91.8 / 78.5 vs 44.0 µs for the 8B layer's
# projections: a third of the standalone's warps per SM stream weights; docs/persistent.md). The grid must stay
# co-resident (<= SMs x this): a CTA spinning on a counter must never hold the SM its producer waits for.
CTAS_PER_SM = 1
PROJ = {k: KINDS.index(k) for k in ("qkv", "o", "gate_up", "down")}
ATTN = {k: KINDS.index(k) for k in ("attn_partial", "attn_combine")}
F = loop.F


class _AsTask:
    """The tile GEMV body as a task of the loop: its n-block and its counter come from the task's table row, which
    the loop stores on the body before running it (values of the traced kernel). With several rows (the multi-token
    body) the partials overwrite the staged rows, so that 8 rows of the 8B down projection fit in shared memory."""

    @property
    def red_in_x(self) -> bool:
        return self.tokens > 1

    def _tile(self):
        return self.task_nb, Int32(0)

    def _thread(self):
        # opaque: the body's per-lane addressing then stays inside the task, not hoisted out of the loop for all
        # four bodies at once (the loop's register pressure: 248 -> see docs/persistent.md)
        return ptx.opaque_i32(self.task_tid)

    def _wait_inputs(self) -> None:
        loop.wait(self.task_counters, self.task_wait, self.task_target, self.task_tid)

    def _release_dependents(self) -> None:
        pass   # the loop signals the task's counters once the CTA's writes are done


class NormTask(_AsTask, GemvTileNorm):
    pass


class ResidualTask(_AsTask, GemvTile):
    pass


class _Projections:
    """The four projection bodies as tasks, and the loop's steps both persistent kernels share."""

    def __init__(self, warps: int, tokens: int = 1):
        self.warps = warps
        self.qkv = NormTask("store", warps, tokens=tokens)
        self.o = ResidualTask("residual", warps, tokens=tokens)
        self.gate_up = NormTask("swiglu", warps, tokens=tokens)
        self.down = ResidualTask("residual", warps, tokens=tokens)

    def _smem(self, h, qkv, attn, hmid, act, h_out):
        return cutlass.max(cutlass.max(self.qkv._shape(h, qkv)[1], self.o._shape(attn, hmid)[1]),
                           cutlass.max(self.gate_up._shape(hmid, act)[1], self.down._shape(act, h_out)[1]))

    @cute.jit
    def _projection_or_wait(self, kind, a0, wait0, target0, counters, tidx, h, w_qkv, s_qkv, qkv, attn, w_o, s_o,
                            hmid, w_gu, s_gu, act, w_d, s_d, h_out, eps):
        """The task's projection (on n-block a0 / 16), or for any other kind only its wait."""
        for body in (self.qkv, self.o, self.gate_up, self.down):
            body.task_nb, body.task_counters, body.task_wait, body.task_target, body.task_tid = (
                a0 // 16, counters, wait0, target0, tidx)
        if kind == PROJ["qkv"]:
            self.qkv._body(h, w_qkv, s_qkv, None, qkv, eps)
        elif kind == PROJ["o"]:
            self.o._body(attn, w_o, s_o, h, hmid, None)
        elif kind == PROJ["gate_up"]:
            self.gate_up._body(hmid, w_gu, s_gu, None, act, eps)
        elif kind == PROJ["down"]:
            self.down._body(act, w_d, s_d, hmid, h_out, None)
        else:
            loop.wait(counters, wait0, target0, tidx)

    @cute.jit
    def _signal(self, table: cute.Tensor, cta, j, counters: cute.Tensor, tidx):
        cute.arch.barrier()   # the task's writes (and its shared-memory reads) done by every thread
        loop.signal(counters, table[cta, j, F["signal0"]], tidx)
        loop.signal(counters, table[cta, j, F["signal1"]], tidx)


class PersistentProjections(_Projections):
    def __init__(self, warps: int = WARPS, ctas_per_sm: int = CTAS_PER_SM):
        super().__init__(warps)
        self.ctas_per_sm = ctas_per_sm

    @cute.jit
    def __call__(self, table: cute.Tensor, counters: cute.Tensor, h: cute.Tensor, w_qkv: cute.Tensor,
                 s_qkv: cute.Tensor, qkv: cute.Tensor, attn: cute.Tensor, w_o: cute.Tensor, s_o: cute.Tensor,
                 hmid: cute.Tensor, w_gu: cute.Tensor, s_gu: cute.Tensor, act: cute.Tensor, w_d: cute.Tensor,
                 s_d: cute.Tensor, h_out: cute.Tensor, eps: Float32, stream):
        smem = self._smem(h, qkv, attn, hmid, act, h_out)
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
            # attention and row factors only wait here (see the module docstring)
            self._projection_or_wait(kind, table[cta, j, F["a0"]], table[cta, j, F["wait0"]],
                                     table[cta, j, F["target0"]], counters, tidx, h, w_qkv, s_qkv, qkv, attn, w_o,
                                     s_o, hmid, w_gu, s_gu, act, w_d, s_d, h_out, eps)
            self._signal(table, cta, j, counters, tidx)
            j = j + 1
            kind = table[cta, j, F["kind"]]


class LayerCall:
    """The layer kernels' calling convention (the tile bodies' PersistentLayer and decode/persistent_ring.py's
    RingLayer take the same arguments, listed on PersistentLayer): the attention tensors gathered, then the kernel's
    own launch (`_launch`). `trace`: None, or the ring layer's task trace (its `.trace` registry entries)."""

    @cute.jit
    def __call__(self, table: cute.Tensor, starts: cute.Tensor, layer: Int32, counters: cute.Tensor, h: cute.Tensor,
                 w_qkv: cute.Tensor, s_qkv: cute.Tensor, qkv: cute.Tensor, attn: cute.Tensor, w_o: cute.Tensor,
                 s_o: cute.Tensor, hmid: cute.Tensor, w_gu: cute.Tensor, s_gu: cute.Tensor, act: cute.Tensor,
                 w_d: cute.Tensor, s_d: cute.Tensor, heads: cute.Tensor, positions: cute.Tensor, slots: cute.Tensor,
                 k_cache: cute.Tensor, v_cache: cute.Tensor, k_mirror: cute.Tensor, k_scale: cute.Tensor,
                 v_mirror: cute.Tensor, v_scale: cute.Tensor, rope: cute.Tensor, attn_heads: cute.Tensor,
                 ws_o: cute.Tensor, ws_ml: cute.Tensor, eps: Float32, softmax_scale: Float32,
                 trace: Optional[cute.Tensor], stream):
        t = AttnTensors(qkv=heads, rope=rope, positions=positions, slots=slots, k_cache=k_cache, v_cache=v_cache,
                        k_mirror=k_mirror, k_scale=k_scale, v_mirror=v_mirror, v_scale=v_scale, out=attn_heads,
                        ws_o=ws_o, ws_ml=ws_ml)
        self._launch(table, starts, layer, counters, h, w_qkv, s_qkv, qkv, attn, w_o, s_o, hmid, w_gu, s_gu, act, w_d,
                     s_d, t, eps, softmax_scale * Float32(LOG2E), trace, stream)


def check_task_plan(plan: AttnPlan, warps: int) -> None:
    """Raise unless `plan` is one a layer's attention tasks can run: fused QKV, a contiguous cache's mirror read
    without the byte table, on `warps` warps, and no dependent launch's (its griddepcontrol belongs to a kernel's
    start, not to a task inside a persistent launch)."""
    if (plan.warps != warps or not plan.fused_qkv or plan.paged or not plan.quantized or plan.uses_lut
            or plan.pdl):
        raise ValueError(f"a persistent layer's attention plan must be fused, contiguous, read a mirror without the "
                         f"byte table, use {warps} warps and not be a dependent launch's, got {plan}")


class PersistentLayer(LayerCall, _Projections):
    """A decode layer (INT4 weights, a contiguous INT4 or E4M3 cache by `plan`) as one launch: `tokens` = 1 for
    one row, TOKENS for 1..8 rows (the multi-token tile GEMV's bodies; the table's tasks name the rows).

    Arguments: the step's task table [ctas, rows, FIELDS] and `starts` [ctas, layers + 1] (CTA c's rows of layer l
    are starts[c, l] .. starts[c, l + 1] - 1), this launch's `layer`, the step's counters; the residual stream `h`
    [M, H] (read by QKV and O, rewritten in place by down), the projections' weights and outputs (`qkv` [M, QKV],
    `hmid`, `act`), `heads` = qkv as [M, Hq + 2 Hkv, D] and `attn_heads` = attn as [M, Hq, D] (the same memory
    as `qkv` and `attn`), the attention kernel's positions, slots, cache and mirror tensors, RoPE table and split
    workspace [M, Hkv, splits, MAX_GROUP, D | 2] (its splits the table's); M = 1 for `tokens` = 1."""

    def __init__(self, plan: AttnPlan, warps: int = WARPS, tokens: int = 1):
        check_task_plan(plan, warps)
        super().__init__(warps, tokens)
        self.att = DecodeAttention(plan)

    @cute.jit
    def _launch(self, table, starts, layer, counters, h, w_qkv, s_qkv, qkv, attn, w_o, s_o, hmid, w_gu, s_gu, act, w_d,
                s_d, t: AttnTensors, eps, scale_log2, trace, stream):
        if cutlass.const_expr(trace is not None):
            raise ValueError("the tile layer keeps no task trace (the ring layer does)")
        bodies = cutlass.max(self._smem(h, qkv, attn, hmid, act, h), self.att.p.smem_bytes)
        self.kernel(table, starts, layer, counters, h, w_qkv, s_qkv, qkv, attn, w_o, s_o, hmid, w_gu, s_gu, act, w_d,
                    s_d, t, eps, scale_log2, bodies).launch(
            grid=(table.shape[0], 1, 1), block=(WARP * self.warps, 1, 1), smem=bodies + 16, stream=stream,
            use_pdl=True)

    @cute.kernel
    def kernel(self, table: cute.Tensor, starts: cute.Tensor, layer: Int32, counters: cute.Tensor, h: cute.Tensor,
               w_qkv: cute.Tensor, s_qkv: cute.Tensor, qkv: cute.Tensor, attn: cute.Tensor, w_o: cute.Tensor,
               s_o: cute.Tensor, hmid: cute.Tensor, w_gu: cute.Tensor, s_gu: cute.Tensor, act: cute.Tensor,
               w_d: cute.Tensor, s_d: cute.Tensor, t: AttnTensors, eps: Float32, scale_log2: Float32,
               slot_at: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        # the next layer's launch may start now: its CTAs take SMs as this launch's CTAs exit (one per SM), and
        # every read of theirs that depends on this layer waits on a counter
        cute.arch.griddepcontrol_launch_dependents()
        if layer == 0:   # the step's first layer reads the rows the launch before it wrote
            cute.arch.griddepcontrol_wait()
        base = ptx.smem_addr(cute.arch.get_dyn_smem(cutlass.Int8, alignment=1024))
        nsplit = t.ws_o.shape[2]
        # the task index waits out each body in shared memory, past every body's (the bodies take every register:
        # ptxas spilled it with the multi-token bodies; a word per thread keeps its address live and spills too).
        # One word for the CTA: every thread writes the same value, and writes task j + 1 only after the barrier
        # that ends task j, by which every thread has read task j
        slot = base + slot_at
        j = starts[cta, layer]
        ptx.sts32(slot, j)
        while j < starts[cta, layer + 1]:   # read again per task: one register less across the bodies
            kind = table[cta, j, F["kind"]]
            wait0, target0 = table[cta, j, F["wait0"]], table[cta, j, F["target0"]]
            a0, a1, a2 = table[cta, j, F["a0"]], table[cta, j, F["a1"]], table[cta, j, F["a2"]]
            if kind == ATTN["attn_partial"]:   # (row, KV head, split)
                loop.wait(counters, wait0, target0, tidx)
                self.att.partial(t, scale_log2, a2, a1, a0, nsplit, base, tidx, False)
            elif kind == ATTN["attn_combine"]:   # (row, KV head)
                loop.wait(counters, wait0, target0, tidx)
                self.att.combine(t, a1, a0, nsplit, tidx)
            else:   # the projections (row factors, fused into them, only wait: fused_norm tables have none)
                self._projection_or_wait(kind, a0, wait0, target0, counters, tidx, h, w_qkv, s_qkv, qkv, attn, w_o,
                                         s_o, hmid, w_gu, s_gu, act, w_d, s_d, h, eps)
            j = Int32(ptx.lds32(slot))
            self._signal(table, cta, j, counters, tidx)
            j = j + 1
            ptx.sts32(slot, j)


def compile_target(cache: str = "int4", head_dim: int = 128, tokens: int = 1):
    """Registry factory (futx/runtime/catalog/persistent.py): (jit callable, fake arguments) of the layer for one
    cache format, head dim and token columns (1: one row; TOKENS: 1..8 rows, a runtime value); CTAs, table rows,
    layers, counters, model shape and split count dynamic."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from decode.attention import fake_args as attn_fake_args
    from decode.persistent_schedule import FIELDS
    from decode.signature import fake_args

    plan = layer_plan(cache, head_dim)
    c, r, n, ls = (cute.sym_int() for _ in range(4))
    table = make_fake_compact_tensor(Int32, (c, r, len(FIELDS)), stride_order=(2, 1, 0), assumed_align=4)
    starts = make_fake_compact_tensor(Int32, (c, ls), stride_order=(1, 0), assumed_align=4)
    counters = make_fake_compact_tensor(Int32, (n,), assumed_align=4)
    m = 1 if tokens == 1 else None
    h, w_qkv, s_qkv, _, qkv, _ = fake_args("int4", "store", m=m)
    attn, w_o, s_o, _, hmid, _ = fake_args("int4", "residual", m=m)
    _, w_gu, s_gu, _, act, _ = fake_args("int4", "swiglu", m=m)
    _, w_d, s_d, _, _, _ = fake_args("int4", "residual", m=m)
    a = dict(zip(plan.tensors, attn_fake_args(plan)))
    attention = [a[k] for k in ("qkv", "positions", "slots", "k_cache", "v_cache", "k_mirror", "k_scale", "v_mirror",
                                "v_scale", "rope", "out", "ws_o", "ws_ml")]
    args = (table, starts, Int32(0), counters, h, w_qkv, s_qkv, qkv, attn, w_o, s_o, hmid, w_gu, s_gu, act, w_d, s_d,
            *attention, Float32(1e-5), Float32(1.0), None, make_fake_stream(use_tvm_ffi_env_stream=True))
    return PersistentLayer(plan, tokens=tokens), args


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
