"""Continuous batching: requests join the running decode batch between steps and leave when done.

A request moves WAITING -> PREFILL -> DECODE -> finished:

    WAITING   queued (at most `max_queue`); admitted, oldest first, when a cache slot is free
    PREFILL   prompt[:-1] written into its slot by the engine's prefill, at most `prefill_chunk` tokens per
              tick over all prefilling requests (so a long prompt is chunked and decode steps go on between)
    DECODE    one row in every decode step: the last prompt token first, then its last generated token
    finished  max_tokens ("length"), EOS or a stop string ("stop"), the client went away ("cancelled") or the
              engine failed ("error"); the slot is freed before the next tick

Each tick runs one prefill chunk batch and one decode step over all DECODE rows (any mix of lengths). The
loop runs in its own thread (`start`) or in the caller's (`run_until_idle`, for `futx generate`). Every new
piece of text goes to the request's `sink` as an Event, from the loop's thread.

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

from .detok import TextStream
from .engines import Chunk
from .sampling import SamplingParams, sample

MAX_DRAFT = 7   # futx.speculative.drafter.MAX_DRAFT

log = logging.getLogger("futx.serve")
STATS_WINDOW = 1 << 16


class QueueFull(RuntimeError):
    """More requests are waiting than the server queues (answer 503 and let the client retry)."""


class RequestTooLong(ValueError):
    """Prompt + max_tokens exceed a cache slot."""


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
                 eos_ids: Optional[Collection[int]] = None, drafter=None, num_draft: int = 0):
        """drafter: a futx.speculative Drafter (speculative decoding with up to num_draft drafts per request and
        step; the engine must run block steps: DecodeEngine over a DecodeModel with max_rows >= max_batch x
        (num_draft + 1))."""
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
        h = Handle(next(self._ids), list(prompt), params, self.tokenizer, self.eos_ids, sink)
        with self._cv:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting (--max-queue {self.max_queue})")
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
        if self.acceptance is not None:
            s = self.acceptance.summary()
            load["speculative"] = {"drafter": self.drafter.name, "num_draft": self.num_draft,
                                   **{k: s[k] for k in ("verifications", "mean_accepted", "acceptance_rate")}}
        return load

    def snapshot(self) -> dict:
        """Requests and cache slots now (the /metrics gauges)."""
        with self._cv:
            return {"waiting": len(self._waiting), "running": len(self._live), "slots_free": len(self._free),
                    "slots_total": self.engine.max_batch}

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

    def _admit(self) -> None:
        for h in [h for h in self._live if h._cancel.is_set()]:
            self._finish(h, "cancelled")
        with self._cv:
            waiting = [h for h in self._waiting if not h._cancel.is_set()]
            gone = [h for h in self._waiting if h._cancel.is_set()]
            self._waiting = deque(waiting)
            while self._waiting and self._free:
                h = self._waiting.popleft()
                h.slot = self._free.pop()
                self._live.append(h)
                if self.metrics is not None:
                    self.metrics.admitted(len(h.prompt))
        for h in gone:
            self._send(h, Event("", "cancelled", len(h.prompt)))
            h.finish_reason = "cancelled"

    def _prefill_end(self, h: Handle) -> int:
        return len(h.prompt) - 1 if self.engine.prefills else 0

    def _prefill(self) -> None:
        budget, chunks, owners = self.prefill_chunk, [], []
        for h in self._live:
            end = self._prefill_end(h)
            if h.pos < end and budget > 0:
                n = min(budget, end - h.pos)
                chunks.append(Chunk(h.slot, h.prompt[h.pos:h.pos + n], h.pos, end))
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
        self.prefill_tokens += sum(n for _, n in owners)

    def _decode(self) -> None:
        rows = [h for h in self._live if h.pos >= self._prefill_end(h)]
        if not rows:
            return
        if self.drafter is not None:
            self._verify(rows)
            return
        tokens = [h.prompt[h.pos] if h.pos < len(h.prompt) else h.output[-1] for h in rows]
        # rows whose output is a token: the last prompt token onwards; logits only when one of them samples
        emits = [h.pos + 1 >= len(h.prompt) for h in rows]
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
        """Retire an admitted request: last event (with the held-back text), slot freed."""
        h.finish_reason, h.error = reason, error
        rest = first + (h.stream.finish() if reason in ("stop", "length") else "")
        self._send(h, Event(rest, reason, len(h.prompt), len(h.output), error))
        if h in self._live:
            self._live.remove(h)
            self.engine.release(h.slot)
            with self._cv:
                self._free.append(h.slot)

    @staticmethod
    def _send(h: Handle, ev: Event) -> None:
        try:
            h.sink(ev)
        except Exception:  # noqa: BLE001 -- a client that went away must not stop the loop
            log.warning("dropping an event of request %d: its sink failed", h.id, exc_info=True)
