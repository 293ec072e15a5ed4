"""Prefill GEMM alone: futx vs cuBLAS (`torch._scaled_mm`, row-wise and tensor-wise scales, with and
without fast accumulation) and futx BF16 vs `torch.matmul`, at 8192^3 and the projection shapes of the
paper's layer presets (futx.config: layer-1b/8b/70b/405b) for several M.

    python scripts/bench_prefill.py [--m 512,2048,8192] [--presets layer-8b,...] [--quick]
    python scripts/bench_prefill.py --render bench_prefill.json      (markdown of a saved run, e.g. for docs)

futx FP8 runs the `scale_bf16` policy (per-row x per-column scale restore, BF16 out: the same work as
row-wise `_scaled_mm`); every variant (tile width, coop/pingpong/stagger schedule, cluster; catalog
VARIANTS + TUNING, or --variants) is timed; the table reports the one the rule picks (`choose_plan`: variant
and split-K count) and the best. --splits 1,2,4 also times every coop variant at those split-K counts
("n128/s2").
At the QKV shapes the QKV epilogue (scales + RoPE + K/V straight into a KV cache, `prefill.qkv`) is
timed too, against the plain `scale_bf16` GEMM of the same shape and variant (its cost over a plain
store) and against the plain GEMM at the variant the rule picks.
Candidates are interleaved in rounds (CUDA-graph replay, CUDA events, medians). Prints a compact table
last; writes bench_prefill.json / bench_prefill.md to $OUT (or --out).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

PEAK = {"fp8": 1555.0, "bf16": 790.0}   # measured on this H200 (shared/device/README.md), TFLOP/s
E4M3 = torch.float8_e4m3fn


def shapes(ms, presets):
    from futx.config import preset

    out = [("8192^3", 8192, 8192, 8192, None)]
    for p in presets:
        cfg = preset(p)
        for proj, (n, k) in cfg.projection_shapes().items():
            for m in ms:
                out.append((f"{p.replace('layer-', '')}.{proj}", m, n, k, cfg if proj == "qkv" else None))
    return out


def qkv_candidates(cfg, a8, w8, sa, names):
    """prefill.qkv on one request of M tokens: Q out, K/V into a BF16 cache [1, Hkv, M, hd]."""
    from futx.ops import prefill
    from futx.rope import inv_freq

    m, hd, hkv = a8.shape[0], cfg.head_dim, cfg.num_key_value_heads
    kc = torch.zeros(1, hkv, m, hd, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    slot = torch.zeros(m, device="cuda", dtype=torch.int32)
    pos = torch.arange(m, device="cuda", dtype=torch.int32)
    freq = inv_freq(cfg).float().cuda()
    rho = torch.ones(m, device="cuda")
    sb = torch.ones(w8.shape[0], device="cuda")
    q = torch.empty(m, cfg.num_attention_heads * hd, device="cuda", dtype=torch.bfloat16)
    pol = f"scale_rho_qkv{hd}_bf16"
    return {f"futxqkv_fp8_{name}": (lambda v=_variant_splits(name): prefill.qkv(
        a8, w8, kc, vc, slot, pos, freq, rho=rho, a_scale=sa.view(-1), b_scale=sb, out=q, variant=v[0], splits=v[1]))
        for name in names.get(pol, ())}


def _variant_splits(name):
    """"n128" -> ("n128", None: the rule's split count); "n128/s3" -> ("n128", 3)."""
    v, _, sp = name.partition("/s")
    return v, int(sp) if sp else None


def candidates(m, n, k, names, qkv_cfg=None):
    from futx.ops import prefill

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16)
    a8, w8 = a.to(E4M3), w.to(E4M3)
    sa = torch.rand(m, 1, device="cuda", generator=g) + 0.5
    sb = torch.rand(1, n, device="cuda", generator=g) + 0.5
    one = torch.ones((), device="cuda")
    out8 = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    out16 = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    c = {}
    for name in names["fp8"]:
        v, sp = _variant_splits(name)
        c[f"futx_fp8_{name}"] = (lambda v=v, sp=sp: prefill.gemm(a8, w8, "scale_bf16", out=out8, variant=v, splits=sp,
                                                                 a_scale=sa.view(-1), b_scale=sb.view(-1)))
    for fast in (True, False):
        sfx = "_fast" if fast else ""
        c[f"cublas_fp8_row{sfx}"] = (lambda fast=fast: torch._scaled_mm(
            a8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast))
        c[f"cublas_fp8_tensor{sfx}"] = (lambda fast=fast: torch._scaled_mm(
            a8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast))
    for name in names["bf16"]:
        v, sp = _variant_splits(name)
        c[f"futx_bf16_{name}"] = (lambda v=v, sp=sp: prefill.gemm(a, w, "bf16", out=out16, variant=v, splits=sp))
    c["torch_bf16"] = lambda: torch.matmul(a, w.t())
    if qkv_cfg is not None:
        c.update(qkv_candidates(qkv_cfg, a8, w8, sa, names))
    return c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="512,2048,8192", help="token counts M (comma-separated)")
    ap.add_argument("--presets", default="layer-1b,layer-8b,layer-70b,layer-405b")
    ap.add_argument("--quick", action="store_true", help="8192^3 and the 8B shapes at M=2048 only")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default=None, help="variants timed (default: shipped + tuning space)")
    ap.add_argument("--splits", default="", help="also time the coop variants at these split-K counts, e.g. 1,2,4")
    ap.add_argument("--out", default=None, help="directory for json/md (default $OUT)")
    ap.add_argument("--render", default=None, metavar="JSON", help="print the markdown table of a saved run and exit")
    args = ap.parse_args(argv)
    if args.render:
        import json

        data = json.loads(Path(args.render).read_text())
        print(render(data["rows"], data["meta"])["md"])
        return 0

    import futx.ops  # noqa: F401
    from futx.hardware import sm_count
    from futx.runtime.catalog.prefill import SHIPPED, TUNING, VARIANTS, Variant, choose_plan, choose_splits

    ms = [int(x) for x in args.m.split(",")]
    presets = [p for p in args.presets.split(",") if p]
    todo = shapes([2048], ["layer-8b"]) if args.quick else shapes(ms, presets)
    # the shipped variants and the tuning space (compiled on demand if not built)
    every = tuple(args.variants.split(",")) if args.variants else VARIANTS + TUNING
    forced = tuple(f"{v}/s{int(sp)}" for v in every if Variant.parse(v).schedule == "coop"
                   for sp in args.splits.split(",") if sp)
    names = {"fp8": every + forced, "bf16": every + forced}
    for hd in (64, 128):
        if f"scale_rho_qkv{hd}_bf16" in SHIPPED["e4m3"]:
            names[f"scale_rho_qkv{hd}_bf16"] = every
    sms = sm_count(0)
    info = bc.gpu_info()
    print(f"# bench_prefill on {info['gpu']} ({sms} SMs), torch {info['torch']}, {info['date']}", flush=True)
    rows = []
    for name, m, n, k, qkv_cfg in todo:
        bc.arm_watchdog(300)
        flops = 2.0 * m * n * k
        res = bc.time_candidates(candidates(m, n, k, names, qkv_cfg), flops=flops, rounds=args.rounds)
        torch.cuda.empty_cache()
        plans = {"fp8": choose_plan(m, n, k, "e4m3", sms), "bf16": choose_plan(m, n, k, "bf16", sms)}
        pick = {ab: v for ab, (v, _) in plans.items()}   # the candidate without "/s": the rule's split count
        row = {"shape": name, "m": m, "n": n, "k": k, "results": res, "pick": pick,
               "splits": {ab: sp for ab, (_, sp) in plans.items()},
               # the split-K count each futx candidate ran (scripts/fit_prefill_rule.py reads it)
               "candidate_splits": {f"futx_{ab}_{c}": _variant_splits(c)[1] or choose_splits(
                   _variant_splits(c)[0], m, n, k, "e4m3" if ab == "fp8" else "bf16", sms)
                   for ab in ("fp8", "bf16") for c in names[ab]}}
        rows.append(row)
        f8 = res.get(f"futx_fp8_{pick['fp8']}", {})
        cb = res.get("cublas_fp8_row_fast", {})
        alts = "  ".join(f"{key.split('_', 2)[2]} {r['tflops']:.0f}" for key, r in res.items()
                         if key.startswith("futx_fp8_") and "tflops" in r)
        print(f"  {name:14s} M={m:5d} N={n:6d} K={k:5d}  futx fp8 {f8.get('tflops', float('nan')):7.1f}  "
              f"cuBLAS fast {cb.get('tflops', float('nan')):7.1f} TF/s   [fp8 variants: {alts}]", flush=True)
        qkv = {key.split("_", 2)[2]: r for key, r in res.items() if key.startswith("futxqkv_") and "us" in r}
        if qkv:
            def over(v, r):
                plain = res.get(f"futx_fp8_{v}", {}).get("us")
                return f", {100 * (r['us'] / plain - 1):+.1f}% vs plain {v}" if plain else ""
            print("  " + " " * 14 + "  QKV epilogue (RoPE + KV-cache placement): " + "  ".join(
                f"{v} {r['us']:.1f} us ({r['tflops']:.0f} TF/s{over(v, r)})" for v, r in qkv.items()), flush=True)
    bc.disarm_watchdog()

    table = render(rows, info)
    od = Path(args.out) if args.out else bc.out_dir()
    if od:
        od.mkdir(parents=True, exist_ok=True)
        bc.write_json(od / "bench_prefill.json", {"meta": info, "peaks": PEAK, "rows": rows})
        (od / "bench_prefill.md").write_text(table["md"])
        print(f"wrote {od / 'bench_prefill.json'} and bench_prefill.md")
    print(table["text"])
    return 0


def _tf(res, key):
    r = res.get(key, {})
    return r.get("tflops")


def _best(res, prefix):
    """(TFLOP/s, variant) of the fastest futx variant with this key prefix."""
    return max(((r["tflops"], k[len(prefix):]) for k, r in res.items() if k.startswith(prefix) and "tflops" in r),
               default=(None, "—"))


def render(rows, info) -> dict:
    """Compact text table (printed last) and a fuller markdown table."""
    head = (f"{'shape':14s} {'M':>5s} {'N':>6s} {'K':>5s} | {'futx8':>6s} {'best8':>6s} {'variant':>8s} {'cuB8f':>6s} "
            f"{'x':>5s} {'xbest':>5s} | {'cuB8':>6s} {'cuB8tf':>6s} | {'futx16':>6s} {'best16':>6s} {'variant':>8s} "
            f"{'mm16':>6s} {'x':>5s}")
    lines = [f"prefill GEMM TFLOP/s on {info['gpu']} ({info['date']}); futx = the variant the rule picks, best = the "
             f"fastest variant; x = / cuBLAS fast accum (FP8), / torch.matmul (BF16); FP8 peak {PEAK['fp8']:.0f}",
             head, "-" * len(head)]
    md = [f"Prefill GEMM, {info['gpu']}, torch {info['torch']}, {info['date']}. TFLOP/s (median of interleaved rounds, "
          "CUDA-graph replay). futx FP8 = `scale_bf16` policy (row x column scales, BF16 out) at the variant the rule "
          "picks (fastest variant in brackets); cuBLAS = `torch._scaled_mm` row-wise / tensor-wise scales, "
          "f = use_fast_accum.",
          "", "| shape | M | N | K | futx FP8 | cuBLAS row f | futx/cuBLAS f | % FP8 peak | cuBLAS row | cuBLAS tensor f "
          "| cuBLAS tensor | futx BF16 | torch.matmul BF16 | futx/torch BF16 | % BF16 peak |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "—" if v is None else f"{v:.0f}"
    ratio = lambda a, b: "—" if not a or not b else f"{a / b:.2f}"
    for row in rows:
        res = row["results"]
        # run-1 JSON recorded the picked tile width (256) instead of the variant name
        p = {k: (f"n{v}" if isinstance(v, int) else v) for k, v in row["pick"].items()}
        f8, f16 = _tf(res, f"futx_fp8_{p['fp8']}"), _tf(res, f"futx_bf16_{p['bf16']}")
        best8, best16 = _best(res, "futx_fp8_"), _best(res, "futx_bf16_")
        cbf, cb = _tf(res, "cublas_fp8_row_fast"), _tf(res, "cublas_fp8_row")
        ctf, ct = _tf(res, "cublas_fp8_tensor_fast"), _tf(res, "cublas_fp8_tensor")
        mm = _tf(res, "torch_bf16")
        pk8 = 100 * f8 / PEAK["fp8"] if f8 else None
        pk16 = 100 * f16 / PEAK["bf16"] if f16 else None
        lines.append(f"{row['shape']:14s} {row['m']:5d} {row['n']:6d} {row['k']:5d} | {fmt(f8):>6s} {fmt(best8[0]):>6s} "
                     f"{best8[1]:>8s} {fmt(cbf):>6s} {ratio(f8, cbf):>5s} {ratio(best8[0], cbf):>5s} | {fmt(cb):>6s} "
                     f"{fmt(ctf):>6s} | {fmt(f16):>6s} {fmt(best16[0]):>6s} {best16[1]:>8s} {fmt(mm):>6s} "
                     f"{ratio(f16, mm):>5s}")
        md.append(f"| {row['shape']} | {row['m']} | {row['n']} | {row['k']} | {fmt(f8)} ({fmt(best8[0])} @{best8[1]}) | "
                  f"{fmt(cbf)} | {ratio(f8, cbf)}× | {fmt(pk8)}% | {fmt(cb)} | {fmt(ctf)} | {fmt(ct)} | "
                  f"{fmt(f16)} ({fmt(best16[0])} @{best16[1]}) | {fmt(mm)} | {ratio(f16, mm)}× | {fmt(pk16)}% |")
        errs = {k: v["error"] for k, v in res.items() if "error" in v}
        if errs:
            lines.append(f"    errors: {errs}")
            md.append(f"| | | | | errors: {errs} |")
    for kind, label in (("fp8", "FP8 `scale_bf16`"), ("bf16", "BF16 `bf16`")):
        names = list(dict.fromkeys(k.split("_", 2)[2] for row in rows for k in row["results"]
                                   if k.startswith(f"futx_{kind}_")))
        if len(names) > 1:
            md += ["", f"Every futx {label} variant, TFLOP/s (in brackets: vs the picked variant):", "",
                   "| shape | M | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
            for row in rows:
                res = row["results"]
                pk = row["pick"][kind] if isinstance(row["pick"][kind], str) else f"n{row['pick'][kind]}"
                base = _tf(res, f"futx_{kind}_{pk}")
                cells = []
                for v in names:
                    t = _tf(res, f"futx_{kind}_{v}")
                    cells.append("—" if t is None else f"**{t:.0f}**" if v == pk else
                                 f"{t:.0f}" + (f" ({100 * (t / base - 1):+.1f}%)" if base else ""))
                md.append(f"| {row['shape']} | {row['m']} | " + " | ".join(cells) + " |")
    qkv = [(row, k.split("_", 2)[2], r) for row in rows for k, r in row["results"].items()
           if k.startswith("futxqkv_") and "us" in r]
    if qkv:
        md += ["", "QKV epilogue (`prefill.qkv`: scales + RoPE on Q/K + K/V written straight into a BF16 KV cache, "
               "Q out) vs the plain `scale_bf16` GEMM (BF16 out) of the same variant, and vs the plain GEMM at the "
               "variant the rule picks:", "",
               "| shape | M | variant | QKV µs | plain µs, same variant | overhead | plain µs, picked variant | overhead |",
               "|---|---|---|---|---|---|---|---|"]
        us1 = lambda v: "—" if v is None else f"{v:.1f}"
        pct = lambda a, b: "—" if not b else f"{100 * (a / b - 1):+.1f}%"
        for row, v, r in qkv:
            same = row["results"].get(f"futx_fp8_{v}", {}).get("us")
            pick = row["pick"]["fp8"] if isinstance(row["pick"]["fp8"], str) else f"n{row['pick']['fp8']}"
            plain = row["results"].get(f"futx_fp8_{pick}", {}).get("us")
            md.append(f"| {row['shape']} | {row['m']} | {v} | {r['us']:.1f} | {us1(same)} | {pct(r['us'], same)} | "
                      f"{us1(plain)} ({pick}) | {pct(r['us'], plain)} |")
    return {"text": "\n".join(lines), "md": "\n".join(md) + "\n"}


if __name__ == "__main__":
    sys.exit(main())
