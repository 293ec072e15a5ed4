"""Where a kernel's warps spend their time, from Nsight Compute's per-instruction source page (issue 29 diagnostic):
the stall reasons over all samples, the instructions holding the most samples, and the samples grouped by how many
times an instruction ran (code run once per stage of one projection, once per task, ... runs the same count: the
groups are the kernel's regions without reading the SASS).

    ncu ... --section SourceCounters -o rep <program>   (scripts/gpu/persistent.sh ncusrc)
    ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv
    python scripts/ncu_source_summary.py src.csv [--top 25] [--groups 12]
"""

import argparse
import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read(path: str) -> list:
    """[(offset, source, samples, executed, {stall: samples})] of the first kernel in the CSV."""
    rows = list(csv.reader(open(path, newline="")))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr = rows[head]
    ix = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    out, base = [], None
    for r in rows[head + 1:]:
        if len(r) < len(hdr) or not r[0].startswith("0x"):
            break
        addr = int(r[0], 16)
        base = addr if base is None else base
        out.append((addr - base, r[ix["Source"]].strip(), int(r[ix[SAMPLES]] or 0), int(r[ix[EXECUTED]] or 0),
                    {h[len("stall_"):]: int(r[ix[h]] or 0) for h in stalls}))
    return out


def report(ins: list, top: int = 25, groups: int = 12) -> str:
    total = sum(i[2] for i in ins) or 1
    reasons = collections.Counter()
    for *_, st in ins:
        reasons.update(st)
    lines = [f"{total} samples, {sum(i[3] for i in ins)} warp instructions executed",
             "stall reasons: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in reasons.most_common(10)),
             f"top {top} instructions (offset, share of samples, times run, source, top reasons):"]
    for off, src, n, ex, st in sorted(ins, key=lambda i: -i[2])[:top]:
        why = ", ".join(f"{k} {v}" for k, v in sorted(st.items(), key=lambda kv: -kv[1])[:2] if v)
        lines.append(f"  {off:6x} {100 * n / total:5.1f}% {ex:8d}  {src[:58]:58s} {why}")
    by = collections.defaultdict(lambda: [0, 0, 1 << 62, 0, collections.Counter()])
    for off, src, n, ex, st in ins:
        g = by[ex]
        g[0] += n
        g[1] += 1
        g[2], g[3] = min(g[2], off), max(g[3], off)
        g[4].update(st)
    lines.append(f"by times run (the {groups} groups with the most samples: times, instructions, share, offsets, "
                 "top reasons):")
    for ex, (n, k, lo, hi, st) in sorted(by.items(), key=lambda kv: -kv[1][0])[:groups]:
        why = ", ".join(f"{r} {100 * v / max(1, n):.0f}%" for r, v in st.most_common(3))
        lines.append(f"  {ex:8d} x {k:5d} instr {100 * n / total:5.1f}%  {lo:6x}..{hi:6x}  {why}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--groups", type=int, default=12)
    a = p.parse_args()
    print(report(read(a.csv), a.top, a.groups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
