"""Prefill GEMM alone: futx vs cuBLAS (`torch._scaled_mm`, row-wise and tensor-wise scales, with and
without fast accumulation) and futx BF16 vs `torch.matmul`, at 8192^3 and the projection shapes of the
paper's layer presets (futx.config: layer-1b/8b/70b/405b) for several M.

    python scripts/bench_prefill.py [--m 512,2048,8192] [--presets layer-8b,...] [--quick]

futx FP8 runs the `scale_bf16` policy (per-row x per-column scale restore, BF16 out: the same work as
row-wise `_scaled_mm`); both tile widths are timed and the one `choose_tile_n` picks is reported.
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

    out = [("8192^3", 8192, 8192, 8192)]
    for p in presets:
        for proj, (n, k) in preset(p).projection_shapes().items():
            for m in ms:
                out.append((f"{p.replace('layer-', '')}.{proj}", m, n, k))
    return out


def candidates(m, n, k, widths):
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
    for wd in widths["fp8"]:
        c[f"futx_fp8_n{wd}"] = (lambda wd=wd: prefill.gemm(a8, w8, "scale_bf16", out=out8, tile_n=wd,
                                                          a_scale=sa.view(-1), b_scale=sb.view(-1)))
    for fast in (True, False):
        sfx = "_fast" if fast else ""
        c[f"cublas_fp8_row{sfx}"] = (lambda fast=fast: torch._scaled_mm(
            a8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast))
        c[f"cublas_fp8_tensor{sfx}"] = (lambda fast=fast: torch._scaled_mm(
            a8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast))
    for wd in widths["bf16"]:
        c[f"futx_bf16_n{wd}"] = (lambda wd=wd: prefill.gemm(a, w, "bf16", out=out16, tile_n=wd))
    c["torch_bf16"] = lambda: torch.matmul(a, w.t())
    return c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="512,2048,8192", help="token counts M (comma-separated)")
    ap.add_argument("--presets", default="layer-1b,layer-8b,layer-70b,layer-405b")
    ap.add_argument("--quick", action="store_true", help="8192^3 and the 8B shapes at M=2048 only")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="directory for json/md (default $OUT)")
    args = ap.parse_args(argv)

    import futx.ops  # noqa: F401
    from futx.ops.prefill import _num_sms
    from futx.runtime.catalog.prefill import choose_tile_n, tile_widths

    ms = [int(x) for x in args.m.split(",")]
    presets = [p for p in args.presets.split(",") if p]
    todo = shapes([2048], ["layer-8b"]) if args.quick else shapes(ms, presets)
    widths = {"fp8": tile_widths("e4m3", "scale_bf16"), "bf16": tile_widths("bf16", "bf16")}
    sms = _num_sms(0)
    info = bc.gpu_info()
    print(f"# bench_prefill on {info['gpu']} ({sms} SMs), torch {info['torch']}, {info['date']}", flush=True)
    rows = []
    for name, m, n, k in todo:
        bc.arm_watchdog(300)
        flops = 2.0 * m * n * k
        res = bc.time_candidates(candidates(m, n, k, widths), flops=flops, rounds=args.rounds)
        torch.cuda.empty_cache()
        pick = {"fp8": choose_tile_n("e4m3", "scale_bf16", m, n, sms), "bf16": choose_tile_n("bf16", "bf16", m, n, sms)}
        row = {"shape": name, "m": m, "n": n, "k": k, "results": res, "pick": pick}
        rows.append(row)
        f8 = res.get(f"futx_fp8_n{pick['fp8']}", {})
        cb = res.get("cublas_fp8_row_fast", {})
        print(f"  {name:14s} M={m:5d} N={n:6d} K={k:5d}  futx fp8 {f8.get('tflops', float('nan')):7.1f}  "
              f"cuBLAS fast {cb.get('tflops', float('nan')):7.1f} TF/s", flush=True)
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


def render(rows, info) -> dict:
    """Compact text table (printed last) and a fuller markdown table."""
    head = (f"{'shape':14s} {'M':>5s} {'N':>6s} {'K':>5s} | {'futx8':>6s} {'n':>3s} {'cuB8f':>6s} {'x':>5s} "
            f"{'%pk8':>4s} | {'cuB8':>6s} {'cuB8tf':>6s} | {'futx16':>6s} {'mm16':>6s} {'x':>5s} {'%pk16':>5s}")
    lines = [f"prefill GEMM TFLOP/s on {info['gpu']} ({info['date']}); x = futx / cuBLAS; "
             f"%pk vs measured peaks FP8 {PEAK['fp8']:.0f}, BF16 {PEAK['bf16']:.0f}", head, "-" * len(head)]
    md = [f"Prefill GEMM, {info['gpu']}, torch {info['torch']}, {info['date']}. TFLOP/s (median of interleaved rounds, "
          "CUDA-graph replay). futx FP8 = `scale_bf16` policy (row x column scales, BF16 out) at the tile width the rule "
          "picks (best width in brackets); cuBLAS = `torch._scaled_mm` row-wise / tensor-wise scales, f = use_fast_accum.",
          "", "| shape | M | N | K | futx FP8 | cuBLAS row f | futx/cuBLAS f | % FP8 peak | cuBLAS row | cuBLAS tensor f "
          "| cuBLAS tensor | futx BF16 | torch.matmul BF16 | futx/torch BF16 |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "—" if v is None else f"{v:.0f}"
    for row in rows:
        res, p = row["results"], row["pick"]
        f8 = _tf(res, f"futx_fp8_n{p['fp8']}")
        best8 = max(((_tf(res, k) or 0), k.split("_n")[-1]) for k in res if k.startswith("futx_fp8_n"))
        f16 = _tf(res, f"futx_bf16_n{p['bf16']}")
        cbf, cb = _tf(res, "cublas_fp8_row_fast"), _tf(res, "cublas_fp8_row")
        ctf, ct = _tf(res, "cublas_fp8_tensor_fast"), _tf(res, "cublas_fp8_tensor")
        mm = _tf(res, "torch_bf16")
        x8 = f8 / cbf if f8 and cbf else None
        x16 = f16 / mm if f16 and mm else None
        pk8 = 100 * f8 / PEAK["fp8"] if f8 else None
        pk16 = 100 * f16 / PEAK["bf16"] if f16 else None
        lines.append(f"{row['shape']:14s} {row['m']:5d} {row['n']:6d} {row['k']:5d} | {fmt(f8):>6s} {p['fp8']:3d} "
                     f"{fmt(cbf):>6s} {'—' if x8 is None else f'{x8:.2f}':>5s} {fmt(pk8):>4s} | {fmt(cb):>6s} "
                     f"{fmt(ctf):>6s} | {fmt(f16):>6s} {fmt(mm):>6s} {'—' if x16 is None else f'{x16:.2f}':>5s} "
                     f"{fmt(pk16):>5s}")
        md.append(f"| {row['shape']} | {row['m']} | {row['n']} | {row['k']} | {fmt(f8)} (best {best8[0]:.0f} @n{best8[1]}) | "
                  f"{fmt(cbf)} | {'—' if x8 is None else f'{x8:.2f}×'} | {fmt(pk8)}% | {fmt(cb)} | {fmt(ctf)} | {fmt(ct)} | "
                  f"{fmt(f16)} | {fmt(mm)} | {'—' if x16 is None else f'{x16:.2f}×'} |")
        errs = {k: v["error"] for k, v in res.items() if "error" in v}
        if errs:
            lines.append(f"    errors: {errs}")
            md.append(f"| | | | | errors: {errs} |")
    return {"text": "\n".join(lines), "md": "\n".join(md) + "\n"}


if __name__ == "__main__":
    sys.exit(main())
