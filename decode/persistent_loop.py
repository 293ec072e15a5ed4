"""The persistent decode kernel's task loop (issue 29): each CTA walks its row of the task table
(decode.persistent_schedule.task_table, fields FIELDS), waits for each task's counters, runs it, then signals.

Memory ordering (the PTX memory model; the pattern of CUTLASS's generic barrier): a producer's threads write their
tiles, `bar.sync`, then thread 0 adds 1 to each signal counter with release semantics at GPU scope; a consumer's
thread 0 polls with acquire loads at GPU scope until the cumulative target, then `bar.sync`, after which every
thread of the CTA may read the producers' tiles. Causality is transitive through the two CTA barriers, so one
thread per CTA carries the ordering. Tiles other CTAs wrote during the launch are read through L2 (`ld.global.cg`):
L1 is not coherent across SMs.

`ChainKernel` runs trivial tasks on this loop: `layers` rounds over `tiles` columns, round l's tile t reading
tiles t-1, t, t+1 of round l-1 (so every tile needs three producers on other CTAs). It is the GPU test of the
loop's ordering and the measurement of the handoff: with tasks this small, a round's time is the time from a
counter's last increment to its waiters running, the parameter docs/persistent.md's model spans from 0 to 1 µs
(27 vs 33 µs for the 8B layer).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cutlass_dsl import dsl_user_op

from decode import ptx
from decode.persistent_host import END, F, THREADS, chain_reference, chain_table  # noqa: F401  (host side)
from decode.persistent_schedule import FIELDS

POLL_NS = 32                   # back-off between polls: short, a handoff is the latency being measured


@dsl_user_op
def nanosleep(ns: int, *, loc=None, ip=None) -> None:
    ptx._asm(None, [], f"nanosleep.u32 {int(ns)};", "", True, loc, ip)


def _cg(x: cute.Tensor, row, col) -> Float32:
    """x[row, col] through L2 (another CTA wrote it during this launch)."""
    return ptx.ldg_cg_f32(x.iterator.toint() + Int64(cute.crd2idx((row, col), x.layout)) * 4)


@cute.jit
def wait(counters: cute.Tensor, idx: Int32, target: Int32, tidx: Int32, threads: cutlass.Constexpr = 0) -> None:
    """Until counters[idx] >= target (idx < 0: no wait); every thread of the CTA returns after it (`threads` > 0:
    the CTA's first `threads` threads, which meet at a named barrier: the ring layer's consumers)."""
    if idx >= 0:
        if tidx == 0:
            seen = cute.arch.load(counters.iterator + idx, Int32, sem="acquire", scope="gpu")
            while seen < target:
                nanosleep(POLL_NS)
                seen = cute.arch.load(counters.iterator + idx, Int32, sem="acquire", scope="gpu")
        cta_sync(threads)


def cta_sync(threads: int = 0) -> None:
    """The task loop's CTA barrier: every thread (`threads` = 0), or the first `threads` at the consumers' named
    barrier (decode/persistent_ring.py: its producer warp runs ahead and never joins)."""
    if threads:
        ptx.bar_sync(ptx.Barrier.PERSISTENT_CONSUMERS, threads)
    else:
        cute.arch.barrier()


@cute.jit
def signal(counters: cute.Tensor, idx: Int32, tidx: Int32, count=1) -> None:
    """counters[idx] += count (1: this task) once the whole CTA's writes are done (idx < 0: none). Call after a CTA
    barrier."""
    if idx >= 0:
        if tidx == 0:
            cute.arch.atomic_add(counters.iterator + idx, Int32(count), sem="release", scope="gpu")


class ChainKernel:
    """x [layers + 1, tiles * THREADS] float32; task (kind 0) of round l = a0 - 1 at tile a1: each thread's column c of
    tile a1 in row l + 1 gets x[l, c - THREADS] + x[l, c] + x[l, c + THREADS] + 1 (missing neighbours count 0);
    table int32 [ctas, rows, len(FIELDS)]; counters int32, zero before the launch."""

    @cute.jit
    def __call__(self, table: cute.Tensor, counters: cute.Tensor, x: cute.Tensor, stream):
        self.kernel(table, counters, x).launch(grid=(table.shape[0], 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, table: cute.Tensor, counters: cute.Tensor, x: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        tiles = x.shape[1] // THREADS
        j = Int32(0)
        kind = table[cta, 0, F["kind"]]
        while kind != END:
            wait(counters, table[cta, j, F["wait0"]], table[cta, j, F["target0"]], tidx)
            wait(counters, table[cta, j, F["wait1"]], table[cta, j, F["target1"]], tidx)
            layer, t = table[cta, j, F["a0"]] - 1, table[cta, j, F["a1"]]
            col = t * THREADS + tidx
            acc = _cg(x, layer, col) + Float32(1.0)
            if t > 0:
                acc = acc + _cg(x, layer, col - THREADS)
            if t < tiles - 1:
                acc = acc + _cg(x, layer, col + THREADS)
            x[layer + 1, col] = acc
            cute.arch.barrier()
            signal(counters, table[cta, j, F["signal0"]], tidx)
            signal(counters, table[cta, j, F["signal1"]], tidx)
            j = j + 1
            kind = table[cta, j, F["kind"]]


def chain_target():
    """The tuning space's factory of the chain kernel (scripts/tuning_space.py, key decode.persistent.chain; not a
    shipped kernel, so not `compile_target`): (jit callable, fake arguments); CTAs, table rows, rounds and tiles
    dynamic."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    c, r, n, rows, cols = (cute.sym_int() for _ in range(5))
    table = make_fake_compact_tensor(Int32, (c, r, len(FIELDS)), stride_order=(2, 1, 0), assumed_align=4)
    counters = make_fake_compact_tensor(Int32, (n,), assumed_align=4)
    x = make_fake_compact_tensor(Float32, (rows, cols), stride_order=(1, 0), assumed_align=16)
    return ChainKernel(), (table, counters, x, make_fake_stream(use_tvm_ffi_env_stream=True))
