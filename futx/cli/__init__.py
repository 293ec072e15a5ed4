"""The `futx` command line (entry point `futx.cli:main`, also `python -m futx` and `python -m futx.cli`).

    registry.py    the subcommands: register(name, help, configure, run, validate)
    parser.py      one-line usage errors, help with defaults
    validators.py  option types: numeric ranges, devices, models, input and output files
    options.py     options several subcommands share (model, device, decode engine) and their checks
    models.py      the reference model, decode engine and serving engine built from parsed options
    version.py     futx --version
    generate.py, ppl.py (+ ppl_results.py), pack.py, serve.py, build.py, bench.py   one subcommand each
    app.py         the parser of all of them, the validation pass, the exit statuses

Imports point down this list: a subcommand imports the shared modules, never app.py or another subcommand;
app.py imports the subcommands. Nothing here imports torch until a command runs.
"""

from .registry import COMMANDS, Command, register


def main(argv=None) -> int:
    from .app import main as run_main

    return run_main(argv)


__all__ = ["COMMANDS", "Command", "main", "register"]
