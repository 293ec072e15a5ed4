"""The persistent layer's projections (decode/persistent_layer.py, tuning-space keys
decode.persistent.projections.m1[.c2]) on the GPU: one launch of a layer's task table (M = 1) runs the tile GEMV's
bodies ordered by counters, and its four outputs equal the four standalone tile GEMV launches bit for bit (same
bodies, same epilogues), for the 8B layer and a small one, on 132 CTAs (and 264 with the two-CTA variant), outputs
NaN-poisoned before; the counters end at their cumulative totals."""

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))
from scripts.bench_persistent_layer import standalone  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def kernels():
    import tuning_space

    from futx.runtime import get_kernel

    tuning_space.register()
    return {c: get_kernel("decode.persistent.projections.m1" + ("" if c == 1 else f".c{c}")) for c in (1, 2)}


def _config(name):
    from futx.config import PRESETS

    cfg = PRESETS["llama-3.1-8b"].replace(num_hidden_layers=1)
    if name == "small":
        cfg = cfg.replace(hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2)
    return cfg


@pytest.mark.parametrize("shape", ["8b", "small"])
@pytest.mark.parametrize("ctas_per_sm", [1, 2])
def test_persistent_projections_equal_the_standalone_kernels(kernels, shape, ctas_per_sm):
    from decode.persistent_schedule import make_schedule, task_table
    from futx.engine.packed import random_packed

    cfg = _config(shape)
    lw = random_packed(cfg, "int4", device="cuda", seed=3).layers[0]
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(1, cfg.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
    attn = torch.randn(1, cfg.q_size, generator=g, device="cuda").to(torch.bfloat16)
    eps = cfg.rms_norm_eps
    want = standalone(lw, h, attn, eps)
    sched = make_schedule(cfg, 1, 1024, ctas=132 * ctas_per_sm)
    table = task_table(sched).cuda()
    got = [torch.full_like(t, float("nan")) for t in want]
    for _ in range(2):
        counters = torch.zeros(len(sched.graph.counters), dtype=torch.int32, device="cuda")
        kernels[ctas_per_sm](table, counters, h, lw.qkv.packed, lw.qkv.scales, got[0], attn, lw.o.packed,
                             lw.o.scales, got[1], lw.gateup.packed, lw.gateup.scales, got[2], lw.down.packed,
                             lw.down.scales, got[3], eps)
        torch.cuda.synchronize()
        for name, a, b in zip(("qkv", "hmid", "act", "h_out"), got, want):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name
        totals = [c.target(0) for c in sched.graph.counters]
        assert counters.tolist() == totals
        for t in got:
            t.fill_(float("nan"))
