"""The prefill block (futx.engine.prefill): futx FP8/BF16 vs compiled PyTorch FP8 at the 8B and 405B layer shapes,
packed vs padded, and a whole 8B prefill of a 2048-token prompt (issue 12, part 5).

    python scripts/bench_prefill_block.py [--rounds 5] [--quick]      (GPU; writes $OUT/bench_prefill_block.{json,md})
    python scripts/bench_prefill_block.py --shape layer-405b --parts block      (the 405B layer: effective PFLOP/s)

1. One layer (preset "layer-8b", or --shape) at S = 2048, one request, CUDA-graph replay, interleaved rounds, medians
   (scripts/bench_common.time_candidates):
     futx_fp8 / futx_bf16      PrefillModel.layer: QKV (+RoPE, K/V into the BF16 cache) -> prefill attention ->
                               O (+residual, RMS partials) -> gate/up (+SwiGLU; FP8: E4M3 out, delayed scale) ->
                               down (+residual, RMS partials); glue "eager" and "compiled" (per-row FP8
                               quantization of the activations fused by torch.compile)
     torch_fp8                 torch.compile of the same block: per-row dynamic E4M3 quantization,
                               torch._scaled_mm row-wise (fast accumulation), rho, RoPE, K/V index_put into the
                               cache, SDPA (causal, GQA), residuals, RMSNorm factors, SwiGLU, per-tensor E4M3 of
                               its output (current scaling)
   The decode mirror is not written here (cache "bf16"); its cost is in part 3.
2. Packed vs padded, one 8B layer, requests 1 x 2048 + 7 x 128 (2944 rows packed, 16384 padded).
3. The whole 8B model (32 layers, random weights drawn in the kernel format): a 2048-token prompt, embedding to
   the last position's logits, eager and as one CUDA graph, with the INT4 mirror written (decode-ready) and
   with a BF16 cache (no mirror); ms and tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import arm_watchdog, disarm_watchdog, gpu_info, out_dir, time_candidates, write_json  # noqa: E402


def random_prefill(cfg, fmt: str, layers: int, device="cuda", seed: int = 0):
    """PrefillWeights with random projections (about unit-RMS activations) drawn directly in `fmt`."""
    from futx.engine.prefill import PrefillLayer, PrefillWeights, _quantize

    gen = torch.Generator(device=device).manual_seed(seed)
    h, i = cfg.hidden_size, cfg.intermediate_size

    def one(n, k):
        return _quantize(torch.randn(n, k, generator=gen, device=device) / k ** 0.5, fmt)

    ls = [PrefillLayer(one(cfg.qkv_size, h), one(h, cfg.q_size), one(2 * i, h), one(h, i)) for _ in range(layers)]
    embed = torch.randn(cfg.vocab_size, h, generator=gen, device=device).to(torch.bfloat16)
    head = (torch.randn(cfg.vocab_size, h, generator=gen, device=device) * 0.02).to(torch.bfloat16)
    return PrefillWeights(cfg.replace(num_hidden_layers=layers), fmt, embed, torch.ones(h, device=device), head, ls)


def block_setup(cfg, fmt, lengths, padded=False, glue="eager", cache_fmt="bf16", seed=0):
    """(PrefillModel, zero-argument layer call) for one layer on requests of `lengths`."""
    from futx.engine.cache import EngineCache
    from futx.engine.prefill import PrefillModel
    from futx.reference.batch import PackedBatch

    cfg = cfg.replace(vocab_size=2048)   # the block does not touch the vocabulary: keep the embedding small
    w = random_prefill(cfg, fmt, 1, seed=seed)
    cap = max(lengths)
    cache = EngineCache(w.config, cache_fmt, len(lengths), cap, "cuda")
    pm = PrefillModel(w, cache, "kernels", glue=glue)
    rows_n = [cap] * len(lengths) if padded else list(lengths)
    batch = PackedBatch.from_lengths(rows_n, device="cuda")
    toks = torch.randint(0, cfg.vocab_size, (sum(rows_n),), device="cuda")
    rows = pm._rows(toks, batch)
    x = pm.weights.embed[toks]
    rho = torch.rsqrt(x.float().pow(2).mean(-1) + cfg.rms_norm_eps)
    st = pm.state(0) if fmt == "e4m3" else None
    pm.layer(0, x, rho, rows, st)   # calibrates the SwiGLU scale outside any capture
    torch.cuda.synchronize()
    return pm, (lambda: pm.layer(0, x, rho, rows, st))


def torch_fp8_block(cfg, s: int, seed=0, gqa: bool = True):
    """A zero-argument call of the compiled PyTorch FP8 block (one request of s tokens, start 0)."""
    import torch.nn.functional as F

    from futx.rope import inv_freq

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(seed)
    h, i, hq, hkv, d = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                        cfg.head_dim)
    e4, mx = torch.float8_e4m3fn, 448.0

    def wq(n, k):
        w = torch.randn(n, k, generator=gen, device=dev) / k ** 0.5
        sc = w.abs().amax(1, keepdim=True) / mx
        return (w / sc).to(e4), sc.view(1, -1).float()

    wqkv, sqkv = wq(cfg.qkv_size, h)
    wo, so = wq(h, cfg.q_size)
    wgu, sgu = wq(2 * i, h)      # [gate; up] halves
    wd, sd = wq(h, i)
    k_cache = torch.zeros(1, hkv, s, d, dtype=torch.bfloat16, device=dev)
    v_cache = torch.zeros_like(k_cache)
    pos = torch.arange(s, device=dev)
    ang = pos[:, None].double() * inv_freq(cfg).to(dev)[None, :]
    cos, sin = ang.cos().float(), ang.sin().float()
    eps = cfg.rms_norm_eps

    def quant_rows(t):
        amax = t.float().abs().amax(1, keepdim=True).clamp_min(1e-12)
        sc = amax / mx
        return (t.float() / sc).clamp(-mx, mx).to(e4), sc

    def mm(a8, sa, w8, sw):
        return torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True)

    def rope(t):   # [S, heads, D] float32
        half = d // 2
        a, b = t[..., :half], t[..., half:]
        c, sn = cos[:, None, :], sin[:, None, :]
        return torch.cat([a * c - b * sn, b * c + a * sn], -1)

    def block(x):
        rho = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        x8, sx = quant_rows(x)
        y = mm(x8, sx, wqkv, sqkv).float() * rho
        y = y.view(s, hq + 2 * hkv, d)
        q = rope(y[:, :hq]).to(torch.bfloat16)
        k = rope(y[:, hq:hq + hkv]).to(torch.bfloat16)
        v = y[:, hq + hkv:].to(torch.bfloat16)
        k_cache[0, :, :s] = k.transpose(0, 1)
        v_cache[0, :, :s] = v.transpose(0, 1)
        kk, vv = k_cache[:, :, :s], v_cache[:, :, :s]
        if not gqa:
            kk, vv = kk.repeat_interleave(hq // hkv, 1), vv.repeat_interleave(hq // hkv, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk, vv, is_causal=True, enable_gqa=gqa)
        o = o[0].transpose(0, 1).reshape(s, hq * d)
        o8, so_ = quant_rows(o)
        x = (mm(o8, so_, wo, so).float() + x.float()).to(torch.bfloat16)
        rho = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        x8, sx = quant_rows(x)
        gu = mm(x8, sx, wgu, sgu).float() * rho
        z = F.silu(gu[:, :i]) * gu[:, i:]
        zs = (z.abs().amax() / mx).clamp_min(1e-12)
        z8 = (z / zs).clamp(-mx, mx).to(e4)
        x = (mm(z8, zs.expand(s, 1).contiguous(), wd, sd).float() + x.float()).to(torch.bfloat16)
        return x

    fn = torch.compile(block, dynamic=False)
    x0 = torch.randn(s, h, generator=gen, device=dev).to(torch.bfloat16)
    for _ in range(3):
        fn(x0)
    torch.cuda.synchronize()
    return lambda: fn(x0)


def whole_model(fmt: str, s: int, rounds: int):
    """Whole 8B prefill of one s-token prompt, eager and as a CUDA graph, with an INT4 cache (mirror written) and
    a BF16 one."""
    from futx.config import preset
    from futx.engine.cache import EngineCache
    from futx.engine.prefill import PrefillModel
    from futx.reference import rms_norm
    from futx.reference.batch import PackedBatch

    cfg = preset("llama-3.1-8b")
    w = random_prefill(cfg, fmt, cfg.num_hidden_layers)
    toks = torch.randint(0, cfg.vocab_size, (s,), device="cuda")
    batch = PackedBatch.from_lengths([s], device="cuda")
    res = {}
    for cache_fmt in ("int4", "bf16"):
        pm = PrefillModel(w, EngineCache(cfg, cache_fmt, 1, s, "cuda"), "kernels")
        pm.forward(toks, batch, want_logits=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            pm.forward(toks, batch, want_logits=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        ms = 1e3 * statistics.median(times)
        res[f"eager_{cache_fmt}"] = {"ms": ms, "tokens_per_s": s / ms * 1e3, "mirror": cache_fmt != "bf16"}
        rows = pm._rows(toks, batch)
        last = torch.tensor([s - 1], device="cuda")

        def run():
            x = pm._run(toks, rows, 0)[last]
            return rms_norm(x, pm.weights.final_norm.to(torch.bfloat16), cfg.rms_norm_eps) @ pm.weights.lm_head.T

        t = time_candidates({"graph": run}, rounds=rounds, target_ms=50.0, max_reps=3)["graph"]
        if "us" in t:
            res[f"graph_{cache_fmt}"] = {"ms": t["us"] / 1e3, "tokens_per_s": s / t["us"] * 1e6, "mode": t["mode"],
                                         "spread": t["spread"], "mirror": cache_fmt != "bf16"}
        else:
            res[f"graph_{cache_fmt}"] = t
        del pm
        torch.cuda.empty_cache()
    del w
    torch.cuda.empty_cache()
    return res


def _routed(rule: str, fn):
    """fn called with the prefill GEMM rule picking from the variants of `rule` (captured that way in a graph)."""
    from futx.runtime.catalog.prefill import route_variants

    def call():
        route_variants(tuple(rule.split(",")))
        try:
            return fn()
        finally:
            route_variants(None)
    return call


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="skip the whole-model BF16 run")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--shape", default="layer-8b", help="layer preset of part 1 (layer-8b, layer-405b)")
    p.add_argument("--parts", default="block,packed,whole", help="comma-separated subset of block,packed,whole")
    p.add_argument("--rule", action="append", default=[], metavar="V1,V2,...",
                   help="also time the FP8 and BF16 blocks with the GEMM rule picking from these variants only "
                        "(repeatable; candidates futx_<fmt>_<glue>@<variants>)")
    p.add_argument("--no-peer", action="store_true", help="skip the compiled PyTorch block (its compile is slow)")
    p.add_argument("--glues", default="eager,kernel,compiled", help="FP8 block glues timed (subset)")
    args = p.parse_args()
    from futx.config import preset

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = preset(args.shape)
    parts = set(args.parts.split(","))
    s = args.seq
    results = {"info": gpu_info(), "seq": s, "shape": args.shape, "block": {},
               "packed_vs_padded": None, "whole_8b": {}}
    layer_flops = 2 * s * (cfg.qkv_size * cfg.hidden_size + cfg.hidden_size * cfg.q_size
                           + 3 * cfg.intermediate_size * cfg.hidden_size) \
        + 2 * 2 * cfg.num_attention_heads * cfg.head_dim * s * s / 2

    # 1. block at S = 2048
    arm_watchdog(900)
    cands = {}
    for fmt in (("e4m3", "bf16") if "block" in parts else ()):
        for glue in (tuple(args.glues.split(",")) if fmt == "e4m3" else ("eager",)):
            try:
                _, fn = block_setup(cfg, fmt, [s], glue=glue)
                cands[f"futx_{'fp8' if fmt == 'e4m3' else 'bf16'}_{glue}"] = fn
                for rule in args.rule:
                    cands[f"futx_{'fp8' if fmt == 'e4m3' else 'bf16'}_{glue}@{rule}"] = _routed(rule, fn)
            except Exception as exc:  # noqa: BLE001
                results.setdefault("errors", {})[f"futx_{fmt}_{glue}"] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"futx {fmt} {glue}: {exc}", file=sys.stderr)
    for gqa in ((True, False) if "block" in parts and not args.no_peer else ()):   # SDPA's enable_gqa, else K/V repeated per query head
        try:
            cands["torch_fp8_compiled"] = torch_fp8_block(cfg, s, gqa=gqa)
            results["torch_sdpa_gqa"] = gqa
            break
        except Exception as exc:  # noqa: BLE001
            results.setdefault("errors", {})[f"torch_fp8_compiled_gqa{gqa}"] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"torch block (gqa={gqa}): {exc}", file=sys.stderr)
    if cands:
        results["block"] = time_candidates(cands, flops=layer_flops, rounds=args.rounds, target_ms=10.0)
        results["layer_flops"] = layer_flops
    del cands
    torch.cuda.empty_cache()
    print("block", {k: round(v.get("us", float("nan")), 1) for k, v in results["block"].items()}, file=sys.stderr)

    # 2. packed vs padded: 1 x 2048 + 7 x 128
    lengths = [s] + [s // 16] * 7
    cands = {}
    for fmt in (("e4m3", "bf16") if "packed" in parts else ()):
        for padded in (False, True):
            try:
                _, fn = block_setup(cfg, fmt, lengths, padded=padded, glue="compiled" if fmt == "e4m3" else "eager")
                cands[f"{fmt}_{'padded' if padded else 'packed'}"] = fn
            except Exception as exc:  # noqa: BLE001
                results.setdefault("errors", {})[f"{fmt}_padded{padded}"] = f"{type(exc).__name__}: {exc}"[:300]
    if cands:
        results["packed_vs_padded"] = {"lengths": lengths, "rows_packed": sum(lengths),
                                       "rows_padded": len(lengths) * s,
                                       "times": time_candidates(cands, rounds=args.rounds, target_ms=10.0)}
    del cands
    torch.cuda.empty_cache()

    # 3. whole 8B prefill
    for fmt in (() if "whole" not in parts else ("e4m3",) if args.quick else ("e4m3", "bf16")):
        try:
            results["whole_8b"][fmt] = whole_model(fmt, s, args.rounds)
        except Exception as exc:  # noqa: BLE001
            results["whole_8b"][fmt] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print("whole", fmt, results["whole_8b"][fmt], file=sys.stderr)
    disarm_watchdog()

    md = render(results)
    print(md)
    d = out_dir()
    if d is not None:
        write_json(d / "bench_prefill_block.json", results)
        (d / "bench_prefill_block.md").write_text(md)
    return 0


def render(r: dict) -> str:
    def us(t):
        return f"{t['us']:.1f}" if "us" in t else t.get("error", "?")

    lines = [f"# Prefill block, S = {r['seq']} ({r['info'].get('gpu')}, torch {r['info'].get('torch')})", "",
             f"## One layer ({r['shape']}), one request, CUDA graphs, median µs", "",
             "| Candidate | µs | TFLOP/s | spread | mode |", "| --- | --- | --- | --- | --- |"]
    for k, t in r["block"].items():
        lines.append(f"| {k} | {us(t)} | {t.get('tflops', float('nan')):.0f} | {t.get('spread', float('nan')):.2f} "
                     f"| {t.get('mode', '-')} |")
    base = r["block"].get("torch_fp8_compiled", {}).get("us")
    if base:
        for k, t in r["block"].items():
            if "us" in t and k.startswith("futx"):
                lines.append(f"\n{k} vs compiled PyTorch FP8: {base / t['us']:.2f}x")
    pv = r["packed_vs_padded"]
    lines += [] if not pv else ["", f"## Packed vs padded, lengths 1 x {pv['lengths'][0]} + 7 x {pv['lengths'][1]} "
              f"({pv['rows_packed']} vs {pv['rows_padded']} rows), one layer, µs", "",
              "| Format | packed | padded | speedup |", "| --- | --- | --- | --- |"]
    for fmt in (("e4m3", "bf16") if pv else ()):
        a, b = pv["times"].get(f"{fmt}_packed", {}), pv["times"].get(f"{fmt}_padded", {})
        sp = f"{b['us'] / a['us']:.2f}x" if "us" in a and "us" in b else "-"
        lines.append(f"| {fmt} | {us(a) if a else '-'} | {us(b) if b else '-'} | {sp} |")
    lines += [] if not r["whole_8b"] else [
        "", f"## Whole 8B prefill of a {r['seq']}-token prompt (32 layers, logits of the last position)", "",
        "| Format | run | ms | tokens/s |", "| --- | --- | --- | --- |"]
    for fmt, res in r["whole_8b"].items():
        if "error" in res:
            lines.append(f"| {fmt} | error | {res['error']} | |")
            continue
        for k, t in res.items():
            if "ms" in t:
                lines.append(f"| {fmt} | {k} | {t['ms']:.2f} | {t['tokens_per_s']:.0f} |")
            else:
                lines.append(f"| {fmt} | {k} | {t.get('error', '?')} | |")
    if r.get("errors"):
        lines += ["", "Errors: " + "; ".join(f"{k}: {v}" for k, v in r["errors"].items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
