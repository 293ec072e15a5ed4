"""Prometheus metrics of one server (`GET /metrics`, the text exposition format of prometheus-client).

Every metric lives in the server's own CollectorRegistry (never the process-global one), so one process may run
several servers (tests) and each /metrics shows only its own. Names, all prefixed `futx_`:

    requests_running, requests_waiting                gauges, read from the scheduler at scrape time
    cache_slots_free, cache_slots_total               gauges: slots (rows of a step), one per running request
    cache_pages_free, cache_pages_total               gauges: pages of a paged cache in the free pool / in all
                                                      (0 on a contiguous cache)
    cache_pages_cached                                gauge: pages held only by the prefix cache (reusable by a
                                                      later prompt, evicted on demand: as good as free)
    cache_staging_pages_free, cache_staging_pages_total   gauges: the INT4-only cache's staging pages (a main copy,
                                                      held while a prompt is prefilled; 0 on other caches)
    prefix_cache_hit_rate                             gauge: prefix_cache_hit_tokens / prompt_tokens
    prefix_cache_hits_total, prefix_cache_hit_tokens_total   counters: admissions that attached cached pages, and
                                                      the prompt positions those pages held (not prefilled)
    preemptions_total                                 counter: requests preempted for lack of pages (recomputed)
    requests_total{outcome}                           counter: ok, client_error (4xx), disconnected,
                                                      overloaded (503 queue full), error (5xx or engine failure)
    prompt_tokens_total, generation_tokens_total      counters (generated tokens as the scheduler emits them)
    time_to_first_token_seconds                       histogram: submit -> first generated token
    inter_token_latency_seconds                       histogram: per generated token after the first; a step that
                                                      emits k tokens of a request (speculative decoding) observes
                                                      its gap / k, k times
    speculative_accepted_tokens                       histogram (only with a drafter): drafts accepted per
                                                      verification
"""

from __future__ import annotations

import threading
from typing import Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OUTCOMES = ("ok", "client_error", "disconnected", "overloaded", "error")
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The metrics of one server over one scheduler. The scheduler calls `tokens` and `accepted` from its
    thread; the HTTP side calls `request`; gauges are read when scraped."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, scheduler=None, registry: Optional[CollectorRegistry] = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.running = Gauge("futx_requests_running", "Requests holding a cache slot (prefill or decode)", registry=r)
        self.waiting = Gauge("futx_requests_waiting", "Requests queued for a cache slot", registry=r)
        self.slots_free = Gauge("futx_cache_slots_free", "Cache slots (one per request) not held by a request",
                                registry=r)
        self.slots_total = Gauge("futx_cache_slots_total", "Cache slots (one per request)", registry=r)
        self.pages_free = Gauge("futx_cache_pages_free", "Pages of the paged KV cache in the free pool", registry=r)
        self.pages_total = Gauge("futx_cache_pages_total", "Pages of the paged KV cache", registry=r)
        self.pages_cached = Gauge("futx_cache_pages_cached", "Pages held only by the prefix cache (evictable)",
                                  registry=r)
        self.staging_free = Gauge("futx_cache_staging_pages_free", "Staging pages (INT4-only cache) not held by a "
                                  "prefilling request", registry=r)
        self.staging_total = Gauge("futx_cache_staging_pages_total", "Staging pages of the INT4-only cache",
                                   registry=r)
        self.hit_rate = Gauge("futx_prefix_cache_hit_rate", "Prompt positions attached from the prefix cache / "
                              "prompt tokens of admitted requests", registry=r)
        self.hits = Counter("futx_prefix_cache_hits", "Admissions that attached cached prefix pages", registry=r)
        self.hit_tokens = Counter("futx_prefix_cache_hit_tokens", "Prompt positions attached from the prefix cache "
                                  "(not prefilled)", registry=r)
        self.preemptions = Counter("futx_preemptions", "Requests preempted for lack of cache pages (recomputed)",
                                   registry=r)
        self.requests = Counter("futx_requests", "Generation requests by outcome", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(o)   # every outcome shows, at 0, from the start
        self.prompt_tokens = Counter("futx_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated = Counter("futx_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("futx_time_to_first_token_seconds", "Submit to first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("futx_inter_token_latency_seconds", "Time per generated token after the first",
                             buckets=ITL_BUCKETS, registry=r)
        self.acceptance: Optional[Histogram] = None
        self._lock = threading.Lock()
        if scheduler is not None:
            self.attach(scheduler)

    def attach(self, scheduler) -> None:
        """Read the gauges from `scheduler` and have it report tokens (and acceptance) here."""
        def snapshot(key):
            return lambda: scheduler.snapshot()[key]

        self.running.set_function(snapshot("running"))
        self.waiting.set_function(snapshot("waiting"))
        self.slots_free.set_function(snapshot("slots_free"))
        self.slots_total.set_function(snapshot("slots_total"))
        self.pages_free.set_function(snapshot("pages_free"))
        self.pages_total.set_function(snapshot("pages_total"))
        self.pages_cached.set_function(snapshot("pages_cached"))
        self.staging_free.set_function(snapshot("staging_free"))
        self.staging_total.set_function(snapshot("staging_total"))

        def rate():
            s = scheduler.snapshot()
            return s["prefix_hit_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0
        self.hit_rate.set_function(rate)
        if scheduler.drafter is not None and self.acceptance is None:
            n = scheduler.num_draft
            self.acceptance = Histogram("futx_speculative_accepted_tokens", "Drafts accepted per verification",
                                        buckets=tuple(float(i) for i in range(n + 1)), registry=self.registry)
        scheduler.metrics = self

    # ---- called by the scheduler (its thread) -------------------------------------------------------------
    def admitted(self, prompt_tokens: int, cached_tokens: int = 0) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        if cached_tokens:
            self.hits.inc()
            self.hit_tokens.inc(cached_tokens)

    def preempted(self) -> None:
        self.preemptions.inc()

    def tokens(self, ttft: Optional[float], gaps: tuple[float, int]) -> None:
        """ttft: seconds to this request's first token (None if it had one before); gaps: (seconds per token,
        count) of its further tokens in this step."""
        n = gaps[1] + (ttft is not None)
        self.generated.inc(n)
        if ttft is not None:
            self.ttft.observe(ttft)
        for _ in range(gaps[1]):
            self.itl.observe(gaps[0])

    def accepted(self, n: int) -> None:
        if self.acceptance is not None:
            self.acceptance.observe(n)

    # ---- called by the HTTP side -------------------------------------------------------------------------
    def request(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def outcome_of(status: int) -> str:
    if status < 400:
        return "ok"
    if status == 503:
        return "overloaded"
    return "client_error" if status < 500 else "error"
