"""Decode attention alone: futx over the INT4 / E4M3 mirrors and the BF16 cache vs PyTorch SDPA on a compact
BF16 cache (and FlashAttention's decode kernel when it is installed), for the 8B and 70B head shapes.

    python scripts/bench_decode_attention.py [--quick] [--rounds 7]

For the 8B shape the INT4 kernel also runs its dequantization ablations: [valu] = keys through the
256-entry table, values by prmt/lop3/f16 FMA; [alu] = both arithmetic. Each candidate runs as a CUDA graph of back-to-back calls; candidates are interleaved round by round and
the median per call is reported. Small caches are replicated (each call in the graph reads a different
copy) so that every call streams from HBM, not from the 50 MB L2. Achieved bandwidth = cache bytes the
call must read (K, V and their scales for the context) / time, as a fraction of the 4.36 TB/s read
floor measured on this H200. The futx calls also write the new row (main copy + mirror), as in a
real decode step; SDPA does not. Markdown and JSON go to $OUT when it is set; the table prints last.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

FLOOR_TBS = 4.36
SHAPES = {"8B": (32, 8, 128), "70B": (64, 8, 128)}  # query heads, KV heads, head dim
POINTS = [(1, 1024), (8, 1024), (32, 1024), (32, 4096), (8, 32768)]
L2_BYTES = 50 * 2 ** 20


def _graph(fn, calls: int):
    fn(0)  # warm up (loads or compiles the kernel) outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    return g


def _time_us(g, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def _fill_cache(cache, fmt):
    with torch.no_grad():
        cache.k_cache.normal_()
        cache.v_cache.normal_()
        if fmt == "int4":
            cache.k_mirror.random_(0, 256)
            cache.v_mirror.random_(0, 256)
        elif fmt == "e4m3":
            cache.k_mirror.copy_(torch.randn_like(cache.k_mirror, dtype=torch.float32).to(torch.float8_e4m3fn))
            cache.v_mirror.copy_(torch.randn_like(cache.v_mirror, dtype=torch.float32).to(torch.float8_e4m3fn))
        if fmt != "bf16":
            cache.k_scale.fill_(0.02)
            cache.v_scale.fill_(0.02)


def _flash_attn():
    try:
        from flash_attn import flash_attn_with_kvcache  # noqa: F401

        return flash_attn_with_kvcache
    except Exception:  # not installed (no internet on the H200), or built for another torch
        return None


def bench_point(name, hq, hkv, d, batch, ctx, rounds, min_calls, ablate=False):
    from futx.ops import decode_attention as da

    cap = -(-ctx // 64) * 64
    dev = "cuda"
    per_token = {"int4": d + 8, "e4m3": 2 * d + 8, "bf16": 4 * d, "sdpa": 4 * d, "flash": 4 * d}
    read = {k: batch * ctx * hkv * v for k, v in per_token.items()}
    copies = max(1, min(64, math.ceil(2 * L2_BYTES / read["int4"])))
    calls = max(min_calls, copies)
    q = torch.randn(batch, hq, d, device=dev).bfloat16()
    k_new, v_new = torch.randn(batch, hkv, d, device=dev).bfloat16(), torch.randn(batch, hkv, d, device=dev).bfloat16()
    positions = torch.full((batch,), ctx - 1, dtype=torch.int32, device=dev)
    slots = torch.arange(batch, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    graphs = {}
    for fmt in ("int4", "e4m3", "bf16"):
        n_copies = max(1, min(copies, math.ceil(2 * L2_BYTES / read[fmt])))
        caches = [da.DecodeCache.allocate(fmt, batch, hkv, cap, d) for _ in range(n_copies)]
        for c in caches:
            _fill_cache(c, fmt)
        rotate = fmt != "bf16"
        for variant in (("", "valu", "alu") if fmt == "int4" and ablate else ("",)):
            def call(i, caches=caches, fmt=fmt, rotate=rotate, variant=variant):
                c = caches[i % len(caches)]
                torch.ops.futx.decode_attention_(q, k_new, v_new, positions, slots, *c.tensors(), out, fmt,
                                                 rotate, max_context=ctx, check_positions_on_host=False,
                                                 variant=variant)
            label = f"futx {fmt}" + (" rot" if rotate else "") + (f" [{variant}]" if variant else "")
            graphs[label] = (_graph(call, calls), read[fmt])
    n_copies = max(1, min(copies, math.ceil(2 * L2_BYTES / read["sdpa"])))
    kv = [(torch.randn(batch, hkv, ctx, d, device=dev).bfloat16(), torch.randn(batch, hkv, ctx, d, device=dev).bfloat16())
          for _ in range(n_copies)]
    q4 = q.unsqueeze(2)

    def sdpa(i):
        k, v = kv[i % len(kv)]
        F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
    graphs["torch sdpa (compact bf16)"] = (_graph(sdpa, calls), read["sdpa"])
    fa = _flash_attn()
    if fa is not None:
        kvf = [(k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()) for k, v in kv]
        seqlens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)

        def flash(i):
            k, v = kvf[i % len(kvf)]
            fa(q.unsqueeze(1), k, v, cache_seqlens=seqlens)
        graphs["flash-attn kvcache"] = (_graph(flash, calls), read["flash"])

    times = {k: [] for k in graphs}
    keys = list(graphs)
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[k].append(_time_us(graphs[k][0], calls))
    from decode.attn_plan import choose_splits, default_plan

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = {fmt: choose_splits(default_plan(fmt, d, fmt != "bf16"), batch, hkv, ctx, sms)
              for fmt in ("int4", "e4m3", "bf16")}
    rows = []
    for k in keys:
        us = statistics.median(times[k])
        tbs = graphs[k][1] / (us * 1e-6) / 1e12
        fmt = k.split()[1] if k.startswith("futx") else None
        rows.append(dict(model=name, batch=batch, context=ctx, candidate=k, us=us, cache_mb=graphs[k][1] / 1e6,
                         tb_s=tbs, floor_frac=tbs / FLOOR_TBS, spread=(max(times[k]) - min(times[k])) / us,
                         splits=splits.get(fmt, "")))
    del graphs, kv
    torch.cuda.empty_cache()
    return rows


def table(rows) -> str:
    lines = ["| model | B | context | candidate | splits | us | cache MB | TB/s | % of 4.36 | vs futx bf16 | vs sdpa |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = [x for x in rows if (x["model"], x["batch"], x["context"]) == (r["model"], r["batch"], r["context"])]
        base = {x["candidate"]: x["us"] for x in same}
        vs_bf16 = base.get("futx bf16", float("nan")) / r["us"]
        vs_sdpa = base.get("torch sdpa (compact bf16)", float("nan")) / r["us"]
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['candidate']} | {r['splits']} | {r['us']:.1f} | "
                     f"{r['cache_mb']:.1f} | {r['tb_s']:.2f} | {100 * r['floor_frac']:.0f}% | {vs_bf16:.2f}x | "
                     f"{vs_sdpa:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20, help="calls per graph replay (at least)")
    ap.add_argument("--quick", action="store_true", help="8B only, three points")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new points after this")
    ap.add_argument("--watchdog-s", type=float, default=180.0, help="abort if one point takes longer")
    ap.add_argument("--no-ablation", action="store_true",
                    help="skip the INT4 dequantization ablations ([valu]: values arithmetic, [alu]: both)")
    args = ap.parse_args()
    import futx.ops  # noqa: F401

    t0 = time.time()
    points = [(m, b, c) for m in SHAPES for b, c in POINTS]
    if args.quick:
        points = [("8B", 8, 1024), ("8B", 32, 4096), ("8B", 8, 32768)]
    rows, skipped = [], []
    for name, b, c in points:
        if time.time() - t0 > args.budget_s:
            skipped.append((name, b, c))
            continue
        hq, hkv, d = SHAPES[name]
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)  # a hung point must not hang the run
        try:
            rows += bench_point(name, hq, hkv, d, b, c, args.rounds, args.calls,
                                ablate=not args.no_ablation and name == "8B")
        except Exception as exc:  # keep going: one bad point must not lose the table
            print(f"[bench] {name} B={b} ctx={c} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            skipped.append((name, b, c))
        faulthandler.cancel_dump_traceback_later()
        print(f"[bench] {name} B={b} ctx={c} done at {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    md = table(rows)
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "bench_decode_attention.md"), "w") as f:
            f.write(md + "\n")
        with open(os.path.join(os.environ["OUT"], "bench_decode_attention.json"), "w") as f:
            json.dump({"rows": rows, "skipped": skipped, "device": torch.cuda.get_device_name()}, f, indent=1)
    if skipped:
        print(f"skipped (budget or error): {skipped}")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
