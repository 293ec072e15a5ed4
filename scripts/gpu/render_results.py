"""Markdown for docs/results.md from the quality GPU run (scripts/gpu/quality_gpu.sh).

    python scripts/gpu/render_results.py --work /tmp/futx-quality --json results.json --md results.md
    python scripts/gpu/render_results.py --results results.json            # re-render what a run returned

Sections: a summary, the reference perplexity (gptq / serving) with the transformers cross-check, the GPTQ
calibration, the quantization quality table (same columns as docs/results.md), the derived GPTQ and
rotation recoveries, per-layer errors and the outlier study. Pure Python (json, math): no torch needed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

RAW = {"reference": "ppl_ref.json", "crosscheck": "crosscheck.jsonl", "gptq": "gptq.json",
       "quality": "quality.jsonl", "layers": "layers.json", "outliers": "outliers.json"}


def _read(path: Path):
    if not path.is_file() or not path.stat().st_size:
        return None
    text = path.read_text()
    if path.suffix == ".jsonl":
        rows = []
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut short by a timeout
                    pass
        return rows
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def gather(work: Path) -> dict:
    res = {k: _read(work / f) for k, f in RAW.items()}
    env = work / "logs" / "env.log"
    res["env"] = env.read_text().strip() if env.is_file() else None
    return res


# ---- quality rows -------------------------------------------------------------------------------------
def combine(rows: list[dict]) -> dict[str, dict]:
    """Per configuration: token-weighted totals over runs on disjoint window ranges (a rerun of the same range
    replaces). Shared with scripts/quality_table.py (its `render`)."""
    runs: dict[tuple, dict] = {}
    for r in rows:
        r.setdefault("first_window", 0)
        if "nll_sum" not in r:  # rows written before the sums were recorded
            r.update(nll_sum=math.log(r["ppl"]) * r["tokens"], kl_sum=r["kl"] * r["tokens"],
                     top1_sum=r["top1"] * r["tokens"])
        runs[(r["config"], r["first_window"], r["windows"])] = r
    out: dict[str, dict] = {}
    for r in runs.values():
        c = out.setdefault(r["config"], {**r, "tokens": 0, "windows": 0, "nll_sum": 0.0, "kl_sum": 0.0,
                                          "top1_sum": 0.0, "ranges": []})
        for key in ("tokens", "windows", "nll_sum", "kl_sum", "top1_sum"):
            c[key] += r[key]
        c["ranges"].append((r["first_window"], r["first_window"] + r["windows"]))
    for c in out.values():
        c.update(ppl=math.exp(c["nll_sum"] / c["tokens"]), kl=c["kl_sum"] / c["tokens"],
                 top1=c["top1_sum"] / c["tokens"])
    return out


def _ppl(rows: dict, protocol: str, prefill: str, decode: str, cache: str):
    r = rows.get(f"{protocol}:{prefill}/{decode}:{cache}")
    return None if r is None else r["ppl"]


def recoveries(rows: dict) -> list[str]:
    """The two goals of issue 3 as numbers: GPTQ's share of the RTN loss recovered, rotation's share of the
    unrotated INT4-cache loss removed (paired: same windows)."""
    out = []
    for p in ("all-decode", "serving"):
        base, rtn, gq = (_ppl(rows, p, "bf16", d, "bf16") for d in ("bf16", "int4-rtn", "int4-gptq"))
        if None not in (base, rtn, gq) and rtn > base:
            out.append(f"{p}: GPTQ recovers {100 * (rtn - gq) / (rtn - base):.0f}% of the RTN loss "
                       f"(RTN {rtn - base:+.3f}, GPTQ {gq - base:+.3f} ppl vs BF16)")
    for w in ("bf16", "int4-gptq", "e4m3", "int4-rtn"):
        base, rot, unrot = (_ppl(rows, "all-decode", "bf16", w, c) for c in ("bf16", "int4", "int4-unrotated"))
        if None not in (base, rot, unrot) and unrot > base:
            out.append(f"all-decode, {w} weights: rotation removes {100 * (unrot - rot) / (unrot - base):.0f}% of "
                       f"the unrotated INT4-cache loss ({unrot - base:+.3f} -> {rot - base:+.3f} ppl)")
    return out


def quality_table(rows: dict) -> list[str]:
    base = {p: rows.get(f"{p}:bf16/bf16:bf16") for p in ("all-decode", "serving")}
    lines = ["| protocol | prefill / decode weights | cache | perplexity | vs BF16 | KL (nats/token) | top-1 agree | "
             "windows | scored tokens |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows.values(), key=lambda r: (r["protocol"], r["prefill"], r["decode"], r["cache"])):
        b = base.get(r["protocol"])
        same = b is not None and sorted(b["ranges"]) == sorted(r["ranges"])
        delta = f"{r['ppl'] - b['ppl']:+.3f}" if same else "-"
        lines.append(f"| {r['protocol']} | {r['prefill']} / {r['decode']} | {r['cache']} | {r['ppl']:.3f} | {delta} | "
                     f"{r['kl']:.4f} | {100 * r['top1']:.1f}% | {r['windows']} | {r['tokens']} |")
    return lines


# ---- markdown -----------------------------------------------------------------------------------------
def _device_line(r: dict) -> str:
    if not r:
        return ""
    if r.get("device", "").startswith("cuda"):
        return (f"{r.get('gpu', 'GPU')}, torch {r.get('torch')}, float32 with TF32 off "
                f"(matmul tf32={r.get('tf32')}, cudnn tf32={r.get('cudnn_tf32')}, precision {r.get('matmul_precision')})")
    return f"CPU, torch {r.get('torch')}, {r.get('threads')} threads"


def render(res: dict) -> str:
    md: list[str] = []
    ref = res.get("reference") or []
    cross = res.get("crosscheck") or []
    gptq = res.get("gptq") or {}
    qrows = combine(res.get("quality") or [])
    layers = res.get("layers") or {}
    outl = res.get("outliers") or {}

    md += ["## Summary", ""]
    for r in ref:
        md.append(f"- reference {r['protocol']}: ppl {r['ppl']:.4f} over {r['windows']} windows "
                  f"({r['scored_tokens']} scored tokens, decode {r['decode']}, {r['seconds']:.0f} s)")
    for r in cross:
        md.append(f"- cross-check {r['protocol']}: {r['windows']} of {r['windows_available']} windows, futx "
                  f"{r['futx_ppl']:.5f} vs transformers {r['transformers_ppl']:.5f}: relative difference "
                  f"{r['relative_difference']:.2e} ({'PASS' if r['relative_difference'] < 1e-3 else 'FAIL'} at 1e-3)")
    if gptq:
        c = gptq.get("calibration", {})
        md.append(f"- GPTQ g{gptq.get('group_size')}: {gptq.get('quantize_seconds')} s on {gptq.get('device')}, "
                  f"calibration {c.get('windows')} x {c.get('seq_len')} tokens of {c.get('text')} (seed {c.get('seed')})")
    if qrows:
        n_w = sorted({r["windows"] for r in qrows.values()})
        md.append(f"- quality table: {len(qrows)} configurations, windows per configuration {n_w}")
        md += [f"- {line}" for line in recoveries(qrows)]
    if layers:
        md.append(f"- per-layer errors: layers {', '.join(str(k) for k in layers.get('independent', {}))}")
    if outl:
        md.append(f"- outlier study: {len(outl)} shapes")
    md.append("")

    if ref:
        md += ["## Reference model (WikiText-2 test)", "",
               f"Computed on: {_device_line(ref[0])}. Text tokens: {ref[0].get('text_tokens')}.", "",
               "| protocol | windows | scored tokens | decode | mean NLL | perplexity |",
               "|---|---:|---:|---|---:|---:|"]
        for r in ref:
            md.append(f"| {r['protocol']} | {r['windows']} | {r['scored_tokens']:,} | {r['decode']} | "
                      f"{r['mean_nll']:.5f} | {r['ppl']:.3f} |")
        md.append("")
    if cross:
        md += ["### Independent cross-check (transformers)", "",
               f"transformers {cross[0].get('transformers')}; max |weight difference| "
               f"{cross[0].get('max_weight_difference')}.", "",
               "| protocol | windows | scored tokens | futx ppl | transformers ppl | relative difference |",
               "|---|---:|---:|---:|---:|---:|"]
        for r in cross:
            md.append(f"| {r['protocol']} | {r['windows']} | {r['scored_tokens']} | {r['futx_ppl']:.5f} | "
                      f"{r['transformers_ppl']:.5f} | {r['relative_difference']:.2e} |")
        md.append("")
    if gptq or qrows:
        md += ["## Quantization quality", ""]
    if gptq:
        c = gptq.get("calibration", {})
        md += [f"GPTQ: group {gptq.get('group_size')}, damping {gptq.get('damping')}, calibration {c.get('windows')} "
               f"random windows of {c.get('seq_len')} tokens from `{c.get('text')}` (SHA-256 {str(c.get('sha256'))[:8]}…, "
               f"{c.get('text_tokens')} tokens, seed {c.get('seed')}), RTN overrides {gptq.get('rtn_overrides') or 'none'}; "
               f"{gptq.get('quantize_seconds')} s on {_device_line(gptq)}.", ""]
        stats = gptq.get("proxy_loss_vs_rtn") or {}
        if stats:
            md += ["| projection | GPTQ / RTN proxy loss: mean | min | max |", "|---|---:|---:|---:|"]
            md += [f"| {k} | {v['mean']:.3f} | {v['min']:.3f} | {v['max']:.3f} |" for k, v in stats.items()]
            md.append("")
    if qrows:
        first = next(iter(qrows.values()))
        md += [f"Decode: {first.get('decode_mode', '?')} per window (exactly equivalent to token-by-token), "
               f"{first.get('batch', '?')} windows per batch; {_device_line(first)}.", ""]
        md += quality_table(qrows)
        md += [""] + [f"- {line}" for line in recoveries(qrows)] + [""]
    if layers:
        s = layers.get("setup", {})
        methods = sorted({m for v in layers.get("independent", {}).values() for m in v}, key=["rtn", "gptq"].index)
        md += ["### Per-layer relative RMS error (%)", "",
               f"Independent: {s.get('independent_windows')} windows, {s.get('prefill')}-token BF16 prefill then "
               f"{s.get('decode_tokens')} decode tokens. Cascaded: {s.get('cascade_windows')} windows, positions "
               f"{s.get('cascade_positions')}.", "",
               "| layer | " + " | ".join(f"independent {m.upper()}" for m in methods) + " | "
               + " | ".join(f"cascaded {m.upper()}" for m in methods) + " |",
               "|---:|" + "---:|" * (2 * len(methods))]
        for k, v in layers.get("independent", {}).items():
            cas = layers.get("cascaded", {}).get(k, {})
            md.append(f"| {k} | " + " | ".join(f"{100 * v[m]:.1f}" for m in methods) + " | "
                      + " | ".join(f"{100 * cas[m]:.1f}" if m in cas else "-" for m in methods) + " |")
        md.append("")
    if outl:
        shapes = list(outl)
        md += ["### Synthetic cache outlier study (attention-output relative RMS error, %)", "",
               "| configuration | " + " | ".join(shapes) + " |", "|---|" + "---:|" * len(shapes)]
        for name in outl[shapes[0]]:
            md.append(f"| {name} | " + " | ".join(f"{outl[s][name]:.1f}" for s in shapes) + " |")
        md.append("")
    if res.get("env"):
        md += ["### Environment", "", "```", res["env"], "```", ""]
    return "\n".join(md)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None, help="the run's work directory (raw JSON files and logs/)")
    ap.add_argument("--results", default=None, help="a results.json written by an earlier call")
    ap.add_argument("--json", default=None, help="write the combined results here")
    ap.add_argument("--md", default=None, help="write the Markdown here (default: stdout)")
    a = ap.parse_args(argv)
    if (a.work is None) == (a.results is None):
        ap.error("give exactly one of --work and --results")
    res = gather(Path(a.work)) if a.work else json.loads(Path(a.results).read_text())
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    md = render(res)
    if a.md:
        Path(a.md).write_text(md + "\n")
    else:
        sys.stdout.write(md + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
