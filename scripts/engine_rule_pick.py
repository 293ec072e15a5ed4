"""Which unrouted engine rules a `futx bench decode --pdl-attention --final-norm-kernel` run says to route:

    python scripts/engine_rule_pick.py pdl-attention-8b.json [pdl-attention-70b.json ...]

For every point and weight/cache format: the plain step, each rule's step (E5 "pdl-attention", E6
"final-norm-kernel", both) and the change in percent. A rule wins at a point when it is faster by more than the two
candidates' spreads together (bench_engine.Timer: (max - min) / median over the interleaved rounds) and loses when
it is slower by more than that; in between it is even (noise). Noise never routes a rule, and a rule is routed only
where it loses nowhere. Proposed values (futx.engine.backends, docs/routing.md E5 / E6):

  PDL_ATTENTION_MAX_ROWS  the largest measured batch B such that E5 loses at no point of batch <= B and wins at one
                          (0: none)
  FINAL_NORM_KERNEL       True when E6 loses nowhere and wins somewhere
  ARGMAX_KERNEL           True when E7 (--argmax-kernel) loses nowhere and wins somewhere

With runs of several models, each model's proposal too (E5's routed limit is per model: backends.pdl_attention_limit).

Reads the JSON the bench saves (--json); no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.bench_engine import RULE_NAMES as RULES  # noqa: E402   (the names the bench gives the rules' steps)


def comparisons(results: dict) -> list[dict]:
    """One row per (point, format) that has a plain step: its ms and, per rule timed there, (ms, change, wins)."""
    out = []
    for pt in results["points"]:
        rows = {r["candidate"]: r for r in pt["rows"] if "ms" in r}
        for name, base in rows.items():
            if " " in name or "/" not in name:   # the plain steps are named "weights/cache"
                continue
            row = {"shape": results.get("shape", ""), "batch": pt["batch"], "context": pt["context"],
                   "format": name, "ms": base["ms"], "rules": {}}
            for rule, suffix in RULES.items():
                r = rows.get(f"{name} {suffix}")
                if r is not None:
                    change = r["ms"] / base["ms"] - 1
                    noise = r["spread"] + base["spread"]
                    row["rules"][rule] = {"ms": r["ms"], "change": change,
                                          "wins": change < -noise, "loses": change > noise}
            out.append(row)
    return out


def propose(rows: list[dict]) -> dict:
    """The routing values the comparisons support (see the module docstring)."""
    e5 = [(r["batch"], r["rules"]["E5"]) for r in rows if "E5" in r["rules"]]
    max_rows, won = 0, False
    for b in sorted({b for b, _ in e5}):
        at_b = [c for bb, c in e5 if bb == b]
        if any(c["loses"] for c in at_b):
            break
        won = won or any(c["wins"] for c in at_b)
        if won:
            max_rows = b
    e6 = [r["rules"]["E6"] for r in rows if "E6" in r["rules"]]
    final_norm = any(c["wins"] for c in e6) and not any(c["loses"] for c in e6)
    e7 = [r["rules"]["E7"] for r in rows if "E7" in r["rules"]]
    argmax = any(c["wins"] for c in e7) and not any(c["loses"] for c in e7)
    return {"PDL_ATTENTION_MAX_ROWS": max_rows, "FINAL_NORM_KERNEL": final_norm, "ARGMAX_KERNEL": argmax}


def render(rows: list[dict]) -> str:
    lines = ["| shape | B | context | format | plain ms | " + " | ".join(f"{r} ms (change)" for r in RULES) + " |",
             "|---|---:|---:|---|---:|" + "---:|" * len(RULES)]
    for r in rows:
        cells = []
        for rule in RULES:
            c = r["rules"].get(rule)
            verdict = "" if c is None or c["wins"] else ", slower" if c["loses"] else ", even"
            cells.append("–" if c is None else f"{c['ms']:.3f} ({100 * c['change']:+.1f}%{verdict})")
        lines.append(f"| {r['shape']} | {r['batch']} | {r['context']} | {r['format']} | {r['ms']:.3f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="JSON files of futx bench decode --json")
    a = p.parse_args(argv)
    rows = []
    for path in a.runs:
        try:
            rows += comparisons(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"{path}: not a `futx bench decode --json` result ({type(e).__name__}: {e})")
    if not rows:
        p.error("no plain step in these runs (was the bench run with --pdl-attention / --final-norm-kernel?)")
    print(render(rows))
    print()
    shapes = sorted({r["shape"] for r in rows})
    for shape in shapes if len(shapes) > 1 else []:   # a rule may win on one model and lose on another
        print(f"{shape}: " + ", ".join(f"{k} = {v}" for k, v in
                                       propose([r for r in rows if r["shape"] == shape]).items()))
    for k, v in propose(rows).items():
        print(f"{k} = {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
