"""Peers of the decode engine for scripts/bench_engine.py, each timed in a process of its own:

  python scripts/decode_peers.py gptfast-int4 --point 64x1024 [--shape S --layers L --reps R --rounds N]

prints one JSON line {"ms", "spread"} (bench_engine.Timer over CUDA-graph replays). A process per peer: a
second compiled peer in one process (new shapes after a graph capture) hit a device-side index assert on the
H200, and such an assert ends the whole CUDA context, the engine's graphs included.

transformers: see TransformersPeer (BF16, static cache, compiled with CUDA graphs).

gptfast-int4 / gptfast-bf16: a gpt-fast-style Llama decode step: one layer function compiled with
torch.compile (fullgraph, static shapes; called for every layer), static BF16 KV cache, projections through
`torch._weight_int4pack_mm` (INT4, group 128: the precision-matched peer) or BF16 `F.linear`, gate/up and
QKV fused, attention as grouped matmuls over the cache with a position mask, the whole step (all layers,
final norm, LM head, argmax) captured as one CUDA graph. Weights are random (speed does not depend on them).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GROUP = 128
INNER_K_TILES = 8   # tinygemm's packing: K must be a multiple of INNER_K_TILES * 16


def _int4_weight(n: int, k: int, gen) -> tuple:
    """tinygemm's packed INT4 (the CUDA layout, or on the CPU the CPU kernel's own) and its scales/zeros."""
    if gen.device.type == "cuda":
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=gen.device, generator=gen)
        wp = torch.ops.aten._convert_weight_to_int4pack(q, INNER_K_TILES)
    else:
        q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=gen.device, generator=gen)
        wp = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)
    sz = (torch.rand(k // GROUP, n, 2, device=gen.device, generator=gen) * 0.01).bfloat16()
    return (wp, sz)


def _bf16_weight(n: int, k: int, gen) -> tuple:
    return ((torch.randn(n, k, device=gen.device, generator=gen) / k ** 0.5).bfloat16(),)


def _linear(x, w: tuple):
    if len(w) == 1:
        return F.linear(x, w[0])
    if x.device.type == "cuda":
        return torch._weight_int4pack_mm(x, w[0], GROUP, w[1])
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[0], GROUP, w[1])


def check_shapes(fmt: str, cfg, batch: int, context: int) -> None:
    """ValueError for a point or a model the peer cannot run, before anything is allocated or launched."""
    if batch < 1 or context < 1:
        raise ValueError(f"batch and context must be positive, got {batch}x{context}")
    if fmt == "int4":
        c = cfg
        for name, n, k in (("qkv", c.qkv_size, c.hidden_size), ("o", c.hidden_size, c.q_size),
                           ("gate/up", 2 * c.intermediate_size, c.hidden_size),
                           ("down", c.hidden_size, c.intermediate_size)):
            if k % (INNER_K_TILES * 16) or k % GROUP or n % 8:
                raise ValueError(f"{name}: K = {k} must be a multiple of {INNER_K_TILES * 16} and {GROUP}, N = {n} "
                                 "of 8 for torch._weight_int4pack_mm")


class GptFastPeer:
    def __init__(self, fmt: str, cfg, batch: int, context: int, device: str = "cuda", capture: bool = True,
                 compile: bool = True):
        check_shapes(fmt, cfg, batch, context)
        gen = torch.Generator(device=device).manual_seed(0)
        make = _int4_weight if fmt == "int4" else _bf16_weight
        c = cfg
        hq, hkv, d, h, i = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size, \
            c.intermediate_size
        cap = context
        self.layers = [(make(c.qkv_size, h, gen), make(h, c.q_size, gen), make(2 * i, h, gen), make(h, i, gen),
                        torch.randn(batch, hkv, cap, d, device=device, generator=gen).bfloat16(),
                        torch.randn(batch, hkv, cap, d, device=device, generator=gen).bfloat16())
                       for _ in range(c.num_hidden_layers)]
        ang = torch.arange(cap, device=device)[:, None].double() * (
            1.0 / c.rope_theta ** (torch.arange(0, d, 2, device=device).double() / d))[None]
        cos_t, sin_t = ang.cos().bfloat16(), ang.sin().bfloat16()
        self.embed = (torch.randn(c.vocab_size, h, device=device, generator=gen) * 0.02).bfloat16()
        self.head = (torch.randn(c.vocab_size, h, device=device, generator=gen) * 0.02).bfloat16()
        self.tokens = torch.randint(0, c.vocab_size, (batch,), device=device, generator=gen)
        self.pos = torch.full((batch,), context - 1, device=device, dtype=torch.long)
        self.next = torch.zeros(batch, dtype=torch.long, device=device)
        eps = c.rms_norm_eps
        rows = torch.arange(batch, device=device)

        def rms(x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

        def rope(x, cos, sin):  # x [B, heads, D]
            a, b = x[..., : d // 2], x[..., d // 2:]
            return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

        def layer(x, pos, qkv_w, o_w, w13_w, w2_w, kc, vc):
            qkv = _linear(rms(x), qkv_w)
            q = qkv[:, : hq * d].view(batch, hq, d)
            k = qkv[:, hq * d: (hq + hkv) * d].view(batch, hkv, d)
            v = qkv[:, (hq + hkv) * d:].view(batch, hkv, d)
            cos, sin = cos_t[pos][:, None], sin_t[pos][:, None]
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            kc[rows, :, pos] = k
            vc[rows, :, pos] = v
            s = torch.einsum("bhgd,bhcd->bhgc", q.view(batch, hkv, hq // hkv, d), kc).float() * d ** -0.5
            live = torch.arange(kc.shape[2], device=x.device)[None, :] <= pos[:, None]
            p = s.masked_fill(~live[:, None, None, :], float("-inf")).softmax(-1).to(x.dtype)
            a = torch.einsum("bhgc,bhcd->bhgd", p, vc).reshape(batch, hq * d)
            x = x + _linear(a, o_w)
            gu = _linear(rms(x), w13_w)
            return x + _linear(F.silu(gu[:, :i]) * gu[:, i:], w2_w)

        # one graph serves every layer
        compiled = torch.compile(layer, fullgraph=True, dynamic=False) if compile else layer

        def step():
            x = self.embed[self.tokens]
            for L in self.layers:
                x = compiled(x, self.pos, *L)
            self.next.copy_((rms(x) @ self.head.T).argmax(-1))

        self.step = step
        self.rows, self.cos_t = rows, cos_t
        self.check_inputs()
        if not capture:
            return
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            step()
            step()
        stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            step()
        torch.cuda.synchronize()

    def check_inputs(self) -> None:
        """Every index the step gathers or scatters with, checked on the host before the first launch: an
        out-of-range index on the GPU is a device-side assert, which no later call in the process survives."""
        vocab, cap = self.embed.shape[0], self.cos_t.shape[0]
        batch, kc = self.tokens.shape[0], self.layers[0][4]
        checks = (("token ids", self.tokens, vocab), ("positions", self.pos, min(cap, kc.shape[2])),
                  ("cache rows", self.rows, kc.shape[0]))
        for what, idx, bound in checks:
            lo, hi = int(idx.min()), int(idx.max())
            if idx.shape[0] != batch or lo < 0 or hi >= bound:
                raise ValueError(f"{what}: {idx.shape[0]} values in {lo}..{hi}; the step needs {batch} in "
                                 f"0..{bound - 1}")

    def replay(self) -> None:
        self.graph.replay()


class TransformersPeer:
    """transformers' own LlamaForCausalLM (BF16, random weights, SDPA attention) with a StaticCache filled to
    context - 1 by one prefill, and its forward compiled with mode="reduce-overhead" (CUDA graphs inside torch),
    as the transformers documentation recommends for decoding. Every timed step decodes position context - 1
    again: the static layers' write counters are stepped back by one foreach op after each step."""

    def __init__(self, cfg, batch: int, context: int, device: str = "cuda", compile: bool = True):
        import transformers

        hf = transformers.LlamaConfig(**cfg.to_hf_dict())
        hf._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with torch.device(device):
            self.model = transformers.LlamaForCausalLM(hf).to(torch.bfloat16).eval()
        cache = transformers.StaticCache(config=hf, max_cache_len=context)
        gen = torch.Generator(device=device).manual_seed(0)
        prompt = torch.randint(0, cfg.vocab_size, (batch, context - 1), device=device, generator=gen)
        with torch.inference_mode():
            self.model(input_ids=prompt, past_key_values=cache, use_cache=True)
        lengths = [layer.cumulative_length for layer in cache.layers]
        tokens = torch.randint(0, cfg.vocab_size, (batch, 1), device=device, generator=gen)
        position = torch.full((batch, 1), context - 1, device=device)
        forward = torch.compile(self.model.forward, mode="reduce-overhead", fullgraph=True) if compile \
            else self.model.forward

        def step():
            with torch.inference_mode():
                logits = forward(input_ids=tokens, past_key_values=cache, position_ids=position, use_cache=True).logits
                torch._foreach_sub_(lengths, 1)
                return logits[:, -1].argmax(-1)

        self.step = step
        for _ in range(3 if compile else 1):  # compile, record the CUDA graph, replay once
            step()

    def replay(self) -> None:
        self.step()


def make_peer(name: str, cfg, batch: int, context: int):
    if name in ("gptfast-int4", "gptfast-bf16"):
        return GptFastPeer(name.split("-")[1], cfg, batch, context)
    if name == "transformers":
        return TransformersPeer(cfg, batch, context)
    raise ValueError(f"unknown peer {name!r}: gptfast-int4, gptfast-bf16, transformers")


def main(argv=None) -> int:
    """Time one peer at one point (bench_engine.measure_peer runs this in a child process)."""
    from scripts.bench_engine import PEERS, SHAPES, Timer, config_for, points

    from futx.cli import validators
    from futx.cli.parser import Parser

    p = Parser(prog="decode_peers.py", description=main.__doc__)
    p.add_argument("peer", choices=PEERS, help="which peer")
    p.add_argument("--point", type=points, required=True, help="BATCHxCONTEXT")
    p.add_argument("--shape", default="llama-3.1-8b", choices=SHAPES, help="model shape")
    p.add_argument("--layers", type=validators.positive_int, default=None, help="layers (default: the model's)")
    p.add_argument("--reps", type=validators.positive_int, default=20, help="graph replays per timing")
    p.add_argument("--rounds", type=validators.positive_int, default=7, help="rounds; the median is reported")
    a = p.parse_args(argv)
    if len(a.point) != 1:
        p.error("argument --point: one point per process")
    if not torch.cuda.is_available():
        raise SystemExit("the peers need a CUDA GPU")
    (batch, context), = a.point
    peer = make_peer(a.peer, config_for(a.shape, a.layers), batch, context)
    r = Timer(a.reps, a.rounds).run({a.peer: peer.replay})[a.peer]
    print(json.dumps({"ms": r["ms"], "spread": r["spread"]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
