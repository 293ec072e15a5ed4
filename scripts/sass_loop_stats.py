"""Instruction mix of a decode projection kernel's main loop, from its SASS (CPU only: the DSL compiles for sm_90a here).

    python scripts/sass_loop_stats.py decode.skinny.int4.m16.swiglu.rw decode.skinny.int4.m16.swiglu.ws ...
    python scripts/sass_loop_stats.py --md docs/decode-linear/sass-loops.md KEY ...

For each registry or tuning-space key: compile it (SASS kept), take the loop (a backward branch) that holds the most
tensor-core instructions, and count its instructions by class per unit of work. A unit is one 16-channel n-block x
128 k of packed INT4 weights per warp (the E4M3 warp-specialized kernel: x 64 k of e4m3 bytes), i.e. 1 KB of weights,
so the counts are instructions per KB per warp; the expansion counts are also given per 8 weights (one packed INT4
word). The unit count of a loop trip is its MMA count over the
kernel's MMAs per unit (mma.sync: 8 k16 steps x token groups x n-blocks per warp; wgmma: 8 k16 steps).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLASSES = {   # opcode base -> class
    "LOP3": "expand", "SHF": "expand", "HFMA2": "expand", "HADD2": "expand", "HMUL2": "expand", "PRMT": "expand",
    "HMMA": "mma", "HGMMA": "mma",
    "LDS": "shared", "LDSM": "shared", "STS": "shared",
    "LDG": "global", "LDGSTS": "global", "UBLKCP": "global", "UTMALDG": "global",
    "FFMA": "fold", "FMUL": "fold", "FADD": "fold",
    "BAR": "sync", "SYNCS": "sync", "WARPGROUP": "sync", "DEPBAR": "sync",
}
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")
TARGET = re.compile(r"`\(\.(L_x_\d+)\)")
LABEL = re.compile(r"^\.(L_x_\d+):")


def parse(sass: str) -> tuple[list, dict]:
    """[(address, opcode, operands)], {label: address}."""
    ins, labels, pending = [], {}, []
    for line in sass.splitlines():
        m = LABEL.match(line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = LINE.search(line)
        if m:
            addr = int(m.group(1), 16)
            for lab in pending:
                labels[lab] = addr
            pending = []
            ins.append((addr, m.group(2), m.group(3)))
    return ins, labels


def hot_loop(ins: list, labels: dict, min_mma: int = 8) -> list:
    """The instructions of the main loop: of the backward-branch ranges holding at least `min_mma` MMAs, the densest
    in MMAs (an outer loop around it, or a range around the whole kernel, holds the same MMAs among more code)."""
    best, best_density = [], -1.0
    for i, (addr, op, rest) in enumerate(ins):
        if not op.startswith("BRA"):
            continue
        t = TARGET.search(rest)
        if not t or t.group(1) not in labels or labels[t.group(1)] > addr:
            continue
        body = [x for x in ins if labels[t.group(1)] <= x[0] <= addr]
        n = sum(1 for x in body if x[1].split(".")[0] in ("HMMA", "HGMMA"))
        if n >= min_mma and n / len(body) > best_density:
            best, best_density = body, n / len(body)
    return best


def e4m3_ws(params: dict) -> bool:
    """The warp-specialized kernel on E4M3 weights: its unit is 64 k (16 channels x 64 bytes, also 1 KB per warp)."""
    return params.get("mma") == "ws" and params.get("fmt") == "e4m3"


def weights_per_lane(params: dict) -> int:
    """Weights a lane expands per unit: 16 x 128 / 32 (INT4), 16 x 64 / 32 (E4M3 ws)."""
    return 32 if e4m3_ws(params) else 64


def mmas_per_unit(params: dict) -> int:
    if e4m3_ws(params):
        return 4
    if params.get("mma") in ("wgmma", "ws"):
        return 8
    m_tiles = params.get("m_tiles", 1)
    return 8 * m_tiles * params.get("nb_per_warp", 1)


def compile_sass(spec) -> str:
    from futx.runtime.compiler import compile_spec

    dump = tempfile.mkdtemp(prefix="futx-sass-loop-")
    os.environ["CUTE_DSL_KEEP"] = "sass"
    os.environ["CUTE_DSL_DUMP_DIR"] = dump
    try:
        compile_spec(spec)
        return "\n".join(Path(p).read_text(errors="replace") for p in sorted(glob.glob(dump + "/*.sass")))
    finally:
        shutil.rmtree(dump, ignore_errors=True)


def find_spec(key: str):
    from futx.runtime.catalog import PACKAGE_SPECS

    for s in PACKAGE_SPECS:
        if s.key == key:
            return s
    sys.path.insert(0, str(ROOT / "scripts"))
    import tuning_space

    for s in tuning_space.specs(key):
        if s.key == key:
            return s
    raise SystemExit(f"no registry or tuning-space kernel {key!r}")


def stats(key: str) -> dict:
    spec = find_spec(key)
    per = mmas_per_unit(spec.param_dict)
    body = hot_loop(*parse(compile_sass(spec)), min_mma=min(8, per))
    n_mma = sum(1 for x in body if x[1].split(".")[0] in ("HMMA", "HGMMA"))
    units = max(1, n_mma // per)
    counts: dict[str, int] = {}
    ops: dict[str, int] = {}
    for _, op, _ in body:
        base = op.split(".")[0]
        cls = CLASSES.get(base, "other")
        counts[cls] = counts.get(cls, 0) + 1
        ops[base] = ops.get(base, 0) + 1
    return {"key": key, "units_per_trip": units, "total": len(body) / units,
            **{c: v / units for c, v in counts.items()},
            "per_word": {op: ops.get(op, 0) / units / (weights_per_lane(spec.param_dict) / 8)
                         for op in ("LOP3", "SHF", "IMAD", "HFMA2", "HMUL2", "PRMT")}}


def render(rows: list) -> str:
    cols = ("total", "expand", "mma", "shared", "global", "fold", "sync", "other")
    per = ("LOP3", "SHF", "IMAD", "HFMA2", "HMUL2", "PRMT")
    out = ["| kernel | units per loop trip | " + " | ".join(cols) + f" | {' / '.join(per)} per 8 weights |",
           "|---|---:|" + "---:|" * len(cols) + "---|"]
    for r in rows:
        pw = r["per_word"]
        out.append(f"| `{r['key']}` | {r['units_per_trip']} | " + " | ".join(f"{r.get(c, 0):.1f}" for c in cols)
                   + " | " + " / ".join(f"{pw[op]:.1f}" for op in per) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("keys", nargs="+")
    ap.add_argument("--md", default="", help="also write the table to this markdown file")
    args = ap.parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    sys.path.insert(0, str(ROOT))
    rows = [stats(k) for k in args.keys]
    table = render(rows)
    print("instructions per unit (1 KB of weights: INT4 16 x 128 k, E4M3 16 x 64 k) per warp in the main loop\n")
    print(table)
    if args.md:
        Path(args.md).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
