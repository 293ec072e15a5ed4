"""Evaluation: the perplexity harness (perplexity.py), the runner interface it drives (runner.py) and the
default text (data.py).

The names below are imported on first use, so `futx.eval.data` stays cheap for the command line.
"""

from futx.lazy import lazy_exports

_EXPORTS = {"PROTOCOLS": "perplexity", "PerplexityResult": "perplexity", "evaluate": "perplexity",
            "format_table": "perplexity", "join_rows": "perplexity", "make_windows": "perplexity",
            "read_rows": "perplexity", "Runner": "runner"}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
