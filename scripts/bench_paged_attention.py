"""Decode attention over a paged cache (futx.paging) vs the contiguous cache: the 8B shape (Hq 32, Hkv 8, D 128),
rotated INT4 mirror, the op's default kernel (decode.attn.int4.d128.rot, .p128, .p256).

    python scripts/bench_paged_attention.py [--rounds 15] [--json paged.json]
    (on the H200: source scripts/gpu/remote.sh; FUTX_KERNELS=aot with the three kernels staged)

Per point (batch, context) the contiguous cache and paged caches of 128- and 256-position pages hold the same
contents, the paged ones at a random permutation of their pages (no request's pages are adjacent by accident).
Each candidate runs as a CUDA graph of back-to-back calls (each call also writes its new row, as a decode step
does); small caches are replicated so that every call reads from HBM, not from the 50 MB L2; candidates are
interleaved round by round and the median per call is reported. Before timing, every paged output is checked bit
for bit against the contiguous one. Issue 28's goal: paged at most 3% slower.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import gpu_info  # noqa: E402

HQ, HKV, D = 32, 8, 128
POINTS = [(1, 1024), (32, 4096), (64, 8192)]
PAGE_SIZES = (128, 256)
L2_BYTES = 50 * 2 ** 20
GOAL = 0.03
PER_TOKEN = D + 8  # INT4 key + value bytes and their two f32 scales, per KV head


def _paged_copy(da, contig, batch: int, page_size: int, gen: torch.Generator):
    """contig's slots [0, batch) in a paged cache at a random page permutation: (cache, block table)."""
    from futx import paging

    cap = contig.k_cache.shape[2]
    lay = paging.PageLayout(page_size, pages=batch * (cap // page_size), slots=batch, max_pages=cap // page_size)
    table = lay.new_table()
    table[:batch] = torch.randperm(lay.pages, generator=gen).to(torch.int32).view(batch, lay.max_pages)
    dev = contig.k_cache.device
    table = table.to(dev)
    paged = da.DecodeCache.allocate("int4", lay.storage_pages(), HKV, page_size, D, dev)
    dst = table[:batch].flatten().long()
    for name in ("k_cache", "v_cache", "k_mirror", "k_scale", "v_mirror", "v_scale"):
        src = getattr(contig, name)[:batch]
        per_page = src.shape[2] // lay.max_pages   # P positions, or P/8 INT4 key blocks
        rows = src.unflatten(2, (lay.max_pages, per_page)).transpose(1, 2).flatten(0, 1)  # [B * max_pages, Hkv, ..]
        getattr(paged, name)[dst] = rows
    return paged, table


def _build(da, batch: int, ctx: int, seed: int):
    """label -> call(i) (the i-th call reads copy i % copies); the caches the calls use stay referenced here."""
    gen = torch.Generator().manual_seed(seed)
    cap = -(-ctx // max(PAGE_SIZES)) * max(PAGE_SIZES)  # whole pages of every page size
    read = batch * ctx * HKV * PER_TOKEN
    copies = max(1, min(64, -(-2 * L2_BYTES // read)))
    q = torch.randn(batch, HQ, D, device="cuda").bfloat16()
    k_new, v_new = (torch.randn(batch, HKV, D, device="cuda").bfloat16() for _ in range(2))
    positions = torch.full((batch,), ctx - 1, dtype=torch.int32, device="cuda")
    slots = torch.arange(batch, dtype=torch.int32, device="cuda")
    layouts = {"contiguous": []} | {f"paged P={p}": [] for p in PAGE_SIZES}
    for _ in range(copies):
        c = da.DecodeCache.allocate("int4", batch, HKV, cap, D)
        c.k_cache.normal_()
        c.v_cache.normal_()
        c.k_mirror.random_(0, 256)
        c.v_mirror.random_(0, 256)
        c.k_scale.uniform_(0.01, 0.03)
        c.v_scale.uniform_(0.01, 0.03)
        layouts["contiguous"].append((c, {}))
        for p in PAGE_SIZES:
            paged, table = _paged_copy(da, c, batch, p, gen)
            layouts[f"paged P={p}"].append((paged, dict(block_table=table, page_size=p)))
    outs = {label: torch.empty_like(q) for label in layouts}

    def make(label):
        def call(i):
            cache, kw = layouts[label][i % copies]
            torch.ops.futx.decode_attention_(q, k_new, v_new, positions, slots, *cache.tensors(), outs[label], "int4",
                                             True, max_context=ctx, check_positions_on_host=False, **kw)
            return outs[label]
        return call
    return {label: make(label) for label in layouts}, layouts, copies, read


def _graph(fn, calls: int):
    from bench_common import capture_calls

    return capture_calls(fn, calls)


def _time_us(g, calls: int) -> float:
    from bench_common import replay_us

    return replay_us(g, calls)


def bench_point(da, batch: int, ctx: int, rounds: int, min_calls: int) -> list[dict]:
    from decode.attn_plan import choose_splits

    calls_by_label, keep, copies, read = _build(da, batch, ctx, seed=batch + ctx)
    ref = calls_by_label["contiguous"](0).clone()   # eager first calls: load the kernels, check the outputs
    torch.cuda.synchronize()
    if not bool(torch.isfinite(ref).all()):
        raise RuntimeError(f"B={batch} ctx={ctx}: non-finite contiguous output")
    equal = {}
    for label, call in calls_by_label.items():
        equal[label] = bool(torch.equal(call(0), ref))
    calls = max(min_calls, copies)
    graphs = {label: _graph(call, calls) for label, call in calls_by_label.items()}
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    times = {label: [] for label in graphs}
    labels = list(graphs)
    for r in range(rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            times[label].append(_time_us(graphs[label], calls))
    splits = choose_splits(da.resolve("int4", D, True, "")[1], batch, HKV, ctx,
                           torch.cuda.get_device_properties(0).multi_processor_count)
    base = statistics.median(times["contiguous"])
    rows = []
    for label in labels:
        us = statistics.median(times[label])
        rows.append(dict(batch=batch, context=ctx, candidate=label, us=us, vs_contiguous=us / base - 1,
                         tb_s=read / (us * 1e-6) / 1e12, spread=(max(times[label]) - min(times[label])) / us,
                         splits=splits, equal_to_contiguous=equal[label], calls=calls, copies=copies))
    del graphs, keep
    torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| B | context | cache | us/call | vs contiguous | TB/s | spread | splits | output |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']} | {r['candidate']} | {r['us']:.2f} | "
                     f"{100 * r['vs_contiguous']:+.1f}% | {r['tb_s']:.2f} | {100 * r['spread']:.0f}% | {r['splits']} | "
                     f"{'bit-equal' if r['equal_to_contiguous'] else 'DIFFERS'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=16, help="calls per graph replay (at least the cache copies)")
    ap.add_argument("--json", default=None, help="write rows and the verdict here (default $OUT/bench_paged.json)")
    args = ap.parse_args()
    import futx.ops  # noqa: F401  (registers torch.ops.futx.*)
    from futx.ops import decode_attention as da

    rows = []
    for batch, ctx in POINTS:
        rows += bench_point(da, batch, ctx, args.rounds, args.calls)
        print(f"[bench] B={batch} ctx={ctx} done", file=sys.stderr, flush=True)
    paged = [r for r in rows if r["candidate"] != "contiguous"]
    worst = max(r["vs_contiguous"] for r in paged)
    verdict = dict(goal=f"paged <= {100 * GOAL:.0f}% slower", worst=worst, met=worst <= GOAL,
                   all_bit_equal=all(r["equal_to_contiguous"] for r in rows))
    equal = "bit-equal" if verdict["all_bit_equal"] else "NOT all bit-equal"
    md = table(rows) + (f"\n\nworst paged slowdown {100 * worst:+.1f}% (goal <= {100 * GOAL:.0f}%: "
                        f"{'met' if verdict['met'] else 'NOT met'}); outputs {equal} to the contiguous kernel's")
    path = args.json or (os.path.join(os.environ["OUT"], "bench_paged.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(dict(info=gpu_info(), kernels=os.environ.get("FUTX_KERNELS", "auto"), rows=rows,
                           verdict=verdict), f, indent=1)
    print(md)
    return 0 if verdict["all_bit_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
