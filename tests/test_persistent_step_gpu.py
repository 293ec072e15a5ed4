"""The persistent decode layer in the engine (futx.engine.persistent, registry decode.persistent.layer.*) on the
GPU: steps of 1, 3 and 8 rows on it against the engine's shipped step, both from the same random cache and weights.

Same arithmetic but the attention's split-KV partials (8 warps per CTA and the persistent table's split count vs 4
warps and the op's), which round differently: at one row hidden rows agree within BF16 rounding carried through the
layers, and layer 0's new cache rows come from the same QKV bits through the same writer: equal bit for bit. With
several rows the shipped step runs the router's kernels for its row count, whose rounding differs from the layer's
bodies in places, and a new cache row that requantizes differently feeds every later step: the chained steps can
drift apart further than one step's rounding, so there each is held to the emulated backend's float reference
(futx.engine, backend="emulated"): the persistent step as close to it as the shipped step is.
Scratch buffers are NaN-poisoned first; several consecutive steps (counters zeroed per step); the first row at
contexts 1, 63, 64, 1025, 8191 (tiles and splits at their edges), the others 5 positions apart below it; slots 1..M
of M + 1; INT4 and E4M3 caches; graph replay equal to eager."""

import pytest
import torch

from futx.config import PRESETS
from futx.engine import DecodeModel
from futx.engine.graphs import GraphSteps
from futx.engine.packed import random_packed

pytestmark = pytest.mark.gpu
CAPACITY = 8200
STEPS = 3
SLOTS = 9


def _config(name):
    cfg = PRESETS["llama-3.1-8b"].replace(num_hidden_layers=2, vocab_size=1024)
    if name == "small":   # GQA group 4, K = 1024 / 2816 (22 groups: not whole ring stages)
        cfg = cfg.replace(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2)
    return cfg


@pytest.fixture(scope="module", params=["8b", "small"])
def packed(request):
    return random_packed(_config(request.param), "int4", device="cuda", seed=5)


@pytest.fixture(scope="module", params=["8b", "small-ring"])
def ring_packed(request):
    """Shapes the ring layer takes (every K a multiple of 1024): the 8B's, and GQA 4 with K = 1024 / 3072."""
    cfg = _config("8b" if request.param == "8b" else "small")
    if request.param == "small-ring":
        cfg = cfg.replace(intermediate_size=3072)
    return random_packed(cfg, "int4", device="cuda", seed=5)


def _pair(packed, cf, rows=1, emulated=False, body="tiles", variant=""):
    """(shipped, persistent[, emulated]) models over equal random caches (`body`, `variant`: the persistent
    layer's)."""
    from futx.engine.persistent import PersistentStep

    models = []
    for kw in [dict(persistent=False), dict(persistent=body == "tiles")] + ([dict(backend="emulated")] if emulated
                                                                           else []):
        m = DecodeModel(packed, cf, max_batch=SLOTS, capacity=CAPACITY, device="cuda", **kw)
        m.cache.randomize(11)
        models.append(m)
    if body == "ring":
        models[1].persistent = PersistentStep(models[1], body="ring", variant=variant)
    p = models[1].persistent
    t = p.tables(rows)
    for buf in (p.qkv, p.attn, p.hmid, p.act, t["ws_o"], t["ws_ml"]):
        buf.fill_(float("nan"))
    return models


def _run(m, start, rows=1, graphs=None):
    """STEPS steps of `rows` rows: row r in slot r + 1 at position max(0, start - 5 r) + step."""
    out = []
    for s in range(STEPS):
        tokens = [100 + 7 * s + r for r in range(rows)]
        n = m.load_inputs(tokens, [max(0, start - 5 * r) + s for r in range(rows)], list(range(1, rows + 1)))
        if graphs is None:
            m.step(n)
        else:
            graphs.replay(n)
        out.append(m.buffers.hidden[:rows].clone())
    return torch.stack(out)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("cf", ["int4", "e4m3"])
@pytest.mark.parametrize("start", [0, 62, 63, 1024, 8190])
def test_persistent_step_equals_the_shipped_step(packed, cf, start, rows):
    _check(*_pair(packed, cf, rows, emulated=rows > 1), start=start, rows=rows)


def _check(ref, per, *emu, start, rows):
    """One row: the persistent steps against the shipped ones directly (1%, layer 0's cache bit for bit); several: each
    held to the emulated float reference as close as the shipped step is."""
    assert per.persistent is not None and ref.persistent is None
    want, got = _run(ref, start, rows), _run(per, start, rows)
    assert torch.isfinite(got).all()
    if rows == 1:
        assert _rel(got, want) < 1e-2, _rel(got, want)
        for a, b in zip(ref.cache.layers[0].tensors(), per.cache.layers[0].tensors()):   # same new rows
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return
    exact = _run(emu[0], start, rows)
    for r in range(rows):
        mine, theirs = _rel(got[:, r], exact[:, r]), _rel(want[:, r], exact[:, r])
        assert mine <= max(1.5 * theirs, 1e-2), (r, mine, theirs)


@pytest.mark.parametrize("rows", [1, 3])
def test_persistent_graph_replay_equals_eager(packed, rows):
    _, per = _pair(packed, "int4", rows)
    eager = _run(per, 200, rows)
    _, per2 = _pair(packed, "int4", rows)
    graphs = GraphSteps(per2, buckets=[rows])
    replayed = _run(per2, 200, rows, graphs=graphs)
    assert torch.equal(eager.view(torch.int16), replayed.view(torch.int16))


@pytest.mark.parametrize("rows", [1, 8])
def test_persistent_counters_end_at_their_totals(packed, rows):
    _, per = _pair(packed, "int4", rows)
    _run(per, 5, rows)
    torch.cuda.synchronize()
    t = per.persistent.tables(rows)
    from decode.persistent_host import F

    signals = torch.cat([t["table"][..., F["signal0"]].flatten(), t["table"][..., F["signal1"]].flatten()])
    totals = torch.bincount(signals[signals >= 0].long().cpu(), minlength=t["counters"].numel())
    assert t["counters"].cpu().tolist() == totals.tolist()


# ---- the ring layer (decode/persistent_ring.py: a producer warp streams the weights) --------------------------------
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("cf", ["int4", "e4m3"])
@pytest.mark.parametrize("start", [0, 62, 63, 1024, 8190])
def test_ring_step_equals_the_shipped_step(ring_packed, cf, start, rows):
    """As the tile layer: at one row hidden rows within 1% (the warps' strided units and the split counts round
    differently), layer 0's new cache rows bit for bit; at several each held to the emulated reference."""
    models = _pair(ring_packed, cf, rows, emulated=rows > 1, body="ring")
    assert models[1].persistent.body == "ring"
    _check(*models, start=start, rows=rows)


@pytest.mark.parametrize("start", [63, 8190])
def test_ring_step_stages_wide_rows_in_chunks(start):
    """8 rows of the 70B layer's inputs do not fit the body at once: QKV, O and gate/up (K = 8192) stage them in two
    chunks, down (K = 28672) in four, the RMSNorm sums of squares carried across the chunks."""
    from futx.config import preset
    from decode.persistent_host import layer_plan, ring_chunk_stages

    assert ring_chunk_stages(layer_plan("int4", 128).smem_bytes, 8, 8) == 7   # < 8 stages of K = 8192
    cfg = preset("layer-70b").replace(num_hidden_layers=2, vocab_size=1024)
    models = _pair(random_packed(cfg, "int4", device="cuda", seed=5), "int4", 8, emulated=True, body="ring")
    _check(*models, start=start, rows=8)


@pytest.mark.parametrize("rows", [1, 3])
def test_ring_graph_replay_equals_eager(ring_packed, rows):
    _, per = _pair(ring_packed, "int4", rows, body="ring")
    eager = _run(per, 200, rows)
    _, per2 = _pair(ring_packed, "int4", rows, body="ring")
    replayed = _run(per2, 200, rows, graphs=GraphSteps(per2, buckets=[rows]))
    assert torch.equal(eager.view(torch.int16), replayed.view(torch.int16))


def test_ring_counters_end_at_their_totals(ring_packed):
    _, per = _pair(ring_packed, "int4", 1, body="ring")
    _run(per, 5)
    torch.cuda.synchronize()
    t = per.persistent.tables(1)
    from decode.persistent_host import F

    signals = torch.cat([t["table"][..., F["signal0"]].flatten(), t["table"][..., F["signal1"]].flatten()])
    totals = torch.bincount(signals[signals >= 0].long().cpu(), minlength=t["counters"].numel())
    assert t["counters"].cpu().tolist() == totals.tolist()



@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("variant", ["la", "s4", "s8", "ew", "g2", "g4", "ewg2", "pf", "ewg2pf"])
def test_ring_variants_equal_the_routed_ring_bit_for_bit(ring_packed, variant, rows):
    """The ring's tuning space (futx.runtime.catalog.persistent.RING_TUNING: consumers one stage ahead, shallower
    rings, an epilogue warp, stages taken in groups) changes when the weights arrive, who finishes a task and how
    the instructions interleave, not what is summed in which order: the steps equal the routed ring's."""
    from tuning import tuning_space

    tuning_space().register()
    _, routed = _pair(ring_packed, "int4", rows, body="ring")
    _, tuned = _pair(ring_packed, "int4", rows, body="ring", variant=variant)
    assert tuned.persistent.variant == variant
    want, got = _run(routed, 1000, rows), _run(tuned, 1000, rows)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("start", [0, 62, 63, 1024, 8190])
@pytest.mark.parametrize("variant", ["pf", "ewg2pf"])
def test_early_tile_ring_equals_the_routed_ring_at_every_context(ring_packed, variant, start, rows):
    """The early_tiles variants request an attention partial's first cache tiles before its counter wait, the new
    row's position zero-filled and its tile requested again once written: at contexts where that tile is the first
    or a later one of a split (and 1, where it is the only one), the steps equal the routed ring's bit for bit."""
    from tuning import tuning_space

    tuning_space().register()
    _, routed = _pair(ring_packed, "int4", rows, body="ring")
    _, tuned = _pair(ring_packed, "int4", rows, body="ring", variant=variant)
    want, got = _run(routed, start, rows), _run(tuned, start, rows)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
