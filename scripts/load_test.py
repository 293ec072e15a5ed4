#!/usr/bin/env python3
"""Load and fault test of `futx serve`: a separate client process on loopback, bounded in requests and time.

    python scripts/load_test.py --url http://127.0.0.1:8000 [--requests 1000 --concurrency 64 ...]
    python scripts/load_test.py --spawn [options] -- <futx serve arguments>     # starts and stops the server

It sends `--requests` requests from `--concurrency` threads (standard library only: http.client): a length mix of
short chats (/v1/chat/completions) and long token-id prompts (/v1/completions, `--long-tokens` per prompt),
plain and streamed, all with `ignore_eos` so each valid one must generate exactly its `max_tokens`; a
`--malformed` fraction of bad requests (invalid JSON, wrong types, negative max_tokens, unknown fields, huge
prompts, invalid UTF-8, lone surrogates, deep nesting, NaN, an oversized body, unknown model, wrong method/route),
each of which must be answered 4xx with an OpenAI error body; and a `--disconnect` fraction of clients that go
away mid-stream (or, non-streamed, right after sending, or halfway through sending the body). Required, else
exit status 1:

    no 5xx and no transport failure on any request the client did not abandon itself
    every valid request finished with finish_reason "length" and usage.completion_tokens == max_tokens
    every malformed request got a 4xx with {"error": {"message", "type", "param", "code"}}
    the server is alive at the end (/health answers; with --spawn the process has not exited)
    afterwards nothing runs or waits and every cache slot is free (/metrics: futx_cache_slots_free ==
    futx_cache_slots_total), and futx_requests_total{outcome="error"} did not grow
    afterwards every page of a paged cache is back in the free pool, or held only by the prefix cache (reported
    apart: futx_cache_pages_free + futx_cache_pages_cached == futx_cache_pages_total), and so is every staging page
    of an INT4-only cache (futx_cache_staging_pages_free == futx_cache_staging_pages_total)
    everything finished within --time-limit seconds

A summary goes to stdout and, with --json, to a file. Only loopback servers are accepted.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import asdict, dataclass, field
from typing import Optional
from urllib.parse import urlsplit

WORDS = ("the of and to in is was for on that with as by at from his her an it were which this are be had not or "
         "summer heat river city light morning garden station window letter music winter road friend market "
         "question answer story number history paper voice water island engine season dinner evening").split()
MALFORMED = ("bad_json", "wrong_type", "negative_max_tokens", "unknown_field", "huge_prompt_tokens",
             "huge_prompt_text", "invalid_utf8", "lone_surrogate", "deep_nesting", "nan", "not_an_object",
             "unknown_model", "empty_messages", "huge_body", "wrong_method", "unknown_route", "seed_overflow")
MAX_BODY = 8 * 1024 * 1024   # futx.serve.server.MAX_BODY


@dataclass
class Plan:
    index: int
    kind: str                      # chat | long | malformed | disconnect
    method: str = "POST"
    path: str = "/v1/completions"
    body: bytes = b""
    stream: bool = False
    max_tokens: int = 0
    case: str = ""                 # the malformed case, or the disconnect style
    prompt_tokens: int = 0         # token-id prompts: their length


@dataclass
class Result:
    index: int
    kind: str
    case: str
    status: Optional[int] = None
    ok: bool = False
    problem: str = ""
    seconds: float = 0.0
    ttft: Optional[float] = None   # streamed: the first data event
    completion_tokens: Optional[int] = None


@dataclass
class Summary:
    config: dict
    counts: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    requirements: dict = field(default_factory=dict)
    latency: dict = field(default_factory=dict)
    metrics_before: dict = field(default_factory=dict)
    metrics_after: dict = field(default_factory=dict)
    wall_seconds: float = 0.0
    passed: bool = False


# ---- the requests ------------------------------------------------------------------------------------------
def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 0 < LO <= HI, got {text!r}")
    return lo, hi


def build_plan(args, model: str, capacity: int, vocab: int) -> list[Plan]:
    rng = random.Random(args.seed)
    n = args.requests
    n_bad, n_gone = round(n * args.malformed), round(n * args.disconnect)
    kinds = ["malformed"] * n_bad + ["disconnect"] * n_gone
    rest = n - len(kinds)
    n_long = round(rest * args.long_fraction)
    kinds += ["long"] * n_long + ["chat"] * (rest - n_long)
    rng.shuffle(kinds)
    top = min(vocab, 256)   # byte-level ids: every tokenizer has them; special tokens are harmless here
    cases = list(MALFORMED)
    rng.shuffle(cases)        # taken in turn: every case once there are len(MALFORMED) malformed requests
    n_seen = 0
    plans = []
    shared = [rng.randrange(top) for _ in range(args.shared_prefix)]
    for i, kind in enumerate(kinds):
        max_tokens = rng.randint(*args.max_tokens)
        if kind in ("long", "disconnect"):
            lo, hi = args.long_tokens if kind == "long" else (8, 64)
            if kind == "disconnect":   # long enough to be cut off mid-stream
                max_tokens = args.max_tokens[1]
            length = min(rng.randint(lo, hi), capacity - max_tokens)
            if length < 1:
                raise SystemExit(f"--long-tokens / --max-tokens do not fit the server's capacity {capacity}")
            ids = [rng.randrange(top) for _ in range(length)]
            if kind == "long" and shared:   # a common "system prompt": the prefix cache's case
                ids = (shared + ids)[:length]
            stream = kind == "disconnect" or rng.random() < 0.5
            body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            if stream:
                body.update(stream=True, stream_options={"include_usage": True})
            case = "" if kind == "long" else rng.choice(("mid_stream", "mid_stream", "after_send", "mid_body"))
            if case == "after_send":
                body.pop("stream"), body.pop("stream_options")
                stream = False
            plans.append(Plan(i, kind, body=json.dumps(body).encode(), stream=stream, max_tokens=max_tokens,
                              case=case, prompt_tokens=length))
        elif kind == "chat":
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*args.chat_words)))
            stream = rng.random() < 0.5
            body = {"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": max_tokens,
                    "ignore_eos": True}
            body["temperature"] = 0 if rng.random() < 0.5 else 0.8
            if body["temperature"]:
                body["seed"] = rng.randrange(1 << 32)
            if stream:
                body.update(stream=True, stream_options={"include_usage": True})
            plans.append(Plan(i, kind, path="/v1/chat/completions", body=json.dumps(body).encode(), stream=stream,
                              max_tokens=max_tokens))
        else:
            plans.append(malformed(i, cases[n_seen % len(cases)], model, capacity, top, rng))
            n_seen += 1
    return plans


def malformed(i: int, case: str, model: str, capacity: int, top: int, rng: random.Random) -> Plan:
    ok = {"model": model, "prompt": "hello", "max_tokens": 4}
    path, method = "/v1/completions", "POST"
    if case == "bad_json":
        body = rng.choice((b'{"model": "x", "prompt": ', b"{not json}", b"", b"[1, 2", b'{"a": 1}}'))
    elif case == "wrong_type":
        field_, value = rng.choice((("max_tokens", "5"), ("temperature", "hot"), ("stream", "yes"), ("prompt", 5),
                                    ("stop", 7), ("seed", 1.5), ("top_p", [1])))
        body = json.dumps({**ok, field_: value}).encode()
    elif case == "negative_max_tokens":
        body = json.dumps({**ok, "max_tokens": -rng.randint(1, 100)}).encode()
    elif case == "unknown_field":
        body = json.dumps({**ok, rng.choice(("top_k", "tools", "frobnicate")): 3}).encode()
    elif case == "huge_prompt_tokens":
        ids = [rng.randrange(top) for _ in range(capacity + 1 + rng.randrange(64))]
        body = json.dumps({**ok, "prompt": ids}).encode()
    elif case == "huge_prompt_text":
        body = json.dumps({**ok, "prompt": "lorem ipsum " * (capacity * 8)}).encode()
    elif case == "invalid_utf8":
        body = b'{"model": "' + model.encode() + b'", "prompt": "caf\xc3\x28 \xff\xfe", "max_tokens": 4}'
    elif case == "lone_surrogate":
        body = json.dumps({**ok, "prompt": "broken \ud800 text"}).encode()   # json escapes it as \ud800
    elif case == "deep_nesting":
        body = b'{"model": "' + model.encode() + b'", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    elif case == "nan":
        body = json.dumps({**ok, "temperature": float("nan")}).encode()
    elif case == "not_an_object":
        body = json.dumps(rng.choice(([1, 2], "prompt", None, 3))).encode()
    elif case == "unknown_model":
        body = json.dumps({**ok, "model": model + "-nope"}).encode()
    elif case == "empty_messages":
        path, body = "/v1/chat/completions", json.dumps({"model": model, "messages": []}).encode()
    elif case == "huge_body":
        body = json.dumps({**ok, "prompt": "x" * (MAX_BODY + 1024)}).encode()
    elif case == "wrong_method":
        method, body = "GET", b""
    elif case == "unknown_route":
        path, body = "/v1/embeddings", json.dumps(ok).encode()
    elif case == "seed_overflow":
        body = json.dumps({**ok, "temperature": 0.5, "seed": 1 << 70}).encode()
    else:
        raise ValueError(case)
    return Plan(i, "malformed", method=method, path=path, body=body, case=case)


# ---- the client --------------------------------------------------------------------------------------------
class Client:
    def __init__(self, host: str, port: int, deadline: float, timeout: float):
        self.host, self.port, self.deadline, self.timeout = host, port, deadline, timeout

    def connect(self) -> http.client.HTTPConnection:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the time limit passed before this request started")
        return http.client.HTTPConnection(self.host, self.port, timeout=min(self.timeout, left))

    def run(self, p: Plan) -> Result:
        r = Result(p.index, p.kind, p.case)
        t0 = time.monotonic()
        try:
            if p.kind == "malformed":
                self._malformed(p, r)
            elif p.kind == "disconnect":
                self._disconnect(p, r)
            else:
                self._valid(p, r, t0)
        except Exception as e:  # noqa: BLE001 -- a transport failure is a result, never a crash of the client
            r.ok, r.problem = False, f"{type(e).__name__}: {e}"
        r.seconds = time.monotonic() - t0
        if r.status is not None and r.status >= 500:
            r.ok = False
            r.problem = r.problem or f"HTTP {r.status}"
        return r

    def _send(self, p: Plan) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self.connect()
        headers = {"Content-Type": "application/json"} if p.method == "POST" else {}
        conn.request(p.method, p.path, body=p.body if p.method == "POST" else None, headers=headers)
        return conn, conn.getresponse()

    def _malformed(self, p: Plan, r: Result) -> None:
        try:
            conn, resp = self._send(p)
        except (BrokenPipeError, ConnectionResetError) as e:
            # a body past the server's limit: it may answer 413 and close before the client has sent it all
            if p.case == "huge_body":
                r.ok, r.problem = True, f"connection closed while sending ({type(e).__name__})"
                return
            raise
        with closing(conn):
            r.status, data = resp.status, resp.read()
        if not 400 <= resp.status < 500:
            r.problem = f"HTTP {resp.status} for a malformed request ({p.case}): {data[:200]!r}"
            return
        try:
            err = json.loads(data)["error"]
            shape = set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
        except (ValueError, KeyError, TypeError):
            shape = False
        r.ok = shape
        if not shape:
            r.problem = f"HTTP {resp.status} without an OpenAI error body: {data[:200]!r}"

    def _valid(self, p: Plan, r: Result, t0: float) -> None:
        conn, resp = self._send(p)
        with closing(conn):
            r.status = resp.status
            if resp.status != 200:
                r.problem = f"HTTP {resp.status}: {resp.read()[:300]!r}"
                return
            if not p.stream:
                out = json.loads(resp.read())
                finish, used = out["choices"][0]["finish_reason"], out["usage"]["completion_tokens"]
            else:
                finish = used = None
                done = False
                for line in iter(resp.readline, b""):
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    ev = json.loads(data)
                    if "error" in ev:
                        r.problem = f"error event: {ev['error']}"
                        return
                    choice = ev["choices"][0] if ev.get("choices") else {}
                    if r.ttft is None and (choice.get("text") or choice.get("delta", {}).get("content")):
                        r.ttft = time.monotonic() - t0   # the first text (a chat's role chunk comes before it)
                    if ev.get("choices") and ev["choices"][0].get("finish_reason"):
                        finish = ev["choices"][0]["finish_reason"]
                    if ev.get("usage"):
                        used = ev["usage"]["completion_tokens"]
                if not done:
                    r.problem = "the stream ended without [DONE]"
                    return
        r.completion_tokens = used
        if finish != "length" or used != p.max_tokens:
            r.problem = f"finish_reason {finish!r}, {used} of {p.max_tokens} tokens"
            return
        r.ok = True

    def _disconnect(self, p: Plan, r: Result) -> None:
        if p.case == "mid_body":   # half the body of a request that announced all of it, then gone
            left = max(0.1, min(self.timeout, self.deadline - time.monotonic()))
            with socket.create_connection((self.host, self.port), timeout=left) as sock:
                head = (f"POST {p.path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(p.body)}\r\n\r\n").encode()
                sock.sendall(head + p.body[:len(p.body) // 2])
                time.sleep(0.01)
            r.ok = True
            return
        conn = self.connect()
        try:
            if p.case == "after_send":   # the whole request, then gone before any answer
                conn.request("POST", p.path, body=p.body, headers={"Content-Type": "application/json"})
                time.sleep(0.01)
            else:
                conn.request("POST", p.path, body=p.body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                r.status = resp.status
                if resp.status != 200:
                    r.problem = f"HTTP {resp.status}: {resp.read()[:300]!r}"
                    return
                events = 0
                for line in iter(resp.readline, b""):
                    if line.startswith(b"data: "):
                        events += 1
                        if events >= 2:
                            break
            r.ok = True
        finally:
            if conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            conn.close()


# ---- the server ------------------------------------------------------------------------------------------
def get(host: str, port: int, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


METRIC = re.compile(r'^(futx_[a-zA-Z0-9_]+)(\{[^}]*\})?\s+(\S+)$')


def read_metrics(host: str, port: int) -> dict:
    """futx_* samples of /metrics as {"name{labels}": value} (histogram buckets left out)."""
    status, data = get(host, port, "/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    out = {}
    for line in data.decode().splitlines():
        m = METRIC.match(line)
        if m and not m.group(1).endswith("_bucket") and not m.group(1).endswith("_created"):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def outcome_key(outcome: str) -> str:
    return 'futx_requests_total{outcome="' + outcome + '"}'


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def spawn(serve_args: list[str], log_path: str, wait: float) -> tuple[subprocess.Popen, str, int]:
    cmd = [sys.executable, "-m", "futx", "serve", *serve_args, "--host", "127.0.0.1", "--port", "0"]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    found: list[str] = []

    def read():
        for line in proc.stdout:
            if "listening on http://" in line and not found:
                found.append(line.split("listening on http://")[1].strip())

    threading.Thread(target=read, daemon=True).start()
    end = time.monotonic() + wait
    while not found and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.05)
    if not found:
        stop(proc)
        raise SystemExit(f"futx serve did not start ({' '.join(cmd)}); its log: {log_path}\n" +
                         open(log_path).read()[-3000:])
    hostport = found[0].split("/")[0]
    host, _, port = hostport.rpartition(":")
    return proc, host, int(port)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def wait_idle(host: str, port: int, until: float) -> dict:
    """/metrics once nothing runs or waits and every slot is free (or the last one read at `until`)."""
    m = {}
    while True:
        m = read_metrics(host, port)
        idle = (m.get("futx_requests_running") == 0 and m.get("futx_requests_waiting") == 0 and
                m.get("futx_cache_slots_free") == m.get("futx_cache_slots_total") and pages_back(m))
        if idle or time.monotonic() >= until:
            return m
        time.sleep(0.1)


def pages_back(m: dict) -> bool:
    """Every page free or held only by the prefix cache (a contiguous cache reports 0 pages: trivially), every
    staging page free (a server without the gauges, or without staging pages, reports none)."""
    total = m.get("futx_cache_pages_total")
    staging = m.get("futx_cache_staging_pages_free", 0) == m.get("futx_cache_staging_pages_total", 0)
    return total is not None and staging \
        and m.get("futx_cache_pages_free", -1) + m.get("futx_cache_pages_cached", 0) == total


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)
    q = (lambda f: xs[min(len(xs) - 1, int(f * len(xs)))])
    return {"n": len(xs), "mean": statistics.fmean(xs), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": xs[-1]}


# ---- main ---------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="%(prog)s (--url URL | --spawn) [options] [-- futx serve arguments]")
    p.add_argument("--url", help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine); loopback only")
    p.add_argument("--spawn", action="store_true", help="start `futx serve <arguments after -->` on a free loopback "
                   "port and stop it at the end")
    p.add_argument("--model", help="the model name to send (default: the first of /v1/models)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--malformed", type=float, default=0.10, help="fraction of malformed requests")
    p.add_argument("--disconnect", type=float, default=0.05, help="fraction of clients that go away mid-request")
    p.add_argument("--long-fraction", type=float, default=0.3, help="fraction of the valid requests with long "
                   "token-id prompts (the rest: short chats)")
    p.add_argument("--long-tokens", type=span, default=(2048, 4096), help="LO:HI prompt tokens of a long request "
                   "(clipped to the server's capacity - max_tokens)")
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens every long prompt starts with (a shared "
                   "system prompt: prefix-cache hits); the prompt's length stays drawn from --long-tokens")
    p.add_argument("--chat-words", type=span, default=(4, 40), help="LO:HI words of a chat message")
    p.add_argument("--max-tokens", type=span, default=(8, 128), help="LO:HI max_tokens of a valid request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds for the run once the server is up "
                   "(requests not done by then fail)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="socket timeout of one request")
    p.add_argument("--start-timeout", type=float, default=600.0, help="--spawn: seconds to wait for the server")
    p.add_argument("--server-log", help="--spawn: the server's stderr goes here (default: a temporary file)")
    p.add_argument("--json", help="write the summary here")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: the arguments of futx serve (--spawn)")
    args = p.parse_args(argv)
    if args.serve_args and args.serve_args[0] == "--":
        args.serve_args = args.serve_args[1:]
    if bool(args.url) == bool(args.spawn):
        p.error("give exactly one of --url and --spawn")
    if args.serve_args and not args.spawn:
        p.error("futx serve arguments only go with --spawn")
    for name in ("malformed", "disconnect", "long_fraction"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    if args.malformed + args.disconnect > 1 or args.requests < 1 or args.concurrency < 1 or args.time_limit <= 0:
        p.error("need --requests and --concurrency >= 1, --time-limit > 0, --malformed + --disconnect <= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    proc = None
    if args.spawn:
        log_path = args.server_log or tempfile.NamedTemporaryFile(prefix="futx-serve-", suffix=".log",
                                                                  delete=False).name
        proc, host, port = spawn(args.serve_args, log_path, args.start_timeout)
        print(f"load_test: futx serve pid {proc.pid} on {host}:{port} (log {log_path})", file=sys.stderr)
    else:
        u = urlsplit(args.url if "://" in args.url else "http://" + args.url)
        host, port = u.hostname, u.port or 80
        if not loopback(host):
            raise SystemExit(f"load_test: only loopback servers ({host} is not)")
    started = time.monotonic()   # --time-limit counts from a running server (--start-timeout bounds its start)
    try:
        return run(args, host, port, proc, started, log_path if proc is not None else None)
    finally:
        if proc is not None:
            stop(proc)


def run(args, host: str, port: int, proc, started: float, log_path: Optional[str] = None) -> int:
    status, data = get(host, port, "/health")
    health = json.loads(data)
    model = args.model or json.loads(get(host, port, "/v1/models")[1])["data"][0]["id"]
    capacity, vocab = int(health["capacity"]), int(health.get("vocab_size", 256))
    plans = build_plan(args, model, capacity, vocab)
    config = {k: v for k, v in vars(args).items() if k != "json"}
    config.update(model=model, capacity=capacity, slots=health.get("slots"), host=host, port=port)
    summary = Summary(config=config)
    summary.metrics_before = read_metrics(host, port)

    t0 = time.monotonic()
    deadline = started + args.time_limit
    client = Client(host, port, deadline, args.request_timeout)
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(client.run, plans))
    wall = time.monotonic() - t0

    alive = proc is None or proc.poll() is None
    try:
        health_ok = get(host, port, "/health")[0] == 200
        after = wait_idle(host, port, min(deadline, time.monotonic() + 60) if time.monotonic() < deadline
                          else time.monotonic() + 5)
    except OSError as e:
        health_ok, after = False, {}
        print(f"load_test: the server does not answer after the run: {e}", file=sys.stderr)
    summary.metrics_after = after
    before = summary.metrics_before

    def grew(key):
        return after.get(key, 0) - before.get(key, 0)

    by_kind: dict[str, dict] = {}
    for r in results:
        k = by_kind.setdefault(r.kind, {"sent": 0, "passed": 0})
        k["sent"] += 1
        k["passed"] += r.ok
    summary.counts = {"requests": len(results), "by_kind": by_kind,
                      "malformed_cases": sorted({r.case for r in results if r.kind == "malformed"}),
                      "5xx": sum(r.status is not None and r.status >= 500 for r in results),
                      "generated_tokens": sum(r.completion_tokens or 0 for r in results)}
    bad = [r for r in results if not r.ok]
    summary.failures = [asdict(r) for r in bad[:50]]
    valid = [r for r in results if r.kind in ("chat", "long")]
    summary.requirements = {
        "no_5xx": summary.counts["5xx"] == 0,
        "no_transport_failures": not any(r.status is None and r.kind != "disconnect" and r.case != "huge_body"
                                         for r in bad),
        "valid_requests_complete": all(r.ok for r in valid),
        "malformed_answered_4xx_json": all(r.ok for r in results if r.kind == "malformed"),
        "server_alive": alive and health_ok,
        "all_slots_free": bool(after) and after.get("futx_cache_slots_free") == after.get("futx_cache_slots_total")
        and after.get("futx_requests_running") == 0 and after.get("futx_requests_waiting") == 0,
        "all_pages_free": bool(after) and pages_back(after),
        "no_server_errors_counted": bool(after) and grew(outcome_key("error")) == 0,
        "within_time_limit": time.monotonic() - started <= args.time_limit,
    }
    summary.latency = {"seconds": percentiles([r.seconds for r in valid if r.ok]),
                       "ttft_streamed": percentiles([r.ttft for r in valid if r.ok and r.ttft is not None])}
    summary.wall_seconds = wall
    for name in ("futx_time_to_first_token_seconds", "futx_inter_token_latency_seconds"):
        n = grew(name + "_count")
        summary.latency["server_" + name[5:].replace("_seconds", "") + "_mean"] = grew(name + "_sum") / n if n else None
    if log_path is not None:   # informational: tracebacks the server logged (a 5xx would fail no_5xx anyway)
        with open(log_path, errors="replace") as fh:
            summary.counts["server_log_tracebacks"] = fh.read().count("Traceback")
    summary.passed = all(summary.requirements.values())
    tokens = summary.counts["generated_tokens"]
    kinds = ", ".join(f"{k} {v['passed']}/{v['sent']}" for k, v in by_kind.items())
    print(f"load_test: {len(results)} requests ({kinds}) in {wall:.1f} s, {args.concurrency} concurrent; "
          f"{tokens} tokens generated ({tokens / wall:.0f}/s)")
    lat = summary.latency["seconds"]
    if lat:
        print(f"load_test: valid request latency p50 {lat['p50']:.3f} s, p99 {lat['p99']:.3f} s")
    ttft, itl = summary.latency["server_time_to_first_token_mean"], summary.latency["server_inter_token_latency_mean"]
    if ttft is not None and itl is not None:
        print(f"load_test: server-side mean TTFT {ttft * 1e3:.1f} ms, mean inter-token latency {itl * 1e3:.2f} ms")
    counters = ", ".join(f"{o} +{grew(outcome_key(o)):.0f}"
                         for o in ("ok", "client_error", "disconnected", "overloaded", "error"))
    slots = f"{after.get('futx_cache_slots_free')}/{after.get('futx_cache_slots_total')}"
    print(f"load_test: server counters: {counters}; slots free {slots}")
    if after.get("futx_cache_pages_total"):
        print(f"load_test: pages free {after.get('futx_cache_pages_free'):.0f} + held only by the prefix cache "
              f"{after.get('futx_cache_pages_cached'):.0f} of {after['futx_cache_pages_total']:.0f}; "
              f"preemptions +{grew('futx_preemptions_total'):.0f}; prefix-cache hits "
              f"+{grew('futx_prefix_cache_hits_total'):.0f} ({grew('futx_prefix_cache_hit_tokens_total'):.0f} "
              f"tokens, hit rate {after.get('futx_prefix_cache_hit_rate', 0):.3f})"
              + (f"; staging pages free {after.get('futx_cache_staging_pages_free'):.0f} of "
                 f"{after['futx_cache_staging_pages_total']:.0f}" if after.get("futx_cache_staging_pages_total")
                 else ""))
    for name, ok in summary.requirements.items():
        print(f"load_test: {'PASS' if ok else 'FAIL'} {name}")
    for f in summary.failures[:10]:
        print(f"load_test:   failed #{f['index']} {f['kind']} {f['case']}: {f['problem']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(asdict(summary), fh, indent=1, default=str)
    print(f"load_test: {'PASSED' if summary.passed else 'FAILED'}")
    return 0 if summary.passed else 1


if __name__ == "__main__":
    sys.exit(main())
