"""Prefill attention alone: futx (futx.ops.prefill_attention, reading the KV cache) vs PyTorch SDPA (flash and
cuDNN backends, causal, GQA by enable_gqa) and FlashAttention-4 (flash_attn.cute, varlen) in one process.

    python scripts/bench_prefill_attention.py [--rounds 7] [--hd 128] [--quick]

Shapes: 32 query heads / 8 KV heads, head dim 128; uniform batches S = 512, 2048, 8192 with B = 16384 / S,
and a mixed packed batch (one 2048-token prompt + seven of 128). TFLOP/s counts the causal work only:
4 * D * Hq * sum_r L_r (L_r + 1) / 2 (Q K^T and P V, the masked upper triangle excluded). Each candidate runs
as a CUDA graph of back-to-back calls (bench_common.time_candidates); candidates are interleaved round by
round and the median per call is reported. SDPA gets the requests as a padded [B, H, S, D] batch when they
have equal lengths and request by request (a Python loop, captured in the same graph) for the mixed batch.
futx reads K/V from a [slots, Hkv, capacity, D] cache (capacity = the request length), SDPA and FA4 from
compact [tokens, Hkv, D] tensors. FlashAttention-4 is measured only when `flash_attn.cute` imports.
Results go to $OUT (json + markdown) when it is set.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import gpu_info, out_dir, time_candidates, write_json  # noqa: E402

HQ, HKV = 32, 8


def causal_flops(lengths, d, hq=HQ):
    return 4.0 * d * hq * sum(n * (n + 1) / 2 for n in lengths)


def make(lengths, d, gen):
    dev = "cuda"
    m, r = sum(lengths), len(lengths)
    cap = max(lengths)
    q = torch.randn(m, HQ, d, generator=gen, device=dev).to(torch.bfloat16)
    k_cache = torch.randn(r, HKV, cap, d, generator=gen, device=dev).to(torch.bfloat16)
    v_cache = torch.randn(r, HKV, cap, d, generator=gen, device=dev).to(torch.bfloat16)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    start = torch.zeros(r, dtype=torch.int32, device=dev)
    slot = torch.arange(r, dtype=torch.int32, device=dev)
    # the same K/V, packed [M, Hkv, D] (SDPA / FA4 inputs)
    k = torch.cat([k_cache[i, :, :n].transpose(0, 1) for i, n in enumerate(lengths)]).contiguous()
    v = torch.cat([v_cache[i, :, :n].transpose(0, 1) for i, n in enumerate(lengths)]).contiguous()
    return q, k_cache, v_cache, cu, start, slot, k, v


def candidates(lengths, d, gen):
    import futx.ops  # noqa: F401
    from futx.ops.prefill_attention import attention

    q, k_cache, v_cache, cu, start, slot, k, v = make(lengths, d, gen)
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(d)
    cands = {"futx": lambda: attention(q, k_cache, v_cache, cu, start, slot, out=out, check_ranges_on_host=False)}
    uniform = len(set(lengths)) == 1
    cu_list = cu.tolist()
    if uniform:
        b, s = len(lengths), lengths[0]
        qb = q.view(b, s, HQ, d).transpose(1, 2)
        kb = k.view(b, s, HKV, d).transpose(1, 2)
        vb = v.view(b, s, HKV, d).transpose(1, 2)
        views = [(qb, kb, vb)]
    else:
        views = [(q[a:e].transpose(0, 1)[None], k[a:e].transpose(0, 1)[None], v[a:e].transpose(0, 1)[None])
                 for a, e in zip(cu_list[:-1], cu_list[1:])]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel(backend):
                for qq, kk, vv in views:
                    F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True)
        cands[name] = run
    try:
        from flash_attn.cute import flash_attn_varlen_func

        max_len = max(lengths)
        cands["flash-attn-4"] = lambda: flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len, causal=True,
            softmax_scale=scale)
    except Exception as exc:  # noqa: BLE001 - not installed / not importable on this machine
        print(f"  (flash-attn-4 skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})",
              file=sys.stderr)
    # correctness guard: futx against SDPA (math of the same inputs) before timing
    cands["futx"]()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = torch.cat([F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True)
                         .transpose(1, 2).reshape(-1, HQ, d) for qq, kk, vv in views])
    err = (out.float() - ref.float()).abs().max().item()
    if "flash-attn-4" in cands:   # the peer is checked too (its output is the first of what it returns)
        o = cands["flash-attn-4"]()
        o = o[0] if isinstance(o, tuple) else o
        print(f"  flash-attn-4 max |err| vs SDPA {(o.float() - ref.float()).abs().max().item():.3g}", file=sys.stderr)
    return cands, err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = 16384
    shapes = {f"S={s} B={tokens // s}": [s] * (tokens // s) for s in ((512, 2048) if args.quick else (512, 2048, 8192))}
    shapes["mixed 2048+7x128"] = [2048] + [128] * 7
    results = {"info": gpu_info(), "hd": args.hd, "hq": HQ, "hkv": HKV, "points": {}}
    rows = []
    for label, lengths in shapes.items():
        cands, err = candidates(lengths, args.hd, gen)
        res = time_candidates(cands, flops=causal_flops(lengths, args.hd), rounds=args.rounds)
        results["points"][label] = {"lengths": lengths, "max_abs_err_vs_sdpa": err, **res}
        for name, r in res.items():
            cell = f"{r['tflops']:.0f} TFLOP/s ({r['us']:.0f} us)" if "tflops" in r else r.get("error", "?")
            rows.append((label, name, cell))
        print(f"{label}: futx max |err| vs SDPA {err:.3g}", file=sys.stderr)
    md = ["| shape | candidate | causal TFLOP/s (median per call) |", "|---|---|---|"]
    md += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    text = "\n".join(md)
    print(text)
    d = out_dir()
    if d is not None:
        write_json(d / "bench_prefill_attention.json", results)
        (d / "bench_prefill_attention.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
