"""The persistent layer's buffers against the shipped ops, per row (issue 29 diagnostic, GPU): one layer of the 8B
shape and of a GQA-4 layer, 8 rows from equal random caches, both cache formats, contexts 1..8191; prints, per
case, ok or each buffer's relative error per row (QKV, attention, O + residual, gate/up + SwiGLU, down + residual)
and the layer-0 cache bytes that differ per slot.

    python scripts/persistent_buffers.py [ring]   (on the H200; AOT kernels as scripts/gpu/persistent.sh stages them)

`ring`: the ring layer (decode/persistent_ring.py), one row, its GQA-4 layer with K = 1024 / 3072 (whole stages).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from futx.config import PRESETS
from futx.engine import DecodeModel
from futx.engine.packed import random_packed
from futx.engine.persistent import PersistentStep

BODY = sys.argv[1] if len(sys.argv) > 1 else "tiles"
ROWS = 1 if BODY == "ring" else 8

def cfg_of(name):
    cfg = PRESETS["llama-3.1-8b"].replace(num_hidden_layers=1, vocab_size=1024)
    if name == "small":
        cfg = cfg.replace(hidden_size=1024, intermediate_size=3072 if BODY == "ring" else 2816, num_attention_heads=8,
                          num_key_value_heads=2)
    return cfg

def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))

for name in ("small", "8b"):
    packed = random_packed(cfg_of(name), "int4", device="cuda", seed=5)
    for cf in ("int4", "e4m3"):
        for start in (0, 8190, 62):
          for rep in range(2):
            rows = ROWS
            ref = DecodeModel(packed, cf, max_batch=9, capacity=8200, device="cuda", persistent=False)
            per = DecodeModel(packed, cf, max_batch=9, capacity=8200, device="cuda", persistent=BODY == "tiles")
            if BODY == "ring":
                per.persistent = PersistentStep(per, body="ring")
            ref.cache.randomize(11); per.cache.randomize(11)
            pos = torch.tensor([max(0, start - 5 * r) for r in range(rows)], dtype=torch.int32, device="cuda")
            slots = torch.arange(1, rows + 1, dtype=torch.int32, device="cuda")
            tok = torch.arange(100, 100 + rows, device="cuda")
            x0 = packed.embed[tok].contiguous()
            ops, w, eps, c = ref.ops, packed.layers[0], ref.config.rms_norm_eps, ref.config
            qkv = ops.norm_linear(x0, w.qkv, "store", eps)
            attn = torch.zeros(rows, c.num_attention_heads, c.head_dim, dtype=torch.bfloat16, device="cuda")
            ops.attention(qkv, pos, slots, ref.cache, 0, ref.rope, attn)
            hmid = ops.linear(attn.view(rows, c.q_size), w.o, "residual", x0)
            act = ops.norm_linear(hmid, w.gateup, "swiglu", eps)
            out = ops.linear(act, w.down, "residual", hmid)
            p = per.persistent
            t = p.tables(rows)
            for b in (p.qkv, p.attn, p.hmid, p.act, t["ws_o"], t["ws_ml"]):
                b.fill_(float("nan"))
            x = x0.clone()
            p.run(x, pos, slots)
            torch.cuda.synchronize()
            res = {}
            for nm, a, bb in (("qkv", p.qkv[:rows], qkv), ("attn", p.attn[:rows], attn), ("hmid", p.hmid[:rows], hmid),
                              ("act", p.act[:rows], act), ("out", x, out)):
                res[nm] = " ".join(f"{rel(a[r], bb[r]):.3f}" for r in range(rows))
            bad = any(float(v) > 0.01 for s in res.values() for v in s.split())
            print(f"{name} {cf} start {start} rep {rep} splits {t['splits']} {'BAD' if bad else 'ok'}")
            if bad:
                for nm, s in res.items():
                    print(f"   {nm:5s} {s}")
                # cache rows of layer 0 per slot
                for i, (a, bb) in enumerate(zip(ref.cache.layers[0].tensors(), per.cache.layers[0].tensors())):
                    a8, b8 = a.view(torch.uint8), bb.view(torch.uint8)
                    diff = [int((a8[s] != b8[s]).sum()) for s in range(9)] if a8.dim() > 1 else int((a8 != b8).sum())
                    print(f"   cache tensor {i} {tuple(a.shape)} differing bytes per slot {diff}")
