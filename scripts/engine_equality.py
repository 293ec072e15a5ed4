"""Kernel path == simulated quantization (the paper's Tables 10-11 check), on a Hopper GPU.

For each weight x cache format (BF16, E4M3, INT4 RTN; the INT4 cache Hadamard-rotated) and protocol
(all-decode, serving), the perplexity of
  * the decode engine on futx's kernels (`futx ppl --backend kernels`: one token per step, CUDA graphs), and
  * `futx.quant.simulated` (the float32 reference with the same dequantized weights and cache mirror;
    decode in exact chunks),
on the same WikiText-2 windows, plus the plain float32 reference for the BF16/BF16 row. Rows are appended
to a JSON-lines file as they finish; `--render` prints the Markdown table for docs/results.md.

  python scripts/engine_equality.py --out eq.jsonl                  # all 147 windows, 9 formats, 2 protocols
  python scripts/engine_equality.py --render eq.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FORMATS = ("bf16", "e4m3", "int4")
PROTOCOLS = ("all-decode", "serving")


def run(a) -> None:
    import torch

    from futx.checkpoint import load
    from futx.eval.data import default_text
    from futx.engine import DecodeModel, pack_model
    from futx.engine.graphs import GraphSteps
    from futx.engine.perplexity import evaluate_engine
    from futx.eval import Runner, evaluate, join_rows, make_windows, read_rows
    from futx.eval.device import describe, setup_device
    from futx.quant.simulated import QuantSpec, quantized_weights, simulate
    from futx.tokenizer import load_tokenizer

    t_start = time.perf_counter()
    dev = setup_device("cuda")
    weights = load(a.model, device=dev)
    text = Path(a.text) if a.text else default_text()
    windows = make_windows(load_tokenizer(a.model).encode(join_rows(read_rows(text))), a.window, a.windows or None)
    where = describe(dev)
    combos = [c.split("/") for c in a.combos.split(",")] if a.combos else [(w, c) for w in FORMATS for c in FORMATS]
    protocols = a.protocols.split(",")
    prefill = quantized_weights(weights, "bf16")
    out = open(a.out, "a")

    def emit(row):
        row.update(model=weights.config.name, windows=int(windows.shape[0]), window=a.window, **where)
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(json.dumps({k: row[k] for k in ("kind", "protocol", "weights", "cache", "ppl", "seconds")
                          if k in row}), flush=True)

    with torch.inference_mode():
        if a.reference:
            for p in protocols:
                t0 = time.perf_counter()
                r = evaluate(Runner(weights), windows, p, batch_size=a.ref_batch, decode_chunk=a.chunk,
                             progress=False)
                emit(dict(kind="reference", protocol=p, weights="float32", cache="float32", ppl=r.ppl,
                          mean_nll=r.mean_nll, tokens=r.tokens, seconds=time.perf_counter() - t0))
        for wf, cf in combos:
            if a.budget_s and time.perf_counter() - t_start > a.budget_s:
                print(f"budget of {a.budget_s} s spent: stopping before {wf}/{cf}", flush=True)
                break
            sim = simulate(weights, QuantSpec(decode_weights=wf, cache=cf, group_size=a.group_size))
            runner = Runner(sim.prefill, sim.decode, mirror=sim.mirror)
            t0 = time.perf_counter()
            packed = pack_model(weights, wf, group_size=a.group_size, progress=False)
            model = DecodeModel(packed, cf, max_batch=a.batch, capacity=a.window)
            graphs = GraphSteps(model)
            t_setup = time.perf_counter() - t0
            for p in protocols:
                t0 = time.perf_counter()
                r = evaluate(runner, windows, p, batch_size=a.ref_batch, decode_chunk=a.chunk, progress=False)
                emit(dict(kind="simulated", protocol=p, weights=wf, cache=cf, ppl=r.ppl, mean_nll=r.mean_nll,
                          tokens=r.tokens, seconds=time.perf_counter() - t0))
                t0 = time.perf_counter()
                k = evaluate_engine(model, windows, p, weights, prefill_weights=prefill, graphs=graphs)
                emit(dict(kind="kernels", protocol=p, weights=wf, cache=cf, ppl=k.ppl, mean_nll=k.mean_nll,
                          tokens=k.tokens, seconds=time.perf_counter() - t0, setup_seconds=t_setup))
            del model, graphs, packed
            torch.cuda.empty_cache()
        # Where a gap comes from: on the first windows, the same engine on the emulated backend (float32 math,
        # BF16 storage at the kernel path's points) beside the kernels and the simulated model.
        sub = windows[: a.diag_windows]
        for combo in filter(None, a.diag_combos.split(",")):
            wf, cf = combo.split("/")
            sim = simulate(weights, QuantSpec(decode_weights=wf, cache=cf, group_size=a.group_size))
            runner = Runner(sim.prefill, sim.decode, mirror=sim.mirror)
            packed = pack_model(weights, wf, group_size=a.group_size, progress=False)
            for p in protocols:
                t0 = time.perf_counter()
                r = evaluate(runner, sub, p, batch_size=a.ref_batch, decode_chunk=a.chunk, progress=False)
                emit(dict(kind="diag-simulated", protocol=p, weights=wf, cache=cf, ppl=r.ppl, mean_nll=r.mean_nll,
                          tokens=r.tokens, seconds=time.perf_counter() - t0, windows_used=int(sub.shape[0])))
                for backend in ("kernels", "emulated"):
                    model = DecodeModel(packed, cf, max_batch=a.batch, capacity=a.window, backend=backend)
                    graphs = GraphSteps(model) if backend == "kernels" else None
                    t0 = time.perf_counter()
                    k = evaluate_engine(model, sub, p, weights, prefill_weights=prefill, graphs=graphs)
                    emit(dict(kind=f"diag-{backend}", protocol=p, weights=wf, cache=cf, ppl=k.ppl,
                              mean_nll=k.mean_nll, tokens=k.tokens, seconds=time.perf_counter() - t0,
                              windows_used=int(sub.shape[0])))
                    del model, graphs


def render(path: str) -> str:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    ref = {r["protocol"]: r for r in rows if r["kind"] == "reference"}
    sim = {(r["protocol"], r["weights"], r["cache"]): r for r in rows if r["kind"] == "simulated"}
    ker = {(r["protocol"], r["weights"], r["cache"]): r for r in rows if r["kind"] == "kernels"}
    lines = ["| protocol | weights | cache | kernels ppl | simulated ppl | kernels − simulated | relative | "
             "windows | scored tokens |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for key in sorted(ker, key=lambda k: (PROTOCOLS.index(k[0]), FORMATS.index(k[1]), FORMATS.index(k[2]))):
        k, s = ker[key], sim.get(key)
        if s is None:
            continue
        d = k["ppl"] - s["ppl"]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {k['ppl']:.4f} | {s['ppl']:.4f} | {d:+.4f} | "
                     f"{d / s['ppl']:+.1e} | {k['windows']} | {k['tokens']} |")
    diag = {}
    for r in rows:
        if r["kind"].startswith("diag-"):
            diag.setdefault((r["protocol"], r["weights"], r["cache"]), {})[r["kind"][5:]] = r
    if diag:
        lines += ["", "| protocol | weights | cache | windows | kernels | emulated | simulated | kernels − emulated | "
                  "emulated − simulated |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for key, d in diag.items():
            if {"kernels", "emulated", "simulated"} <= set(d):
                k, e, s_ = d["kernels"]["ppl"], d["emulated"]["ppl"], d["simulated"]["ppl"]
                lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {d['kernels']['windows_used']} | {k:.4f} | {e:.4f} | "
                             f"{s_:.4f} | {k - e:+.4f} | {e - s_:+.4f} |")
    for p, r in ref.items():
        k = ker.get((p, "bf16", "bf16"))
        if k:
            lines.append(f"\nBF16/BF16 kernels vs the float32 reference ({p}): {k['ppl']:.4f} vs {r['ppl']:.4f} "
                         f"({k['ppl'] - r['ppl']:+.4f})")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--render", default=None, help="print the table of a JSON-lines file and exit")
    p.add_argument("--model", default=None)
    p.add_argument("--text", default=None)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--windows", type=int, default=0, help="first N windows (0: all)")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--combos", default=None, help="weights/cache pairs, e.g. int4/int4,bf16/bf16 (default: all 9)")
    p.add_argument("--protocols", default=",".join(PROTOCOLS))
    p.add_argument("--batch", type=int, default=32, help="engine rows per step")
    p.add_argument("--ref-batch", type=int, default=147, help="windows per simulated-model batch")
    p.add_argument("--chunk", type=int, default=1024, help="simulated decode chunk (exact)")
    p.add_argument("--reference", action="store_true", help="also the float32 reference")
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument("--diag-combos", default="", help="weights/cache pairs to also run on the emulated backend")
    p.add_argument("--diag-windows", type=int, default=32, help="windows of the emulated comparison")
    p.add_argument("--out", default="engine_equality.jsonl")
    a = p.parse_args(argv)
    if a.render:
        print(render(a.render))
        return 0
    run(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
