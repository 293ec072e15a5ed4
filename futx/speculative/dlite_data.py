"""Where the draft head's training text lives: enwiki-sample in ../shared/data beside the repository (never the
WikiText-2 test split, which is for reporting perplexity only). No torch here: the command line checks it first."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

DEFAULT_DATA = Path("shared") / "data" / "enwiki-sample" / "enwiki-sample.txt"   # relative to the repo's parent


def default_data() -> Optional[Path]:
    """../shared/data/enwiki-sample/enwiki-sample.txt next to the repository, if present."""
    path = Path(__file__).resolve().parents[2].parent / DEFAULT_DATA
    return path if path.is_file() else None
