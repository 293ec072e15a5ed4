"""Serving on the CPU: the scheduler (continuous batching, chunked prefill, stops) on the reference model and
the emulated decode engine, and a real aiohttp server on a free port driven by httpx: completions and chat
(plain and streamed), concurrent requests, stop strings, max_tokens, 4xx errors, cancellation, `futx serve`."""

import json
import subprocess
import sys
import threading
import time

import pytest
import torch

from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.engine import DecodeModel, pack_model
from futx.engine.generate import generate
from futx.kvcache import KVCache
from futx.quant.simulated import quantized_weights
from futx.reference import PackedBatch, forward
from futx.serve import QueueFull, RequestTooLong, SamplingParams, Scheduler
from futx.serve.chat import render_chat
from futx.serve.detok import TextStream
from futx.serve.engines import DecodeEngine, ReferenceEngine
from futx.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")
pytest.importorskip("aiohttp")
from futx.serve.server import App, ServerThread  # noqa: E402

# head dim 64 and K/N on the decode kernels' granularity (the emulated engine checks them), vocab past the bytes
CFG = tiny_config(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, num_hidden_layers=2, vocab_size=300)
NAME = "tiny-test"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops on a busy 2-core machine (see conftest.single_thread)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=11, std=0.3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, weights):
    """The tiny model as an HF directory with a byte-level tokenizer and ChatML special tokens."""
    from tiny_checkpoint import save_tiny_hf

    return save_tiny_hf(tmp_path_factory.mktemp("serve-tiny"), weights,
                        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"))


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_hf_dir(model_dir)


def greedy_reference(weights, ids, n):
    """n greedy tokens of the reference model: whole-prompt prefill, then one token per step."""
    cache = KVCache(CFG, 1, len(ids) + n)
    logits = forward(CFG, weights, torch.tensor(ids), PackedBatch.from_lengths([len(ids)]), cache)
    new = []
    for _ in range(n):
        new.append(int(logits[-1].argmax()))
        logits = forward(CFG, weights, torch.tensor(new[-1:]), PackedBatch.decode([len(ids) + len(new) - 1]), cache,
                         phase="decode")
    return new


def run_all(scheduler, prompts, params):
    handles = [scheduler.submit(p, params) for p in prompts]
    scheduler.run_until_idle()
    return handles


# ---- pieces ----------------------------------------------------------------------------------------------------
def test_text_stream_holds_back_a_possible_stop_string(tok):
    s = TextStream(tok, stops=("END",))
    shown = "".join(s.push(t) for t in tok.encode("abc E"))
    assert shown == "abc " and not s.stopped  # "E" may start "END"
    shown += "".join(s.push(t) for t in tok.encode("Xy"))
    assert shown == "abc EXy"
    shown += "".join(s.push(t) for t in tok.encode(" ENDzz"))
    assert s.stopped and s.text == "abc EXy " and shown + s.finish() == "abc EXy "


def test_chat_template_matches_the_tokenizer(tok):
    assert render_chat(tok, [{"role": "user", "content": "hi"}]) == tok.chat_prompt("hi")
    two = render_chat(tok, [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}])
    assert two.startswith("<|im_start|>system\nS<|im_end|>\n") and two.endswith("c<|im_end|>\n<|im_start|>assistant\n")


def test_sampling_params_are_checked():
    for bad in (dict(max_tokens=0), dict(max_tokens=4, temperature=-1), dict(max_tokens=4, top_p=0),
                dict(max_tokens=4, stop=("",))):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# ---- the scheduler -------------------------------------------------------------------------------------------
def test_reference_scheduler_equals_the_reference_model(weights, tok):
    """Chunked packed prefill (chunk 5) + batched decode of prompts of different lengths = each alone."""
    prompts = [tok.encode("the heat of the summer afternoon"), tok.encode("x"), tok.encode("hello there")]
    sched = Scheduler(ReferenceEngine(weights, 2, 64), tok, prefill_chunk=5)
    hs = run_all(sched, prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [h.output for h in hs] == [greedy_reference(weights, p, 6) for p in prompts]
    assert all(h.finish_reason == "length" for h in hs) and max(sched.step_rows) == 2
    assert sched.prefill_tokens == sum(len(p) - 1 for p in prompts)
    with pytest.raises(RequestTooLong, match="cache positions"):
        sched.submit(prompts[0], SamplingParams(max_tokens=64))


def _engine(weights, batch, prefill=True, wf="int4", cf="int4", capacity=64):
    model = DecodeModel(pack_model(weights, wf, progress=False), cf, max_batch=batch, capacity=capacity,
                        backend="emulated", device="cpu")
    return DecodeEngine(model, None, quantized_weights(weights, "bf16") if prefill else None)


def test_decode_engine_batched_equals_alone_and_chunking_is_exact(weights, tok):
    prompts = [tok.encode("a longer prompt than the chunk"), tok.encode("hi"), tok.encode("third one")]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    together = run_all(Scheduler(_engine(weights, 2), tok, prefill_chunk=7), prompts, params)
    alone = [run_all(Scheduler(_engine(weights, 1), tok, prefill_chunk=512), [p], params)[0] for p in prompts]
    assert [h.output for h in together] == [h.output for h in alone]
    assert all(len(h.output) == 5 for h in together)


def test_decode_engine_without_prefill_is_the_old_generate(weights, tok):
    """No prefill weights: prompts read by the decode step, exactly engine.generate's tokens."""
    prompts = [tok.encode("abc def"), tok.encode("q"), tok.encode("more words")]
    got = run_all(Scheduler(_engine(weights, 2, prefill=False, wf="e4m3", cf="bf16"), tok), prompts,
                  SamplingParams(max_tokens=4, ignore_eos=True))
    want, _ = generate(_engine(weights, 2, prefill=False, wf="e4m3", cf="bf16").model, prompts, 4)
    assert [h.output for h in got] == want


def test_queue_limit_and_cancel(weights, tok):
    sched = Scheduler(ReferenceEngine(weights, 1, 32), tok, max_queue=2)
    a = sched.submit([1, 2], SamplingParams(max_tokens=20, ignore_eos=True))
    b = sched.submit([3], SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(QueueFull):
        sched.submit([4], SamplingParams(max_tokens=2))
    sched.tick()
    sched.tick()
    a.cancel()
    sched.run_until_idle()
    assert a.finish_reason == "cancelled" and len(a.output) < 20
    assert b.finish_reason == "length" and len(b.output) == 2  # took the freed slot
    assert list(a.events())[-1].finish_reason == "cancelled"


def test_cancelled_waiting_requests_hold_no_place_in_the_queue(weights, tok):
    """A client that leaves while queued frees its place at once, not at the next tick (the H200 load test's 503s:
    64 streams against --max-queue 64 while a long tick ran)."""
    sched = Scheduler(ReferenceEngine(weights, 1, 32), tok, max_queue=2)   # never ticked
    a = sched.submit([1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    sched.submit([3], SamplingParams(max_tokens=2, ignore_eos=True))
    a.cancel()
    c = sched.submit([4], SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(QueueFull, match="2 requests are already waiting"):
        sched.submit([5], SamplingParams(max_tokens=2))
    sched.run_until_idle()
    assert a.finish_reason == "cancelled" and c.finish_reason == "length"


# ---- the HTTP server -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(weights, tok):
    sched = Scheduler(ReferenceEngine(weights, 4, 128), tok, max_queue=16, prefill_chunk=8).start()
    srv = ServerThread(App(sched, tok, (NAME,), CFG.vocab_size).build()).start()
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        yield client, sched
    srv.stop()
    sched.stop()


def sse(lines) -> list:
    """The JSON events of a server-sent-event stream, checking it ends with [DONE]."""
    data = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def complete(client, **body):
    r = client.post("/v1/completions", json={"model": NAME, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_models_and_health(server):
    client, _ = server
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [NAME]
    assert client.get("/health").json()["status"] == "ok"


def test_completion_is_the_greedy_continuation(server, weights, tok):
    client, _ = server
    prompt = "the heat of a long summer day"  # 29 tokens: 4 prefill chunks of 8
    out = complete(client, prompt=prompt, max_tokens=6, ignore_eos=True)
    ids = tok.encode(prompt)
    assert out["object"] == "text_completion" and out["choices"][0]["finish_reason"] == "length"
    assert out["choices"][0]["text"] == tok.decode(greedy_reference(weights, ids, 6), skip_special=True)
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 6, "total_tokens": len(ids) + 6}
    # token-id prompts are accepted too
    assert complete(client, prompt=ids, max_tokens=6, ignore_eos=True)["choices"][0]["text"] == \
        out["choices"][0]["text"]


def test_streamed_completion_equals_the_plain_one(server):
    client, _ = server
    plain = complete(client, prompt="hello", max_tokens=8, ignore_eos=True)
    with client.stream("POST", "/v1/completions", json={
            "model": NAME, "prompt": "hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == plain["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1]["usage"]["completion_tokens"] == 8


def test_chat_completion_plain_and_streamed(server, tok):
    client, _ = server
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["prompt_tokens"] == len(tok.encode(tok.chat_prompt("hi")))
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = sse(r.iter_lines())
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == out["choices"][0]["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_concurrent_requests_share_steps_and_finish_independently(server):
    client, sched = server
    rows_before = len(sched.step_rows)
    long_done = []

    def long_request():
        with client.stream("POST", "/v1/completions", json={"model": NAME, "prompt": "a long one", "max_tokens": 100,
                                                             "temperature": 0, "ignore_eos": True,
                                                             "stream": True}) as r:
            lines = r.iter_lines()
            next(ln for ln in lines if ln.startswith("data: "))  # it is decoding now
            started.set()
            events = sse(lines)
        long_done.append((time.perf_counter(), events[-1]["choices"][0]["finish_reason"]))

    started = threading.Event()
    t = threading.Thread(target=long_request)
    t.start()
    assert started.wait(30)
    short = complete(client, prompt="short", max_tokens=3, ignore_eos=True)
    short_end = time.perf_counter()
    t.join(60)
    assert short["usage"]["completion_tokens"] == 3 and short["choices"][0]["finish_reason"] == "length"
    assert long_done and long_done[0][1] == "length" and long_done[0][0] > short_end
    assert 2 in list(sched.step_rows)[rows_before:]  # decode steps with both requests in the batch


def test_stop_strings(server):
    client, _ = server
    full = complete(client, prompt="the heat", max_tokens=16, ignore_eos=True)["choices"][0]["text"]
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip())
    want = full[:full.find(stop)]
    out = complete(client, prompt="the heat", max_tokens=16, ignore_eos=True, stop=[stop, "never-seen"])
    assert out["choices"][0] == {"index": 0, "text": want, "logprobs": None, "finish_reason": "stop"}
    with client.stream("POST", "/v1/completions", json={"model": NAME, "prompt": "the heat", "max_tokens": 16,
                                                         "temperature": 0, "ignore_eos": True, "stop": stop,
                                                         "stream": True}) as r:
        assert "".join(e["choices"][0]["text"] for e in sse(r.iter_lines())) == want


def test_seeded_sampling_repeats(server):
    client, _ = server
    a, b = (complete(client, prompt="hey", max_tokens=8, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)
            for _ in range(2))
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


BAD = [
    ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"prompt": "x"}, 400, "model"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "top_k": 3}, 400, "top_k"),
    ("/v1/completions", {"model": NAME, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": [5, 9999]}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stop": 7}, 400, "stop"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"model": NAME, "prompt": "x" * 120, "max_tokens": 20}, 400, "max_tokens"),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
     400, "stream"),
]


def test_bad_requests_get_json_errors_and_the_server_goes_on(server):
    client, _ = server
    for path, body, status, param in BAD:
        r = client.post(path, json=body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param, body
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "x" * 120, "max_tokens": 20})
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert complete(client, prompt="still here", max_tokens=2)["usage"]["completion_tokens"] >= 1


def test_a_client_that_goes_away_frees_its_slot(server):
    client, sched = server
    with client.stream("POST", "/v1/completions", json={"model": NAME, "prompt": "bye", "max_tokens": 120,
                                                         "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        next(ln for ln in r.iter_lines() if ln.startswith("data: "))
    deadline = time.time() + 20
    while sched.load["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert sched.load == {"waiting": 0, "running": 0, "slots": 4}


def test_queue_full_is_503(weights, tok):
    sched = Scheduler(ReferenceEngine(weights, 1, 32), tok, max_queue=1)  # never started: the queue stays full
    sched.submit([1], SamplingParams(max_tokens=2))
    srv = ServerThread(App(sched, tok, (NAME,), CFG.vocab_size).build()).start()
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "x"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
    finally:
        srv.stop()


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    client, _ = server
    oc = openai.OpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="none")
    out = oc.completions.create(model=NAME, prompt="hello", max_tokens=4, temperature=0,
                                extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    chunks = list(oc.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        oc.completions.create(model="nope", prompt="x")


# ---- the command -------------------------------------------------------------------------------------------------
def test_futx_serve_command(model_dir):
    proc = subprocess.Popen([sys.executable, "-m", "futx", "serve", "--model", str(model_dir), "--backend",
                             "reference", "--port", "0", "--capacity", "64", "--max-batch", "2", "--threads", "1",
                             "--served-model-name", NAME], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on http://" in line, proc.stderr.read() if proc.poll() is not None else line
        base = line.split("listening on ")[1].strip()
        r = httpx.post(base + "/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 3,
                                                    "temperature": 0, "ignore_eos": True}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_help_says_how_prompts_are_prefilled(capsys):
    from futx import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and "CUDA graphs per row bucket" in out and "--max-queue" in out


# ---- the GPU ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_server_on_the_kernels(tok):
    """The same client flow on futx's decode kernels (CUDA graphs), prefill on the BF16 reference path."""
    from futx.engine.graphs import GraphSteps

    w = random_weights(CFG, seed=11, std=0.05).to(device="cuda")
    model = DecodeModel(pack_model(w, "int4", progress=False), "int4", max_batch=4, capacity=128,
                        backend="kernels", device="cuda")
    engine = DecodeEngine(model, GraphSteps(model), quantized_weights(w, "bf16"))
    sched = Scheduler(engine, tok, prefill_chunk=8).start()
    srv = ServerThread(App(sched, tok, (NAME,), CFG.vocab_size).build()).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            body = {"model": NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            a = client.post("/v1/completions", json={**body, "prompt": "the heat of a long summer day"}).json()
            assert a["usage"]["completion_tokens"] == 6 and a["choices"][0]["finish_reason"] == "length"
            with client.stream("POST", "/v1/completions", json={**body, "prompt": "the heat of a long summer day",
                                                                 "stream": True}) as r:
                assert "".join(e["choices"][0]["text"] for e in sse(r.iter_lines())) == a["choices"][0]["text"]
            r = client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
            assert client.post("/v1/completions", json={**body, "prompt": "x", "n": 3}).status_code == 400
            assert client.get("/health").json()["status"] == "ok"
    finally:
        srv.stop()
        sched.stop()
