"""Continuous batching: requests join the running decode batch between steps and leave when done.

A request moves WAITING -> PREFILL -> DECODE -> finished:

    WAITING   queued (at most `max_queue`); admitted, oldest first, when a cache slot is free
    PREFILL   prompt[:-1] written into its slot by the engine's prefill, at most `prefill_chunk` tokens per
              tick over all prefilling requests (so a long prompt is chunked and decode steps go on between)
    DECODE    one row in every decode step: the last prompt token first, then its last generated token
    finished  max_tokens ("length"), EOS or a stop string ("stop"), the client went away ("cancelled") or the
              engine failed ("error"); the slot is freed before the next tick

Each tick runs one prefill chunk batch and one decode step over all DECODE rows (any mix of lengths), within a
token budget: decode rows first (one token each, num_draft + 1 with a drafter), prefill chunks in what is left
(at most `prefill_chunk`). The loop runs in its own thread (`start`) or in the caller's (`run_until_idle`, for
`futx generate`). Every new piece of text goes to the request's `sink` as an Event, from the loop's thread.

Paged engines (engine.layout set; futx.engine.pages keeps the books). Slots are rows of a step; pages are the
memory. A waiting request is admitted when a slot is free and the pages of its whole history fit, leaving one
page of headroom per running request (so requests already running can grow without preempting the newcomer at
once). With the prefix cache, admission first attaches the longest cached full-page prefix of the history (the
request's prefill then starts there), and each full page a prefill completes is published at once (read only
from then on: a request writes only at or past its position), so requests that arrive together share a system
prompt too. A request grows page by page: before each step its rows' positions get pages (num_draft + 1
positions for a verify block). When none are left (after evicting idle prefix pages), the youngest running
request is preempted: it gives its pages back (its prefilled pages stay in the prefix cache) and goes back to
the head of the queue with its prompt + generated tokens, recomputed on readmission: the prompt by prefill, the
generated tokens by decode rows that emit nothing (so the cache gets the bytes it had: the engine's prefill and
decode weights differ, FP8 or BF16 against INT4), or all by prefill where both phases are one computation
(`engine.prefill_is_decode`: the reference model). Greedy output is unchanged. The oldest running request is
never preempted for a younger one, and a request whose pages could never fit is refused at submit, so the loop
always makes progress.

INT4-only cache (a layout with staging pages, futx.paging: `--cache-main none`). The pages above hold only the
mirror. A request that has a prompt to prefill also takes staging pages (main copy + mirror) for positions
[0, prefill end) on admission; its table row points at them while it is prefilled (the prefill kernels read and
write the main copy as always; an attached cached prefix is first copied there and its main copy dequantized from
the mirror), and when its prefill completes its mirror rows are copied to its own pages, the table row points
there and the staging pages go back. Its full pages are published to the prefix cache then (not chunk by chunk).

With a `drafter` (speculative decoding, futx.speculative) the decode step is a block (verify) step: each DECODE
request feeds the tokens of its history not yet in the cache (its last token; without a prefill, up to
num_draft + 1 prompt tokens at once) and up to `num_draft` drafts, and keeps the prefix the target agrees with
plus one token of its own: greedy requests by the argmax (the same tokens as without speculation), sampled ones
by speculative rejection sampling on their own generator (the same distribution as without it; the drafters
are deterministic, q one-hot). Acceptance per verification, by context position: `Scheduler.acceptance`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Callable, Collection, Optional

import torch

from futx.engine.generate import GenerationStats
from futx.engine.pages import PagePool, PrefixCache
from futx.paging import pages_for

from .detok import TextStream
from .engines import Chunk
from .sampling import SamplingParams, sample

MAX_DRAFT = 7   # futx.speculative.drafter.MAX_DRAFT

log = logging.getLogger("futx.serve")
STATS_WINDOW = 1 << 16


class QueueFull(RuntimeError):
    """More requests are waiting than the server queues (answer 503 and let the client retry)."""


class RequestTooLong(ValueError):
    """Prompt + max_tokens exceed a cache slot (or every page of a paged cache)."""


@dataclass
class Event:
    text: str                             # new text (may be empty)
    finish_reason: Optional[str] = None   # set on the request's last event
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: Optional[str] = None


class Handle:
    """A submitted request: its events go to `sink` (default: a queue that `events()` drains)."""

    def __init__(self, rid: int, prompt: list[int], params: SamplingParams, tokenizer, eos_ids,
                 sink: Optional[Callable[[Event], None]]):
        self.id = rid
        self.prompt, self.params = prompt, params
        self.eos_ids = frozenset() if params.ignore_eos else frozenset(eos_ids)
        self.output: list[int] = []
        self.stream = TextStream(tokenizer, params.stop)
        self.gen = params.generator()
        self.slot = -1
        self.pos = 0                  # next cache position this request writes
        self.pages: list[int] = []    # paged engines: the pages holding positions [0, len(pages) P)
        self.staging: list[int] = []  # INT4-only cache: the staging pages it is being prefilled on
        self.prefill_end = 0          # positions [0, prefill_end) are prefilled (set on admission)
        self.reusable = 0             # positions below this (once written) may go to the prefix cache
        self.cached = 0               # positions attached from the prefix cache on its first admission
        self.published = 0            # its leading pages in the prefix cache (or attached from it)
        self.preemptions = 0
        self.steps: list[int] = []    # decode steps it took part in
        self.hidden = None            # speculative drafters that read hidden states: the row of the last token
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None
        self.submitted = time.perf_counter()
        self.last_token: Optional[float] = None   # when its latest token came (metrics: TTFT, ITL)
        self._cancel = threading.Event()
        self._queue: Optional[queue.Queue] = None
        if sink is None:
            self._queue = queue.Queue()
            sink = self._queue.put
        self.sink = sink

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def length(self) -> int:
        """Tokens of its history: the prompt and what it generated (a preempted request recomputes them all)."""
        return len(self.prompt) + len(self.output)

    def token_at(self, pos: int) -> int:
        return self.prompt[pos] if pos < len(self.prompt) else self.output[pos - len(self.prompt)]

    @property
    def text(self) -> str:
        return self.stream.text

    def cancel(self) -> None:
        self._cancel.set()

    def events(self, timeout: Optional[float] = None):
        """Events until the last one (only for handles submitted without a sink)."""
        while True:
            ev = self._queue.get(timeout=timeout)
            yield ev
            if ev.finish_reason is not None:
                return


class Scheduler:
    def __init__(self, engine, tokenizer, *, max_queue: int = 64, prefill_chunk: int = 512,
                 eos_ids: Optional[Collection[int]] = None, drafter=None, num_draft: int = 0,
                 token_budget: Optional[int] = None, prefix_cache: bool = True):
        """drafter: a futx.speculative Drafter (speculative decoding with up to num_draft drafts per request and
        step; the engine must run block steps: DecodeEngine over a DecodeModel with max_rows >= max_batch x
        (num_draft + 1)). token_budget: tokens per tick, decode rows and prefill chunks together (default
        prefill_chunk + the decode rows of a full batch: prefill never waits for decode); it must exceed a full
        batch's decode rows, so prefill always moves. prefix_cache: share prefilled full pages across requests
        (paged engines that allow it)."""
        if max_queue < 1 or prefill_chunk < 1:
            raise ValueError(f"max_queue and prefill_chunk must be positive, got {max_queue} and {prefill_chunk}")
        self.drafter, self.num_draft = drafter, num_draft
        self.acceptance = None
        if drafter is not None:
            from futx.speculative.stats import AcceptanceStats

            if not 1 <= num_draft <= MAX_DRAFT:
                raise ValueError(f"num_draft must be in 1..{MAX_DRAFT}, got {num_draft}")
            rows = getattr(engine, "max_rows", 0)
            if not hasattr(engine, "verify") or rows < engine.max_batch * (num_draft + 1):
                raise ValueError(f"speculative decoding needs an engine with block steps of {engine.max_batch} x "
                                 f"({num_draft} + 1) rows (DecodeEngine over DecodeModel(max_rows=...))")
            self.acceptance = AcceptanceStats(keep_log=False)   # a server runs for days
        self.engine, self.tokenizer = engine, tokenizer
        self.max_queue, self.prefill_chunk = max_queue, prefill_chunk
        self.width = num_draft + 1 if drafter is not None else 1   # decode tokens per request and step
        rows = engine.max_batch * self.width
        self.token_budget = prefill_chunk + rows if token_budget is None else token_budget
        if self.token_budget <= rows:
            raise ValueError(f"the token budget ({self.token_budget}) must exceed the decode rows of a full batch "
                             f"({rows}), or prefill could never run")
        self.layout = getattr(engine, "layout", None)
        self.pool: Optional[PagePool] = None
        self.staging: Optional[PagePool] = None   # the INT4-only cache's staging pages
        self.prefix: Optional[PrefixCache] = None
        if self.layout is not None:
            self.pool = PagePool(self.layout.pages, self.layout.first_page)
            if self.layout.staging:
                self.staging = PagePool(self.layout.staging)
            if prefix_cache and getattr(engine, "prefix_ok", False):
                self.prefix = PrefixCache(self.pool, self.layout.page_size)
        self.preemptions = 0
        self.prefix_hits = 0          # first admissions that attached cached pages
        self.prefix_hit_tokens = 0    # ... and their positions
        self.admitted_prompt_tokens = 0
        self._pages_now = self._page_counts()
        self.eos_ids = frozenset(tokenizer.eos_ids if eos_ids is None else eos_ids)
        # recent steps only: a server runs for days (ms_per_step is a median over these)
        self.stats = GenerationStats(step_seconds=deque(maxlen=STATS_WINDOW))
        self.step_rows: deque[int] = deque(maxlen=STATS_WINDOW)  # rows per decode step (how much batching)
        self.prefill_tokens = 0
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._waiting: deque[Handle] = deque()
        self._live: list[Handle] = []       # admitted: PREFILL or DECODE, each with a slot
        self._free = list(range(engine.max_batch - 1, -1, -1))
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self.metrics = None   # a futx.serve.metrics.ServerMetrics (attach) or None

    # ---- client side (any thread) ------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams,
               sink: Optional[Callable[[Event], None]] = None) -> Handle:
        if not prompt:
            raise ValueError("the prompt is empty")
        need = len(prompt) + params.max_tokens - 1   # the last generated token is never fed back
        if need > self.engine.capacity:
            raise RequestTooLong(f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) needs "
                                 f"{need} cache positions; this server holds {self.engine.capacity} per request")
        if self.pool is not None and pages_for(need, self.layout.page_size) > self.pool.total:
            raise RequestTooLong(f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) needs "
                                 f"{pages_for(need, self.layout.page_size)} pages of {self.layout.page_size} "
                                 f"positions; this server's cache has {self.pool.total}")
        h = Handle(next(self._ids), list(prompt), params, self.tokenizer, self.eos_ids, sink)
        with self._cv:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            # requests whose clients left stay queued until the next tick drops them: they hold no place
            waiting = sum(not w._cancel.is_set() for w in self._waiting)
            if waiting >= self.max_queue:
                raise QueueFull(f"{waiting} requests are already waiting (--max-queue {self.max_queue})")
            self._waiting.append(h)
            self._cv.notify()
        return h

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._loop, name="futx-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

    @property
    def load(self) -> dict:
        with self._cv:
            load = {"waiting": len(self._waiting), "running": len(self._live), "slots": self.engine.max_batch}
            if self.layout is not None:
                load["pages"] = {"page_size": self.layout.page_size, "total": self._pages_now["pages_total"],
                                 "free": self._pages_now["pages_free"], "cached": self._pages_now["pages_cached"],
                                 "prefix_cache": self.prefix is not None}
                if self.staging is not None:   # the INT4-only cache
                    load["pages"].update(staging_total=self._pages_now["staging_total"],
                                         staging_free=self._pages_now["staging_free"])
        if self.acceptance is not None:
            s = self.acceptance.summary()
            load["speculative"] = {"drafter": self.drafter.name, "num_draft": self.num_draft,
                                   **{k: s[k] for k in ("verifications", "mean_accepted", "acceptance_rate")}}
        return load

    def snapshot(self) -> dict:
        """Requests, cache slots and pages now (the /metrics gauges; the page counts as of the last tick, the
        books being the loop thread's)."""
        with self._cv:
            return {"waiting": len(self._waiting), "running": len(self._live), "slots_free": len(self._free),
                    "slots_total": self.engine.max_batch, **self._pages_now, "preemptions": self.preemptions,
                    "prefix_hits": self.prefix_hits, "prefix_hit_tokens": self.prefix_hit_tokens,
                    "prompt_tokens": self.admitted_prompt_tokens}

    def _page_counts(self) -> dict:
        """pages_total; pages_free (in the pool); pages_cached: held only by the prefix cache (free for the
        taking: evicted on demand); staging_total / staging_free: the INT4-only cache's staging pages. Zeros on a
        contiguous engine."""
        if self.pool is None:
            return {"pages_total": 0, "pages_free": 0, "pages_cached": 0, "staging_total": 0, "staging_free": 0}
        staged = self.staging is not None
        return {"pages_total": self.pool.total, "pages_free": self.pool.free_count,
                "pages_cached": self.prefix.idle_pages() if self.prefix is not None else 0,
                "staging_total": self.staging.total if staged else 0,
                "staging_free": self.staging.free_count if staged else 0}

    # ---- the loop ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (self._stopping or self._waiting or self._live):
                        self._cv.wait()
                    if self._stopping:
                        break
                self.tick()
        for h in list(self._live) + list(self._waiting):
            self._finish(h, "error", "the server shut down")

    def run_until_idle(self) -> None:
        """Tick in the calling thread until every submitted request has finished."""
        with torch.inference_mode():
            while self._waiting or self._live:
                self.tick()

    def tick(self) -> None:
        self._admit()
        self._prefill()
        self._decode()
        pages = self._page_counts()
        with self._cv:
            self._pages_now = pages

    def _admit(self) -> None:
        for h in [h for h in self._live if h._cancel.is_set()]:
            self._finish(h, "cancelled")
        admitted = []
        with self._cv:
            waiting = [h for h in self._waiting if not h._cancel.is_set()]
            gone = [h for h in self._waiting if h._cancel.is_set()]
            self._waiting = deque(waiting)
            failed = []
            while self._waiting and self._free:
                h = self._waiting[0]
                h.slot = self._free[-1]
                try:
                    placed = self._place(h)
                except Exception as e:  # noqa: BLE001 -- the engine failed to stage it: fail it, keep serving
                    log.error("admitting request %d failed:\n%s", h.id, traceback.format_exc())
                    self._waiting.popleft()
                    h.slot = -1
                    failed.append((h, e))
                    continue
                if not placed:   # its pages do not fit yet: oldest first, nobody overtakes it
                    h.slot = -1
                    break
                self._waiting.popleft()
                self._free.pop()
                self._live.append(h)
                admitted.append(h)
        for h in admitted:
            if h.preemptions == 0:
                self.admitted_prompt_tokens += len(h.prompt)
                if h.cached:
                    self.prefix_hits += 1
                    self.prefix_hit_tokens += h.cached
                if self.metrics is not None:
                    self.metrics.admitted(len(h.prompt), h.cached)
        for h in gone:
            self._send(h, Event("", "cancelled", len(h.prompt)))
            h.finish_reason = "cancelled"
        for h, e in failed:
            self._finish(h, "error", f"admission failed: {e}")

    def _place(self, h: Handle) -> bool:
        """Set h up to run from its history's start (paged: attach its cached prefix and give it the pages of
        its whole history); False, with nothing held, when its pages do not fit now."""
        n = h.length
        if not self.engine.prefills:
            h.prefill_end, h.reusable = 0, n - 1
        elif h.preemptions == 0 or getattr(self.engine, "prefill_is_decode", False):
            h.prefill_end = h.reusable = n - 1
        else:   # recomputed: the prompt by prefill, its generated tokens by decode rows, as the first time
            h.prefill_end = h.reusable = len(h.prompt) - 1
        h.pos = 0
        if self.pool is None:
            return True
        size = self.layout.page_size
        hist = h.prompt + h.output
        # the last history token is always computed (its row emits); attach at most the full pages before it,
        # and only pages its own run would have prefilled
        shared = self.prefix.attach(hist, h.reusable // size) if self.prefix is not None else []
        need = pages_for(n, size) - len(shared)
        headroom = len(self._live)   # one page per running request, so admission does not preempt at once
        # INT4-only cache: staging pages for the positions its prefill writes and reads
        stage = pages_for(h.prefill_end, size) if self.staging is not None and \
            h.prefill_end > len(shared) * size else 0
        if need + headroom > self._available() or (stage and stage > self.staging.free_count):
            self.pool.free(shared)
            return False
        h.pages = shared + self._allocate(need)
        h.pos = len(shared) * size
        h.published = len(shared)
        if h.preemptions == 0:
            h.cached = h.pos
        if stage:
            h.staging = self.staging.allocate(stage)
            try:
                self.engine.stage(h.slot, shared, h.staging, h.pos)
            except Exception:   # nothing held: the caller fails or retries the request
                self.staging.free(h.staging)
                self.pool.free(h.pages)
                h.staging, h.pages = [], []
                raise
        else:
            self.engine.set_pages(h.slot, h.pages, filled=h.pos)
        return True

    def _unstage(self, h: Handle) -> None:
        """h's prefill is complete: its prefilled rows to its own pages (all but the attached prefix, which they
        hold already), its table row there, the staging pages back."""
        self.engine.unstage(h.slot, h.staging, h.pages, h.published)
        self.staging.free(h.staging)
        h.staging = []

    def _available(self) -> int:
        return self.pool.free_count + (self.prefix.idle_pages() if self.prefix is not None else 0)

    def _allocate(self, n: int) -> list[int]:
        if n > self.pool.free_count and self.prefix is not None:
            self.prefix.evict(n - self.pool.free_count)
        return self.pool.allocate(n)

    def _grow(self, h: Handle, end: int) -> bool:
        """Pages for h's positions [0, end) before a step writes them; preempts the youngest running request
        (h itself if it is the youngest: then False) until they fit."""
        need = pages_for(min(end, self.engine.capacity), self.layout.page_size) - len(h.pages)
        while need > 0 and need > self._available():
            victim = self._live[-1]
            self._preempt(victim)
            if victim is h:
                return False
        if need > 0:
            h.pages += self._allocate(need)
            self.engine.set_pages(h.slot, h.pages)
        return True

    def _preempt(self, h: Handle) -> None:
        """Take h's pages and slot back and queue it first again, to be recomputed from its history."""
        log.info("preempting request %d (%d pages) for lack of cache pages", h.id, len(h.pages))
        self.preemptions += 1
        h.preemptions += 1
        if self.metrics is not None:
            self.metrics.preempted()
        self._retire(h, publish=True)
        h.slot, h.pos, h.hidden = -1, 0, None
        with self._cv:
            self._waiting.appendleft(h)

    def _retire(self, h: Handle, publish: bool) -> None:
        """h leaves the running batch: its prefilled full pages to the prefix cache (publish), pages and slot
        freed."""
        self._live.remove(h)
        if h.staging:   # retired mid-prefill (INT4-only cache): its own pages hold nothing yet
            self.staging.free(h.staging)
            h.staging, publish = [], False
        if h.pages:
            if publish and self.prefix is not None:
                self._publish(h)
            self.pool.free(h.pages)
            h.pages = []
        self.engine.release(h.slot)
        pages = self._page_counts()
        with self._cv:
            self._free.append(h.slot)
            self._pages_now = pages

    def _publish(self, h: Handle) -> None:
        """h's full pages written from its admitted history (by the prefill, or by decode steps on an engine
        without one) to the prefix cache; never its last history token's page or what it generated since. The
        pages are read only from now on: h writes only at or past its position."""
        done = min(h.pos, h.reusable) // self.layout.page_size
        if done > h.published:
            self.prefix.publish(h.prompt + h.output, h.pages, done)
            h.published = done

    def _prefill(self) -> None:
        # decode rows come first in the tick's token budget: every running request may take a row (or a block)
        budget = min(self.prefill_chunk, self.token_budget - self.width * len(self._live))
        chunks, owners = [], []
        for h in self._live:
            end = h.prefill_end
            if h.pos < end and budget > 0:
                n = min(budget, end - h.pos)
                chunks.append(Chunk(h.slot, [h.token_at(p) for p in range(h.pos, h.pos + n)], h.pos, end))
                owners.append((h, n))
                budget -= n
        if not chunks:
            return
        try:
            self.engine.prefill(chunks)
        except Exception as e:  # noqa: BLE001 -- fail these requests, keep serving
            log.error("prefill failed:\n%s", traceback.format_exc())
            for h, _ in owners:
                self._finish(h, "error", f"prefill failed: {e}")
            return
        for h, n in owners:
            h.pos += n
            if h.staging and h.pos >= h.prefill_end:
                self._unstage(h)
            if self.prefix is not None and not h.staging:   # full pages shared at once: requests arriving
                self._publish(h)                            # together hit them too
        self.prefill_tokens += sum(n for _, n in owners)

    def _decode(self) -> None:
        rows = [h for h in self._live if h.pos >= h.prefill_end]
        if self.pool is not None:   # pages for what the step writes, oldest first (a younger one may go)
            for h in list(rows):
                if h in self._live:
                    self._grow(h, h.pos + self.width)
            rows = [h for h in rows if h in self._live]
        if not rows:
            return
        if self.drafter is not None:
            self._verify(rows)
            return
        tokens = [h.token_at(h.pos) for h in rows]
        # rows whose output is a token: the history's last token onwards; logits only when one of them samples
        emits = [h.pos + 1 >= h.length for h in rows]
        want_logits = any(e and not h.params.greedy for h, e in zip(rows, emits))
        t0 = time.perf_counter()
        try:
            nxt, logits = self.engine.step(tokens, [h.pos for h in rows], [h.slot for h in rows], want_logits)
        except Exception as e:  # noqa: BLE001 -- the batch's requests fail, the server goes on
            log.error("decode step failed:\n%s", traceback.format_exc())
            for h in rows:
                self._finish(h, "error", f"decode step failed: {e}")
            return
        self.stats.step_seconds.append(time.perf_counter() - t0)
        step = self.stats.steps
        self.stats.steps += 1
        self.stats.rows += len(rows)
        self.step_rows.append(len(rows))
        now = time.perf_counter()
        for i, (h, tok, emit) in enumerate(zip(rows, nxt, emits)):
            h.pos += 1
            h.steps.append(step)
            if emit:
                if not h.params.greedy:
                    tok = sample(logits[i], h.params, h.gen)
                self.stats.generated += 1
                self._timed(h, 1, now)
                self._emit(h, tok)

    def _verify(self, rows: list[Handle]) -> None:
        """The speculative decode step: one block per request (see the module's docstring)."""
        from futx.speculative.accept import greedy_accept, probabilities, rejection_accept
        from futx.speculative.drafter import check_proposals

        width, drafter = self.num_draft + 1, self.drafter
        hists = [h.prompt + h.output for h in rows]
        known = [hist[h.pos:h.pos + width] for h, hist in zip(rows, hists)]
        room = []
        for h, hist, kn in zip(rows, hists, known):
            r = 0
            if h.pos + len(kn) == len(hist):    # the block reaches the history's end: drafts may follow
                r = min(width - len(kn), h.params.max_tokens - len(h.output) - 1,
                        self.engine.capacity - h.pos - len(kn))
                if drafter.needs_hidden and h.hidden is None:
                    r = 0
            room.append(max(0, r))
        drafts: list[list[int]] = [[] for _ in rows]
        ask = [i for i, r in enumerate(room) if r > 0]
        t0 = time.perf_counter()
        try:
            if ask:
                k = max(room[i] for i in ask)
                hidden = torch.stack([rows[i].hidden for i in ask]) if drafter.needs_hidden else None
                got = drafter.propose([hists[i] for i in ask], hidden, k)
                check_proposals(got, len(ask), k, self.engine.config.vocab_size)
                for i, d in zip(ask, got):
                    drafts[i] = [int(t) for t in d[:room[i]]]
            blocks = [(h.slot, h.pos, kn + d) for h, kn, d in zip(rows, known, drafts)]
            step = self.engine.verify(blocks)
            # the sampling distributions of the rows that emit, for the requests that sample
            logits = {}
            sampled = [i for i, h in enumerate(rows) if not h.params.greedy
                       and h.pos + len(known[i]) == len(hists[i])]
            if sampled:
                idx = [step.row(i, j) for i in sampled for j in range(len(known[i]) - 1, len(blocks[i][2]))]
                lg = self.engine.row_logits(idx).float().cpu()
                at = 0
                for i in sampled:
                    n = len(blocks[i][2]) - len(known[i]) + 1
                    logits[i] = lg[at:at + n]
                    at += n
        except Exception as e:  # noqa: BLE001 -- the batch's requests fail, the server goes on
            log.error("verify step failed:\n%s", traceback.format_exc())
            for h in rows:
                self._finish(h, "error", f"decode step failed: {e}")
            return
        now = time.perf_counter()
        self.stats.step_seconds.append(now - t0)
        step_no = self.stats.steps
        self.stats.steps += 1
        n_rows = sum(len(b[2]) for b in blocks)
        self.stats.rows += n_rows
        self.step_rows.append(n_rows)
        hidden_rows = []
        for i, h in enumerate(rows):
            nk = len(known[i])
            h.steps.append(step_no)
            if h.pos + nk < len(hists[i]):    # prompt tokens only: nothing to emit yet
                h.pos += nk
                continue
            if h.params.greedy:
                a, emitted = greedy_accept(drafts[i], step.targets[i][nk - 1:])
            else:
                p = probabilities(logits[i], h.params.temperature, h.params.top_p)
                a, emitted = rejection_accept(drafts[i], p, None, h.gen)
            self.acceptance.record(h.pos + nk - 1, len(drafts[i]), a)
            if self.metrics is not None and drafts[i]:
                self.metrics.accepted(a)
            h.pos += nk + a                   # rejected drafts: past the length, overwritten by the next block
            n_before = len(h.output)
            for tok in emitted:
                self.stats.generated += 1
                self._emit(h, tok)
                if h.done:
                    break
            self._timed(h, len(h.output) - n_before, now)
            if not h.done and drafter.needs_hidden:
                hidden_rows.append((h, step.row(i, nk - 1 + a)))
        if hidden_rows:
            hs = self.engine.row_hidden([j for _, j in hidden_rows])
            for (h, _), x in zip(hidden_rows, hs):
                h.hidden = x

    def _timed(self, h: Handle, n: int, now: float) -> None:
        """n tokens of h came out of the step that ended at `now`: TTFT and inter-token latency."""
        if self.metrics is None or n <= 0:
            return
        ttft = None
        if h.last_token is None:
            ttft, h.last_token, n = now - h.submitted, now, n - 1
        gap = (now - h.last_token) / n if n else 0.0
        h.last_token = now
        self.metrics.tokens(ttft, (gap, n))

    def _emit(self, h: Handle, tok: int) -> None:
        h.output.append(tok)
        if tok in h.eos_ids:
            self._finish(h, "stop")
            return
        text = h.stream.push(tok)
        if h.stream.stopped:
            self._finish(h, "stop", first=text)
        elif len(h.output) >= h.params.max_tokens:
            self._finish(h, "length", first=text)
        elif text:
            self._send(h, Event(text))

    def _finish(self, h: Handle, reason: str, error: Optional[str] = None, first: str = "") -> None:
        """Retire an admitted request: last event (with the held-back text), slot and pages freed (its prefilled
        pages published unless it failed: an engine error may have left them half written)."""
        h.finish_reason, h.error = reason, error
        rest = first + (h.stream.finish() if reason in ("stop", "length") else "")
        if h in self._live:   # before the last event: a client that then reads /metrics sees its pages back
            self._retire(h, publish=reason != "error")
        self._send(h, Event(rest, reason, len(h.prompt), len(h.output), error))

    @staticmethod
    def _send(h: Handle, ev: Event) -> None:
        try:
            h.sink(ev)
        except Exception:  # noqa: BLE001 -- a client that went away must not stop the loop
            log.warning("dropping an event of request %d: its sink failed", h.id, exc_info=True)
