"""Prompt lookup (n-gram) drafting: no model, no training.

The draft for a request is what followed the most recent earlier occurrence of its history's suffix: for n
from n_max down to n_min, the last n tokens are searched for earlier in the history (prompt + accepted
output); at the first n that matches, the up to k tokens after the latest match are proposed. Nothing is
proposed when no suffix of length >= n_min occurs earlier. (The technique vLLM and transformers call prompt
lookup; it pays off where outputs copy from their context: code edits, summaries, retrieval answers.)
"""

from __future__ import annotations

from typing import Sequence


def lookup(history: Sequence[int], k: int, n_max: int = 3, n_min: int = 1, max_lookback: int = 0) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix (n_max..n_min
    tokens) of `history`; [] if none. max_lookback > 0: search only the last max_lookback tokens."""
    h = list(history)
    size = len(h)
    lo = max(0, size - max_lookback) if max_lookback > 0 else 0
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = h[size - n:]
        first = suffix[0]
        # a match at j must be followed by at least one token before the suffix's own start: j + n <= size - 1
        for j in range(size - n - 1, lo - 1, -1):
            if h[j] == first and h[j:j + n] == suffix:
                # past the history's end the match continues into the suffix itself: the history repeats with
                # period size - n - j there, and the proposal continues that period (a run of one token, a
                # repeated phrase) instead of stopping at the end
                out: list[int] = []
                for t in range(k):
                    i = j + n + t
                    out.append(h[i] if i < size else out[i - size])
                return out
    return []


class NgramDrafter:
    """The `Drafter` of `--speculative ngram` (futx.speculative.drafter)."""

    name = "ngram"
    needs_hidden = False

    def __init__(self, n_max: int = 3, n_min: int = 1, max_lookback: int = 0):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes need 1 <= n_min <= n_max, got {n_min}..{n_max}")
        if max_lookback < 0:
            raise ValueError(f"max_lookback must be >= 0 (0: the whole history), got {max_lookback}")
        self.n_max, self.n_min, self.max_lookback = n_max, n_min, max_lookback

    def propose(self, histories: Sequence[Sequence[int]], hidden, k: int) -> list[list[int]]:
        return [lookup(h, k, self.n_max, self.n_min, self.max_lookback) if k > 0 else [] for h in histories]
