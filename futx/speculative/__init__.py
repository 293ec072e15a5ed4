"""Speculative decoding on the decode engine (issue 27).

    drafter.py  the `Drafter` protocol every draft source implements (n-gram prompt lookup, DLite head)
    ngram.py    prompt lookup: propose the tokens that followed an earlier match of the history's suffix
    accept.py   acceptance: greedy (longest matching prefix) and rejection sampling for temperature > 0
    stats.py    acceptance length per verification, bucketed by context position

The engine side (the verify step, speculative generation) lives in futx.engine.speculative.
"""

from futx.lazy import lazy_exports

_EXPORTS = {"Drafter": "drafter", "NoDrafter": "drafter", "make_drafter": "drafter", "NgramDrafter": "ngram",
            "greedy_accept": "accept", "rejection_accept": "accept", "AcceptanceStats": "stats"}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
