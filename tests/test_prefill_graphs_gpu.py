"""The prefill replayed as CUDA graphs (futx.engine.prefill_graphs) on a Hopper GPU: every call of a sequence of
packed batches (new requests, chunked continuations, padding to a bucket, fewer requests than the graph holds)
leaves the same bytes in the cache (main copy, mirror, scales) and the same last-row hidden states and FP8 scale
state as the eager prefill of the same batches; and the serving engine generates the same tokens with and
without prefill graphs.

    python -m pytest -m gpu -q tests/test_prefill_graphs_gpu.py
"""

import pytest
import torch

from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.engine import DecodeModel, pack_model
from futx.engine.cache import EngineCache
from futx.engine.graphs import GraphSteps
from futx.engine.prefill import PrefillModel, pack_prefill, prefill_tokens
from futx.engine.prefill_graphs import PrefillGraphs

pytestmark = pytest.mark.gpu

CAP = 256
CFGS = {hd: tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=hd, num_hidden_layers=2, vocab_size=512) for hd in (64, 128)}
# (lengths, starts, slots) per call: new requests, then continuations plus a new one, then one short chunk
CALLS = [([77, 1, 130], [0, 0, 0], [0, 1, 2]),
         ([20, 5, 40, 9], [77, 1, 130, 0], [0, 1, 2, 3]),
         ([3], [97], [0])]
# (head dim, weights, cache, the graphs' glue; the eager model always runs the eager torch glue)
CASES = [(64, "e4m3", "int4", "eager"), (128, "e4m3", "int4", "eager"), (128, "bf16", "int4", "eager"),
         (128, "e4m3", "e4m3", "eager"), (64, "bf16", "bf16", "eager"), (128, "e4m3", "int4", "kernel")]


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int16) \
        if t.dtype == torch.bfloat16 else t


def _pair(w, fmt, cache_fmt, glue):
    weights = pack_prefill(w, fmt)
    models = []
    for kind in ("eager", glue):
        cache = EngineCache(w.config, cache_fmt, 4, CAP, "cuda")
        for lc in cache.layers:   # unwritten rows stay NaN: nothing may read them
            lc.k_cache.fill_(float("nan"))
            lc.v_cache.fill_(float("nan"))
        models.append(PrefillModel(weights, cache, "kernels", glue=kind))
    return models


def _calls(w, eager, graphs):
    """(graph, eager) last-row hidden states of every call in CALLS."""
    g = torch.Generator().manual_seed(2)
    for lengths, starts, slots in CALLS:
        prompts = [torch.randint(0, w.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
        want = prefill_tokens(eager, prompts, starts, slots).hidden
        got = graphs.run(torch.tensor(sum(prompts, [])), lengths, starts, slots)
        torch.cuda.synchronize()
        yield got.clone(), want


@pytest.mark.parametrize("hd,fmt,cache_fmt,glue", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_graph_prefill_equals_eager(hd, fmt, cache_fmt, glue):
    """glue "kernel" (futx's row-quantization kernel) stores the torch glue's bytes, so it is equal too."""
    w = random_weights(CFGS[hd], seed=5, std=0.05).to(device="cuda")
    eager, pm = _pair(w, fmt, cache_fmt, glue)
    graphs = PrefillGraphs(pm, max_rows=256, max_requests=4)
    for got, want in _calls(w, eager, graphs):
        assert torch.equal(got, want)
    assert graphs.replays == (2 if fmt == "e4m3" else 3) and graphs.eager_calls == (1 if fmt == "e4m3" else 0)
    for a, b in zip(eager.cache.layers, pm.cache.layers):
        for ta, tb in zip(a.tensors(), b.tensors()):
            if ta is not None:   # real slots 0..3 (the scratch slot holds the padding rows)
                assert torch.equal(_bytes(ta[:4]), _bytes(tb[:4]))
    if fmt == "e4m3":
        sa, sb = eager.state(), pm.state()
        for x, y in zip(sa.tensors(), sb.tensors()):
            assert torch.equal(x, y)
    with pytest.raises(ValueError, match="overflow"):
        graphs.run(torch.zeros(4, dtype=torch.int64), [4], [CAP - 2], [0])
    with pytest.raises(ValueError, match="slot"):
        graphs.run(torch.zeros(4, dtype=torch.int64), [4], [0], [4])
    with pytest.raises(ValueError, match="token ids"):
        graphs.run(torch.full((4,), w.config.vocab_size), [4], [0], [0])


def test_compiled_glue_in_graphs_is_close():
    """glue="compiled" (torch.compile'd per-row FP8 quantization) in the graphs: within the FP8
    noise of the eager glue (not bitwise: E4M3 ties and folded constant divisions, futx.engine.compiled)."""
    w = random_weights(CFGS[128], seed=5, std=0.05).to(device="cuda")
    eager, pm = _pair(w, "e4m3", "int4", "compiled")
    graphs = PrefillGraphs(pm, max_rows=256, max_requests=4)
    for got, want in _calls(w, eager, graphs):
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 0.1
    assert graphs.replays == 2
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    mirror = EngineCache(w.config, "int4", 4, CAP, "cuda")   # the eager writer on the compiled run's main rows
    for layer in range(w.config.num_hidden_layers):   # slot 0 holds positions 0..99 after CALLS
        lc = pm.cache.layers[layer]
        assert rel(lc.k_cache[0, :, :100], eager.cache.layers[layer].k_cache[0, :, :100]) < 0.1
        mirror.write_rows(layer, torch.zeros(100, dtype=torch.long, device="cuda"), torch.arange(100, device="cuda"),
                          lc.k_cache[0, :, :100].transpose(0, 1), lc.v_cache[0, :, :100].transpose(0, 1))
        for got, want in zip(pm.cache.read(layer, 0, 100), mirror.read(layer, 0, 100)):
            assert rel(got, want) < 1e-2


def test_serving_engine_generates_the_same_with_prefill_graphs():
    from futx.serve.engines import DecodeEngine
    from futx.serve.sampling import SamplingParams
    from futx.serve.scheduler import Scheduler

    w = random_weights(CFGS[128], seed=7, std=0.05).to(device="cuda")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (90, 13, 200, 41, 7)]
    outs = []
    with torch.inference_mode():
        for use_graphs in (False, True):
            model = DecodeModel(pack_model(w, "int4", progress=False), "int4", max_batch=4, capacity=CAP,
                                backend="kernels", device="cuda")
            pm = PrefillModel(pack_prefill(w, "e4m3"), model.cache, "kernels")
            pg = PrefillGraphs(pm, max_rows=64, max_requests=4) if use_graphs else None
            engine = DecodeEngine(model, GraphSteps(model), None, pm, pg)
            sched = Scheduler(engine, _NullTok(), prefill_chunk=64)
            handles = [sched.submit(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
                       for p in prompts]
            sched.run_until_idle()
            outs.append([h.output for h in handles])
            if use_graphs:
                assert pg.replays > 0 and "CUDA graphs" in engine.describe()
    assert outs[0] == outs[1]


class _NullTok:
    eos_ids: tuple = ()

    def decode(self, ids, skip_special=True):
        return ""
