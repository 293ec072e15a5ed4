"""The interface every draft source implements, so the engine, `futx generate` and `futx serve` take any of them.

A drafter proposes, for each live request, up to k tokens that the target model is likely to produce next. The
engine then runs one verify step over [last accepted token, draft_1 .. draft_k_i] per request and keeps the
longest prefix the target agrees with (futx.speculative.accept), plus one token of the target's own.

    class Drafter(Protocol):
        name: str            # "ngram", "dlite", ...: what the acceptance summary and logs call it
        needs_hidden: bool   # True: propose() needs the target's hidden states (the engine then passes them)

        def propose(self, histories, hidden, k) -> list[list[int]]: ...

* histories: list[list[int]] of n requests, each the request's whole accepted sequence (prompt + accepted
  output tokens), in order; the draft continues histories[i] after its last token. The engine passes its
  own lists: a drafter must not modify them (copy what it keeps).
* hidden: None when needs_hidden is False; else a bf16 tensor [n, H] on the model's device: row i is the
  target's final hidden state (the residual stream after the last decoder layer, before the final RMSNorm:
  `StepBuffers.hidden`) at the row that produced histories[i][-1], i.e. the row of position
  len(histories[i]) - 2 whose input was histories[i][-2] and whose argmax was the last accepted token.
* k: the most drafts wanted per request (1..7). Returns n lists, list i holding 0..k token ids (0: no
  proposal; the engine then verifies only the last accepted token, a plain decode row). The engine may use
  fewer than returned (cache capacity, max_new_tokens), never more than k.

A drafter is deterministic (the greedy acceptance rule and the rejection rule with one-hot q then keep the
target's distribution exactly). A drafter that samples its drafts may additionally define
`propose_probs(histories, hidden, k) -> list[tuple[list[int], Optional[Tensor [k_i, V]]]]` returning the
float32 distribution q each draft token was drawn from; futx.speculative.accept.rejection_accept takes it.
The stateless interface is deliberate: a request's whole history is passed every time, so the engine can
roll a request back (reject drafts) without telling the drafter.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, runtime_checkable

MAX_DRAFT = 7        # drafts per verification: k + 1 <= 8 rows per request in one verify step
SPECULATIVE_KINDS = ("none", "ngram", "dlite")


@runtime_checkable
class Drafter(Protocol):
    name: str
    needs_hidden: bool

    def propose(self, histories: Sequence[Sequence[int]], hidden, k: int) -> list[list[int]]:
        ...


class NoDrafter:
    """Proposes nothing: speculative generation with it is plain greedy decoding (a test and benchmark baseline)."""

    name = "none"
    needs_hidden = False

    def propose(self, histories: Sequence[Sequence[int]], hidden, k: int) -> list[list[int]]:
        return [[] for _ in histories]


def check_proposals(proposals: list[list[int]], n: int, k: int, vocab_size: Optional[int] = None) -> None:
    """Raise ValueError unless `proposals` is n lists of at most k token ids (in [0, vocab_size))."""
    if len(proposals) != n:
        raise ValueError(f"the drafter returned {len(proposals)} proposals for {n} requests")
    for i, p in enumerate(proposals):
        if len(p) > k:
            raise ValueError(f"the drafter proposed {len(p)} tokens for request {i}, more than k = {k}")
        if vocab_size is not None and any(not 0 <= int(t) < vocab_size for t in p):
            raise ValueError(f"the drafter proposed a token outside [0, {vocab_size}) for request {i}")


def make_drafter(kind: str, draft: Optional[str] = None, *, device=None, target=None,
                 **options) -> Optional[Drafter]:
    """The drafter of `futx generate/serve --speculative KIND [--draft FILE]`; None for "none". target: the
    target model (its PackedModel or ModelWeights) for drafters that borrow its tensors (DLite: embedding, final
    norm, LM head); None lets such a drafter load the model its file records."""
    if kind == "none":
        return None
    if kind == "ngram":
        from .ngram import NgramDrafter

        return NgramDrafter(**options)
    if kind == "dlite":
        if draft is None:
            raise ValueError("--speculative dlite needs --draft FILE (the trained draft head)")
        from . import dlite  # futx/speculative/dlite.py: load(path, target=None, device=None) -> Drafter

        return dlite.load(draft, target=target, device=device, **options)
    raise ValueError(f"unknown speculative kind {kind!r}: one of {', '.join(SPECULATIVE_KINDS)}")
