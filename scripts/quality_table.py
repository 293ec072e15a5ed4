"""Quantization quality of the simulated-quantization model (docs/results.md, "Quantization quality").

Subcommands (CPU or --device cuda, float32 with TF32 off, windows batched, decode in exact chunks):
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
On a GPU (all 147 windows in one batch; decode in chunks of 1024 new tokens per window, exactly
equivalent to token-by-token decoding): add --device cuda --batch 147 (scripts/gpu/quality_gpu.sh).
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
from futx.eval.device import describe, setup_device  # noqa: E402
from futx.reference.model import tokens_checked  # noqa: E402
from futx.kvcache import KVCache  # noqa: E402
from futx.quant import gptq  # noqa: E402
from futx.quant.kv_mirror import CacheMirror  # noqa: E402
from futx.quant.formats import cache_format  # noqa: E402
from futx.quant.simulated import quantized_weights  # noqa: E402
from futx.reference import PackedBatch, block  # noqa: E402
from scripts.gpu.render_results import combine  # noqa: E402  (the one definition of combining window ranges)
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


def scored_hidden(runner: Runner, tokens: torch.Tensor, protocol: str, chunk: int):
    """Yield (final hidden states [rows, H], targets [rows]) of the scored positions of windows [B, W]."""
    b, w = tokens.shape
    dev = tokens.device
    cache = runner.new_cache(b, w)
    start = 0
    if protocol == "serving":
        start = w // 2
        runner.prefill(tokens[:, :start].reshape(-1), PackedBatch.from_lengths([start] * b, device=dev), cache)
    elif protocol != "all-decode":
        raise ValueError(f"protocol {protocol!r}: this script runs all-decode and serving")
    for s in range(start, w - 1, chunk):
        e = min(s + chunk, w - 1)
        batch = PackedBatch.from_lengths([e - s] * b, [s] * b, device=dev)
        yield runner.decode(tokens[:, s:e].reshape(-1), batch, cache), tokens[:, s + 1:e + 1].reshape(-1)


def logit_rows(dev: torch.device) -> int:
    """LM-head rows per step when scoring ([rows, V] float32 blocks, a few alive at once)."""
    return 8192 if dev.type == "cuda" else 1024


def score_rows(sums: torch.Tensor, head: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor,
               base_hidden: torch.Tensor | None, step: int) -> None:
    """Add (NLL, KL(P_base || P), top-1 agreements) of rows to `sums` (float64 [3], on the device).

    base_hidden None: this is the baseline itself (KL 0, every row agrees)."""
    for r in range(0, hidden.shape[0], step):
        logp = (hidden[r:r + step] @ head.T).float().log_softmax(-1)
        sums[0] -= logp.gather(1, targets[r:r + step, None]).double().sum()
        if base_hidden is None:
            sums[2] += logp.shape[0]
            continue
        base = (base_hidden[r:r + step] @ head.T).float().log_softmax(-1)
        sums[1] += (base.exp() * (base - logp)).sum(-1).double().sum()
        sums[2] += (base.argmax(-1) == logp.argmax(-1)).sum()


def cmd_ppl(a) -> None:
    from futx.checkpoint import load
    from futx.tokenizer import load_tokenizer

    t_start = time.time()
    dev = setup_device(a.device)
    weights = load(a.model, device=dev)
    ids = load_tokenizer(a.model).encode(join_rows(read_rows(a.text)))
    windows = make_windows(ids, a.window, None if a.windows is None else a.first + a.windows)[a.first:]
    if int(windows.max()) >= weights.config.vocab_size:
        raise ValueError("token ids exceed the model's vocabulary")
    windows = windows.to(dev)
    models = Models(weights, a.group_size, a.gptq)
    configs = [parse_config(c) for c in (a.configs.split(",") if a.configs else DEFAULT_CONFIGS)]
    for protocol in dict.fromkeys(c[0] for c in configs):  # each protocol's BF16 model: the KL/top-1 reference
        if (protocol, "bf16", "bf16", "bf16") not in configs:
            configs.append((protocol, "bf16", "bf16", "bf16"))
    # baselines first (their hidden states are kept for the KL), then the table's order
    configs.sort(key=lambda c: c[1:] != ("bf16", "bf16", "bf16"))
    baseline: dict[str, list[torch.Tensor]] = {}
    out = Path(a.out)
    where = describe(dev)
    step = logit_rows(dev)
    for protocol, prefill, decode, cache in configs:
        is_base = (prefill, decode, cache) == ("bf16", "bf16", "bf16")
        name = f"{protocol}:{prefill}/{decode}:{cache}"
        if a.budget_s is not None and not is_base and time.time() - t_start > a.budget_s:
            print(f"SKIPPED {name}: past the time budget of {a.budget_s:.0f} s", flush=True)
            continue
        if "int4-gptq" in (prefill, decode) and models.gptq is None:
            print(f"SKIPPED {name}: no --gptq file", flush=True)
            continue
        t0 = time.time()
        runner = Runner(models.get(prefill), models.get(decode), mirror=cache_format(cache).mirror())
        head = runner.decode_weights.output_weight
        sums = torch.zeros(3, dtype=torch.float64, device=dev)
        rows = 0
        stored = baseline.setdefault(protocol, []) if is_base else None
        ref = iter(baseline[protocol])
        with tokens_checked():
            for i in range(0, windows.shape[0], a.batch):
                for hidden, tgt in scored_hidden(runner, windows[i:i + a.batch], protocol, a.chunk):
                    if is_base:
                        stored.append(hidden)
                    score_rows(sums, head, hidden, tgt, None if is_base else next(ref), step)
                    rows += tgt.numel()
        nll, kl, agree = sums.tolist()
        row = {"config": name, "protocol": protocol, "prefill": prefill,
               "decode": decode, "cache": cache, "first_window": a.first, "windows": int(windows.shape[0]),
               "window": a.window, "nll_sum": nll, "kl_sum": kl, "top1_sum": agree,
               "tokens": int(rows), "ppl": math.exp(nll / rows), "kl": kl / rows, "top1": agree / rows,
               "group_size": a.group_size, "decode_mode": f"chunked({a.chunk})", "batch": a.batch,
               "gptq_file": Path(a.gptq).name if a.gptq else None, "seconds": round(time.time() - t0, 1), **where}
        print(json.dumps(row), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


# ---- per-layer errors ------------------------------------------------------------------------------
def _stack(config, layers, tokens, phase, cache, embed, keep):
    """Residual stream of windows tokens [B, W] through the blocks: {j: states[j] as [B, W, H]} for j in
    `keep`, where states[0] is the embedding and states[j] the stream after block j - 1."""
    b, w = tokens.shape
    batch = PackedBatch.from_lengths([w] * b, device=tokens.device)
    rope = cos_sin(config, batch.row_position, torch.float32)
    x = embed[tokens.reshape(-1)]
    states = {0: x.view(b, w, -1)} if 0 in keep else {}
    for i, layer in enumerate(layers):
        x = block(config, layer, i, x, batch, cache, phase, rope)
        if i + 1 in keep:
            states[i + 1] = x.view(b, w, -1)
    return states


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _add_err(acc: list, got: torch.Tensor, ref: torch.Tensor) -> None:
    """acc += [sum (got - ref)^2, sum ref^2] in float64 (relative RMS error = sqrt(acc[0] / acc[1]))."""
    acc[0] += (got - ref).double().pow(2).sum()
    acc[1] += ref.double().pow(2).sum()


def cmd_layers(a) -> None:
    """Per-layer relative RMS error of INT4 blocks (RTN and GPTQ) against the BF16 block.

    independent: layer i's *update* (output - input) for `--decode-tokens` decode tokens after a
      `--prefill`-token BF16 prefill of that layer, the input being the BF16 model's stream, over the
      first `--independent-windows` windows (defaults: 1 window, 512 + 4 tokens, as first recorded).
    cascaded: the residual stream after layer i when each stack decodes whole windows (all-decode, one
      chunk per window, BF16 cache) with its own stream, positions W/2..W-1, `--cascade-windows` windows.
    """
    from futx.checkpoint import load
    from futx.tokenizer import load_tokenizer

    dev = setup_device(a.device)
    weights = load(a.model, device=dev)
    config = weights.config
    ids = load_tokenizer(a.model).encode(join_rows(read_rows(a.text)))
    models = Models(weights, a.group_size, a.gptq)
    methods = ("rtn", "gptq") if models.gptq is not None else ("rtn",)  # without --gptq: RTN only
    sets = {"bf16": models.get("bf16"), "rtn": models.get("int4-rtn")}
    if models.gptq is not None:
        sets["gptq"] = models.get("int4-gptq")
    layers = [int(x) for x in a.layers.split(",")]
    one = config.replace(num_hidden_layers=1)
    h = config.hidden_size
    zero = lambda: [torch.zeros((), dtype=torch.float64, device=dev) for _ in range(2)]  # noqa: E731
    ind = {i: {n: zero() for n in methods} for i in layers}
    cas = {i: {n: zero() for n in methods} for i in layers}
    pre_len, dec_len = a.prefill, a.decode_tokens
    t0 = time.time()
    with torch.no_grad(), tokens_checked():
        # independent: windows cut to prefill + decode tokens (window 0 = the text's first tokens)
        seqs = make_windows(ids, a.window, a.independent_windows or None)[:, :pre_len + dec_len].to(dev)
        for s0 in range(0, seqs.shape[0], a.batch):
            seq = seqs[s0:s0 + a.batch]
            b = seq.shape[0]
            states = _stack(config, sets["bf16"].layers, seq, "prefill",
                            KVCache(config, b, seq.shape[1], device=dev), sets["bf16"].embed, set(layers))
            pre = PackedBatch.from_lengths([pre_len] * b, device=dev)
            dec = PackedBatch.from_lengths([dec_len] * b, [pre_len] * b, device=dev)
            rope_p = cos_sin(config, pre.row_position, torch.float32)
            rope_d = cos_sin(config, dec.row_position, torch.float32)
            for i in layers:
                x = states[i]
                x_pre, x_dec = x[:, :pre_len].reshape(-1, h), x[:, pre_len:].reshape(-1, h)
                cache = KVCache(one, b, seq.shape[1], device=dev)
                block(one, sets["bf16"].layers[i], 0, x_pre, pre, cache, "prefill", rope_p)
                upd = {n: block(one, sets[n].layers[i], 0, x_dec, dec, cache, "decode", rope_d) - x_dec
                       for n in sets}
                for n in methods:
                    _add_err(ind[i][n], upd[n], upd["bf16"])
            del states
        # cascaded: each stack decodes whole windows with its own residual stream and (BF16) cache
        win = make_windows(ids, a.window, a.cascade_windows or None).to(dev)
        lo = a.window // 2
        keep = {i + 1 for i in layers}  # the stream after layer i
        for s0 in range(0, win.shape[0], a.batch):
            w = win[s0:s0 + a.batch]
            ref = None
            for n in sets:
                cache = KVCache(config, w.shape[0], a.window, device=dev, mirror=CacheMirror("bf16"))
                st = {j: t[:, lo:] for j, t in _stack(config, sets[n].layers, w, "decode", cache, sets[n].embed,
                                                       keep).items()}
                if n == "bf16":
                    ref = st
                else:
                    for i in layers:
                        _add_err(cas[i][n], st[i + 1], ref[i + 1])
            del ref, st
    rel = lambda acc: math.sqrt(float(acc[0]) / float(acc[1]))  # noqa: E731
    result = {"independent": {i: {n: rel(ind[i][n]) for n in methods} for i in layers},
              "cascaded": {i: {n: rel(cas[i][n]) for n in methods} for i in layers},
              "setup": {"independent_windows": int(seqs.shape[0]), "prefill": pre_len, "decode_tokens": dec_len,
                        "cascade_windows": int(win.shape[0]), "cascade_positions": [lo, a.window],
                        "group_size": a.group_size, "gptq_file": Path(a.gptq).name if a.gptq else None,
                        "seconds": round(time.time() - t0, 1), **describe(dev)}}
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    threads = argparse.ArgumentParser(add_help=False)
    threads.add_argument("--threads", type=int, default=1,
                         help="torch CPU threads (1: no OpenMP spin-waits on a busy CPU)")
    common = argparse.ArgumentParser(add_help=False, parents=[threads])
    common.add_argument("--model", default="smollm2-135m")
    common.add_argument("--text", default=str(TEST_TEXT))
    common.add_argument("--group-size", type=int, default=64)
    common.add_argument("--gptq", default=None, help="INT4 GPTQ file from python -m futx.quant.gptq")
    common.add_argument("--window", type=int, default=2048)
    common.add_argument("--device", default="cpu", help="cpu or cuda (TF32 is turned off on CUDA)")
    s = sub.add_parser("ppl", parents=[common])
    s.add_argument("--first", type=int, default=0, help="index of the first window (runs can be combined)")
    s.add_argument("--windows", type=int, default=None, help="number of windows (default: all from --first)")
    s.add_argument("--batch", type=int, default=2)
    s.add_argument("--chunk", type=int, default=512, help="decode chunk (exactly equivalent to token by token)")
    s.add_argument("--configs", default=None, help="comma-separated protocol:prefill/decode:cache (default: table)")
    s.add_argument("--budget-s", type=float, default=None,
                   help="start no new (non-baseline) configuration after this many seconds; finished ones are saved")
    s.add_argument("--out", required=True)
    s = sub.add_parser("layers", parents=[common])
    s.add_argument("--layers", default="0,1,2,4,8,15,24,29")
    s.add_argument("--prefill", type=int, default=512, help="independent: BF16 prefill tokens")
    s.add_argument("--decode-tokens", type=int, default=4, help="independent: decode tokens measured per window")
    s.add_argument("--independent-windows", type=int, default=1, help="independent: windows (0: all)")
    s.add_argument("--cascade-windows", type=int, default=1, help="cascaded: windows (0: all)")
    s.add_argument("--batch", type=int, default=1, help="windows per forward")
    s.add_argument("--out", required=True)
    s = sub.add_parser("outliers", parents=[threads])
    s.add_argument("--tokens", type=int, default=1024)
    s.add_argument("--out", required=True)
    s = sub.add_parser("origin", parents=[common])
    s.add_argument("--layers", default="0,15,29")
    s.add_argument("--out", required=True)
    s = sub.add_parser("render", parents=[threads])
    s.add_argument("--ppl", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    {"ppl": cmd_ppl, "layers": cmd_layers, "outliers": cmd_outliers, "origin": cmd_origin, "render": cmd_render}[a.cmd](a)


if __name__ == "__main__":
    main()
