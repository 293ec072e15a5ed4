"""`futx build`: command-line front end of futx.runtime.build (also `python -m futx.runtime.cli build`)."""

from __future__ import annotations

import argparse
import json
import sys


def add_build_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("build", help="compile kernels ahead of time into a deployable directory",
                              description="Compile registry kernels for a GPU arch on any machine (no GPU "
                                          "needed) and write objects, libraries and a manifest.")
    p.add_argument("--arch", default="sm_90a", choices=["sm_90a"], help="target GPU architecture")
    p.add_argument("--out", required=True, help="output directory (re-running skips up-to-date kernels)")
    p.add_argument("--only", default=None, help="comma-separated glob patterns of kernel keys, e.g. 'prefill.*'")
    p.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: CPU count)")
    p.add_argument("--force", action="store_true", help="rebuild even up-to-date kernels")
    p.add_argument("--no-runtime", action="store_true",
                   help="do not copy libcute_dsl_runtime.so into OUT/lib (the target installs the DSL wheel)")
    p.add_argument("--chain", action="append", default=[], metavar="MODULE:FACTORY",
                   help="also build a composed prefill epilogue chain: FACTORY() returns an epilogues.base.Chain "
                        "(repeatable; MODULE is imported from the current directory or the Python path)")
    p.add_argument("--ab", default="e4m3", help="operand dtypes of --chain kernels: e4m3, bf16 or e4m3,bf16")
    p.add_argument("--list", action="store_true", help="list the matching kernel keys and exit")
    p.set_defaults(func=run_build)
    return p


def run_build(args) -> int:
    from futx.runtime import select

    if args.chain:   # composed chains join the registry in this process; build only them unless --only says more
        from futx.runtime.catalog.prefill import chain_specs, load_chain

        keys = [s.key for path in args.chain for s in chain_specs(load_chain(path), args.ab.split(","))]
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="futx")
    sub = parser.add_subparsers(dest="command", required=True)
    add_build_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
