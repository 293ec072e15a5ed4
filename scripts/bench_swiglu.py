"""Gate/up projection + SwiGLU at M=2048 (paper Table 2): futx BF16 and FP8 vs compiled PyTorch and CODA.

    python scripts/bench_swiglu.py --only futx   [--json F]   futx rows + compiled PyTorch BF16/FP8 rows
    python scripts/bench_swiglu.py --only coda   [--json F]   CODA `linear_swiglu` rows (+ PyTorch BF16 anchor)
    python scripts/bench_swiglu.py --merge futx.json coda_8B.json coda_405B.json [--md F]   -> Table 2 (markdown)

CODA needs its own DSL (4.6.0) bundle, so it runs in a separate process/GPU run; both runs time the
same compiled PyTorch BF16 row, which the merge step uses as a cross-run anchor: CODA (anchored) =
CODA x (PyTorch BF16 in the futx run / PyTorch BF16 in the CODA run), and the "vs CODA" ratios use the
anchored latency (the raw one in brackets). CODA is an optional import
(`coda.kernels.functional.swiglu.linear_swiglu`), never a futx dependency.

Work per row: y = rho * (x @ W^T) with W = [2I, K]; out = silu(gate) * up, [M, I]. rho is the RMSNorm
row factor of the *input* (paper 3.2.2: the gain is folded into W), so it scales gate and up before the
SiLU: out = silu(rho g) * (rho u).
  futx BF16:    rho_swiglu_bf16        (interleaved gate/up rows, rho applied, BF16 out)
  futx FP8:     scale_rho_swiglu_fp8   (E4M3 x E4M3, row/column scales + rho, E4M3 out with delayed scale)
                (each futx row also runs its benchmark variants, e.g. futx_fp8@n256.pp = pingpong schedule)
  PyTorch BF16: torch.compile(x @ W^T -> rho * . -> silu(g) * u), split halves (its best layout)
  PyTorch FP8:  torch.compile(_scaled_mm(row-wise, fast accum) -> rho * . -> silu(g) * u -> E4M3)
  CODA BF16:    linear_swiglu(x, W) (interleaved rows, no rho; also stores the pre-activation for backward)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

SHAPES = {"8B": (2048, 4096, 28672), "405B": (2048, 16384, 106496)}   # (M, K, 2I)
E4M3 = torch.float8_e4m3fn
OUT_SCALE = 0.1   # E4M3 output scale: |silu(g) * u * rho| stays below 448 * 0.1 for these inputs
DEFAULTS: dict = {}   # futx row -> the variant choose_variant picked (the row without "@variant")
LEGACY_DEFAULT = "n256"   # futx JSON without a "defaults" field (run 2): the default was coop 128x256


def _inputs(m, k, n2):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(n2, k, device="cuda", generator=g, dtype=torch.bfloat16) * k ** -0.5)
    rho = torch.rand(m, device="cuda", generator=g) + 0.5
    return x, w, rho


def torch_rows(x, w, rho):
    i = w.shape[0] // 2

    def bf16(x, w, rho):
        y = (x @ w.t()).float() * rho[:, None]
        g, u = y[:, :i], y[:, i:]
        return (torch.nn.functional.silu(g) * u).to(torch.bfloat16)

    def fp8(x8, w8, sa, sb, rho, s_out):
        y = torch._scaled_mm(x8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True)
        y = y.float() * rho[:, None]
        g, u = y[:, :i], y[:, i:]
        z = torch.nn.functional.silu(g) * u
        return (z / s_out).clamp(-448.0, 448.0).to(E4M3)

    x8, w8 = x.to(E4M3), w.mul(64).to(E4M3)
    sa = torch.ones(x.shape[0], 1, device="cuda")
    sb = torch.full((1, w.shape[0]), 1 / 64, device="cuda")
    s_out = torch.full((), OUT_SCALE, device="cuda")
    cb = torch.compile(bf16, dynamic=False)
    c8 = torch.compile(fp8, dynamic=False)
    return {"torch_bf16": lambda: cb(x, w, rho), "torch_fp8": lambda: c8(x8, w8, sa, sb, rho, s_out)}


def futx_rows(x, w, rho):
    from futx.ops import prefill
    from futx.runtime.catalog.prefill import TUNING, VARIANTS, choose_variant

    m, n2 = x.shape[0], w.shape[0]
    x8, w8 = x.to(E4M3), w.mul(64).to(E4M3)
    a_scale = torch.ones(m, device="cuda")
    b_scale = torch.full((n2,), 1 / 64, device="cuda")
    scale = torch.full((1,), OUT_SCALE, device="cuda")
    amax = torch.zeros(1, device="cuda")
    sat = torch.zeros(1, device="cuda", dtype=torch.int32)
    out16 = torch.empty(m, n2 // 2, device="cuda", dtype=torch.bfloat16)
    out8 = torch.empty(m, n2 // 2, device="cuda", dtype=E4M3)
    rows = {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, ab, pol in (("futx_bf16", "bf16", "rho_swiglu_bf16"), ("futx_fp8", "e4m3", "scale_rho_swiglu_fp8")):
        default = choose_variant(m, n2, sms)
        DEFAULTS[name] = default
        for v in VARIANTS + TUNING:   # the default variant is the plain row
            key = name if v == default else f"{name}@{v}"
            if ab == "bf16":
                rows[key] = lambda v=v: prefill.gemm(x, w, "rho_swiglu_bf16", out=out16, variant=v, rho=rho)
            else:
                rows[key] = lambda v=v: prefill.gemm(x8, w8, "scale_rho_swiglu_fp8", out=out8, variant=v,
                                                     a_scale=a_scale, b_scale=b_scale, rho=rho, scale=scale,
                                                     amax=amax, saturated=sat)
    return rows


def coda_rows(x, w, rho):
    try:
        from coda.kernels.functional.swiglu import linear_swiglu
    except ImportError as exc:
        raise SystemExit(f"CODA is not importable here ({exc}); run the CODA rows in its own environment "
                         "(coda-kernels 0.2 + DSL 4.6.0 bundle, fla, an `ipdb` stub on PYTHONPATH)")

    def run():
        with torch.no_grad():
            return linear_swiglu(x, w)
    return {"coda_bf16": run}


def check_agreement(x, w, rho, fns) -> dict:
    """Sanity: every implementation computes the same SwiGLU (rows use different gate/up layouts)."""
    i = w.shape[0] // 2
    y = (x[:256].float() @ w.float().t())
    swiglu = {"split": lambda y: torch.nn.functional.silu(y[:, :i]) * y[:, i:],
              "inter": lambda y: torch.nn.functional.silu(y[:, 0::2]) * y[:, 1::2]}
    errs = {}
    for name, fn in fns.items():
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        got = out[:256].float()
        if "fp8" in name:
            got = got * OUT_SCALE
        yr = y if name.startswith("coda") else y * rho[:256, None]   # CODA has no rho
        ref = swiglu["split" if name.startswith("torch") else "inter"](yr)
        errs[name] = float((got - ref).abs().max() / ref.abs().max())
    return errs


def run(only: str, shapes, rounds: int) -> dict:
    info = bc.gpu_info()
    print(f"# bench_swiglu --only {only} on {info['gpu']}, torch {info['torch']}, {info['date']}", flush=True)
    rows = {}
    for label in shapes:
        m, k, n2 = SHAPES[label]
        # long watchdog: CODA autotunes for minutes at 405B on its first call
        bc.arm_watchdog(1200 if only == "coda" else 400)
        x, w, rho = _inputs(m, k, n2)
        if only == "futx":
            fns = {**torch_rows(x, w, rho), **futx_rows(x, w, rho)}
        else:
            fns = {"torch_bf16": torch_rows(x, w, rho)["torch_bf16"], **coda_rows(x, w, rho)}
        failed = {}
        for name, fn in list(fns.items()):   # warm up (compile / autotune) outside the timed region
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - keep the other rows
                failed[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
                del fns[name]
        agree = check_agreement(x, w, rho, fns)
        flops = 2.0 * m * k * n2
        res = {**bc.time_candidates(fns, flops=flops, rounds=rounds, target_ms=20.0), **failed}
        rows[label] = {"m": m, "k": k, "n2": n2, "results": res, "rel_err": agree, "defaults": dict(DEFAULTS)}
        print(f"  {label}: " + ", ".join(f"{n} {r.get('us', float('nan')):.0f} us" for n, r in res.items())
              + f"  (rel err vs float32: {', '.join(f'{n} {e:.2g}' for n, e in agree.items())})", flush=True)
        for name, r in failed.items():
            print(f"  {label}: {name} failed: {r['error']}", flush=True)
        del fns, x, w, rho
        torch.cuda.empty_cache()
    bc.disarm_watchdog()
    return {"meta": info, "only": only, "rows": rows}


def merge(paths) -> str:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    us, defaults = {}, {}
    for r in runs:
        for label, row in r["rows"].items():
            for name, res in row["results"].items():
                if "us" in res:
                    us.setdefault(label, {})[name if name != "torch_bf16" or r["only"] == "futx" else "torch_bf16@coda"] = res["us"]
            if r["only"] == "futx":
                defaults[label] = row.get("defaults", {})
    meta = next((r["meta"] for r in runs if r["only"] == "futx"), runs[0]["meta"])
    lines = [f"Gate/up projection + SwiGLU at M=2048 on {meta['gpu']} ({meta['date']}). Latency in µs, lower is better;",
             "speedup = baseline latency / futx latency. CODA ran in a separate process (its own DSL 4.6.0); "
             "'CODA (anchored)' rescales it by the ratio of the compiled-PyTorch BF16 row timed in both runs "
             "(futx run / CODA run), and 'vs CODA' uses the anchored latency (raw CODA in brackets). "
             "futx = the default variant (the one `choose_variant` picks); best = the fastest futx variant measured.", "",
             "| Shape | Compiled PyTorch | CODA | CODA (anchored) | futx (ours) | vs PyTorch | vs CODA | futx best "
             "| best vs CODA |",
             "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "—" if v is None else f"{v:.0f}"

    def vs(base, base_raw, f):
        if base is None or f is None:
            return "—"
        return f"{base / f:.2f}×" + (f" ({base_raw / f:.2f}×)" if base_raw is not None and base_raw != base else "")

    def panel(title, ours):
        lines.append(f"| **{title}** | | | | | | | | |")
        for label in SHAPES:
            d = us.get(label, {})
            pt, coda, f = d.get("torch_bf16"), d.get("coda_bf16"), d.get(ours)
            anch = coda * pt / d["torch_bf16@coda"] if coda and pt and d.get("torch_bf16@coda") else None
            ref = anch if anch is not None else coda
            default = defaults.get(label, {}).get(ours, LEGACY_DEFAULT)
            cands = [(t, default if n == ours else n.split("@", 1)[1]) for n, t in d.items()
                     if n == ours or n.startswith(ours + "@")]
            best, bv = min(cands) if cands else (None, "—")
            lines.append(f"| {label} | {fmt(pt)} | {fmt(coda)} | {fmt(anch)} | {fmt(f)} ({default}) | "
                         f"{vs(pt, None, f)} | {vs(ref, coda, f)} | {fmt(best)} ({bv}) | {vs(ref, coda, best)} |")

    panel("A. Precision matched: all BF16", "futx_bf16")
    panel("B. Cross precision: baselines BF16, futx E4M3 (FP8 in, FP8 out)", "futx_fp8")
    extra = [f"{label}: compiled PyTorch FP8 (_scaled_mm fast accum + fused SwiGLU + E4M3 cast) "
             f"{us[label]['torch_fp8']:.0f} µs" for label in SHAPES if "torch_fp8" in us.get(label, {})]
    if extra:
        lines += ["", "Also measured: " + "; ".join(extra) + "."]
    anchors = [f"{label}: {us[label]['torch_bf16']:.0f} µs in the futx run, {us[label]['torch_bf16@coda']:.0f} µs in "
               f"the CODA run" for label in SHAPES if "torch_bf16@coda" in us.get(label, {}) and "torch_bf16" in us[label]]
    if anchors:
        lines += ["", "Anchor (compiled PyTorch BF16): " + "; ".join(anchors) + "."]
    alt = [f"{label}: {name} {t:.0f} µs" for label in SHAPES for name, t in us.get(label, {}).items() if "@" in name
           and not name.endswith("@coda")]
    if alt:
        lines += ["", "futx variants (the table's futx column is the default variant): " + "; ".join(alt) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["futx", "coda"], help="which rows this process times")
    ap.add_argument("--shapes", default="8B,405B")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None, help="result file (default $OUT/swiglu_<only>.json)")
    ap.add_argument("--merge", nargs="+", default=None, help="json files to merge into Table 2")
    ap.add_argument("--md", default=None, help="markdown output of --merge (default $OUT/swiglu_table2.md)")
    args = ap.parse_args(argv)
    od = bc.out_dir()
    if args.merge:
        table = merge(args.merge)
        path = Path(args.md) if args.md else (od / "swiglu_table2.md" if od else None)
        if path:
            path.write_text(table)
        print(table)
        return 0
    if not args.only:
        ap.error("--only futx|coda (or --merge)")
    if args.only == "futx":
        import futx.ops  # noqa: F401
    data = run(args.only, [s for s in args.shapes.split(",") if s], args.rounds)
    path = Path(args.json) if args.json else (od / f"swiglu_{args.only}.json" if od else None)
    if path:
        bc.write_json(path, data)
        print(f"wrote {path}")
    if args.only == "futx":   # a futx-only Table 2 right away (CODA columns empty until merged)
        print(merge([path]) if path else json.dumps(data["rows"], indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
