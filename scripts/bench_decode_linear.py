"""Decode projections as they run inside a decode step: weights not in L2, one CUDA-graph replay each.

    python scripts/bench_decode_linear.py [--layers layer-8b,layer-70b] [--m 1,8,16,32] [--quack]
                                          [--cands futx-int4,torch-bf16,...] [--budget-s 80]
    python scripts/bench_decode_linear.py --render decode_linear.json     # the markdown report again

For each projection (QKV, O, gate/up, down) of each layer and each M, every candidate is captured in a
CUDA graph as `reps` x [L2 flush, projection]; a graph of `reps` flushes alone is timed in the same
rounds and subtracted. The flush *reads* a 128 MB buffer (2.5x the L2) (clean lines: no write-backs later).
Rounds are interleaved across candidates; medians are reported, with achieved bandwidth = bytes of
weights + scales / time and its fraction of the 4.36 TB/s HBM read floor measured on this H200.

Candidates: futx INT4 (g128) / E4M3 / BF16 as the ops pick them (decode.plan; the `plan` column names the
INT4 kernel), the INT4 design alternatives where they apply (those the router never picks are registered from
scripts/tuning_space.py and compiled on demand: JIT, or `python scripts/tuning_space.py build` for AOT):
  futx-int4-tile      the one-tile-per-CTA GEMV (run-1 design; the plan's M = 1 choice; for 1 < M <= 8 the
                      multi-token tile GEMV where its rows fit)
  futx-int4-tile-xw   the same with the other warp count (4 <-> 8)
  futx-int4-rolling   the tile GEMV with a rolling prefetch and late scale conversion (tuning space)
  futx-int4-p1/p3/p4  the tile GEMV with batches of 1 / 3 (run 1) / 4 units instead of 2 (tuning space)
  futx-int4-skinny-s3/s4  the skinny kernel with 3 / 4 ring stages, 4 / 3 CTAs per SM (tuning space)
  futx-int4-gemv      the persistent GEMV (scale-conversion fix; the plan's choice for 2 <= M <= 8)
  futx-int4-r2        the persistent GEMV exactly as measured in run 2 (scales converted at the load)
  futx-int4-nofold    the persistent GEMV without the folded nibble bias
  futx-int4-skinny    the skinny kernel (the plan's choice from M = 9)
  futx-int4-split<S>  the plan's skinny kernel with S split-K CTAs per tile instead of the rule's (1, 2, 4, 8, 16)
  futx-e4m3-ws/wsk    E4M3: the warp-specialized kernel (decode/skinny_ws_e4m3.py), grid / stream-K, from M = 9
  futx-e4m3-skinny[-rww]  E4M3 from M = 17: the ring / register-weights kernel P18 replaced (tuning space)
and the peers: torch._weight_int4pack_mm (g128, the gpt-fast/torchao kernel), torch BF16 matmul, and
quack's gemm_w4a16 `int4` (optional: --quack, needs quack-kernels and the DSL).
A candidate equal to the plan's choice is not timed twice. `futx-int4-best` (per projection, the fastest
futx INT4 design) appears in the per-layer sums. The whole benchmark keeps within --budget-s (fewer rounds
when behind). Writes decode_linear.{json,md} to $OUT when set; prints a compact table and the GOAL lines last.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from decode import plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tuning_space  # noqa: E402

tuning_space.register()  # the design alternatives below are tuning space, not in the package registry

FLOOR_TBPS = 4.36
GROUP = 128
PROJS = ("qkv", "o", "gate_up", "down")
EPILOGUE = {"qkv": "store", "o": "residual", "gate_up": "swiglu", "down": "residual"}
SKINNY_SPLITS = (1, 2, 4, 8, 16)


# ---- candidates ---------------------------------------------------------------------------------
def _int4_designs(n, k, m, proj) -> dict:
    """INT4 design alternatives for this shape and M: name -> run_variant keywords (the plan's own choice
    and designs that cannot serve the shape are left out)."""
    epi = EPILOGUE[proj]
    choice = plan.choose("int4", GROUP, epi, m, n, k)
    out = {}
    if m == 1 or plan.tile_fits(k, plan.TILE_WARPS_LARGE_K, False, "", m):
        w = plan.tile_warps(k, n, m=m)
        out["futx-int4-tile"] = dict(kernel="tile", nblocks=1)   # one n-block per CTA
        out["futx-int4-tile-xw"] = dict(kernel="tile", nblocks=1,
                                        warps=plan.TILE_WARPS_SMALL_K + plan.TILE_WARPS_LARGE_K - w)
        if m > 1:  # n-blocks per CTA bringing the grid within one wave (decode.plan.tile_rows_nblocks, P13)
            nb = plan.tile_rows_nblocks(m, n, k, w, False)
            if nb > 1:
                out["futx-int4-tile-nb"] = dict(kernel="tile", nblocks=nb)
    if m == 1:
        for v in plan.TILE_VARIANTS:
            if v:
                out[f"futx-int4-{v}"] = dict(kernel="tile", variant=v)
    if m <= plan.GEMV_MAX_M and plan.gemv_tiles(plan.gemv_params("int4", GROUP, epi, m), m, n, k, 132):
        out["futx-int4-gemv"] = dict(kernel="gemv")
        if m <= plan.INT4_GEMV_MAX_M:
            out["futx-int4-r2"] = dict(kernel="gemv", variant="r2")
        if m == 1:
            out["futx-int4-nofold"] = dict(kernel="gemv", variant="nofold")
    if m > 1:
        out["futx-int4-skinny"] = dict(kernel="skinny")
        for v in plan.SKINNY_VARIANTS:
            if v:
                out[f"futx-int4-skinny-{v}"] = dict(kernel="skinny", variant=v)
        if choice.kind == "skinny":
            for s in SKINNY_SPLITS:
                out[f"futx-int4-split{s}"] = dict(kernel="skinny", variant=plan.skinny_variant("int4", GROUP, m),
                                                  split=s)

    def same(c):
        return (c.key, c.split) == (choice.key, choice.split)
    return {name: kw for name, kw in out.items() if not same(plan.choose("int4", GROUP, epi, m, n, k, **kw))}


def _e4m3_designs(n, k, m, proj) -> dict:
    """E4M3 design alternatives: the warp-specialized kernel's two schedules (decode/skinny_ws_e4m3.py) from M = 9 on,
    where they are not the plan's own choice."""
    epi = EPILOGUE[proj]
    choice = plan.choose("e4m3", GROUP, epi, m, n, k)
    out = {f"futx-e4m3-{v}": dict(kernel="skinny", variant=v) for v in plan.E4M3_WS_VARIANTS} if m > 8 else {}
    for v in plan.skinny_replaced_variants("e4m3", GROUP, m):   # the kernel P18 replaced
        out["futx-e4m3-skinny" + (f"-{v}" if v else "")] = dict(kernel="skinny", variant=v)
    def same(c):
        return (c.key, c.split) == (choice.key, choice.split)
    return {name: kw for name, kw in out.items() if not same(plan.choose("e4m3", GROUP, epi, m, n, k, **kw))}


def futx_candidates(n, k, m, proj, gen):
    from futx.ops.decode_linear import run_variant

    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    r = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    epi = EPILOGUE[proj]
    res = r if epi == "residual" else None
    out = torch.empty(m, n // 2 if epi == "swiglu" else n, dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(64 * n * 32, device="cuda")
    packed = torch.randint(-2**31, 2**31 - 1, (n // 16, k // 64, 32, 4), dtype=torch.int32, device="cuda",
                           generator=gen)
    scales = (torch.rand(n // 16, k // GROUP, 16, device="cuda", generator=gen) * 0.01).half()
    raw = torch.randint(0, 126, (n, k), dtype=torch.uint8, device="cuda", generator=gen)
    e4 = raw.view(torch.float8_e4m3fn)
    e4s = torch.rand(n, device="cuda", generator=gen) * 1e-3
    wb = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()

    def call(fmt, w, s, **kw):
        return lambda: run_variant(fmt, x, w, s, GROUP, epi, res, out=out, workspace=ws, **kw)

    int4_bytes = n * k // 2 + n * (k // GROUP) * 2
    cands = {
        "futx-int4": (call("int4", packed, scales), int4_bytes),
        "futx-e4m3": (call("e4m3", e4, e4s), n * k + 4 * n),
        "futx-bf16": (call("bf16", wb, None), 2 * n * k),
    }
    for name, kw in _int4_designs(n, k, m, proj).items():
        cands[name] = (call("int4", packed, scales, **kw), int4_bytes)
    for name, kw in _e4m3_designs(n, k, m, proj).items():
        cands[name] = (call("e4m3", e4, e4s, **kw), n * k + 4 * n)
    return x, cands


def plan_note(n, k, m, proj, fmt="int4") -> str:
    """Which kernel and launch shape the ops pick (reported with the timings)."""
    c = plan.choose(fmt, GROUP, EPILOGUE[proj], m, n, k)
    if c.kind == "tile":
        nb = c.key.rsplit(".nb", 1)[1] if ".nb" in c.key else ""
        return f"tile w{plan.tile_warps(k, n, m=m)}" + (f" nb{nb}" if nb else "")
    variant = f".{c.variant}" if c.variant else ""
    return f"gemv tiles={c.tiles}" if c.kind == "gemv" else f"skinny{variant} split={c.split}"


def torch_candidates(x, n, k, gen):
    cands = {}
    wb = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    cands["torch-bf16"] = (lambda: torch.nn.functional.linear(x, wb), 2 * n * k)
    try:
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        try:
            wp = torch.ops.aten._convert_weight_to_int4pack(q, 8)
        except RuntimeError:  # older torch: int32 [N, K] nibbles
            wp = torch.ops.aten._convert_weight_to_int4pack(
                torch.stack([q & 0xF, q >> 4], -1).reshape(n, k).int(), 8)
        sz = (torch.rand(k // GROUP, n, 2, device="cuda", generator=gen) * 0.01).bfloat16()
        torch._weight_int4pack_mm(x, wp, GROUP, sz)
        cands["torch-int4"] = (lambda: torch._weight_int4pack_mm(x, wp, GROUP, sz),
                               n * k // 2 + n * (k // GROUP) * 4)
    except Exception as exc:  # noqa: BLE001 - report, keep going
        print(f"  torch-int4 unavailable: {str(exc).splitlines()[0][:120]}", file=sys.stderr)
    return cands


def quack_candidate(x, n, k, gen):
    from quack.gemm_w4 import gemm_w4a16, prepare_w4_weight

    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    sf = (torch.rand(n, k // GROUP, device="cuda", generator=gen) * 0.01).bfloat16()
    blob, sf_blob = prepare_w4_weight(q, sf, wformat="int4")
    gemm_w4a16(x, blob, sf_blob, wformat="int4")
    nbytes = blob.numel() * blob.element_size() + sf_blob.numel() * sf_blob.element_size()  # its scale strip
    return {"quack-w4a16": (lambda: gemm_w4a16(x, blob, sf_blob, wformat="int4"), nbytes)}


# ---- timing -------------------------------------------------------------------------------------
class Flush:
    """Evict L2 by reading a buffer several times its size (reads leave no dirty lines behind)."""

    def __init__(self, mb: int = 128):
        self.buf = torch.ones(mb << 18, device="cuda")  # mb MiB of float32
        self.sink = torch.empty((), device="cuda")

    def __call__(self):
        torch.amax(self.buf, dim=0, out=self.sink)


def capture(fns, reps: int):
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(reps):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph


def time_graph(graph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3  # us


def bench(cands: dict, flush: Flush, reps: int, rounds: int) -> dict:
    graphs, out = {}, {}
    for name, (fn, nbytes) in cands.items():
        try:
            fn()
            torch.cuda.synchronize()
            graphs[name] = capture([flush, fn], reps)
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"}
    base = capture([flush], reps)
    times = {name: [] for name in graphs}
    flush_t = []
    names = list(graphs)
    for r in range(rounds):
        order = names[r % max(1, len(names)):] + names[:r % max(1, len(names))]
        flush_t.append(time_graph(base))
        for name in order:
            times[name].append(time_graph(graphs[name]))
    f = statistics.median(flush_t)
    for name, ts in times.items():
        us = max((statistics.median(ts) - f) / reps, 1e-3)
        nbytes = cands[name][1]
        out[name] = {"us": us, "gbps": nbytes / us / 1e3, "floor_frac": nbytes / us / 1e6 / FLOOR_TBPS,
                     "bytes": nbytes, "spread": (max(ts) - min(ts)) / statistics.median(ts)}
    out["_flush_us"] = f / reps
    return out


# ---- report -------------------------------------------------------------------------------------
PEERS = ("torch-bf16", "torch-int4", "quack-w4a16")
GOAL_SUM_US = {"layer-8b": 35.0, "layer-70b": 115.0}
FLAT_RATIO = 1.25  # "nearly flat": the M = 16 layer sum within 1.25x of the M = 1 sum


def floor_us(nbytes: int) -> float:
    return nbytes / FLOOR_TBPS / 1e6


def _cell(e: dict) -> str:
    return f"{e['us']:.1f} ({100 * e['floor_frac']:.0f}%)" if e and "us" in e else "-"


def table(rows: list[dict], cand_names: list[str], with_plan: bool = True) -> str:
    extra = ["INT4 floor us", "plan (INT4)"] if with_plan else ["INT4 floor us"]
    head = "| layer | proj | M | " + " | ".join(extra + cand_names) + " |"
    lines = [head, "|" + "---|" * (3 + len(extra) + len(cand_names))]
    for row in rows:
        first = [f"{floor_us(row.get('int4_bytes', 0)):.1f}"] + ([row.get("plan", "")] if with_plan else [])
        cells = [_cell(row["cands"].get(c, {})) for c in cand_names]
        lines.append(f"| {row['layer']} | {row['proj']} | {row['m']} | " + " | ".join(first + cells) + " |")
    return "\n".join(lines)


def add_best(rows: list[dict]) -> None:
    """futx-int4-best: the fastest futx INT4 design of each row (what an oracle router would get)."""
    for row in rows:
        opts = [(v["us"], c) for c, v in row["cands"].items() if c.startswith("futx-int4") and "us" in v
                and c != "futx-int4-best"]
        if opts:
            us, name = min(opts)
            b = row["cands"][name]["bytes"]
            row["cands"]["futx-int4-best"] = {"us": us, "bytes": b, "gbps": b / us / 1e3,
                                              "floor_frac": b / us / 1e6 / FLOOR_TBPS, "design": name}


def layer_sums(results: list[dict], cand_names: list[str]) -> list[dict]:
    sums = {}
    for row in results:
        acc = sums.setdefault((row["layer"], row["m"]), {"_n": 0, "_int4_bytes": 0})
        acc["_n"] += 1
        acc["_int4_bytes"] += row.get("int4_bytes", 0)
        for c in cand_names:
            e = row["cands"].get(c, {})
            if "us" in e and acc.get(c, 0.0) is not None:
                acc[c] = acc.get(c, 0.0) + e["us"]
                acc[c + "#bytes"] = acc.get(c + "#bytes", 0) + e["bytes"]
                acc[c + "#n"] = acc.get(c + "#n", 0) + 1
            else:
                acc[c] = None
    rows = []
    for (layer, m), acc in sums.items():
        cands = {}
        for c in cand_names:
            if acc.get(c) and acc.get(c + "#n") == acc["_n"]:  # only candidates timed on every projection
                b = acc[c + "#bytes"]
                cands[c] = {"us": acc[c], "bytes": b, "gbps": b / acc[c] / 1e3,
                            "floor_frac": b / acc[c] / 1e6 / FLOOR_TBPS}
        rows.append({"layer": layer, "proj": "sum", "m": m, "cands": cands, "int4_bytes": acc["_int4_bytes"],
                     "plan": ""})
    return rows


def goal_lines(rows: list[dict], sums: list[dict]) -> list[str]:
    out = []
    by = {(r["layer"], r["m"]): r["cands"] for r in sums}
    for layer, goal in GOAL_SUM_US.items():
        c = by.get((layer, 1), {})
        if "futx-int4" in c:
            e = c["futx-int4"]
            best = c.get("futx-int4-best", e)
            out.append(f"GOAL {layer} INT4 M=1 sum: {e['us']:.1f} us = {100 * e['floor_frac']:.0f}% of the floor "
                       f"({floor_us(e['bytes']):.1f} us) (goal <= {goal}) {'MET' if e['us'] <= goal else 'MISSED'}"
                       f"; best futx design per projection: {best['us']:.1f} us")
    for layer in GOAL_SUM_US:
        a, b = by.get((layer, 1), {}).get("futx-int4"), by.get((layer, 16), {}).get("futx-int4")
        if a and b:
            ratio = b["us"] / a["us"]
            out.append(f"GOAL {layer} INT4 flat M=1->16: {a['us']:.1f} -> {b['us']:.1f} us ({ratio:.2f}x, goal "
                       f"<= {FLAT_RATIO}x) {'MET' if ratio <= FLAT_RATIO else 'MISSED'}")
    misses, total = [], 0
    for row in rows:
        f = row["cands"].get("futx-int4", {})
        peers = [(v["us"], p) for p, v in row["cands"].items() if p in PEERS and "us" in v]
        if "us" not in f or not peers:
            continue
        total += 1
        us, peer = min(peers)
        if f["us"] >= us:
            misses.append(f"{row['layer']} {row['proj']} M={row['m']} ({f['us']:.1f} vs {peer} {us:.1f})")
    if total:
        out.append(f"GOAL INT4 faster than the fastest peer on {total - len(misses)}/{total} projections: "
                   f"{'MET' if not misses else 'MISSED (losses: ' + '; '.join(misses) + ')'}")
    return out


def render(data: dict) -> str:
    rows = data["rows"]
    names = data.get("names") or list(dict.fromkeys(c for r in rows for c in r["cands"] if not c.startswith("_")))
    if "goals" not in data:  # a json of an earlier version of this script
        for r in rows:
            r.setdefault("int4_bytes", r["n"] * r["k"] // 2 + r["n"] * (r["k"] // GROUP) * 2)
        add_best(rows)
        data["sums"] = layer_sums(rows, names + ["futx-int4-best"])
        data["goals"] = goal_lines(rows, data["sums"])
    sums = data["sums"]
    sum_names = names + (["futx-int4-best"] if "futx-int4-best" not in names else [])
    best = [f"| {r['layer']} | {r['proj']} | {r['m']} | {r['cands']['futx-int4-best']['design']} |"
            for r in rows if "futx-int4-best" in r["cands"]]
    return ("# Decode projections (L2 flushed, CUDA-graph replay, median of rounds)\n\n"
            f"{json.dumps(data['info'])}\n\nus per call (fraction of the {FLOOR_TBPS} TB/s read floor for that "
            "candidate's bytes; achieved bandwidth = fraction x 4.36 TB/s). `INT4 floor us` = INT4 weight + "
            "scale bytes / 4.36 TB/s; `plan (INT4)` = the kernel futx-int4 ran.\n\n"
            + table(rows, names) + "\n\n## Per layer (sum of the four projections)\n\n"
            + table(sums, sum_names, with_plan=False) + "\n\n## Fastest futx INT4 design per projection\n\n"
            "| layer | proj | M | design |\n|---|---|---|---|\n" + "\n".join(best) + "\n\n## Goals\n\n"
            + "\n".join(f"- {g}" for g in data["goals"]) + "\n")


def compact(data: dict) -> str:
    """The per-layer sums of the main candidates and GB/s, one line per (layer, M)."""
    keep = ["futx-int4", "futx-int4-best", "futx-e4m3", "futx-bf16", *PEERS]
    lines = ["layer      M  " + "".join(f"{c:>16s}" for c in keep)]
    for r in data["sums"]:
        cells = "".join(f"{r['cands'][c]['us']:9.1f} {r['cands'][c]['gbps'] / 1e3:4.2f}T" if c in r["cands"]
                        else f"{'-':>16s}" for c in keep)
        lines.append(f"{r['layer']:10s} {r['m']:2d}  {cells}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="layer-8b,layer-70b")
    ap.add_argument("--m", default="1,8,16,32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--budget-s", type=float, default=80.0, help="wall-clock budget: fewer rounds when behind")
    ap.add_argument("--quack", action="store_true", help="add quack gemm_w4a16 (int4, g128); JIT compiles")
    ap.add_argument("--watchdog", type=float, default=120.0, help="seconds per shape before aborting")
    ap.add_argument("--cands", default="", help="comma list: time only these candidates (e.g. a JIT run with "
                    "quack: torch-bf16,quack-w4a16 keeps futx kernels from compiling)")
    ap.add_argument("--render", default="", help="print the markdown report of a decode_linear.json and exit")
    args = ap.parse_args()
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return
    t_start = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    import futx.ops  # noqa: F401
    from futx.config import preset

    p = torch.cuda.get_device_properties(0)
    info = {"gpu": p.name, "sms": p.multi_processor_count, "torch": torch.__version__,
            "kernels": os.environ.get("FUTX_KERNELS", "auto"),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python", "scripts/bench_decode_linear.py", *sys.argv[1:]])}
    print("bench_decode_linear:", info, flush=True)
    flush = Flush()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, names = [], []
    use_quack = args.quack
    work = [(layer, proj, m) for layer in args.layers.split(",") for proj in PROJS
            for m in (int(v) for v in args.m.split(","))]
    rounds = args.rounds
    for i, (layer, proj, m) in enumerate(work):
        n, k = preset(layer).projection_shapes()[proj]
        elapsed = time.time() - t_start
        if i and elapsed / i * len(work) > args.budget_s and rounds > 3:
            rounds = max(3, rounds - 2)  # behind the budget: fewer rounds from here on
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
        t0 = time.time()
        x, cands = futx_candidates(n, k, m, proj, gen)
        cands.update(torch_candidates(x, n, k, gen))
        if use_quack:
            try:
                cands.update(quack_candidate(x, n, k, gen))
            except Exception as exc:  # noqa: BLE001
                print(f"  quack unavailable ({type(exc).__name__}: {str(exc)[:120]}); dropping it", file=sys.stderr)
                use_quack = False
        if args.cands:
            cands = {c: v for c, v in cands.items() if c in args.cands.split(",")}
        res = bench(cands, flush, args.reps, rounds)
        faulthandler.cancel_dump_traceback_later()
        for c in res:
            if not c.startswith("_") and c not in names:
                names.append(c)
        row = {"layer": layer, "proj": proj, "n": n, "k": k, "m": m, "cands": res, "plan": plan_note(n, k, m, proj),
               "plan_e4m3": plan_note(n, k, m, proj, "e4m3"), "plan_bf16": plan_note(n, k, m, proj, "bf16"),
               "int4_bytes": n * k // 2 + n * (k // GROUP) * 2, "rounds": rounds}
        results.append(row)
        timed = sorted((v["us"], c) for c, v in res.items() if not c.startswith("_") and "us" in v)
        errs = {c: v["error"] for c, v in res.items() if isinstance(v, dict) and "error" in v}
        alts = " ".join(f"{c.replace('futx-int4-', '')}={v['us']:.1f}" for c, v in res.items()
                        if c.startswith(("futx-int4-", "futx-e4m3", "futx-bf16")) and "us" in v)
        print(f"{layer} {proj:7s} M={m:2d} N={n} K={k} [{row['plan']}; e4m3 {row['plan_e4m3']}]: futx-int4 "
              f"{res.get('futx-int4', {}).get('us', float('nan')):.1f} us "
              f"(floor {floor_us(row['int4_bytes']):.1f}) alts: {alts or '-'}; "
              f"fastest {timed[0][1]} {timed[0][0]:.1f} us "
              f"({time.time() - t0:.1f} s){' errors: ' + json.dumps(errs) if errs else ''}", flush=True)
        del x, cands
        torch.cuda.empty_cache()
    add_best(results)
    sums = layer_sums(results, names + ["futx-int4-best"])
    data = {"info": info, "names": names, "rows": results, "sums": sums, "goals": goal_lines(results, sums),
            "seconds": round(time.time() - t_start, 1)}
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "decode_linear.json").write_text(json.dumps(data, indent=1, default=str))
        Path(out, "decode_linear.md").write_text(render(data))
    print(f"\n{len(results)} shapes in {data['seconds']} s. Per-layer sums (us, achieved TB/s):")
    print(compact(data))
    for g in data["goals"]:
        print(g)


if __name__ == "__main__":
    main()
