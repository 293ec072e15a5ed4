"""Where the default evaluation text lives: WikiText-2's test split in ../shared/data beside the repository."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

DEFAULT_TEXT = Path("shared") / "data" / "wikitext-2-raw" / "wiki.test.raw"   # relative to the repo's parent


def default_text() -> Optional[Path]:
    """../shared/data/wikitext-2-raw/wiki.test.raw next to the repository, if present."""
    path = Path(__file__).resolve().parents[2].parent / DEFAULT_TEXT
    return path if path.is_file() else None
