"""The decode step's attention as a programmatic dependent launch (AttnPlan.pdl), on the CPU: the kernel's formula
for which ring stage holds the new row's tile, replayed over every warp's ring; the plan and op refuse it outside
the engine's fused entry; its SASS requests the first tiles before the wait. GPU equality with the plain kernel:
tests/test_attention_pdl_gpu.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from decode.attn_plan import default_plan, new_row_prologue_stage

REPO = Path(__file__).resolve().parents[1]


def _replay(ctx: int, nsplit: int, warps: int, stages: int, tile: int) -> None:
    """One sequence of context ctx (the new row at ctx - 1) on nsplit splits, as the kernel runs it (extent and
    ring_start's arithmetic): the tiles a warp requests before the wait see rows < ctx - 1 only; the formula must
    flag exactly the request that holds the new row, at its ring stage, and nothing else."""
    tiles = -(-ctx // tile)
    per_split = -(-tiles // nsplit)
    n_active = -(-tiles // per_split)
    last = (ctx - 1) // tile
    flagged = []
    for split in range(n_active):
        t_begin, t_end = split * per_split, min(tiles, split * per_split + per_split)
        for warp in range(warps):
            first = t_begin + warp
            left = t_end - first
            n_my = -(-left // warps) if left > 0 else 0
            early = [first + i * warps for i in range(min(stages - 1, n_my))]   # ring_prologue before the wait
            held, stage = new_row_prologue_stage(first, last, warps, stages, n_my)
            if held:
                flagged.append((split, warp))
                assert early[stage] == last
            else:
                assert last not in early
    holders = [(s, w) for s in range(n_active) for w in range(warps)
               if last in [s * per_split + w + i * warps for i in range(stages - 1)]
               and s * per_split + w <= last < min(tiles, (s + 1) * per_split)]
    assert flagged == holders and len(flagged) <= 1
    assert not flagged or flagged[0][0] == n_active - 1   # only the split that writes the row re-requests it


@pytest.mark.parametrize("warps,stages,tile", [(4, 3, 32), (4, 3, 16), (6, 3, 32), (4, 2, 32), (6, 2, 16)])
def test_new_row_stage_over_every_warps_ring(warps, stages, tile):
    for ctx in list(range(1, 400)) + [1023, 1024, 1025, 4096, 4097, 8191, 8192]:
        for nsplit in (1, 2, 3, 5, 8, 16, 64):
            _replay(ctx, nsplit, warps, stages, tile)


def _ring_trace(n_my: int, stages: int, held_stage):
    """A warp's cp.async ring as the kernel runs it, under wait_group's worst case (a group completes only when a
    wait forces it): the prologue (`prefetch`, before griddepcontrol.wait, for a dependent launch), then where
    `held_stage` is not None request_new_row's re-request of that stage and attend()'s wait for it before its loop
    (the query staging between them issues no copies), then the loop. Asserts
    that every tile is consumed from its own latest copy, landed, and that no copy is issued to a stage while
    another copy to it is in flight."""
    groups = []          # per commit group: list of (stage, tile, copy id)
    pending = []         # open group's copies
    landed, latest = set(), {}
    copy_id = iter(range(10 ** 6))

    def issue(stage, tile):
        in_flight = [c for g in groups for (st, _, c) in g if st == stage and c not in landed]
        assert not in_flight and not [c for st, _, c in pending if st == stage], "two copies to one stage in flight"
        c = next(copy_id)
        pending.append((stage, tile, c))
        latest[stage] = (tile, c)

    def commit():
        groups.append(list(pending))
        pending.clear()

    def wait_group(n):
        for g in groups[:max(0, len(groups) - n)]:
            landed.update(c for _, _, c in g)

    for i in range(stages - 1):
        if i < n_my:
            issue(i, i)
        commit()
    if held_stage is not None:
        wait_group(0)
        issue(held_stage, held_stage)
        commit()
        wait_group(0)
    for it in range(n_my):
        ahead = it + stages - 1
        if ahead < n_my:
            issue(ahead % stages, ahead)
        commit()
        wait_group(stages - 1)
        tile, c = latest[it % stages]
        assert tile == it and c in landed, f"tile {it} consumed before its copy landed"


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_the_re_request_keeps_the_rings_group_count(stages):
    """The re-requested tile's extra commit group (and its waits) keep every consumed stage landed and never put two
    copies in flight to one stage, wherever the new row's tile sits in the prologue."""
    for n_my in range(0, 9):
        _ring_trace(n_my, stages, None)
        for held in range(min(stages - 1, n_my)):
            _ring_trace(n_my, stages, held)


def test_pdl_is_the_engine_entry_only():
    with pytest.raises(ValueError, match="fused-QKV entry only"):
        default_plan("int4", 128, True, pdl=True)
    assert default_plan("int4", 128, True, fused_qkv=True, pdl=True).smem_bytes == \
        default_plan("int4", 128, True, fused_qkv=True).smem_bytes


def test_the_op_refuses_a_head_dim_without_twins():
    import torch

    import futx.ops  # noqa: F401
    from futx.ops.decode_attention import decode_attention_qkv_

    out = torch.empty(1, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="built for head dims"):
        decode_attention_qkv_(None, None, None, None, None, None, None, None, None, None, out, "int4", True, pdl=True)


def test_block_steps_never_launch_it():
    """KernelOps: rule E5 applies to the decode step's attention only (the verify step's rows were just written by
    the kernels before it), up to the measured row limit."""
    import inspect

    from futx.engine import backends

    assert backends.KernelOps().pdl_attention_rows is None   # None: the routed limit (pdl_attention_limit)
    src = inspect.getsource(backends.KernelOps.attention)
    assert "pdl_attention_limit(c) if self.pdl_attention_rows is None" in src
    src = inspect.getsource(backends.KernelOps.attention_block)
    assert src.count("step=False") == 2 and "self.attention(" in src


def test_the_routed_row_limit_follows_the_measurements():
    """E5 where it was measured faster: the 8B at 1..8 rows; never the 70B (slower at (4, 1024) and (1, 8192))."""
    from futx.engine import backends
    from scripts.bench_engine import config_for

    assert backends.pdl_attention_limit(config_for("llama-3.1-8b", None)) == 8
    assert backends.pdl_attention_limit(config_for("llama-3.1-70b", None)) == 0


@pytest.mark.parametrize("kw", [dict(fmt="int4", head_dim=128, rotate=True), dict(fmt="e4m3", head_dim=128),
                                dict(fmt="bf16", head_dim=128, page_size=128)], ids=lambda k: k["fmt"])
def test_pdl_kernel_requests_its_first_tiles_before_the_wait(tmp_path, kw):
    """One release of the dependents (PREEXIT) at the start, one wait (ACQBULK), cache copies (LDGSTS) before the
    wait, and no spills."""
    pytest.importorskip("cutlass")
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(REPO)!r})
        import cutlass.cute as cute
        from decode import attention
        fn, args = attention.compile_target(**{dict(kw, fused_qkv=True, pdl=True)!r})
        cute.compile(fn, *args)
    """)
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="sass", CUTE_DSL_DUMP_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=900, capture_output=True)
    sass = "\n".join(p.read_text() for p in tmp_path.glob("*.sass"))
    assert sass.count("PREEXIT") == 1 and sass.count("ACQBULK") == 1
    before = sass[:sass.index("ACQBULK")]
    assert "PREEXIT" in before and "LDGSTS" in before
    assert not re.search(r"\b(LDL|STL)\b", sass)
