"""Checks of the files a command reads and writes, each failing with a ValueError that says what is wrong.

No torch here: the command line runs these before any model loads, and the readers call the same checks.
"""

from __future__ import annotations

import os
from pathlib import Path


def input_file(path: str | os.PathLike) -> Path:
    """`path` as a Path if it names an existing regular file (following links)."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{p} is a directory, not a file")
    if not p.exists():
        raise ValueError(f"{p} does not exist")
    if not p.is_file():
        raise ValueError(f"{p} is not a regular file")
    if not os.access(p, os.R_OK):
        raise ValueError(f"{p} is not readable")
    return p


def read_text(path: str | os.PathLike) -> str:
    """The content of a UTF-8 text file; a file that is not UTF-8 is refused with the offset of its first bad
    byte (a NUL byte counts as bad: it means a binary file)."""
    p = input_file(path)
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = f"byte {e.start} (0x{data[e.start]:02x}) is not valid UTF-8"
        raise ValueError(f"{p} is not UTF-8 text: {bad}") from None
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{p} is not text: byte {nul} is a NUL byte")
    return text


def _writable_dir(d: Path) -> None:
    if not d.exists():
        raise ValueError(f"directory {d} does not exist")
    if not d.is_dir():
        raise ValueError(f"{d} is not a directory")
    if not os.access(d, os.W_OK | os.X_OK):
        raise ValueError(f"directory {d} is not writable")


def output_file(path: str | os.PathLike) -> Path:
    """`path` as a Path if a file can be written there: not a directory, in an existing writable directory,
    and not an existing file that cannot be replaced."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{p} is a directory; give a file name")
    _writable_dir(p.parent)
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{p} exists and is not writable")
    return p


def output_dir(path: str | os.PathLike) -> Path:
    """`path` as a Path if a directory can be written there: an existing writable directory, or a new one in
    an existing writable directory."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{p} exists and is not a directory")
    _writable_dir(p if p.exists() else p.parent)
    return p
