"""Acceptance length per verification, bucketed by context position.

A draft that depends on its history (n-gram lookup, a draft head reading the target's hidden state) can hold
up on short contexts and collapse on long ones, so every verification is logged at the context position it
starts from (the position of the request's last accepted token) and summarized per bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

BUCKETS = (0, 512, 1024, 2048)   # [0, 512), [512, 1024), [1024, 2048), [2048, ...)


def bucket_name(lo: int, hi: int | None) -> str:
    return f"{lo}-{hi}" if hi is not None else f"{lo}+"


@dataclass
class _Bucket:
    verifications: int = 0
    drafted: int = 0
    accepted: int = 0

    def summary(self) -> dict:
        v = self.verifications
        return {"verifications": v, "drafted": self.drafted, "accepted": self.accepted,
                "mean_accepted": self.accepted / v if v else None,
                "mean_tokens_per_verification": (self.accepted + v) / v if v else None,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else None}


@dataclass
class AcceptanceStats:
    """record(position, drafted, accepted) per request row that could emit (a verification where drafted > 0;
    rows without drafts, plain decode rows, are only counted); summary() is JSON-able."""

    edges: Sequence[int] = BUCKETS
    log: list = field(default_factory=list)   # (position, drafted, accepted) per verification
    keep_log: bool = True

    def __post_init__(self):
        self._total = _Bucket()
        self._buckets = [_Bucket() for _ in self.edges]
        self._histogram: dict[int, int] = {}
        self.undrafted = 0

    def record(self, position: int, drafted: int, accepted: int) -> None:
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafts")
        if drafted == 0:
            self.undrafted += 1
            return
        i = max(j for j, lo in enumerate(self.edges) if position >= lo) if position >= self.edges[0] else 0
        for b in (self._total, self._buckets[i]):
            b.verifications += 1
            b.drafted += drafted
            b.accepted += accepted
        self._histogram[accepted] = self._histogram.get(accepted, 0) + 1
        if self.keep_log:
            self.log.append((position, drafted, accepted))

    @property
    def verifications(self) -> int:
        return self._total.verifications

    @property
    def mean_accepted(self) -> float:
        t = self._total
        return t.accepted / t.verifications if t.verifications else float("nan")

    def summary(self) -> dict:
        his = list(self.edges[1:]) + [None]
        return {**self._total.summary(),
                "rows_without_draft": self.undrafted, "accepted_histogram": {str(a): n for a, n in sorted(self._histogram.items())},
                "by_position": {bucket_name(lo, hi): b.summary() for lo, hi, b in zip(self.edges, his, self._buckets)}}

    def lines(self) -> list[str]:
        """A human summary: mean accepted drafts (and tokens) per verification, overall and per bucket."""
        s = self.summary()
        if not s["verifications"]:
            return ["speculative: no verifications"]
        out = [f"speculative: {s['verifications']} verifications (+ {self.undrafted} rows without a draft), {s['accepted']}/{s['drafted']} drafts accepted, "
               f"{s['mean_accepted']:.2f} accepted ({s['mean_tokens_per_verification']:.2f} tokens) per verification"]
        for name, b in s["by_position"].items():
            if b["verifications"]:
                rate = "" if b["acceptance_rate"] is None else f", rate {b['acceptance_rate']:.2f}"
                out.append(f"  positions {name}: {b['verifications']} verifications, {b['mean_accepted']:.2f} "
                           f"accepted per verification{rate}")
        return out
