"""The persistent decode layer in the engine (futx.engine.persistent, registry decode.persistent.layer.*) on the
GPU: one-row steps on it against the engine's shipped step, both from the same random cache and weights.

Same arithmetic but the attention's split-KV partials (8 warps per CTA and the persistent table's split count vs 4
warps and the op's), which round differently: hidden rows agree within BF16 rounding carried through the layers.
Layer 0's new cache rows come from the same QKV bits through the same writer: equal bit for bit. Scratch buffers
are NaN-poisoned first; several consecutive steps (counters zeroed per step), contexts 1, 63, 64, 1025 (tiles and
splits at their edges), slot 1 of 2, INT4 and E4M3 caches, graph replay equal to eager."""

import pytest
import torch

from futx.config import PRESETS
from futx.engine import DecodeModel
from futx.engine.graphs import GraphSteps
from futx.engine.packed import random_packed

pytestmark = pytest.mark.gpu
CAPACITY = 2048
STEPS = 3


def _config(name):
    cfg = PRESETS["llama-3.1-8b"].replace(num_hidden_layers=2, vocab_size=1024)
    if name == "small":   # GQA group 4, K = 1024 / 2816 (22 groups)
        cfg = cfg.replace(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2)
    return cfg


@pytest.fixture(scope="module", params=["8b", "small"])
def packed(request):
    return random_packed(_config(request.param), "int4", device="cuda", seed=5)


def _pair(packed, cf):
    models = []
    for persistent in (False, True):
        m = DecodeModel(packed, cf, max_batch=2, capacity=CAPACITY, device="cuda", persistent=persistent)
        m.cache.randomize(11)
        models.append(m)
    p = models[1].persistent
    for t in (p.qkv, p.attn, p.hmid, p.act, p.ws_o, p.ws_ml):
        t.fill_(float("nan"))
    return models


def _run(m, start, slot=1, graphs=None):
    out = []
    for s in range(STEPS):
        n = m.load_inputs([100 + 7 * s], [start + s], [slot])
        if graphs is None:
            m.step(n)
        else:
            graphs.replay(n)
        out.append(m.buffers.hidden[:1].clone())
    return torch.cat(out)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("cf", ["int4", "e4m3"])
@pytest.mark.parametrize("start", [0, 62, 63, 1024])
def test_persistent_step_equals_the_shipped_step(packed, cf, start):
    ref, per = _pair(packed, cf)
    assert per.persistent is not None and ref.persistent is None
    want, got = _run(ref, start), _run(per, start)
    assert torch.isfinite(got).all()
    assert _rel(got, want) < 1e-2, _rel(got, want)
    for a, b in zip(ref.cache.layers[0].tensors(), per.cache.layers[0].tensors()):   # same history, same new rows
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_persistent_graph_replay_equals_eager(packed):
    _, per = _pair(packed, "int4")
    eager = _run(per, 200)
    _, per2 = _pair(packed, "int4")
    graphs = GraphSteps(per2, buckets=[1])
    replayed = _run(per2, 200, graphs=graphs)
    assert torch.equal(eager.view(torch.int16), replayed.view(torch.int16))


def test_persistent_counters_end_at_their_totals(packed):
    _, per = _pair(packed, "int4")
    _run(per, 5)
    torch.cuda.synchronize()
    p = per.persistent
    from decode.persistent_host import F

    signals = torch.cat([p.table[..., F["signal0"]].flatten(), p.table[..., F["signal1"]].flatten()])
    totals = torch.bincount(signals[signals >= 0].long().cpu(), minlength=p.counter_count)
    assert p.counters.cpu().tolist() == totals.tolist()
