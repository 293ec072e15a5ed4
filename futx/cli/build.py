"""`futx build`: compile registry kernels ahead of time into a deployable directory (futx.runtime.build)."""

from __future__ import annotations

import argparse
import json
import sys
from argparse import ArgumentTypeError

from . import validators as v
from .registry import register

HELP = "compile kernels ahead of time into a deployable directory"
DESCRIPTION = ("Compile registry kernels for a GPU arch on any machine (no GPU needed) and write objects, libraries "
               "and a manifest.")


def chain_factory(value: str) -> str:
    module, colon, factory = value.partition(":")
    if not (colon and module.strip() and factory.strip()):
        raise ArgumentTypeError(f"{value!r} is not MODULE:FACTORY")
    return value


def configure(p: argparse.ArgumentParser) -> None:
    p.description = DESCRIPTION
    p.add_argument("--arch", default="sm_90a", choices=["sm_90a"], help="target GPU architecture")
    p.add_argument("--out", required=True, type=v.output_dir,
                   help="output directory (re-running skips up-to-date kernels)")
    p.add_argument("--only", default=None, type=v.nonempty,
                   help="comma-separated glob patterns of kernel keys, e.g. 'prefill.*' (default: every kernel)")
    p.add_argument("--jobs", type=v.positive_int, default=None, help="parallel compiles (default: CPU count)")
    p.add_argument("--force", action="store_true", help="rebuild even up-to-date kernels")
    p.add_argument("--no-runtime", action="store_true",
                   help="do not copy libcute_dsl_runtime.so into OUT/lib (the target installs the DSL wheel)")
    p.add_argument("--chain", action="append", default=[], type=chain_factory, metavar="MODULE:FACTORY",
                   help="also build a composed prefill epilogue chain: FACTORY() returns an epilogues.base.Chain "
                        "(repeatable; MODULE is imported from the current directory or the Python path)")
    p.add_argument("--ab", default=["e4m3"], type=v.choice_list(("e4m3", "bf16")),
                   help="operand dtypes of --chain kernels: e4m3, bf16 or e4m3,bf16 (default: e4m3)")
    p.add_argument("--list", action="store_true", help="list the matching kernel keys and exit")


def run(args: argparse.Namespace) -> int:
    from futx.runtime import select

    if args.chain:   # composed chains join the registry in this process; build only them unless --only says more
        from futx.runtime.catalog.prefill import chain_specs, load_chain

        keys = [s.key for path in args.chain for s in chain_specs(load_chain(path), args.ab)]
        args.only = ",".join(keys + ([args.only] if args.only else []))
    if args.list:
        for spec in select(args.only):
            print(f"{spec.key:60s} {spec.module}  {dict(spec.params)}")
        return 0
    from futx.runtime.build import build

    manifest = build(args.out, arch=args.arch, only=args.only, jobs=args.jobs, force=args.force,
                     bundle_runtime=not args.no_runtime)
    entries = manifest["entries"]
    print(f"{len(entries)} kernels in {args.out} (arch {manifest['arch']}, DSL {manifest['dsl_version']})")
    bad = {k: e["sass"] for k, e in entries.items() if e.get("sass", {}).get("LDL") or e.get("sass", {}).get("STL")}
    if bad:
        print("warning: local-memory spills in " + json.dumps(bad), file=sys.stderr)
    return 0


register("build", HELP, configure, run)
