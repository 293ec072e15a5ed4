"""Incremental detokenization: text deltas of a growing token list, cut at the first stop string.

The whole output is decoded each time (a byte-level BPE merges across token boundaries); a delta holds
back an incomplete UTF-8 sequence (U+FFFD at the end) and any tail that could still become a stop string,
so streamed text never shows what the final text will not contain.
"""

from __future__ import annotations

from typing import Sequence


class TextStream:
    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.ids: list[int] = []
        self.sent = 0            # characters already returned
        self.stopped = False     # a stop string was found; `text` ends before it
        self.text = ""

    def push(self, token: int) -> str:
        """Add a token; return the new text that is safe to show."""
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids, skip_special=True)
        cut = min((i for i in (full.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.text = True, full[:cut]
            return self._take(cut)
        self.text = full
        safe = len(full.rstrip("\ufffd"))
        safe -= max((_partial_stop(full[:safe], s) for s in self.stops), default=0)
        return self._take(safe)

    def finish(self) -> str:
        """What is left to show once no more tokens come."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out


def _partial_stop(text: str, stop: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `stop`."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
