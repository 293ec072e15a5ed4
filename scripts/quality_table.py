"""Quantization quality of the simulated-quantization model (docs/results.md, "Quantization quality").

Subcommands (all CPU-capable, float32, windows batched, decode in exact chunks):
  ppl       perplexity + KL divergence and top-1 agreement vs the BF16 model, per configuration
            "protocol:prefill/decode:cache", results appended to a JSON-lines file
  layers    per-layer relative RMS error of INT4 decode blocks (independent and cascaded)
  outliers  synthetic cache study: random K/V, four K channels per head x8, INT4 with/without rotation, E4M3
  origin    how SmolLM2's own Q4_1 grid (groups of 32) meets the INT4 g64 and E4M3 formats
  render    Markdown tables from the JSON-lines files

Example (docs/results.md lists the exact commands of the recorded subset):
  python -m futx.quant.gptq --out runs/gptq-g64.safetensors --group-size 64 --windows 16 --seq-len 512
  python scripts/quality_table.py ppl --windows 4 --gptq runs/gptq-g64.safetensors --out runs/ppl.jsonl
  python scripts/quality_table.py render --ppl runs/ppl.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from futx.eval import Runner, join_rows, make_windows, read_rows  # noqa: E402
from futx.kvcache import KVCache  # noqa: E402
from futx.quant import gptq  # noqa: E402
from futx.quant.kv_mirror import CacheMirror  # noqa: E402
from futx.quant.formats import cache_format  # noqa: E402
from futx.quant.simulated import quantized_weights  # noqa: E402
from futx.reference import PackedBatch, block  # noqa: E402
from futx.rope import cos_sin  # noqa: E402

TEST_TEXT = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"
DEFAULT_CONFIGS = [
    # all-decode: weights x cache
    *[f"all-decode:bf16/{w}:{c}" for w in ("bf16", "e4m3", "int4-rtn", "int4-gptq")
      for c in ("bf16", "int4", "int4-unrotated")],
    "all-decode:bf16/bf16:e4m3", "all-decode:bf16/int4-gptq:e4m3",
    # serving: prefill / decode weights x cache
    "serving:bf16/bf16:bf16", "serving:bf16/bf16:int4", "serving:bf16/e4m3:bf16", "serving:bf16/int4-rtn:bf16",
    "serving:bf16/int4-gptq:bf16", "serving:bf16/int4-gptq:int4", "serving:e4m3/bf16:bf16",
    "serving:e4m3/e4m3:bf16", "serving:e4m3/int4-gptq:bf16", "serving:e4m3/int4-gptq:int4",
]


class Models:
    """Quantized weight sets, built once per format and reused across configurations."""

    def __init__(self, weights, group_size: int, gptq_path: str | None):
        self.base, self.group_size, self.cache = weights, group_size, {}
        self.gptq = gptq.load(gptq_path) if gptq_path else None

    def get(self, name: str):
        if name not in self.cache:
            if name == "int4-gptq":
                if self.gptq is None:
                    raise ValueError("int4-gptq needs --gptq FILE (python -m futx.quant.gptq --out FILE)")
                self.cache[name] = quantized_weights(self.base, "int4", self.group_size, self.gptq)
            else:
                self.cache[name] = quantized_weights(self.base, name.replace("-rtn", ""), self.group_size)
        return self.cache[name]


def parse_config(spec: str):
    try:
        protocol, weights, cache = spec.split(":")
        prefill, decode = weights.split("/")
    except ValueError:
        raise ValueError(f"bad configuration {spec!r}: expected protocol:prefill/decode:cache") from None
    if protocol not in ("all-decode", "serving"):
        raise ValueError(f"bad protocol in {spec!r}: all-decode or serving")
    if prefill not in ("bf16", "e4m3") or decode not in ("bf16", "e4m3", "int4-rtn", "int4-gptq"):
        raise ValueError(f"bad weights in {spec!r}: prefill bf16|e4m3, decode bf16|e4m3|int4-rtn|int4-gptq")
    cache_format(cache)
    return protocol, prefill, decode, cache


def scored_logprobs(runner: Runner, tokens: torch.Tensor, protocol: str, chunk: int):
    """Yield (log-probs [rows, V] float32, targets [rows]) of the scored positions of windows [B, W]."""
    b, w = tokens.shape
    cache = runner.new_cache(b, w)
    head = runner.decode_weights.output_weight
    start = 0
    if protocol == "serving":
        start = w // 2
        runner.prefill(tokens[:, :start].reshape(-1), PackedBatch.from_lengths([start] * b), cache)
    elif protocol != "all-decode":
        raise ValueError(f"protocol {protocol!r}: this script runs all-decode and serving")
    for s in range(start, w - 1, chunk):
        e = min(s + chunk, w - 1)
        hidden = runner.decode(tokens[:, s:e].reshape(-1), PackedBatch.from_lengths([e - s] * b, [s] * b), cache)
        yield (hidden @ head.T).float().log_softmax(-1), tokens[:, s + 1:e + 1].reshape(-1)


def cmd_ppl(a) -> None:
    from futx.checkpoint import load
    from futx.tokenizer import load_tokenizer

    weights = load(a.model)
    ids = load_tokenizer(a.model).encode(join_rows(read_rows(a.text)))
    windows = make_windows(ids, a.window, None if a.windows is None else a.first + a.windows)[a.first:]
    models = Models(weights, a.group_size, a.gptq)
    configs = [parse_config(c) for c in (a.configs.split(",") if a.configs else DEFAULT_CONFIGS)]
    for protocol in {c[0] for c in configs}:  # the BF16 model of each protocol runs first: KL/top-1 reference
        if (protocol, "bf16", "bf16", "bf16") not in configs:
            configs.append((protocol, "bf16", "bf16", "bf16"))
    configs.sort(key=lambda c: (c[0], c[1:] != ("bf16", "bf16", "bf16")))
    baseline: dict[str, list[torch.Tensor]] = {}
    out = Path(a.out)
    for protocol, prefill, decode, cache in configs:
        is_base = (prefill, decode, cache) == ("bf16", "bf16", "bf16")
        t0 = time.time()
        runner = Runner(models.get(prefill), models.get(decode), mirror=cache_format(cache).mirror())
        nll = kl = agree = rows = 0.0
        stored = baseline.setdefault(protocol, []) if is_base else None
        ref = iter(baseline[protocol])
        for i in range(0, windows.shape[0], a.batch):
            for logp, tgt in scored_logprobs(runner, windows[i:i + a.batch], protocol, a.chunk):
                if is_base:
                    stored.append(logp)
                base = logp if is_base else next(ref)
                nll += float(-logp.gather(1, tgt[:, None]).double().sum())
                kl += float((base.exp() * (base - logp)).sum(-1).double().sum())
                agree += float((base.argmax(-1) == logp.argmax(-1)).sum())
                rows += tgt.numel()
        row = {"config": f"{protocol}:{prefill}/{decode}:{cache}", "protocol": protocol, "prefill": prefill,
               "decode": decode, "cache": cache, "first_window": a.first, "windows": int(windows.shape[0]),
               "window": a.window, "nll_sum": nll, "kl_sum": kl, "top1_sum": agree,
               "tokens": int(rows), "ppl": math.exp(nll / rows), "kl": kl / rows, "top1": agree / rows,
               "group_size": a.group_size, "seconds": round(time.time() - t0, 1)}
        print(json.dumps(row), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


# ---- per-layer errors ------------------------------------------------------------------------------
def _stack(config, layers, tokens, phase, cache, embed):
    """Residual stream entering and leaving every block: list of [M, H] (own loop to expose each layer)."""
    b, w = tokens.shape
    batch = PackedBatch.from_lengths([w] * b)
    rope = cos_sin(config, batch.row_position, torch.float32)
    x = embed[tokens.reshape(-1)]
    states = [x]
    for i, layer in enumerate(layers):
        x = block(config, layer, i, x, batch, cache, phase, rope)
        states.append(x)
    return states


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def cmd_layers(a) -> None:
    from futx.checkpoint import load
    from futx.tokenizer import load_tokenizer

    weights = load(a.model)
    config = weights.config
    ids = load_tokenizer(a.model).encode(join_rows(read_rows(a.text)))
    models = Models(weights, a.group_size, a.gptq)
    sets = {"bf16": models.get("bf16"), "rtn": models.get("int4-rtn"), "gptq": models.get("int4-gptq")}
    layers = [int(x) for x in a.layers.split(",")]
    result = {"independent": {}, "cascaded": {}}
    one = config.replace(num_hidden_layers=1)
    with torch.no_grad():
        # independent: BF16 inputs to the layer, 512-token BF16 prefill, then 4 decode tokens per layer
        seq = torch.tensor(ids[:a.prefill + 4])[None]
        states = _stack(config, sets["bf16"].layers, seq, "prefill", KVCache(config, 1, seq.shape[1]),
                        sets["bf16"].embed)
        pre = PackedBatch.from_lengths([a.prefill])
        dec = PackedBatch.from_lengths([4], [a.prefill])
        rope_p = cos_sin(config, pre.row_position, torch.float32)
        rope_d = cos_sin(config, dec.row_position, torch.float32)
        for i in layers:
            x = states[i]
            cache = KVCache(one, 1, a.prefill + 4)
            block(one, sets["bf16"].layers[i], 0, x[:a.prefill], pre, cache, "prefill", rope_p)
            upd = {}
            for name in ("bf16", "rtn", "gptq"):
                upd[name] = block(one, sets[name].layers[i], 0, x[a.prefill:], dec, cache, "decode", rope_d) \
                    - x[a.prefill:]
            result["independent"][i] = {n: _rel(upd[n], upd["bf16"]) for n in ("rtn", "gptq")}
        # cascaded: each stack decodes windows with its own residual stream and (BF16) cache
        win = make_windows(ids, a.window, a.cascade_windows)
        lo = a.window // 2
        streams = {}
        for name in ("bf16", "rtn", "gptq"):
            cache = KVCache(config, win.shape[0], a.window, mirror=CacheMirror("bf16"))
            st = _stack(config, sets[name].layers, win, "decode", cache, sets[name].embed)
            streams[name] = [s.view(win.shape[0], a.window, -1)[:, lo:] for s in st[1:]]
        for i in layers:
            result["cascaded"][i] = {n: _rel(streams[n][i], streams["bf16"][i]) for n in ("rtn", "gptq")}
    print(json.dumps(result))
    Path(a.out).write_text(json.dumps(result, indent=1))


# ---- synthetic outlier study -------------------------------------------------------------------------
def cmd_outliers(a) -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = {"8B (32/8 heads, D=128)": (32, 8, 128), "1B (32/8 heads, D=64)": (32, 8, 64),
              "SmolLM2 (9/3 heads, D=64)": (9, 3, 64)}
    rows = {}
    for label, (hq, hkv, d) in shapes.items():
        t = a.tokens
        q = torch.randn(hq, d, generator=gen, dtype=torch.float64)
        k = torch.randn(hkv, t, d, generator=gen, dtype=torch.float64)
        v = torch.randn(hkv, t, d, generator=gen, dtype=torch.float64)
        k_out = k.clone()
        for h in range(hkv):  # four K channels per head scaled x8
            k_out[h, :, torch.randperm(d, generator=gen)[:4]] *= 8

        def attend(kk, vv):
            qg = q.view(hkv, hq // hkv, d)
            return torch.softmax(qg @ kk.transpose(1, 2) / d ** 0.5, -1) @ vv

        res = {}
        for name, kk, mirror in (("E4M3 cache", k, CacheMirror("e4m3")),
                                 ("INT4 cache (rotated)", k, CacheMirror("int4", rotate=True)),
                                 ("INT4 cache, unrotated", k, CacheMirror("int4")),
                                 ("E4M3 cache, channel outliers", k_out, CacheMirror("e4m3")),
                                 ("INT4 cache, channel outliers, no rotation", k_out, CacheMirror("int4")),
                                 ("INT4 cache, channel outliers, Hadamard rotation", k_out,
                                  CacheMirror("int4", rotate=True))):
            ref = attend(kk, v)
            ke, ve = mirror(0, kk.float(), v.float())
            res[name] = 100 * _rel(attend(ke.double(), ve.double()), ref)
        rows[label] = res
    print(json.dumps(rows, indent=1))
    Path(a.out).write_text(json.dumps(rows, indent=1))


# ---- SmolLM2's Q4_1 origin ------------------------------------------------------------------------
def cmd_origin(a) -> None:
    """How the checkpoint's own 4-bit grid (GGUF Q4_1, groups of 32) meets our formats, per projection."""
    from futx.checkpoint import load
    from futx.quant.fold import fold_layer
    from futx.quant.fp8 import fake_quantize_e4m3
    from futx.quant.int4 import fake_quantize_int4

    weights = load(a.model)
    gen = torch.Generator().manual_seed(0)
    res = {}
    for i in [int(x) for x in a.layers.split(",")]:
        raw, folded = weights.layers[i], fold_layer(weights.layers[i])
        for f in gptq.PROJECTIONS:
            w, wf = getattr(raw, f), getattr(folded, f)
            groups = w.reshape(-1, 32)
            levels = max(len(torch.unique(g)) for g in groups[:: max(1, groups.shape[0] // 256)])
            gauss = torch.randn(w.shape, generator=gen) * w.std(dim=1, keepdim=True)  # a continuous stand-in

            def rel(x, fq):
                return 100 * float((fq(x) - x).norm() / x.norm())

            res[f"layers.{i}.{f}"] = {
                "max levels per 32-group (raw)": levels,
                "int4 g64 err % (folded, as used)": rel(wf, lambda x: fake_quantize_int4(x, a.group_size)),
                "int4 g64 err % (raw Q4_1 values)": rel(w, lambda x: fake_quantize_int4(x, a.group_size)),
                "int4 g64 err % (Gaussian, same row std)": rel(gauss, lambda x: fake_quantize_int4(x, a.group_size)),
                "e4m3 err % (folded)": rel(wf, fake_quantize_e4m3),
                "e4m3 err % (Gaussian)": rel(gauss, fake_quantize_e4m3)}
    print(json.dumps(res, indent=1))
    Path(a.out).write_text(json.dumps(res, indent=1))


# ---- Markdown ----------------------------------------------------------------------------------------
def combine(rows: list[dict]) -> dict[str, dict]:
    """Per configuration: token-weighted totals over runs on disjoint window ranges (a rerun replaces)."""
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


def cmd_render(a) -> None:
    rows = combine([json.loads(line) for line in Path(a.ppl).read_text().splitlines() if line.strip()])
    base = {p: rows.get(f"{p}:bf16/bf16:bf16") for p in ("all-decode", "serving")}
    print("| protocol | prefill / decode weights | cache | perplexity | vs BF16 | KL (nats/token) | top-1 agree | "
          "windows | scored tokens |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in sorted(rows.values(), key=lambda r: (r["protocol"], r["prefill"], r["decode"], r["cache"])):
        b = base.get(r["protocol"])
        same = b is not None and sorted(b["ranges"]) == sorted(r["ranges"])
        delta = f"{r['ppl'] - b['ppl']:+.3f}" if same else "-"
        print(f"| {r['protocol']} | {r['prefill']} / {r['decode']} | {r['cache']} | {r['ppl']:.3f} | {delta} | "
              f"{r['kl']:.4f} | {100 * r['top1']:.1f}% | {r['windows']} | {r['tokens']} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default="smollm2-135m")
    common.add_argument("--text", default=str(TEST_TEXT))
    common.add_argument("--group-size", type=int, default=64)
    common.add_argument("--gptq", default=None, help="INT4 GPTQ file from python -m futx.quant.gptq")
    common.add_argument("--window", type=int, default=2048)
    s = sub.add_parser("ppl", parents=[common])
    s.add_argument("--first", type=int, default=0, help="index of the first window (runs can be combined)")
    s.add_argument("--windows", type=int, default=None, help="number of windows (default: all from --first)")
    s.add_argument("--batch", type=int, default=2)
    s.add_argument("--chunk", type=int, default=512, help="decode chunk (exactly equivalent to token by token)")
    s.add_argument("--configs", default=None, help="comma-separated protocol:prefill/decode:cache (default: table)")
    s.add_argument("--out", required=True)
    s = sub.add_parser("layers", parents=[common])
    s.add_argument("--layers", default="0,1,2,4,8,15,24,29")
    s.add_argument("--prefill", type=int, default=512)
    s.add_argument("--cascade-windows", type=int, default=1)
    s.add_argument("--out", required=True)
    s = sub.add_parser("outliers")
    s.add_argument("--tokens", type=int, default=1024)
    s.add_argument("--out", required=True)
    s = sub.add_parser("origin", parents=[common])
    s.add_argument("--layers", default="0,15,29")
    s.add_argument("--out", required=True)
    s = sub.add_parser("render")
    s.add_argument("--ppl", required=True)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: no OpenMP spin-waits on a busy CPU)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    {"ppl": cmd_ppl, "layers": cmd_layers, "outliers": cmd_outliers, "origin": cmd_origin, "render": cmd_render}[a.cmd](a)


if __name__ == "__main__":
    main()
