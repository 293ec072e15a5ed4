"""Which draft tokens a verification keeps.

A verification feeds [t_0, d_1 .. d_k] (t_0 the last accepted token, d_i the drafts) and the target returns
at row j its prediction for the token after d_j (after t_0 at j = 0): k + 1 predictions.

* Greedy: keep drafts while d_{j+1} equals the target's argmax at row j; then the target's own argmax at the
  first disagreeing row (or at row k when all agree) is the bonus token. The output is exactly greedy decoding
  of the target, 1..k+1 tokens per verification.
* Temperature > 0: speculative sampling (Leviathan et al. 2023, Chen et al. 2023): d_{j+1} is kept with
  probability min(1, p_j(d) / q_j(d)); the first rejected position draws from norm(max(0, p_j - q_j)); if all k
  are kept the bonus token draws from p_k. Every emitted token is then distributed as the target's p. A
  deterministic drafter (n-gram) has one-hot q: accept with probability p_j(d), on rejection draw from p_j with
  d removed.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def greedy_accept(drafts: Sequence[int], targets: Sequence[int]) -> tuple[int, list[int]]:
    """(accepted draft count a, emitted tokens drafts[:a] + [targets[a]]) for targets = the target's argmax at
    rows 0..k (len(targets) >= len(drafts) + 1)."""
    if len(targets) < len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target predictions, got {len(targets)}")
    a = 0
    while a < len(drafts) and int(drafts[a]) == int(targets[a]):
        a += 1
    return a, [int(t) for t in drafts[:a]] + [int(targets[a])]


def probabilities(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """float32 sampling distributions [R, V] of logits rows [R, V] (temperature > 0, then top-p as
    futx.serve.sampling does: the smallest prefix of the sorted distribution whose mass reaches top_p)."""
    if temperature <= 0:
        raise ValueError("probabilities are for temperature > 0; greedy acceptance needs none")
    probs = torch.softmax(logits.detach().float() / temperature, dim=-1)
    if top_p < 1.0:
        p, idx = probs.sort(dim=-1, descending=True)
        keep = p.cumsum(-1) - p < top_p
        probs = torch.zeros_like(probs).scatter_(-1, idx, p * keep)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def rejection_accept(drafts: Sequence[int], p: torch.Tensor, q: Optional[torch.Tensor] = None,
                     generator: Optional[torch.Generator] = None) -> tuple[int, list[int]]:
    """(accepted draft count a, emitted tokens: drafts[:a] + one token drawn by the rule above).

    p: float32 [k + 1, V] the target's sampling distribution at rows 0..k (rows past len(drafts) unused);
    q: float32 [k, V] the drafter's distribution of each draft, or None for a deterministic drafter (one-hot).
    All draws on the host from `generator`."""
    p = p.detach().float().cpu()
    if q is not None:
        q = q.detach().float().cpu()
    k = len(drafts)
    if p.shape[0] < k + 1:
        raise ValueError(f"{k} drafts need {k + 1} target distributions, got {p.shape[0]}")
    for j, d in enumerate(int(t) for t in drafts):
        pd = float(p[j, d])
        qd = 1.0 if q is None else float(q[j, d])
        u = float(torch.rand((), generator=generator))
        if qd > 0 and u < min(1.0, pd / qd):
            continue
        if q is None:
            residual = p[j].clone()
            residual[d] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_min(0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q (or p one-hot on d): a rejection there has probability 0; draw from p
            residual, total = p[j], float(p[j].sum())
        tok = int(torch.multinomial(residual / total, 1, generator=generator))
        return j, [int(t) for t in drafts[:j]] + [tok]
    return k, [int(t) for t in drafts] + [int(torch.multinomial(p[k] / p[k].sum(), 1, generator=generator))]
