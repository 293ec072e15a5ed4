"""CPU model of the ring layer's mbarrier protocol (decode/persistent_ring.py): one producer lane filling `stages`
slots in order (wait for the slot's *empty* barrier at parity phase ^ 1, arrive on its *full* barrier with the
stage's bytes expected, a bulk copy landing later and completing them), eight consumer warps taking every stage of
their tasks (wait *full* at parity phase, read, arrive on *empty*: one arrival per warp here, where the kernel has
each of the warp's threads arrive for its own reads), in chunks, with a CTA barrier after each
task, in the routed order or `lookahead` (the next stage read before this one's release; past a chunk's last stage
the current one re-read). PTX's semantics: a barrier completes a phase when its pending arrivals and transaction
bytes reach zero; a wait on parity P passes once the phase of parity P has completed (on a fresh barrier, P = 1
passes at once). Over random interleavings and copy delays: every read finds the stage it expects (no slot refilled
under a reader, none read before its copy landed) and nothing deadlocks."""

from __future__ import annotations

import random

import pytest

WARPS = 8


class MBarrier:
    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.completed = count, count, 0, 0

    def passed(self, parity: int) -> bool:
        return self.completed % 2 != parity

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.count

    def arrive(self, expect_tx: int = 0):
        self.tx += expect_tx
        self.pending -= 1
        self._maybe_complete()

    def complete_tx(self, nbytes: int):
        self.tx -= nbytes
        self._maybe_complete()


def run_ring(tasks, stages: int, lookahead: bool, seed: int, release_first: bool = False) -> None:
    """tasks: per task its chunks' stage counts (e.g. [[2], [7, 7]]); every warp takes every stage. `release_first`
    (a broken consumer, to show the model catches it): the routed order with the arrive before the read."""
    rng = random.Random(seed)
    full = [MBarrier(1) for _ in range(stages)]
    empty = [MBarrier(WARPS) for _ in range(stages)]
    content = [None] * stages
    total = sum(sum(t) for t in tasks)
    at_barrier = [0]   # arrivals at the consumers' CTA barrier, cumulative

    def copy(i, slot):
        yield lambda: True   # lands some time later
        content[slot] = i
        full[slot].complete_tx(1)

    def producer():
        for i in range(total):
            slot, phase = i % stages, (i // stages) % 2
            yield lambda: empty[slot].passed(phase ^ 1)
            full[slot].arrive(expect_tx=1)
            actors.append(copy(i, slot))

    def read(slot, i):
        assert content[slot] == i, f"read slot {slot}: stage {content[slot]}, expected {i}"

    def consumer():
        i = 0
        for n_task, chunks in enumerate(tasks):
            for n in chunks:
                if not lookahead:
                    for _ in range(n):
                        slot, phase = i % stages, (i // stages) % 2
                        yield lambda: full[slot].passed(phase)
                        if release_first:
                            empty[slot].arrive()
                            yield lambda: True
                        read(slot, i)
                        if not release_first:
                            empty[slot].arrive()
                        i += 1
                    continue
                slot, phase = i % stages, (i // stages) % 2
                yield lambda: full[slot].passed(phase)
                read(slot, i)
                for st in range(n):
                    more = st + 1 < n
                    nslot, nphase = (i + 1) % stages, ((i + 1) // stages) % 2
                    if more:
                        yield lambda: full[nslot].passed(nphase)
                    read(nslot if more else slot, i + 1 if more else i)
                    empty[slot].arrive()
                    slot, phase, i = nslot, nphase, i + 1
            at_barrier[0] += 1
            goal = (n_task + 1) * WARPS
            yield lambda: at_barrier[0] >= goal
        assert i == total

    actors = [producer()] + [consumer() for _ in range(WARPS)]
    waiting: dict = {}
    while actors:
        ready = [a for a in actors if waiting.get(id(a), lambda: True)()]
        assert ready, "deadlock"
        a = rng.choice(ready)
        try:
            waiting[id(a)] = next(a)
        except StopIteration:
            actors.remove(a)


TASKS = {
    "one row, 8B layer": [[4]] * 3 + [[4]] * 2 + [[4]] * 4 + [[14]] * 2,   # QKV, O, gate/up, down stage counts
    "chunked": [[7, 7], [2], [7, 7], [1, 1, 1]],
    "single stages": [[1]] * 9,
}


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("stages", [2, 3, 13])
@pytest.mark.parametrize("tasks", list(TASKS))
def test_ring_protocol_reads_each_stage_once_landed_and_never_deadlocks(tasks, stages, lookahead):
    for seed in range(20):
        run_ring(TASKS[tasks], stages, lookahead, seed)


def test_the_model_catches_a_release_before_the_read():
    """The model is sharp: consumers that release a stage before reading it (the producer may refill it under them)
    fail on some interleaving."""
    with pytest.raises(AssertionError, match="expected"):
        for seed in range(50):
            run_ring(TASKS["single stages"], 2, False, seed, release_first=True)
