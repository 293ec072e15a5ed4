"""The results of a `futx ppl` run, kept as they grow: after every batch of windows the --json file is
rewritten atomically and a line goes to --jsonl, so an interrupted or failed run leaves every window it
finished behind, marked partial (`windows` scored of `windows_planned`)."""

from __future__ import annotations

import json
import sys
from typing import Callable, Optional

from futx import atomic


class RunningResults:
    def __init__(self, json_path: Optional[str], jsonl_path: Optional[str], planned: int,
                 record: Callable[[object], dict]):
        self.json_path, self.jsonl_path, self.planned, self._record = json_path, jsonl_path, planned, record
        self.results: dict = {}   # protocol -> PerplexityResult over the windows so far

    def record(self, r) -> dict:
        return {**self._record(r), "windows_planned": self.planned, "partial": r.windows < self.planned}

    def update(self, r) -> None:
        """`r`: the running result of one protocol (all its windows so far)."""
        self.results[r.protocol] = r
        if self.jsonl_path:
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps(self.record(r)) + "\n")
        self.write()

    def write(self) -> None:
        if self.json_path and self.results:
            atomic.write_text(self.json_path, json.dumps([self.record(r) for r in self.results.values()],
                                                         indent=2) + "\n")

    def table(self, model: str, text) -> str:
        from futx.eval.perplexity import format_table

        return format_table(list(self.results.values()), model=model, text=str(text))

    def report_interrupted(self, command: str, model: str, text) -> int:
        """After Ctrl-C: the table of what was kept, and what it is; exit status 130 (as a shell reports SIGINT)."""
        # Ctrl-C may have landed between a batch's result and its file write: write what the table shows
        self.write()
        if self.results:
            print(self.table(model, text), flush=True)
        done = ", ".join(f"{p} {r.windows}" for p, r in self.results.items()) or "none"
        where = f"; partial results in {self.json_path}" if self.json_path and self.results else ""
        print(f"{command}: interrupted; windows scored so far (of {self.planned}): {done}{where}", file=sys.stderr)
        return 130
