"""The subcommands of `futx`: each command module calls `register` when it is imported (futx.cli.app imports
them). This module imports nothing of the CLI, so any module may register."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Optional

Configure = Callable[[argparse.ArgumentParser], None]
Check = Callable[[argparse.Namespace], None]
Run = Callable[[argparse.Namespace], Optional[int]]


@dataclass(frozen=True)
class Command:
    """`configure` adds the options; `validate` checks what the options' own types cannot (how they combine,
    files named by defaults) and raises ValueError naming the option, before `run` starts any work; `run`
    returns the exit status."""
    name: str
    help: str
    configure: Configure
    run: Run
    validate: Optional[Check] = None


COMMANDS: dict[str, Command] = {}


def register(name: str, help: str, configure: Configure, run: Run, validate: Optional[Check] = None) -> None:
    if name in COMMANDS:
        raise ValueError(f"futx subcommand {name!r} is already registered")
    COMMANDS[name] = Command(name, help, configure, run, validate)
