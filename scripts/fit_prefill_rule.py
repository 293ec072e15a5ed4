"""How well the prefill variant rule (futx/runtime/catalog/prefill.py `choose_plan`) picks, against saved sweeps,
and a refit of its cost constants.

    python scripts/fit_prefill_rule.py            # per sweep: mean and worst slowdown of the rule's pick
    python scripts/fit_prefill_rule.py --fit      # least-squares fit of the cost model's constants (torch)

A sweep is a saved `scripts/bench_prefill.py` JSON. For each (shape, M, dtype) the rule chooses among the
variants the sweep timed (in VARIANTS order, at the split counts it timed); the loss is the pick's time over
the fastest measured candidate. Picks the sweep did not time are counted apart ("unmeasured").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from futx.runtime.catalog import prefill as cat  # noqa: E402

# (file under docs/prefill/, the M values it contributes): the first split-K sweep split every tile, which
# equals the kernel's last-wave split only under one wave (M = 128 there)
SWEEPS = (("pp128-m128-m512-m2048.json", None), ("split-k-tail-m512-m2048.json", None),
          ("split-k-m128-m512.json", (128,)), ("pp128-validate-m256-m1024-m4096.json", None),
          ("pp128-sweep-m512-m2048-m8192.json", None))


def load_sweeps(sweeps=SWEEPS) -> list:
    """Measured points: dicts of sweep, shape, m, n, k, ab, variant, splits, us."""
    pts = []
    for name, ms in sweeps:
        data = json.loads((ROOT / "docs" / "prefill" / name).read_text())
        for r in data["rows"]:
            if ms and r["m"] not in ms:
                continue
            ran = r.get("candidate_splits", {})
            for key, res in r["results"].items():
                if not key.startswith("futx_") or "us" not in res:
                    continue
                _, ab, var = key.split("_", 2)
                var, _, sp = var.partition("/s")
                if sp:
                    splits = int(sp)
                elif key in ran:
                    splits = ran[key]
                elif cat.Variant.parse(var).schedule != "coop":
                    splits = 1
                else:
                    continue   # a coop candidate at the rule's split count of its day: unknown here
                pts.append(dict(sweep=name, shape=r["shape"], m=r["m"], n=r["n"], k=r["k"],
                                ab="e4m3" if ab == "fp8" else "bf16", variant=var, splits=splits, us=res["us"]))
    return pts


def _groups(pts):
    g = defaultdict(dict)
    for p in pts:
        g[p["sweep"], p["shape"], p["m"], p["ab"]][p["variant"], p["splits"]] = p
    return g


def pick_losses(pts, num_sms: int = 132) -> dict:
    """{sweep: {(shape, m, ab): pick time / fastest measured - 1}} over the picks the sweep timed."""
    out = defaultdict(dict)
    for (sweep, shape, m, ab), opts in _groups(pts).items():
        p = next(iter(opts.values()))
        names = tuple(v for v in cat.VARIANTS if any(o[0] == v for o in opts))
        if not names:
            continue
        pick = cat.choose_plan(m, p["n"], p["k"], ab, num_sms, names)
        if pick in opts:
            out[sweep][shape, m, ab] = opts[pick]["us"] / min(o["us"] for o in opts.values()) - 1
    return out


def report(pts) -> None:
    for sweep, losses in pick_losses(pts).items():
        worst = sorted(losses.items(), key=lambda kv: -kv[1])[:6]
        print(f"{sweep}: {len(losses)} picks, mean {100 * sum(losses.values()) / len(losses):.2f}% slower than the "
              f"fastest, {sum(v > 0.03 for v in losses.values())} over 3%; worst: "
              + ", ".join(f"{s}@{m} {ab} +{100 * v:.1f}%" for (s, m, ab), v in worst))


def fit(pts, steps: int = 1500) -> dict:
    """Least squares (log time) of the cost model with one time unit per dtype (a 64x256 pingpong k-tile); prints
    the constants in k-tile times. The split and empty-CTA terms are fitted too; coop 128x256 has no points (kept
    from run 2)."""
    import torch

    init = dict(u_e=0.42, u_b=0.41, c128=1.0, pp128=0.6, fix_c=2.0, fix_pp=3.0, fix_pp128=1.5, empty=1.2,
                xch=10.0, xch_s=3.0)
    logp = {k: torch.tensor(math.log(v), requires_grad=True) for k, v in init.items()}

    def model(q, p):
        """The shipped `_waves` at trial constants, in µs (one k-tile time per dtype)."""
        costs = cat.Costs(k_tile={("coop", 128): q["c128"], ("coop", 256): cat.K_TILE_COST["coop", 256],
                                  ("pingpong", 256): 1.0, ("pingpong", 128): q["pp128"]},
                          fixed={("coop", 128): q["fix_c"], ("coop", 256): q["fix_c"],
                                 ("pingpong", 256): q["fix_pp"], ("pingpong", 128): q["fix_pp128"]},
                          empty_cta=q["empty"], exchange=q["xch"], per_split=q["xch_s"])
        u = q["u_e"] if p["ab"] == "e4m3" else q["u_b"]
        kt = cat.k_tiles(p["k"], p["ab"])
        return u * cat._waves(cat.Variant.parse(p["variant"]), p["m"], p["n"], 132, kt, p["splits"], costs)

    pts = [p for p in pts if cat.Variant.parse(p["variant"]).tile_n == 128 or
           cat.Variant.parse(p["variant"]).schedule == "pingpong"]
    opt = torch.optim.Adam(list(logp.values()), lr=0.03)
    for _ in range(steps):
        q = {k: v.exp() for k, v in logp.items()}
        loss = sum((torch.log(model(q, p)) - math.log(p["us"])) ** 2 for p in pts) / len(pts)
        opt.zero_grad()
        loss.backward()
        opt.step()
    q = {k: round(float(v.detach().exp()), 3) for k, v in logp.items()}
    print(f"{len(pts)} points, rms log error {float(loss.detach()) ** 0.5:.3f}: {q}")
    return q


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fit", action="store_true", help="also refit the cost constants")
    args = ap.parse_args(argv)
    pts = load_sweeps()
    report(pts)
    if args.fit:
        fit(pts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
