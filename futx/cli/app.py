"""`futx`: the parser of every registered subcommand, one validation pass, then the command.

A subcommand is a module that calls `futx.cli.registry.register(name, help, configure, run, validate)` when
imported; the built-in ones are listed in COMMAND_MODULES (append yours). For every command: argparse checks
each option as it is parsed (futx.cli.validators), `validate` checks how they combine, and only then `run`
loads a model or starts work. A mistake is one line `futx CMD: error: ...` with exit status 2; Ctrl-C exits
with 130.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

from .parser import Parser, UsageError
from .registry import COMMANDS
from .version import VersionAction

COMMAND_MODULES: list[str] = ["futx.cli.generate", "futx.cli.ppl", "futx.cli.pack", "futx.cli.serve",
                              "futx.cli.build", "futx.cli.bench", "futx.cli.train_draft"]


def build_parser() -> Parser:
    for module in COMMAND_MODULES:
        importlib.import_module(module)
    parser = Parser(prog="futx", description="Llama-style transformer inference for NVIDIA Hopper (reference "
                    "path on CPU)")
    parser.add_argument("--version", action=VersionAction,
                        help="futx's, torch's and the CUTLASS DSL's versions, and whether a Hopper GPU is present")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in COMMANDS.values():
        cmd.configure(sub.add_parser(cmd.name, help=cmd.help, description=cmd.help))
    return parser


def one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:   # already printed
        return e.code
    cmd = COMMANDS[args.command]
    prog = f"futx {args.command}"
    try:
        if cmd.validate is not None:
            cmd.validate(args)
        return cmd.run(args) or 0
    except ValueError as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except UsageError as e:   # a command's own parser (futx bench decode)
        return e.code
    except OSError as e:      # the machine's, not the code's: a full disk, a port in use, a vanished file
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
