"""Option types for argparse (`type=`): each checks one option's value as it is parsed, before any model loads,
and says what is wrong; argparse names the option ("argument --batch-size: must be at least 1, got 0").

No torch at import; `device` imports it only where the driver reports a GPU, to count the CUDA devices.
"""

from __future__ import annotations

import re
from argparse import ArgumentTypeError
from typing import Callable, Iterable, Optional

from futx import files, gpus
from futx.checkpoint import resolve


def _checked(check: Callable[[str], object], name: str) -> Callable[[str], str]:
    """A type that runs `check` (raising ValueError, as futx.files does) and keeps the string."""

    def parse(value: str) -> str:
        try:
            check(value)
        except ValueError as e:
            raise ArgumentTypeError(str(e)) from None
        return value

    parse.__name__ = name
    return parse


input_file = _checked(files.input_file, "input_file")


def _file_or_dir(path: str) -> None:
    from pathlib import Path

    if not Path(path).is_dir():
        files.input_file(path)


input_path = _checked(_file_or_dir, "input_path")     # an existing file, or a directory (a draft head's)
text_file = _checked(files.read_text, "text_file")      # UTF-8: the message names the first bad byte
output_file = _checked(files.output_file, "output_file")
output_dir = _checked(files.output_dir, "output_dir")
# a checkpoint directory, a .gguf file, a packed directory or a known model name
model = _checked(resolve, "model")


def int_in(lo: int, hi: Optional[int] = None) -> Callable[[str], int]:
    """An integer in [lo, hi] (no upper bound when hi is None)."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise ArgumentTypeError(f"{value!r} is not an integer") from None
        if n < lo or (hi is not None and n > hi):
            raise ArgumentTypeError(f"must be at least {lo}, got {n}" if hi is None
                                    else f"must be in {lo}..{hi}, got {n}")
        return n

    parse.__name__ = "int"
    return parse


positive_int = int_in(1)


def positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise ArgumentTypeError(f"{value!r} is not a number") from None
    if not 0 < x < float("inf"):
        raise ArgumentTypeError(f"must be a positive number, got {value}")
    return x


def int_choice(values: Iterable[int]) -> Callable[[str], int]:
    allowed = tuple(values)

    def parse(value: str) -> int:
        n = int_in(min(allowed))(value)
        if n not in allowed:
            raise ArgumentTypeError(f"must be one of {', '.join(map(str, allowed))}, got {n}")
        return n

    parse.__name__ = "int"
    return parse


def choice_list(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """A comma-separated list of some of `choices` (at least one, no repeats)."""
    allowed = tuple(choices)

    def parse(value: str) -> list[str]:
        items = [v.strip() for v in value.split(",")]
        bad = [v for v in items if v not in allowed]
        if bad:
            raise ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(allowed)} (comma-separated)")
        if len(set(items)) != len(items):
            raise ArgumentTypeError(f"{value!r} names a value twice")
        return items

    parse.__name__ = "list"
    return parse


def nonempty(value: str) -> str:
    if not value.strip():
        raise ArgumentTypeError("must not be empty")
    return value


DEVICE_FORMS = "cpu, cuda or cuda:N"


def device(value: str) -> str:
    """cpu, cuda or cuda:N, and for CUDA a device this machine has."""
    m = re.fullmatch(r"(cpu|cuda)(?::(\d+))?", value.strip())
    if not m or (m.group(1) == "cpu" and m.group(2) is not None):
        raise ArgumentTypeError(f"{value!r} is not a device: give {DEVICE_FORMS}")
    if m.group(1) == "cuda":
        if not gpus.any_visible():   # asked without torch: a CPU machine answers at once
            raise ArgumentTypeError(f"{value}: no CUDA device here ({gpus.describe()}); use cpu")
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = "" if torch.version.cuda else ", a CPU-only build"
            raise ArgumentTypeError(f"{value}: torch {torch.__version__}{build} sees no CUDA device; use cpu")
        index = int(m.group(2) or 0)
        if index >= count:
            raise ArgumentTypeError(f"{value}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return value.strip()


def default_text_file(find: Callable[[], Optional[str]], option: str, expected: str) -> str:
    """The default of a text-file option (`find()`: its path beside the repo, or None), checked as a given one
    would be: it exists and is UTF-8 text (`expected` names where it should be, for the message)."""
    from futx import files

    path = find()
    if path is None:
        raise ValueError(f"no {option} given and {expected} is not beside the repo")
    try:
        files.read_text(path)
    except ValueError as e:
        raise ValueError(f"{option} (default): {e}") from None
    return path
