"""The persistent decode layer under NVIDIA Compute Sanitizer (issue 29), both bodies (the ring's mbarrier ring
between the producer warp and the consumers checked too): a small model's steps of 1 and 3 rows on 8 CTAs (every CTA runs tasks of every kind, counters wait across CTAs and across the layers' launches) finish, with no
shared-memory hazard (racecheck) and no misuse of barriers (synccheck). Eager steps, no graphs: the sanitizer
instruments each launch. Skipped where compute-sanitizer is not installed."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]
SANITIZER = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"

STEPS = textwrap.dedent(f"""
    import sys; sys.path.insert(0, {str(REPO)!r})
    import torch
    from futx.checkpoint.synthetic import tiny_config
    from futx.engine import DecodeModel
    from futx.engine.packed import random_packed
    from futx.engine.persistent import PersistentStep

    body, _, variant = sys.argv[1].partition(":")
    if variant:   # a tuning-space kernel
        sys.path.insert(0, {str(REPO / "scripts")!r}); import tuning_space; tuning_space.register()
    # the ring takes whole stages of K (1024); two, so a group of stages (the g2 variant) runs
    ring = body == "ring"
    cfg = tiny_config(head_dim=128, num_attention_heads=16 if ring else 8, num_key_value_heads=2,
                      hidden_size=2048 if ring else 512, intermediate_size=2048 if ring else 1024,
                      num_hidden_layers=2, vocab_size=256)
    m = DecodeModel(random_packed(cfg, "int4", device="cuda", seed=3), "int4", max_batch=4, capacity=256,
                    device="cuda")
    m.cache.randomize(1)
    m.persistent = PersistentStep(m, ctas=8, body=body, variant=variant)
    for rows in (1, 3):
        for s in range(2):
            n = m.load_inputs(list(range(1, rows + 1)), [100 + s - r for r in range(rows)], list(range(rows)))
            m.step(n)
    torch.cuda.synchronize()
    assert torch.isfinite(m.buffers.hidden[:3].float()).all()
    print("STEPS DONE")
""")


@pytest.mark.parametrize("body", ["tiles", "ring", "ring:ew", "ring:g2", "ring:pf"])
@pytest.mark.parametrize("tool", ["racecheck", "synccheck"])
def test_persistent_steps_are_clean_under_compute_sanitizer(tool, body):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not os.path.exists(SANITIZER):
        pytest.skip("compute-sanitizer not installed")
    r = subprocess.run([SANITIZER, "--tool", tool, "--error-exitcode", "3", sys.executable, "-c", STEPS, body],
                       capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "STEPS DONE" in out, out[-6000:]
    # synccheck ends on "ERROR SUMMARY: 0 errors", racecheck on its own line
    clean = "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" if tool == "racecheck" else \
        "ERROR SUMMARY: 0 errors"
    assert clean in out, out[-6000:]
