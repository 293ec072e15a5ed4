"""Speculative greedy generation on the decode engine: draft, verify in one block step, keep the agreed prefix.

Every step runs one block per live request (DecodeModel.load_blocks / step(rows, width)): the tokens of its
history not yet in the cache (the last accepted token; while its prompt is read, up to `num_draft + 1` prompt
tokens at once) followed, once the block reaches the end of the history, by up to `num_draft` drafts from the
drafter. The target's argmax at each row decides how many drafts are kept (futx.speculative.accept: greedy),
plus one token of its own, so every verification emits 1..k+1 tokens and the output is token for token the
target's greedy decoding. Rejected drafts are rolled back by the request's length alone: their K/V rows stay
in the cache past it, never read (attention reads [0, pos]), and the request's next block overwrites them.

Requests of different lengths and different acceptance share steps (continuous batching over cache slots, as
futx.engine.generate); a step's width is its longest block, so a step where no request has a draft is a plain
decode step. A request's drafts are capped so that it never writes past the cache's capacity and never
verifies more tokens than it may still emit (max_new_tokens); EOS ends it at once (tokens after it in the same
verification are dropped).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Optional, Sequence

import torch

from futx.speculative.accept import greedy_accept
from futx.speculative.drafter import MAX_DRAFT, Drafter, check_proposals
from futx.speculative.stats import AcceptanceStats

from .generate import GenerationStats
from .model import DecodeModel


@dataclass
class _Request:
    index: int
    prompt_len: int
    max_new_tokens: int
    history: list[int]                 # prompt + accepted output
    pos: int = 0                       # tokens of history in the cache
    slot: int = -1
    hidden: Optional[torch.Tensor] = None  # [H]: the row that produced history[-1] (drafters with needs_hidden)
    done: bool = False

    @property
    def output(self) -> list[int]:
        return self.history[self.prompt_len:]


@dataclass
class SpeculativeStats(GenerationStats):
    verifications: int = 0
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)

    def summary(self) -> dict:
        return {"steps": self.steps, "rows": self.rows, "generated": self.generated, "seconds": self.seconds,
                "tokens_per_s": self.tokens_per_s, "ms_per_step": self.ms_per_step,
                "acceptance": self.acceptance.summary()}


def max_live_requests(model: DecodeModel, num_draft: int) -> int:
    """Requests one step can hold: cache slots, and rows per request num_draft + 1 within the step's rows."""
    return max(1, min(model.cache.slots, model.max_rows // (num_draft + 1)))


def generate_speculative(model: DecodeModel, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32,
                         eos_ids: Collection[int] = (), drafter: Optional[Drafter] = None, num_draft: int = 4,
                         graphs=None, on_token: Optional[Callable[[int, int], None]] = None,
                         prompt_blocks: bool = True, max_requests: Optional[int] = None,
                         ) -> tuple[list[list[int]], SpeculativeStats]:
    """Greedy continuations of `prompts` with speculative verification; the same tokens as
    futx.engine.generate.generate. drafter: a futx.speculative Drafter (None: no drafts). num_draft: drafts per
    verification (1..7). graphs: a BlockGraphs to replay (else eager steps). prompt_blocks: read prompts
    num_draft + 1 tokens per step (else one, as generate does). max_requests: live requests at most (default:
    what the cache slots and the step's rows hold)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0 <= num_draft <= MAX_DRAFT:
        raise ValueError(f"num_draft must be in [0, {MAX_DRAFT}], got {num_draft}")
    width = num_draft + 1
    if width > model.max_rows:
        raise ValueError(f"a verification of {num_draft} drafts needs {width} rows; the model's steps hold "
                         f"{model.max_rows} (DecodeModel(max_rows=...))")
    live_max = max_live_requests(model, num_draft) if max_requests is None else max_requests
    if not 1 <= live_max <= max_live_requests(model, num_draft):
        raise ValueError(f"max_requests must be in [1, {max_live_requests(model, num_draft)}], got {max_requests}")
    reqs = [_Request(i, len(p), max_new_tokens, list(p)) for i, p in enumerate(prompts)]
    for r in reqs:
        if not r.prompt_len:
            raise ValueError(f"prompt {r.index} is empty")
        need = r.prompt_len + max_new_tokens - 1
        if need > model.capacity:
            raise ValueError(f"prompt {r.index} needs {need} cache positions ({r.prompt_len} prompt + "
                             f"{max_new_tokens} new - 1) but the cache holds {model.capacity}")
    vocab = model.config.vocab_size
    waiting = list(reversed(reqs))
    free = list(range(model.cache.slots - 1, -1, -1))
    live: list[_Request] = []
    stats = SpeculativeStats()
    t_start = time.perf_counter()
    while waiting or live:
        while waiting and free and len(live) < live_max:
            r = waiting.pop()
            r.slot = free.pop()
            live.append(r)
        # the known tokens of each block (history not yet in the cache), then the drafts where there is room
        known = [r.history[r.pos:r.pos + (width if prompt_blocks else 1)] for r in live]
        room = [0] * len(live)
        for i, r in enumerate(live):
            if r.pos + len(known[i]) == len(r.history):     # the block reaches the end of the history
                may_emit = r.max_new_tokens - len(r.output)  # a verification of d drafts emits up to d + 1
                fits = model.capacity - r.pos - len(known[i])
                room[i] = max(0, min(width - len(known[i]), may_emit - 1, fits))
                if drafter is not None and drafter.needs_hidden and r.hidden is None:
                    room[i] = 0   # no target row produced history[-1] yet (a prompt read in this step)
        drafts: list[list[int]] = [[] for _ in live]
        ask = [i for i in range(len(live)) if room[i] > 0]
        if drafter is not None and ask:
            hidden = (torch.stack([live[i].hidden for i in ask]) if drafter.needs_hidden else None)
            k = max(room[i] for i in ask)
            got = drafter.propose([live[i].history for i in ask], hidden, k)
            check_proposals(got, len(ask), k, vocab)
            for i, d in zip(ask, got):
                drafts[i] = [int(t) for t in d[:room[i]]]
        blocks = [(r.slot, r.pos, known[i] + drafts[i]) for i, r in enumerate(live)]
        t0 = time.perf_counter()
        step = graphs.run(blocks) if graphs is not None else model.verify(blocks)
        stats.step_seconds.append(time.perf_counter() - t0)
        stats.steps += 1
        stats.rows += sum(len(b[2]) for b in blocks)
        rows_hidden = []
        still = []
        for i, r in enumerate(live):
            nk, targets = len(known[i]), step.targets[i]
            if r.pos + nk < len(r.history):   # a prompt block that ends before the prompt does: no output
                r.pos += nk
                still.append(r)
                continue
            a, emitted = greedy_accept(drafts[i], targets[nk - 1:])
            if drafts[i]:
                stats.verifications += 1
            stats.acceptance.record(r.pos + nk - 1, len(drafts[i]), a)
            r.pos += nk + a              # the accepted drafts' rows stay; the rejected ones are past the length
            for t in emitted:
                r.history.append(t)
                stats.generated += 1
                if on_token is not None:
                    on_token(r.index, t)
                if len(r.output) >= r.max_new_tokens or t in eos_ids:
                    r.done = True
                    break
            if r.done:
                r.hidden = None
                free.append(r.slot)
            else:
                if drafter is not None and drafter.needs_hidden:
                    rows_hidden.append((r, step.row(i, nk - 1 + a)))
                still.append(r)
        if rows_hidden:
            h = model.buffers.hidden[torch.tensor([j for _, j in rows_hidden], device=model.device)]
            for (r, _), row in zip(rows_hidden, h):
                r.hidden = row
        live = still
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    stats.seconds = time.perf_counter() - t_start
    return [r.output for r in reqs], stats
