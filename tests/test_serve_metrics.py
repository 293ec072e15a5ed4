"""/metrics of `futx serve` (Prometheus text format, one registry per server) and the requests the load test
found answered 5xx (now 4xx): lone surrogates, deep JSON nesting, seeds past torch's range, over-long prompts."""

import json
import time

import pytest
import torch

from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.serve import SamplingParams, Scheduler
from futx.serve.engines import DecodeEngine, ReferenceEngine
from futx.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")
pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from futx.serve.metrics import ServerMetrics  # noqa: E402
from futx.serve.server import App, ServerThread  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
CFG = tiny_config(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, num_hidden_layers=2, vocab_size=300)
NAME = "tiny-test"
CAPACITY = 96


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=3)


@pytest.fixture(scope="module")
def tok(tmp_path_factory, weights):
    from tiny_checkpoint import save_tiny_hf

    d = save_tiny_hf(tmp_path_factory.mktemp("metrics-tiny"), weights,
                     specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    return Tokenizer.from_hf_dir(d)


class Server:
    def __init__(self, weights, tok, slots=2):
        self.sched = Scheduler(ReferenceEngine(weights, slots, CAPACITY), tok, max_queue=8, prefill_chunk=16).start()
        self.srv = ServerThread(App(self.sched, tok, (NAME,), CFG.vocab_size).build()).start()
        self.client = httpx.Client(base_url=self.srv.url, timeout=30)

    def close(self):
        self.client.close()
        self.srv.stop()
        self.sched.stop()

    def metrics(self) -> dict:
        r = self.client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(r.text) for s in fam.samples}


@pytest.fixture
def server(weights, tok):
    s = Server(weights, tok)
    yield s
    s.close()


def value(m, name, **labels):
    return m[(name, tuple(sorted(labels.items())))]


def test_metrics_before_any_request(server):
    m = server.metrics()
    assert value(m, "futx_cache_slots_total") == 2 and value(m, "futx_cache_slots_free") == 2
    assert value(m, "futx_requests_running") == 0 and value(m, "futx_requests_waiting") == 0
    for o in ("ok", "client_error", "disconnected", "overloaded", "error"):
        assert value(m, "futx_requests_total", outcome=o) == 0
    assert value(m, "futx_time_to_first_token_seconds_count") == 0
    assert not any(name.startswith("futx_speculative") for name, _ in m)   # no drafter
    assert not any(name.startswith("python_") or name.startswith("process_") for name, _ in m)  # own registry
    # a contiguous cache has no pages; the prefix and preemption series show from the start, at 0
    for name in ("futx_cache_pages_total", "futx_cache_pages_free", "futx_cache_pages_cached",
                 "futx_prefix_cache_hit_rate", "futx_prefix_cache_hits_total", "futx_prefix_cache_hit_tokens_total",
                 "futx_preemptions_total"):
        assert value(m, name) == 0, name


def test_a_paged_server_shows_its_pages_and_prefix_hits(weights, tok):
    from futx.paging import PageLayout

    sched = Scheduler(ReferenceEngine(weights, 2, 256, PageLayout.for_capacity(128, 4, 2, 256)), tok,
                      prefill_chunk=64).start()
    srv = ServerThread(App(sched, tok, (NAME,), CFG.vocab_size).build()).start()
    s = Server.__new__(Server)
    s.sched, s.srv, s.client = sched, srv, httpx.Client(base_url=srv.url, timeout=30)
    try:
        m = s.metrics()
        assert value(m, "futx_cache_pages_total") == 4 and value(m, "futx_cache_pages_free") == 4
        prompt = list(range(1, 140))                     # one full page before its last token
        for _ in range(2):
            body = {"model": NAME, "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
            assert s.client.post("/v1/completions", json=body).status_code == 200
        m = s.metrics()
        assert value(m, "futx_prefix_cache_hits_total") == 1 and value(m, "futx_prefix_cache_hit_tokens_total") == 128
        assert value(m, "futx_prefix_cache_hit_rate") == pytest.approx(128 / (2 * 139))
        assert value(m, "futx_cache_pages_cached") == 1 and value(m, "futx_cache_pages_free") == 3
        assert value(m, "futx_preemptions_total") == 0
    finally:
        s.close()


def test_metrics_count_tokens_latencies_and_outcomes(server):
    body = {"model": NAME, "prompt": "the heat of the day", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    assert server.client.post("/v1/completions", json=body).status_code == 200
    with server.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and [ln for ln in r.iter_lines() if ln][-1] == "data: [DONE]"
    assert server.client.post("/v1/completions", json={**body, "max_tokens": -1}).status_code == 400
    assert server.client.post("/v1/completions", json={**body, "model": "nope"}).status_code == 404
    m = server.metrics()
    assert value(m, "futx_requests_total", outcome="ok") == 2
    assert value(m, "futx_requests_total", outcome="client_error") == 2
    assert value(m, "futx_generation_tokens_total") == 10
    assert value(m, "futx_prompt_tokens_total") == 2 * len("the heat of the day")
    assert value(m, "futx_time_to_first_token_seconds_count") == 2
    assert value(m, "futx_inter_token_latency_seconds_count") == 8   # 4 per request after the first token
    assert value(m, "futx_inter_token_latency_seconds_sum") > 0
    assert value(m, "futx_cache_slots_free") == 2


def test_each_server_has_its_own_registry(server, weights, tok):
    other = Server(weights, tok, slots=3)
    try:
        other.client.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2})
        assert value(other.metrics(), "futx_requests_total", outcome="ok") == 1
        assert value(other.metrics(), "futx_cache_slots_total") == 3
        assert value(server.metrics(), "futx_requests_total", outcome="ok") == 0
    finally:
        other.close()


def test_a_disconnect_is_counted_and_frees_its_slot(server):
    with server.client.stream("POST", "/v1/completions", json={"model": NAME, "prompt": "bye", "max_tokens": 80,
                                                                "temperature": 0, "ignore_eos": True,
                                                                "stream": True}) as r:
        next(ln for ln in r.iter_lines() if ln.startswith("data: "))
    deadline = time.time() + 20
    while time.time() < deadline:
        m = server.metrics()
        if value(m, "futx_requests_total", outcome="disconnected") == 1 and value(m, "futx_cache_slots_free") == 2:
            break
        time.sleep(0.05)
    assert value(m, "futx_requests_total", outcome="disconnected") == 1
    assert value(m, "futx_cache_slots_free") == 2 and value(m, "futx_requests_running") == 0


@pytest.mark.parametrize("raw, param", [
    (json.dumps({"model": NAME, "prompt": "broken \ud800 text"}).encode(), "prompt"),
    (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "a\udc00"}]}).encode(), "messages"),
    (b'{"model": "tiny-test", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None),
    (json.dumps({"model": NAME, "prompt": "x", "temperature": 0.5, "seed": 1 << 70}).encode(), "seed"),
    (b'{"model": "tiny-test", "prompt": "caf\xc3\x28", "max_tokens": 2}', None),
])
def test_requests_that_were_answered_5xx_are_4xx_now(server, raw, param):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    r = server.client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param


def test_an_oversized_prompt_is_refused_up_front_saying_the_limit(server):
    for prompt in ([5] * (CAPACITY + 1), "y" * (CAPACITY + 1), "z " * (CAPACITY * 64)):
        r = server.client.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 1})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "prompt"
        assert f"at most {CAPACITY} tokens" in err["message"]
    r = server.client.post("/v1/chat/completions", json={"model": NAME,
                                                         "messages": [{"role": "user", "content": "w" * CAPACITY}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert value(server.metrics(), "futx_requests_total", outcome="client_error") == 4


def test_speculative_acceptance_histogram(weights, tok):
    from futx.engine import DecodeModel, pack_model
    from futx.quant.simulated import quantized_weights
    from futx.speculative.ngram import NgramDrafter

    k = 3
    model = DecodeModel(pack_model(weights, "int4", progress=False), "int4", max_batch=2, capacity=CAPACITY,
                        backend="emulated", device="cpu", max_rows=2 * (k + 1))
    sched = Scheduler(DecodeEngine(model, None, quantized_weights(weights, "bf16")), tok, drafter=NgramDrafter(),
                      num_draft=k)
    metrics = ServerMetrics(sched)
    hs = [sched.submit(tok.encode(p), SamplingParams(max_tokens=12, ignore_eos=True))
          for p in ("the heat the heat the heat the", "hello there hello there")]
    sched.run_until_idle()
    fams = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    samples = {(s.name, s.labels.get("le")): s.value for s in fams["futx_speculative_accepted_tokens"].samples}
    s = sched.acceptance.summary()
    assert samples[("futx_speculative_accepted_tokens_count", None)] == s["verifications"] > 0
    assert samples[("futx_speculative_accepted_tokens_sum", None)] == pytest.approx(
        s["verifications"] * s["mean_accepted"])
    assert samples[("futx_speculative_accepted_tokens_bucket", "0.0")] == s["accepted_histogram"].get("0", 0)
    gen = {s.name: s.value for s in fams["futx_generation_tokens"].samples}
    assert gen["futx_generation_tokens_total"] == sum(len(h.output) for h in hs) == 24
    ttft = {s.name: s.value for s in fams["futx_time_to_first_token_seconds"].samples}
    itl = {s.name: s.value for s in fams["futx_inter_token_latency_seconds"].samples}
    assert ttft["futx_time_to_first_token_seconds_count"] == 2 and itl["futx_inter_token_latency_seconds_count"] == 22
