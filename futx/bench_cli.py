"""`futx bench decode`: the whole-model decode benchmark (scripts/bench_engine.py in the source checkout)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

SCRIPTS = {"decode": "bench_engine.py"}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: `futx bench decode [options]` (see --help of each)",
                       description="futx bench decode [options]: ms per step of the decode engine against the "
                                   "bytes floor and peers (scripts/bench_engine.py; needs a CUDA GPU)")
    p.add_argument("what", choices=sorted(SCRIPTS))
    p.add_argument("args", nargs=argparse.REMAINDER, help="options of the benchmark (e.g. --points 1x1024)")
    p.set_defaults(func=run)


def run(args) -> int:
    path = Path(__file__).resolve().parents[1] / "scripts" / SCRIPTS[args.what]
    if not path.is_file():
        raise ValueError(f"{path} is missing: benchmarks run from a source checkout of futx")
    spec = importlib.util.spec_from_file_location(f"futx_bench_{args.what}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(args.args)
