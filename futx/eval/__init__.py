"""Evaluation: the perplexity harness (perplexity.py) and the runner interface it drives (runner.py)."""

from futx.eval.perplexity import (PROTOCOLS, PerplexityResult, evaluate, format_table, join_rows, make_windows,
                                  read_rows)
from futx.eval.runner import Runner

__all__ = ["PROTOCOLS", "PerplexityResult", "Runner", "evaluate", "format_table", "join_rows", "make_windows",
           "read_rows"]
