"""The argument parser of every futx command: a usage error is one line on stderr, help shows defaults."""

from __future__ import annotations

import argparse
import sys


class UsageError(SystemExit):
    """A bad command line, already reported; exit status 2. A SystemExit, so a script using `Parser` exits
    cleanly, and `futx.cli.app.main` can return the status instead."""

    def __init__(self) -> None:
        super().__init__(2)


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help, except where the help already says its default or there
    is none to show (None: the help says what happens; a flag's False; an empty string or list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        d = action.default
        if "default" in help or d is None or d is False or d == "" or d == [] or d == argparse.SUPPRESS:
            return help
        if isinstance(d, list):   # nargs="+" and the like: as it would be typed
            return f"{help} (default: {' '.join(map(str, d))})"
        return super()._get_help_string(action)


class RawDefaultsFormatter(DefaultsFormatter, argparse.RawDescriptionHelpFormatter):
    """DefaultsFormatter that keeps the description's own line breaks (a script's docstring)."""


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are the single line `PROG: error: MESSAGE` (no usage block)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise UsageError()
