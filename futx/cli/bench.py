"""`futx bench decode|speculative [options]`: the whole-model benchmarks, scripts/bench_engine.py and
scripts/bench_speculative.py of a source checkout.

The benchmark's own parser (`build_parser` in the script) reads its options here, in the validation pass, so
a bad option is refused at once and on any machine; `run` then measures (a CUDA GPU).
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from .registry import register

SCRIPTS = {"decode": "bench_engine.py", "speculative": "bench_speculative.py"}
HELP = "benchmarks: `futx bench decode|speculative [options]` (see --help of each)"
DESCRIPTION = ("futx bench decode [options]: ms per step of the decode engine against the bytes floor and peers "
               "(scripts/bench_engine.py); futx bench speculative [options]: generated tokens/s and acceptance "
               "by context position of speculative decoding against plain decoding (scripts/bench_speculative.py)")


def configure(p: argparse.ArgumentParser) -> None:
    p.description = DESCRIPTION
    p.add_argument("what", choices=sorted(SCRIPTS), help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="options of the benchmark (e.g. --points 1x1024)")


def script(what: str):
    """The benchmark script as a module (its heavy imports happen when it runs)."""
    path = Path(__file__).resolve().parents[2] / "scripts" / SCRIPTS[what]
    if not path.is_file():
        raise ValueError(f"{path} is missing: benchmarks run from a source checkout of futx")
    spec = importlib.util.spec_from_file_location(f"futx_bench_{what}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def validate(args: argparse.Namespace) -> None:
    args.script = script(args.what)
    args.options = args.script.build_parser(prog=f"futx bench {args.what}").parse_args(args.args)


def run(args: argparse.Namespace) -> int:
    return args.script.run(args.options)


register("bench", HELP, configure, run, validate)
