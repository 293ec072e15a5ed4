"""The persistent kernel's task loop (decode/persistent_loop.py) on the CPU: the chain test's table (each CTA's list
in round order, one counter with cumulative targets, well-formed end rows), its torch reference, and the loop kernel
compiling for sm_90a with the acquire polls and release increments in its SASS. Its GPU test is
tests/test_persistent_loop_gpu.py."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from decode import persistent_loop as pl
from decode.persistent_schedule import FIELDS

REPO = Path(__file__).resolve().parents[1]
F = {n: i for i, n in enumerate(FIELDS)}


@pytest.mark.parametrize("layers,tiles,ctas", [(1, 1, 1), (3, 5, 2), (4, 7, 16), (2, 132, 264)])
def test_chain_table_orders_every_list_by_round(layers, tiles, ctas):
    table, counters = pl.chain_table(layers, tiles, ctas)
    assert table.shape[0] == ctas and table.shape[2] == len(FIELDS) and counters.tolist() == [0]
    seen = []
    for cta in table.tolist():
        rounds = [row[F["a0"]] for row in cta if row[F["kind"]] != pl.END]
        assert rounds == sorted(rounds)            # a CTA never waits on a later round than one it runs after
        ends = [row[F["kind"]] for row in cta[len(rounds):]]
        assert ends and all(k == pl.END for k in ends)
        for row in cta[:len(rounds)]:
            r = row[F["a0"]]
            want = (-1, 0) if r == 1 else (0, (r - 1) * tiles)
            assert (row[F["wait0"]], row[F["target0"]]) == want and row[F["wait1"]] == -1
            assert row[F["signal0"]] == 0 and row[F["signal1"]] == -1
            seen.append((r, row[F["a1"]]))
    assert sorted(seen) == [(r, t) for r in range(1, layers + 1) for t in range(tiles)]
    with pytest.raises(ValueError, match="positive"):
        pl.chain_table(0, 1, 1)


def test_chain_reference_adds_in_the_kernels_order():
    x0 = torch.arange(3 * pl.THREADS, dtype=torch.float32)
    x = pl.chain_reference(x0, 2)
    t = x0.view(3, pl.THREADS)
    assert torch.equal(x[1].view(3, pl.THREADS)[1], ((t[1] + 1) + t[0]) + t[2])
    assert torch.equal(x[1].view(3, pl.THREADS)[0], (t[0] + 1) + t[1])
    assert x.shape == (3, 3 * pl.THREADS)


def test_loop_kernel_compiles_with_acquire_polls_and_release_signals(tmp_path):
    pytest.importorskip("cutlass")
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(REPO)!r})
        import cutlass.cute as cute
        from decode import persistent_loop as pl
        fn, args = pl.chain_target()
        cute.compile(fn, *args)
    """)
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="sass,ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=600, capture_output=True)
    ptx = "\n".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    sass = "\n".join(p.read_text() for p in tmp_path.glob("*.sass"))
    assert ptx.count("ld.acquire.gpu.global") >= 2 and re.search(r"atom\.global\.release(\.gpu)?\.add", ptx)
    assert "NANOSLEEP" in sass and "CCTL.IVALL" in sass      # the acquire invalidates L1 for the CTA's reads
    assert not re.search(r"\b(LDL|STL)\b", sass)


@pytest.mark.parametrize("ctas_per_sm", [1, 2])
def test_persistent_projections_compile_with_the_tile_gemv_bodies(tmp_path, ctas_per_sm):
    """decode/persistent_layer.py: the four tile GEMV bodies (16 HMMA each) on the task loop (six wait sites: the
    second wait, four bodies' input waits, the attention / row-factor tasks' wait); one CTA per SM keeps every
    register (no spills); two per SM spill today (tuning space: the H200 decides, docs/persistent.md)."""
    pytest.importorskip("cutlass")
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(REPO)!r})
        import cutlass.cute as cute
        from decode import persistent_layer as pl
        fn, args = pl.projections_target(ctas_per_sm={ctas_per_sm})
        cute.compile(fn, *args)
    """)
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="sass", CUTE_DSL_DUMP_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=900, capture_output=True)
    sass = "\n".join(p.read_text() for p in tmp_path.glob("*.sass"))
    assert len(re.findall(r"\bHMMA\.16816\.F32\.BF16\b", sass)) == 64
    assert sass.count("NANOSLEEP") == 6 and "REDG.E.ADD.STRONG.GPU" in sass
    if ctas_per_sm == 1:
        assert not re.search(r"\b(LDL|STL)\b", sass)


@pytest.mark.parametrize("cache,tokens", [("int4", 1), ("e4m3", 1), ("int4", 8), ("e4m3", 8)])
def test_persistent_layer_compiles_with_every_task_body(tmp_path, cache, tokens):
    """decode/persistent_layer.py's whole layer (registry decode.persistent.layer.*, one row or 1..8): the four tile
    GEMV bodies (64 HMMA) and decode attention's partial (its QK and PV MMAs) on the task loop; it releases the next
    layer's launch at once (PREEXIT) and waits for the launch before it only in layer 0 (one ACQBULK); no spills (the
    bodies' thread index opaque to the task loop, the loop's bound read per task, the task index kept in shared
    memory across the bodies)."""
    pytest.importorskip("cutlass")
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(REPO)!r})
        import cutlass.cute as cute
        from decode import persistent_layer as pl
        fn, args = pl.compile_target(cache={cache!r}, tokens={tokens})
        cute.compile(fn, *args)
    """)
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="sass", CUTE_DSL_DUMP_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=900, capture_output=True)
    sass = "\n".join(p.read_text() for p in tmp_path.glob("*.sass"))
    assert len(re.findall(r"\bHMMA\.16816\.F32\.BF16\b", sass)) == 64
    assert len(re.findall(r"\bHMMA\.16816\.F32\b", sass)) > 64
    assert sass.count("PREEXIT") == 1 and sass.count("ACQBULK") == 1
    assert "REDG.E.ADD.STRONG.GPU" in sass and "CCTL.IVALL" in sass
    assert not re.search(r"\b(LDL|STL)\b", sass)


@pytest.mark.parametrize("cache,trace,tokens,lookahead,ew,group,early", [
    ("int4", False, 1, False, False, 1, False), ("e4m3", False, 1, False, False, 1, False),
    ("int4", True, 1, False, False, 1, False), ("int4", False, 8, False, False, 1, False),
    ("e4m3", True, 8, False, False, 1, False), ("int4", False, 1, True, False, 1, False),
    ("int4", False, 8, True, False, 1, False), ("int4", False, 1, False, True, 1, False),
    ("e4m3", True, 8, False, True, 1, False), ("int4", False, 1, False, False, 2, False),
    ("int4", False, 8, False, False, 4, False), ("int4", True, 1, False, True, 2, False),
    ("int4", False, 1, False, False, 1, True), ("int4", True, 8, False, True, 2, True)])
def test_ring_layer_compiles_with_a_producer_warp(tmp_path, cache, trace, tokens, lookahead, ew, group, early):
    """decode/persistent_ring.py (registry decode.persistent.ring.*): 288 threads (8 consumer warps + the producer),
    the four projection bodies reading the ring (8 HMMA per unit each) beside decode attention's partial; the producer
    issues two bulk copies per stage on the stage's full mbarrier (arrive + expected bytes); the consumers' barriers
    are named (the producer never joins one: the only bar.sync 0 is the mbarrier setup's); PDL as the tile layer's
    (one PREEXIT, one ACQBULK); no spills. The traced variant reads the global timer at the task's four stamps; the
    multi-token one (1..8 rows) has the same MMAs, B columns being rows. The tuning space's `lookahead` runs its stage
    loop two stages per trip (8 MMAs per unit: 16 per trip and 8 for an odd last stage, per projection body); its
    `epilogue_warp` adds a tenth warp (320 threads) that finishes the projection tasks; its `group` takes that many
    stages per trip (8 x group MMAs in one basic block, and a one-stage loop for a chunk's last stages); its
    `early_tiles` requests an attention partial's first cache tiles before the partial's counter wait."""
    pytest.importorskip("cutlass")
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(REPO)!r})
        import cutlass.cute as cute
        from decode import persistent_ring as pr
        fn, args = pr.compile_target(cache={cache!r}, trace={trace}, tokens={tokens}, lookahead={lookahead},
                                     epilogue_warp={ew}, group={group}, early_tiles={early})
        cute.compile(fn, *args)
    """)
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="sass,ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=900, capture_output=True)
    sass = "\n".join(p.read_text() for p in tmp_path.glob("*.sass"))
    ptx = "\n".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    assert (".reqntid 320, 1, 1" if ew else ".reqntid 288, 1, 1") in ptx
    assert len(re.findall(r"\bHMMA\.16816\.F32\.BF16\b", sass)) == (96 if lookahead else 32 * (group + 1) if group > 1
                                                                   else 32)
    assert len(re.findall(r"\bHMMA\.16816\.F32\b", sass)) > 0
    assert len(re.findall(r"\bUBLKCP\.S\.G\b", sass)) == 2 and "SYNCS.ARRIVE.TRANS64" in sass
    assert "SYNCS.PHASECHK.TRANS64.TRYWAIT" in sass
    assert len(re.findall(r"\bbar(rier)?\.sync(\.aligned)?\s+0;", ptx)) == 1
    assert len(re.findall(r"\bbarrier\.sync\s+3,", ptx)) >= 4   # ptx.Barrier.PERSISTENT_CONSUMERS
    assert sass.count("PREEXIT") == 1 and sass.count("ACQBULK") == 1
    assert "REDG.E.ADD.STRONG.GPU" in sass and "CCTL.IVALL" in sass
    # ew: the epilogue warp stamps "end" too; early: a partial stamps "ready" again after its own counter wait
    assert ptx.count("%globaltimer") == ((5 if ew else 4) + early if trace else 0)
    assert not re.search(r"\b(LDL|STL)\b", sass)
    if group > 1:   # each body's group of units in one branch-free stretch, where ptxas interleaves them
        assert len(_branch_free_mma_runs(sass, 8 * group)) == 4


def _branch_free_mma_runs(sass: str, mmas: int) -> list:
    """The stretches of SASS between branches (and branch targets) holding exactly `mmas` BF16 MMAs."""
    sys.path.insert(0, str(REPO / "scripts"))
    import sass_loop_stats as s

    ins, labels = s.parse(sass)
    starts = set(labels.values())
    runs, n = [], 0
    for addr, op, _ in ins:
        if addr in starts or op.startswith("BRA"):
            if n:
                runs.append(n)
            n = 0
        n += op.startswith("HMMA.16816.F32.BF16")
    return [r for r in runs + [n] if r == mmas]


@pytest.mark.parametrize("change", [dict(pdl=True), dict(fused_qkv=False), dict(warps=4)])
def test_layer_kernels_refuse_attention_plans_their_tasks_cannot_run(change):
    """A dependent launch's plan (griddepcontrol at a kernel's start), an unfused one or one on other warps inside
    a persistent layer's task is refused when the kernel object is made, before any trace."""
    import dataclasses

    from decode.persistent_host import layer_plan
    from decode.persistent_layer import PersistentLayer
    from decode.persistent_ring import RingLayer

    plan = dataclasses.replace(layer_plan("int4"), **change)
    for make in (PersistentLayer, RingLayer):
        with pytest.raises(ValueError, match="persistent layer's attention plan"):
            make(plan)
