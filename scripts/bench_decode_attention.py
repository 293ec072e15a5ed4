"""Decode attention alone: futx over the INT4 / E4M3 mirrors and the BF16 cache vs PyTorch SDPA on a compact BF16
cache (and FlashAttention's decode kernel when it is installed), for the 8B and 70B head shapes.

    python scripts/bench_decode_attention.py [--quick] [--rounds 7] [--no-ablation] [--budget-s 80]
    python scripts/bench_decode_attention.py --render bench_decode_attention.json   (tables of a finished run)

"futx int4 rot" is what the op launches by default (decode.attn_plan.default_plan: "pair" dequantization of keys
and values, no table). For the 8B shape the INT4 kernel also runs its tuning-space variants
(futx.runtime.catalog.decode_attention.VARIANTS, registered from scripts/tuning_space.py): [table] keys
through the 256-entry shared-memory table, values by
arithmetic (the previous default), [s2] the previous long-context kernel, [vlut] table keys and values (the run-2
default), [w6v] the table design in 6-warp CTAs with 2-deep rings, [fx] the default dequantization in 6-warp CTAs.
Each candidate runs as a CUDA graph of back-to-back calls; candidates are interleaved round by round and the
median per call is reported. Small caches are replicated (each call in the graph reads a different copy) so
that every call streams from HBM, not from the 50 MB L2. Achieved bandwidth = cache bytes the call must read
(K, V and their scales for the context) / time; "floor" is that byte count at the 4.36 TB/s read rate measured
on this H200. The futx calls also write the new row (main copy + mirror), as in a real decode step; SDPA does not.

Robustness: the points run in a child process. Before its first call every candidate is announced, called once
eagerly and synchronized (output must be finite). A CUDA fault poisons a process, so when a child dies the
parent records the announced candidate as failed and starts a new child for the rest (without it). Markdown and
JSON go to $OUT when it is set; the table prints last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tuning_space  # noqa: E402

tuning_space.register()  # the INT4 variants ([table], [s2], ...) are tuning space, not in the package registry

FLOOR_TBS = 4.36
SHAPES = {"8B": (32, 8, 128), "70B": (64, 8, 128)}  # query heads, KV heads, head dim
POINTS = [(1, 1024), (8, 1024), (32, 1024), (32, 4096), (8, 32768)]
L2_BYTES = 50 * 2 ** 20
BENCH_VARIANTS = ("table", "s2", "vlut", "w6v", "fx")  # catalog TUNING
GOAL = ("8B", 32, 4096, 0.70)  # issue 7: INT4 attention >= 70% of the floor at (32, 4096)
PER_TOKEN = {"int4": lambda d: d + 8, "e4m3": lambda d: 2 * d + 8, "bf16": lambda d: 4 * d}  # per KV head


def _labels(model: str, ablate: bool) -> list[str]:
    out = ["futx int4 rot"] + ([f"futx int4 rot [{v}]" for v in BENCH_VARIANTS] if ablate and model == "8B" else [])
    return out + ["futx e4m3 rot", "futx bf16", "torch sdpa (compact bf16)", "flash-attn kvcache"]


# ---- child: one process measures points until done or a CUDA fault ------------------------------------------
def _graph(fn, calls: int):
    from bench_common import capture_calls

    return capture_calls(fn, calls)


def _time_us(g, calls: int) -> float:
    from bench_common import replay_us

    return replay_us(g, calls)


def _fill_cache(cache, fmt):
    import torch

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


def _candidates(model, batch, ctx, ablate):
    """label -> build() -> (call(i) -> output, bytes read per call, splits); built lazily, one at a time."""
    import torch
    import torch.nn.functional as F

    from decode.attn_plan import choose_splits
    from futx.ops import decode_attention as da

    hq, hkv, d = SHAPES[model]
    cap = -(-ctx // 64) * 64
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q = torch.randn(batch, hq, d, device=dev).bfloat16()
    k_new, v_new = torch.randn(batch, hkv, d, device=dev).bfloat16(), torch.randn(batch, hkv, d, device=dev).bfloat16()
    positions = torch.full((batch,), ctx - 1, dtype=torch.int32, device=dev)
    slots = torch.arange(batch, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    read = {fmt: batch * ctx * hkv * f(d) for fmt, f in PER_TOKEN.items()}

    def n_copies(fmt):
        return max(1, min(64, math.ceil(2 * L2_BYTES / read[fmt])))

    def futx(fmt, variant=""):
        def build():
            caches = [da.DecodeCache.allocate(fmt, batch, hkv, cap, d) for _ in range(n_copies(fmt))]
            for c in caches:
                _fill_cache(c, fmt)
            rotate = fmt != "bf16"

            def call(i):
                torch.ops.futx.decode_attention_(q, k_new, v_new, positions, slots, *caches[i % len(caches)].tensors(),
                                                 out, fmt, rotate, max_context=ctx, check_positions_on_host=False,
                                                 variant=variant)
                return out
            _, plan = da.resolve(fmt, d, rotate, variant)  # what the op launches
            splits = choose_splits(plan, batch, hkv, ctx, sms)
            return call, read[fmt], f"{splits}"
        return build

    def bf16_pairs(shape):
        return [tuple(torch.randn(*shape, device=dev).bfloat16() for _ in range(2)) for _ in range(n_copies("bf16"))]

    def sdpa_build():
        kv = bf16_pairs((batch, hkv, ctx, d))

        def call(i):
            k, v = kv[i % len(kv)]
            return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True)
        return call, read["bf16"], ""

    def flash_build():
        """FlashAttention's decode path on a compact BF16 cache [B, ctx, Hkv, D]: FA2/FA3's
        flash_attn_with_kvcache when installed, else FlashAttention-4's CuTe-DSL kernel (PyPI flash-attn-4,
        JIT-compiled by the DSL: a JIT run) with its own split-KV heuristic and packed GQA."""
        kv = bf16_pairs((batch, ctx, hkv, d))
        try:
            from flash_attn import flash_attn_with_kvcache
        except ImportError:
            from flash_attn.cute import flash_attn_func  # ImportError: neither is installed

            # FA4 has no split-KV on SM90 (it asserts): its heuristic where that works, else one split
            splits = 0
            try:
                flash_attn_func(q.unsqueeze(1), *kv[0], num_splits=0, pack_gqa=True)
            except AssertionError:
                splits = 1

            def call(i):
                k, v = kv[i % len(kv)]
                return flash_attn_func(q.unsqueeze(1), k, v, num_splits=splits, pack_gqa=True)[0]  # (out, lse)
            return call, read["bf16"], "fa4" + (" s1" if splits else "")
        seqlens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)

        def call(i):
            k, v = kv[i % len(kv)]
            return flash_attn_with_kvcache(q.unsqueeze(1), k, v, cache_seqlens=seqlens)
        return call, read["bf16"], ""

    builders = {"futx int4 rot": futx("int4")}
    for v in BENCH_VARIANTS:
        builders[f"futx int4 rot [{v}]"] = futx("int4", v)
    builders.update({"futx e4m3 rot": futx("e4m3"), "futx bf16": futx("bf16"),
                     "torch sdpa (compact bf16)": sdpa_build, "flash-attn kvcache": flash_build})
    return {k: builders[k] for k in _labels(model, ablate)}


def _cuda_dead() -> bool:
    import torch

    try:
        torch.cuda.synchronize()
        return False
    except Exception:  # noqa: BLE001 - a sticky error (illegal address, ...) poisons the context
        return True


def bench_point(model, batch, ctx, rounds, min_calls, ablate, skip, progress):
    import torch

    graphs, meta, failed = {}, {}, {}
    # A graph only records addresses: the buffers its calls use must outlive it. (Letting them go with the
    # closure, as the first version did, freed them; the next capture's empty_cache() unmapped them and
    # the first replay hit an illegal address.)
    keep = {}
    for label, build in _candidates(model, batch, ctx, ablate).items():
        if label in skip:
            failed[label] = skip[label]
            continue
        with open(progress, "w") as f:  # the parent blames this candidate if the process dies now
            json.dump({"point": [model, batch, ctx], "candidate": label}, f)
        print(f"[bench] {model} B={batch} ctx={ctx}: {label}", file=sys.stderr, flush=True)
        try:
            call, nbytes, splits = build()
            copies = max(1, min(64, math.ceil(2 * L2_BYTES / nbytes)))
            calls = max(min_calls, copies)
            out = call(0)  # eager first call: loads the kernel, surfaces faults with a name on them
            torch.cuda.synchronize()
            if not bool(torch.isfinite(out).all()):
                raise RuntimeError("non-finite output")
            keep[label] = call  # holds the caches and inputs the graph reads and writes
            graphs[label] = _graph(call, calls)
            graphs[label].replay()
            torch.cuda.synchronize()
            meta[label] = (calls, nbytes, splits)
        except ImportError as exc:
            failed[label] = f"not available ({exc.name})"
        except Exception as exc:  # noqa: BLE001 - record it and keep the other candidates
            failed[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            print(f"[bench]   failed: {failed[label]}", file=sys.stderr, flush=True)
            if _cuda_dead():
                sys.exit(3)  # the parent restarts without this candidate
    with open(progress, "w") as f:
        json.dump({"point": [model, batch, ctx], "candidate": "timing"}, f)
    times = {k: [] for k in graphs}
    keys = list(graphs)
    for r in range(rounds):
        for k in keys[r % max(1, len(keys)):] + keys[:r % max(1, len(keys))]:
            times[k].append(_time_us(graphs[k], meta[k][0]))
    rows = []
    for k in keys:
        us = statistics.median(times[k])
        calls, nbytes, splits = meta[k]
        tbs = nbytes / (us * 1e-6) / 1e12
        rows.append(dict(model=model, batch=batch, context=ctx, candidate=k, us=us, cache_mb=nbytes / 1e6,
                         floor_us=nbytes / (FLOOR_TBS * 1e12) * 1e6, tb_s=tbs, floor_frac=tbs / FLOOR_TBS,
                         spread=(max(times[k]) - min(times[k])) / us, splits=splits))
    rows += [dict(model=model, batch=batch, context=ctx, candidate=k, error=e) for k, e in failed.items()]
    del graphs, keep
    torch.cuda.empty_cache()
    return rows


def child(args) -> int:
    import faulthandler

    import futx.ops  # noqa: F401

    todo = json.loads(args.child_points)
    skip = json.loads(args.child_skip)
    for model, batch, ctx in todo:
        if time.time() > float(args.child_deadline):
            break  # out of budget: the parent lists the rest as skipped
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)  # a hung point must not hang the run
        key = f"{model}/{batch}/{ctx}"
        t_point = time.time()
        rows = bench_point(model, batch, ctx, args.rounds, args.calls, not args.no_ablation, skip.get(key, {}),
                           args.child_progress)
        faulthandler.cancel_dump_traceback_later()
        print(f"[bench] {key}: {time.time() - t_point:.1f} s", file=sys.stderr, flush=True)
        with open(args.child_results, "a") as f:
            f.write(json.dumps({"point": [model, batch, ctx], "rows": rows}) + "\n")
    return 0


# ---- parent: runs children, survives their faults ------------------------------------------------------------
def _read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def supervise(args) -> int:
    points = [(m, b, c) for m in SHAPES for b, c in POINTS]
    if args.quick:
        points = [("8B", 8, 1024), ("8B", 32, 4096), ("8B", 8, 32768)]
    t0 = time.time()
    work = tempfile.mkdtemp(prefix="bench-attn-")
    results, progress = os.path.join(work, "results.jsonl"), os.path.join(work, "progress.json")
    skip: dict[str, dict[str, str]] = {}
    rows, skipped = [], []
    for restart in range(8):
        done = {tuple(r["point"]) for r in _read_jsonl(results)}
        todo = [p for p in points if p not in done]
        if not todo:
            break
        if time.time() - t0 > args.budget_s:
            skipped += todo
            break
        cmd = [sys.executable, os.path.abspath(__file__), "--child-points", json.dumps(todo), "--child-skip",
               json.dumps(skip), "--child-results", results, "--child-progress", progress,
               "--child-deadline", str(t0 + args.budget_s), "--rounds",
               str(args.rounds), "--calls", str(args.calls), "--watchdog-s", str(args.watchdog_s)]
        cmd += ["--no-ablation"] if args.no_ablation else []
        try:
            rc = subprocess.run(cmd, timeout=max(30.0, args.budget_s - (time.time() - t0) + 60)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc == 0:
            if time.time() - t0 > args.budget_s:  # the child stopped at the deadline
                skipped += [p for p in points if p not in {tuple(r["point"]) for r in _read_jsonl(results)}]
                break
            continue
        try:
            with open(progress) as f:
                where = json.load(f)
        except (OSError, ValueError):
            print(f"[bench] child died (rc={rc}) before any point started; giving up", file=sys.stderr)
            break
        key = "/".join(map(str, where["point"]))
        why = "CUDA fault (process poisoned)" if rc == 3 else f"child died (rc={rc})"
        print(f"[bench] {key} {where['candidate']}: {why}; restarting without it", file=sys.stderr, flush=True)
        if where["candidate"] == "timing":  # the fault was not in a first call: drop the whole point
            skipped.append(tuple(where["point"]))
            points.remove(tuple(where["point"]))
        else:
            skip.setdefault(key, {})[where["candidate"]] = why
        os.remove(progress)
    for rec in _read_jsonl(results):
        rows += rec["rows"]
    elapsed = time.time() - t0
    md = table(rows)
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "bench_decode_attention.md"), "w") as f:
            f.write(md + "\n\n" + summary(rows) + "\n\n" + goal_line(rows) + "\n")
        with open(os.path.join(os.environ["OUT"], "bench_decode_attention.json"), "w") as f:
            json.dump({"rows": rows, "skipped": skipped, "floor_tb_s": FLOOR_TBS, "elapsed_s": round(elapsed, 1)},
                      f, indent=1)
    errors = [r for r in rows if "error" in r and not r["error"].startswith("not available")]
    for r in errors:
        print(f"FAILED {r['model']} B={r['batch']} ctx={r['context']} {r['candidate']}: {r['error']}")
    if skipped:
        print(f"skipped (budget or fault): {skipped}")
    print(summary(rows))
    print(f"benchmark wall time {elapsed:.0f} s")
    print(goal_line(rows))
    print(compact(rows))
    return 1 if errors or skipped else 0


SHORT = {"futx int4 rot": "int4", "futx e4m3 rot": "e4m3", "futx bf16": "bf16", "torch sdpa (compact bf16)": "sdpa",
         "flash-attn kvcache": "flash"}


def _short(candidate: str) -> str:
    if candidate.startswith("futx int4 rot ["):
        return candidate[len("futx int4 rot ["):-1]
    return SHORT.get(candidate, candidate)


def compact(rows) -> str:
    """The table printed last: one line per candidate, us / TB/s / % of the floor / speed-up vs futx BF16 and
    vs SDPA (x > 1: faster)."""
    lines = [f"{'model':5} {'B':>2} {'ctx':>5} {'cand':6} {'splits':>8} {'us':>7} {'TB/s':>5} {'%fl':>4} "
             f"{'xbf16':>5} {'xsdpa':>5}"]
    for r in rows:
        if "us" not in r:
            continue
        same = {x["candidate"]: x["us"] for x in rows if "us" in x and
                (x["model"], x["batch"], x["context"]) == (r["model"], r["batch"], r["context"])}
        lines.append(f"{r['model']:5} {r['batch']:>2} {r['context']:>5} {_short(r['candidate']):6} "
                     f"{str(r['splits']):>8} {r['us']:7.1f} {r['tb_s']:5.2f} {100 * r['floor_frac']:3.0f}% "
                     f"{same.get('futx bf16', float('nan')) / r['us']:5.2f} "
                     f"{same.get('torch sdpa (compact bf16)', float('nan')) / r['us']:5.2f}")
    return "\n".join(lines)


def goal_line(rows) -> str:
    model, batch, ctx, frac = GOAL
    got = {r["candidate"]: r for r in rows if "us" in r and (r["model"], r["batch"], r["context"]) == (model, batch, ctx)}
    if "futx int4 rot" not in got:
        return f"goal ({model} B={batch} ctx={ctx}): not measured"
    r = got["futx int4 rot"]
    need = r["floor_us"] / frac
    best = min((k for k in got if k.startswith("futx int4 rot")), key=lambda k: got[k]["us"])
    return (f"goal: INT4 >= {100 * frac:.0f}% of the floor at ({batch}, {ctx}) = <= {need:.1f} us; default "
            f"{r['us']:.1f} us ({100 * r['floor_frac']:.0f}%) -> {'MET' if r['floor_frac'] >= frac else 'missed'}; "
            f"best INT4 kernel: {_short(best)} {got[best]['us']:.1f} us ({100 * got[best]['floor_frac']:.0f}%)")


def render(path: str) -> int:
    """Markdown table, per-point summary, goal line and compact table of a finished run's JSON."""
    with open(path) as f:
        data = json.load(f)
    rows = data["rows"]
    print(table(rows))
    print()
    print(summary(rows))
    print()
    print(goal_line(rows) + (f"; benchmark wall time {data['elapsed_s']} s" if "elapsed_s" in data else ""))
    print()
    print("```\n" + compact(rows) + "\n```")
    return 0


def summary(rows) -> str:
    """One line per point: futx INT4 (and its % of the floor), the best variant, E4M3, BF16, SDPA."""
    short = {"futx int4 rot": "int4", "futx e4m3 rot": "e4m3", "futx bf16": "bf16", "torch sdpa (compact bf16)": "sdpa"}
    lines = []
    for point in dict.fromkeys((r["model"], r["batch"], r["context"]) for r in rows):
        got = {r["candidate"]: r for r in rows if (r["model"], r["batch"], r["context"]) == point and "us" in r}
        parts = [f"{short[k]} {got[k]['us']:.1f}us" + (f" ({100 * got[k]['floor_frac']:.0f}%)" if k != "torch sdpa "
                 "(compact bf16)" else "") for k in short if k in got]
        variants = [k for k in got if k.startswith("futx int4 rot [")]
        if variants:
            best = min(variants, key=lambda k: got[k]["us"])
            parts.insert(1, f"{best[15:-1]} {got[best]['us']:.1f}us")
        lines.append(f"{point[0]} B={point[1]} ctx={point[2]}: " + ", ".join(parts))
    return "\n".join(lines)


def table(rows) -> str:
    lines = ["| model | B | context | candidate | splits | us | floor us | cache MB | TB/s | % of 4.36 | vs futx bf16 "
             "| vs sdpa |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            continue
        same = [x for x in rows if (x["model"], x["batch"], x["context"]) == (r["model"], r["batch"], r["context"])
                and "us" in x]
        base = {x["candidate"]: x["us"] for x in same}
        vs_bf16 = base.get("futx bf16", float("nan")) / r["us"]
        vs_sdpa = base.get("torch sdpa (compact bf16)", float("nan")) / r["us"]
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['candidate']} | {r['splits']} | "
                     f"{r['us']:.1f} | {r['floor_us']:.1f} | {r['cache_mb']:.1f} | {r['tb_s']:.2f} | "
                     f"{100 * r['floor_frac']:.0f}% | {vs_bf16:.2f}x | {vs_sdpa:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20, help="calls per graph replay (at least)")
    ap.add_argument("--quick", action="store_true", help="8B only, three points")
    ap.add_argument("--budget-s", type=float, default=80.0, help="start no new point after this")
    ap.add_argument("--watchdog-s", type=float, default=120.0, help="abort a child if one point takes longer")
    ap.add_argument("--no-ablation", action="store_true", help="skip the tuning-space INT4 variants")
    ap.add_argument("--render", metavar="FILE.json", help="print the tables of a finished run and exit")
    for name in ("points", "skip", "results", "progress", "deadline"):  # internal: parent -> child
        ap.add_argument(f"--child-{name}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.render:
        return render(args.render)
    return child(args) if args.child_points else supervise(args)


if __name__ == "__main__":
    sys.exit(main())
