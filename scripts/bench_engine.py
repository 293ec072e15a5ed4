"""Whole-model decode step on the H200 (`futx bench decode`): ms per step of the kernel-path engine for every
weight x cache format at several (batch, context) points, against the bytes floor, per-layer breakdown,
and the peers (scripts/decode_peers.py).

Every candidate is one CUDA graph of the complete step (32 layers of the Llama-3.1-8B shape with random
weights drawn in the kernel format, BF16 LM head, greedy argmax), each row at position context - 1 of a
random-filled cache; candidates are interleaved round by round and the median of the rounds is reported.
Floor = bytes one step must read (projections, LM head, the cache rows attended) / 4.36 TB/s.

The engine's points are measured (and --out written) first; each peer then runs at each point in a process of
its own, so a peer that fails, even with a device-side assert that ends its CUDA context, costs only its own
row ("peer failed: <reason>"). Options are checked before anything loads; results are written atomically as
soon as they exist (--out after every point).

  python scripts/bench_engine.py --points 1x1024,8x1024,32x4096 --out bench.json --md bench.md --plot bench.png
  python scripts/bench_engine.py --shape llama-3.1-70b --weights int4 --cache int4   (all 80 layers fit in INT4)
  python scripts/bench_engine.py --shape llama-3.1-70b --weights int4 --cache int4 --cache-main none --points 64x4096
      (the INT4-only paged cache of futx serve --cache-main none: mirror-only pages, their decode kernels)
  python scripts/bench_engine.py --weights int4 --cache int4 --tile-variants ring4,ring8,@0
      (also the int4/int4 step with the router's M = 1 tile GEMV switched to tuning variants, captured alongside;
      "VARIANT@G": with 8 warps up to G CTAs per SM instead of decode.plan.TILE_SMALL_GRID_CTAS)
  python scripts/bench_engine.py --speculative --weights int4 --cache int4 --points 1x1024,8x1024,32x1024
      (the speculative verify step instead, k = 0..7 drafts per request: scripts/bench_verify.py)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from futx import atomic  # noqa: E402
from futx.cli import validators  # noqa: E402
from futx.cli.parser import Parser, RawDefaultsFormatter  # noqa: E402
from futx.config import PRESETS, RopeScaling, LlamaConfig  # noqa: E402
from futx.engine.support import MAX_BATCH  # noqa: E402
from scripts import bench_verify  # noqa: E402

# torch is imported where it is used, so the options are checked in a blink and on any machine
HBM_BYTES_PER_S = 4.36e12  # measured read-only ceiling of the H200 (docs/results.md)
FORMATS = ("int4", "e4m3", "bf16")
SHAPES = ("llama-3.1-8b", "llama-3.1-70b", *sorted(set(PRESETS) - {"llama-3.1-8b"}))
PEERS = ("gptfast-int4", "gptfast-bf16", "transformers")   # scripts/decode_peers.py: make_peer


def config_for(shape: str, layers: int | None) -> LlamaConfig:
    if shape == "llama-3.1-70b":
        cfg = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                          head_dim=128, num_hidden_layers=80, vocab_size=128256, rope_theta=500000.0,
                          rope_scaling=RopeScaling(), max_position_embeddings=131072, name="llama-3.1-70b")
    else:
        cfg = PRESETS[shape]
    return cfg if layers is None else cfg.replace(num_hidden_layers=layers)


def head_bytes(config) -> int:
    """The BF16 LM head's bytes (one read per step)."""
    return config.vocab_size * config.hidden_size * 2


def step_bytes(model, batch: int, context: int) -> int:
    c = model.config
    head = head_bytes(c)
    cache = batch * context * model.cache.read_bytes_per_token() * c.num_hidden_layers
    return model.packed.projection_bytes() + head + cache


def decode_cache(cfg, fmt: str, batch: int, capacity: int, device, main: str = "bf16", emulated: bool = False):
    """(cache, DecodeModel keyword arguments) of one point. main "bf16": the contiguous cache (a main copy beside
    the mirror); "none": the INT4-only paged cache (futx.paging, 128-position pages, the staging pages of one
    request, a layout's least), each slot owning the mirror-only pages of its `capacity` positions, so its decode
    steps run the mirror-only kernels and the cache takes ~1/5 of the memory (the 70B shape at 64 x 4096 fits)."""
    from futx.engine.cache import EngineCache

    if main == "bf16":
        return EngineCache(cfg, fmt, batch, capacity, device, keep_values=emulated), {}
    from futx.paging import DEFAULT_PAGE_SIZE as size
    from futx.paging import PageLayout, pages_for

    per = pages_for(capacity, size)
    lay = PageLayout.for_capacity(size, pages=batch * per, slots=batch, capacity=per * size, staging=per)
    cache = EngineCache(cfg, fmt, batch, per * size, device, keep_values=emulated, layout=lay)
    for s in range(batch):
        cache.set_pages(s, [lay.first_page + s * per + i for i in range(per)])
    return cache, {"pages": batch * per, "page_size": size, "staging": per, "capacity": per * size}


def replaying_model(shape: str, weights: str, cache_fmt: str, batch: int, context: int, persistent=False,
                    rules: Optional[dict] = None):
    """One point's model ready to replay (the diagnostics' set-up): `shape`'s config with random `weights`, a
    randomized contiguous cache, `batch` rows loaded at `context` tokens and their CUDA graphs. `persistent`:
    DecodeModel's argument, or a function of the model giving its persistent step (set before the graphs);
    `rules`: KernelOps attributes to set first (engine_rules: E5, E6 on). Returns (config, model, graphs)."""
    from futx.engine import random_packed

    cfg = config_for(shape, None)
    cap = -(-context // 8) * 8
    cache, kw = decode_cache(cfg, cache_fmt, batch, cap, "cuda")
    cache.randomize(0)
    m, g = captured_step(random_packed(cfg, weights, seed=0), cache, batch, context, rules, capacity=cap,
                         persistent=persistent, **kw)
    return cfg, m, g


def captured_step(packed, cache, batch: int, context: int, ops: Optional[dict] = None, persistent=False, **model_kw):
    """A DecodeModel of `packed` over the shared `cache` (DecodeModel's other keywords `model_kw`; `persistent`: its
    argument, or a function of the model giving its persistent step), KernelOps attributes `ops` set, its CUDA graph
    captured and `batch` rows loaded at `context` tokens. Returns (model, its GraphSteps)."""
    from futx.engine import DecodeModel
    from futx.engine.graphs import GraphSteps

    m = DecodeModel(packed, cache.fmt, max_batch=batch, shared_cache=cache,
                    persistent=False if callable(persistent) else persistent, **model_kw)
    if callable(persistent):
        m.persistent = persistent(m)
    for attr, value in (ops or {}).items():
        setattr(m.ops, attr, value)
    g = GraphSteps(m, buckets=[batch])
    m.load_inputs(list(range(1, batch + 1)), [context - 1] * batch, list(range(batch)))
    return m, g


def ring_step(variant: str = "", **kw):
    """A function of the model giving its ring-layer persistent step (replaying_model's `persistent`), with ring tuning
    variant `variant` (its tuning space registered; the diagnostic ones allowed: these are diagnostics) and
    PersistentStep's other keywords."""
    from futx.engine.persistent import PersistentStep

    if variant:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import tuning_space

        tuning_space.register()
    return lambda m: PersistentStep(m, body="ring", variant=variant, diagnostic=True, **kw)


class Timer:
    """Interleaved rounds of `reps` graph replays per candidate; median ms per replay."""

    def __init__(self, reps: int, rounds: int):
        self.reps, self.rounds = reps, rounds

    def run(self, cands: dict) -> dict:
        import torch

        times = {k: [] for k in cands}
        names = list(cands)
        for fn in cands.values():
            fn()
        torch.cuda.synchronize()
        for r in range(self.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                fn = cands[name]
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(self.reps):
                    fn()
                b.record()
                torch.cuda.synchronize()
                times[name].append(a.elapsed_time(b) / self.reps)
        return {k: {"ms": statistics.median(v), "spread": (max(v) - min(v)) / statistics.median(v)}
                for k, v in times.items()}


def graph_of(fn, stream, copies: int = 1):
    """One CUDA graph of `copies` back-to-back calls (copies > 1: the graph launch is amortized, and each
    call waits for the previous one as inside a step)."""
    import torch

    with torch.cuda.stream(stream):
        fn()
        fn()
    stream.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for _ in range(copies):
            fn()
    return g


def breakdown(model, rows: int, timer: Timer, stream) -> dict:
    """Per-layer time vs the layer's ops each timed alone: a graph of 16 back-to-back copies of one op (or of
    the whole layer, or of the final norm + LM head + argmax), replayed; us per copy."""
    import torch

    from futx.engine.backends import KernelOps

    ops: KernelOps = model.ops
    c, eps = model.config, model.config.rms_norm_eps
    w = model.packed.layers[0]
    b = model.buffers
    x = torch.randn(rows, c.hidden_size, device=model.device).to(torch.bfloat16)
    qkv = ops.norm_linear(x, w.qkv, "store", eps)
    attn = model._attn_out[:rows]
    z = ops.norm_linear(x, w.gateup, "swiglu", eps)
    pos, slt = b.positions[:rows], b.slots[:rows]
    # the layer's own ops: a projection that reads an RMSNorm row includes its row factor (its own kernel, or
    # computed inside the projection where decode.plan.fuses_norm)
    parts = {
        "rms+qkv": lambda: ops.norm_linear(x, w.qkv, "store", eps),
        "attention": lambda: ops.attention(qkv, pos, slt, model.cache, 0, model.rope, attn),
        "o+residual": lambda: ops.linear(attn.view(rows, c.q_size), w.o, "residual", x),
        "rms+gate/up+swiglu": lambda: ops.norm_linear(x, w.gateup, "swiglu", eps),
        "down+residual": lambda: ops.linear(z, w.down, "residual", x),
    }

    def layer():
        model.layer(0, x, pos, slt)

    def head():
        model.buffers.next_tokens[:rows].copy_(model.logits(x).argmax(-1))

    copies = 16
    graphs = {k: graph_of(f, stream, copies) for k, f in {**parts, "layer": layer, "head": head}.items()}
    t = timer.run({k: g.replay for k, g in graphs.items()})
    out = {k: t[k]["ms"] * 1e3 / copies for k in t}
    out["sum of the ops"] = sum(out[k] for k in parts)
    return out


def points(value: str) -> list[tuple[int, int]]:
    """BATCHxCONTEXT,... with batch 1..MAX_BATCH (the engine's rows per step) and context >= 1."""
    out = []
    for item in value.split(","):
        b, x, c = item.strip().partition("x")
        if not (x and b.isdigit() and c.isdigit()):
            raise argparse.ArgumentTypeError(f"{item!r} is not BATCHxCONTEXT (e.g. 32x4096)")
        if not 1 <= int(b) <= MAX_BATCH or int(c) < 1:
            raise argparse.ArgumentTypeError(f"{item}: batch must be in 1..{MAX_BATCH} and context at least 1")
        out.append((int(b), int(c)))
    return out


ATTENTION_MAX_SPLITS = 64   # futx.ops.decode_attention.MAX_SPLITS, not imported: parsing loads no torch


def split_counts(value: str) -> list:
    """--persistent: 'auto' or split counts 1..64 (the attention op's range), comma-separated, each optionally
    'ring:' (the ring layer's body; 'ring' alone: 'ring:auto'). Returns 'auto' / ints, and ('ring', 'auto' / int)
    for the ring."""
    count = validators.int_in(1, ATTENTION_MAX_SPLITS)
    out = []
    for v in (x.strip() for x in value.split(",") if x.strip()):
        ring = v == "ring" or v.startswith("ring:")
        v = "auto" if v == "ring" else v.removeprefix("ring:")
        v = v if v == "auto" else count(v)
        out.append(("ring", v) if ring else v)
    return out


# the candidate-name suffixes of the engine rules E5 / E6 / E7 (scripts/engine_rule_pick.py reads them back)
RULE_NAMES = {"E5": "pdl-attention", "E6": "final-norm-kernel", "E7": "argmax-kernel"}
RULE_NAMES["E5+E6"] = f"{RULE_NAMES['E5']}+{RULE_NAMES['E6']}"


# the KernelOps attributes that turn each of them off, routed or not
RULES_OFF = {"E5": {"pdl_attention_rows": 0}, "E6": {"final_norm_kernel": False}, "E7": {"argmax_kernel": False}}


def _asked(a: argparse.Namespace) -> list:
    """The rules this run times: --pdl-attention (E5), --final-norm-kernel (E6), --argmax-kernel (E7)."""
    flags = {"E5": a.pdl_attention, "E6": a.final_norm_kernel, "E7": a.argmax_kernel}
    return [r for r, on in flags.items() if on]


def rules_off(a: argparse.Namespace) -> dict:
    """KernelOps attributes that turn off the rules this run times (_asked), routed or not: the plain step they are
    compared with runs without them."""
    return {k: v for r in _asked(a) for k, v in RULES_OFF[r].items()}


def engine_rules(a: argparse.Namespace, batch: int) -> list:
    """(candidate name, KernelOps attributes) of the engine rules this run times (_asked) at this batch: each alone
    (the others off, even where routed) and, when several are asked for, all of them together (the plain step:
    rules_off)."""
    off = rules_off(a)
    on = {"E5": {"pdl_attention_rows": batch}, "E6": {"final_norm_kernel": True}, "E7": {"argmax_kernel": True}}
    asked = _asked(a)
    rules = [(RULE_NAMES[r], {**off, **on[r]}) for r in asked]
    if len(asked) > 1:   # named as RULE_NAMES["E5+E6"] is
        rules.append(("+".join(RULE_NAMES[r] for r in asked), {k: v for r in asked for k, v in on[r].items()}))
    return rules


def split_list(value: str) -> list[int]:
    """--attention-splits: split-KV counts 1..64 (the attention op's range), comma-separated."""
    count = validators.int_in(1, ATTENTION_MAX_SPLITS)
    return [count(v.strip()) for v in value.split(",") if v.strip()]


def peer_list(value: str) -> list[str]:
    return validators.choice_list(PEERS)(value) if value else []


def plot_file(value: str) -> str:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError("matplotlib is not installed (pip install matplotlib)")
    return validators.output_file(value)


class BenchParser(Parser):
    """The options' own types check each value; parse_args then checks how they combine."""

    def parse_args(self, args=None, namespace=None):
        a = _defaults(super().parse_args(args, namespace))
        pairs = [f"{w}/{c}" for w in a.weights for c in a.cache]
        if a.breakdown and a.breakdown not in pairs:
            self.error(f"argument --breakdown: {a.breakdown!r} is not one of the measured formats "
                       f"{', '.join(pairs)} ('' for none)")
        if a.cache_main == "none" and "bf16" in a.cache:
            self.error("argument --cache-main: none keeps only the mirror: --cache int4 and/or e4m3, not bf16")
        if a.cache_main == "none" and a.speculative:
            self.error("argument --cache-main: the verify step is measured on the contiguous cache")
        if (a.glue or a.tile_variants) and "int4/int4" not in pairs:
            self.error("argument --glue/--tile-variants: measures int4/int4; add int4 to --weights and --cache")
        if a.speculative:
            if a.glue or a.tile_variants or a.peers or a.plot:
                self.error("argument --speculative: measures the verify step alone (no --glue, --tile-variants, "
                           "--peers or --plot)")
            if not any(bench_verify.fits(b, k) for b, _ in a.points for k in a.num_draft):
                self.error(f"argument --num-draft: no point holds BATCH x (k + 1) <= {MAX_BATCH} rows")
        elif a.num_draft_given:
            self.error("argument --num-draft: applies to --speculative")
        elif a.block_attention:
            self.error("argument --block-attention: applies to --speculative")
        return a


def build_parser(prog: str | None = None) -> Parser:
    p = BenchParser(prog=prog, description=__doc__, formatter_class=RawDefaultsFormatter)
    p.add_argument("--shape", default="llama-3.1-8b", choices=SHAPES, help="model shape (random weights)")
    p.add_argument("--layers", type=validators.positive_int, default=None,
                   help="layers (default: the model's; fewer to fit memory)")
    p.add_argument("--points", type=points, default="1x1024,8x1024,32x4096", help="BATCHxCONTEXT,...")
    p.add_argument("--capacity", type=validators.positive_int, default=None, help="cache positions per row, at least "
                   "each point's context (default: the context): the split rules (A8, the persistent ring's) choose by "
                   "capacity, so a point below it times a serving cache part filled")
    p.add_argument("--weights", type=validators.choice_list(FORMATS), default=",".join(FORMATS),
                   help="weight formats, comma-separated")
    p.add_argument("--cache", type=validators.choice_list(FORMATS), default=",".join(FORMATS),
                   help="cache formats, comma-separated")
    p.add_argument("--cache-main", default="bf16", choices=("bf16", "none"),
                   help="bf16: the contiguous cache, a BF16 main copy beside the mirror; none: the INT4-only paged "
                        "cache of futx serve --cache-main none (mirror-only pages, its decode kernels)")
    p.add_argument("--reps", type=validators.positive_int, default=20, help="graph replays per timing")
    p.add_argument("--rounds", type=validators.positive_int, default=7,
                   help="interleaved rounds; the median is reported")
    p.add_argument("--breakdown", default="int4/int4", help="weights/cache whose per-layer breakdown to measure "
                                                           "('' for none)")
    p.add_argument("--glue", action="store_true", help="also the step with the RMSNorm row factor as its own kernel "
                   "and the unfused chain (RMSNorm/RoPE as torch ops)")
    p.add_argument("--tile-variants", default="", help="comma-separated decode.plan.TILE_VARIANTS, each optionally "
                   "with @G (8 warps up to G CTAs per SM), /sS (S CTAs per tile of the split-capable projections), "
                   ":L (variant L for K > 16384; ':' alone: batches of 2 there too), ^M (the multi-token tile GEMV "
                   "up to M rows; ^1: never; ^Mr: for the residual projections too), #S (the M = 1 warps by the "
                   "fill rule with S warp slots per SM; #S>K: for K above K only), +nb (n-blocks per CTA by "
                   "decode.plan.tile_nblocks), -rnb (2..8 rows on the multi-token tile GEMV only on small grids: "
                   "rule P12 instead of P13), %%C (P13 with at most C n-blocks per CTA), ~R (its 8 warps "
                   "from R rows) and a final $V (skinny variant V where the router picks the skinny kernel), e.g. "
                   "'/s1', '@3/s2', ':', '^8r', '#24>8192', ':#24+nb', '-rnb', '%%8', '~3', '$rw': also "
                   "the int4/int4 step (and its breakdown) with the router's tile GEMV switched to each")
    p.add_argument("--pdl-attention", action="store_true", help="also each weights/cache pair's step with its "
                   "attention launched as a programmatic dependent of the QKV projection (routing rule E5 on: "
                   "decode.attn.*.qkv*.pdl, futx.engine.backends.pdl_attention_limit); the --tile-variants and "
                   "--attention-splits candidates then both ways; the plain step then runs with E5 off, routed or not")
    p.add_argument("--final-norm-kernel", action="store_true", help="also each weights/cache pair's step with the "
                   "final RMSNorm as one kernel (routing rule E6 on: engine.rms_rows.gain, "
                   "futx.engine.backends.FINAL_NORM_KERNEL; the plain step then runs with E6 off); with "
                   "--pdl-attention both rules together too")
    p.add_argument("--argmax-kernel", action="store_true", help="also each weights/cache pair's step with its "
                   "greedy argmax on futx's kernel (routing rule E7 on: engine.argmax_rows, "
                   "futx.engine.backends.ARGMAX_KERNEL; the plain step then runs with E7 off); with the other rule "
                   "flags all of them together too")
    p.add_argument("--attention-splits", type=split_list, default=[], help="also the int4/int4 step with its "
                   "attention forced to each of these split-KV counts (comma-separated, 1..64; with --pdl-attention "
                   "both launches), e.g. 2,4,16")
    p.add_argument("--persistent", type=split_counts, default="", help="also the step on the persistent layer kernel "
                   "(futx.engine.persistent; INT4 weights, INT4/E4M3 caches, batch 1..8 where its shared memory fits "
                   "the rows): comma-separated split counts, "
                   "'auto' the attention op's choice for the capacity, each optionally 'ring:' (the layer with a "
                   "producer warp streaming the weights, batch 1; 'ring' = 'ring:auto'), e.g. auto,8,ring,ring:16")
    p.add_argument("--peers", type=peer_list, default="",
                   help=f"comma-separated, each timed in a process of its own after the engine: {', '.join(PEERS)} "
                        "(scripts/decode_peers.py)")
    p.add_argument("--peer-timeout", type=validators.positive_int, default=1800,
                   help="seconds one peer may take at one point")
    p.add_argument("--speculative", action="store_true",
                   help="measure the speculative verify step (BATCH requests x (k + 1) rows, causal blocks) for "
                        "each k of --num-draft instead of the plain step (scripts/bench_verify.py)")
    p.add_argument("--num-draft", type=bench_verify.draft_list, default=None,
                   help="with --speculative: draft counts k, comma-separated, 0..7 (default 0,1,...,7; k = 0 is "
                        "the plain step)")
    p.add_argument("--block-attention", type=bench_verify.block_list, default=None,
                   help="with --speculative: how the verify step writes a block's K/V rows before its attention, "
                        "comma-separated: prewrite (torch glue + the mirror kernel), kernel (one futx.ops.qkv_rows "
                        "launch) (default kernel, the engine's)")
    p.add_argument("--out", "--json", dest="out", type=validators.output_file, default=None, help="JSON results")
    p.add_argument("--md", type=validators.output_file, default=None, help="Markdown table")
    p.add_argument("--plot", type=plot_file, default=None, help="PNG plot of ms per step (needs matplotlib)")
    return p


def _defaults(a: argparse.Namespace) -> argparse.Namespace:
    a.num_draft_given = a.num_draft is not None
    if a.num_draft is None:
        a.num_draft = list(range(bench_verify.MAX_DRAFT + 1))
    return a


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))


def run(a: argparse.Namespace) -> int:
    import torch

    from futx.engine import random_packed

    if a.speculative:
        bench_verify.run(a)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("futx bench decode needs a CUDA GPU")
    tile_variants = [v for v in a.tile_variants.split(",") if v]
    if tile_variants:
        from decode import plan
        from scripts import tuning_space

        tuning_space.register()

        def route(spec: str) -> None:
            spec, dollar, skinny = spec.partition("$")
            skinny = skinny if dollar else None   # no $V: the shipped skinny rule
            rows_nblocks = "-rnb" not in spec
            spec, _, most = spec.replace("-rnb", "").partition("%")
            rows_nblocks = int(most) if most else rows_nblocks
            spec, _, rows_w8 = spec.partition("~")
            nblocks = "+nb" in spec
            spec, _, fill = spec.replace("+nb", "").partition("#")
            fill, _, fill_min_k = fill.partition(">")
            spec, _, max_m = spec.partition("^")
            spec, colon, long_k = spec.partition(":")
            spec, _, split = spec.partition("/s")
            name, _, grid = spec.partition("@")
            residual = max_m.endswith("r")  # ^Mr: the residual projections too
            max_m = max_m.rstrip("r")
            plan.route_tile_variant(name, float(grid) if grid else None, int(split) if split else None,
                                    long_k if colon else None, int(max_m) if max_m else None,
                                    plan.EPILOGUES if residual else None, int(fill) if fill else None,
                                    nblocks, int(fill_min_k or 0), rows_nblocks,
                                    int(rows_w8) if rows_w8 else None, skinny)
    cfg = config_for(a.shape, a.layers)
    wfs, cfs = a.weights, a.cache
    timer = Timer(a.reps, a.rounds)
    stream = torch.cuda.Stream()
    t0 = time.perf_counter()
    packed = {wf: random_packed(cfg, wf, seed=i) for i, wf in enumerate(wfs)}
    for wf in wfs[1:]:  # one embedding/head for all: keeps memory for the caches
        packed[wf].embed, packed[wf].lm_head = packed[wfs[0]].embed, packed[wfs[0]].lm_head
    print(f"{cfg.name}: {cfg.num_hidden_layers} layers, weights packed in {time.perf_counter() - t0:.1f} s",
          flush=True)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": cfg.name,
               "layers": cfg.num_hidden_layers, "cache_main": a.cache_main, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": " ".join(sys.argv), "points": []}
    for batch, context in a.points:
        cap = -(-max(context, a.capacity or 0) // 8) * 8
        built = {cf: decode_cache(cfg, cf, batch, cap, "cuda", a.cache_main) for cf in cfs}
        caches = {cf: c for cf, (c, _) in built.items()}
        kw = {cf: {"capacity": cap, **k} for cf, (_, k) in built.items()}
        for i, c in enumerate(caches.values()):
            c.randomize(i)
        models, cands = {}, {}
        for wf in wfs:
            for cf in cfs:
                models[(wf, cf)], g = captured_step(packed[wf], caches[cf], batch, context, rules_off(a), **kw[cf])
                cands[f"{wf}/{cf}"] = lambda g=g: g.replay(batch)
                for name, rules in engine_rules(a, batch):   # the same step with rules E5 / E6 on
                    _, g = captured_step(packed[wf], caches[cf], batch, context, rules, **kw[cf])
                    cands[f"{wf}/{cf} {name}"] = lambda g=g: g.replay(batch)
        for sp in a.attention_splits if ("int4", "int4") in models else []:
            for pdl in (False, True) if a.pdl_attention else (False,):
                _, g = captured_step(packed["int4"], caches["int4"], batch, context,
                                     {"attention_splits": sp, "pdl_attention_rows": batch if pdl else 0}, **kw["int4"])
                cands[f"int4/int4{' pdl-attention' if pdl else ''} splits {sp}"] = lambda g=g: g.replay(batch)
        if a.glue:
            for glue, name in (("norm-kernel", "int4/int4 row factor as its own kernel"),
                               ("torch", "int4/int4 unfused glue")):
                _, g = captured_step(packed["int4"], caches["int4"], batch, context, glue=glue, **kw["int4"])
                cands[name] = lambda g=g: g.replay(batch)
        for sp in a.persistent if "int4" in wfs else []:
            from futx.engine.persistent import FORMATS as PFORMATS, PersistentMisfit, PersistentStep

            body, sp = sp if isinstance(sp, tuple) else ("tiles", sp)
            name = "persistent ring" if body == "ring" else "persistent"
            for cf in [f for f in cfs if f in PFORMATS]:
                def step(m, sp=sp, body=body):
                    return PersistentStep(m, splits=None if sp == "auto" else int(sp), max_rows=batch, body=body)

                try:
                    m, g = captured_step(packed["int4"], caches[cf], batch, context, persistent=step, **kw[cf])
                except PersistentMisfit as e:
                    print(f"  {name} at batch {batch}: skipped, {e}")
                    continue
                splits = m.persistent.tables(batch)["splits"]
                cands[f"int4/{cf} {name} s{splits}"] = lambda g=g: g.replay(batch)
        variant_models = {}
        for v in tile_variants:
            for pdl in (False, True) if a.pdl_attention else (False,):   # (with E5: e.g. the ring pipeline, whose
                route(v)                                                  # weights are all requested before the wait)
                try:
                    m, g = captured_step(packed["int4"], caches["int4"], batch, context,
                                         {"pdl_attention_rows": batch if pdl else 0}, **kw["int4"])
                finally:
                    plan.route_tile_variant("")
                cands[f"int4/int4 {'pdl-attention ' if pdl else ''}tile {v}"] = lambda g=g: g.replay(batch)
                if not pdl:
                    variant_models[v] = m
        t = timer.run(cands)
        point = {"batch": batch, "context": context, "capacity": cap, "rows": []}
        for name, r in t.items():
            row = {"candidate": name, "ms": r["ms"], "spread": r["spread"], "tokens_per_s": batch / r["ms"] * 1e3}
            key = tuple(name.split(" ")[0].split("/")) if "/" in name else None
            if key in models:
                floor = step_bytes(models[key], batch, context) / HBM_BYTES_PER_S * 1e3
                row.update(floor_ms=floor, of_floor=floor / r["ms"])
            point["rows"].append(row)
            print_row(batch, context, row)
        if a.breakdown:
            wf, cf = a.breakdown.split("/")
            bd = breakdown(models[(wf, cf)], batch, timer, stream)
            bd["layer in the step"] = (t[a.breakdown]["ms"] * 1e3 - bd["head"]) / cfg.num_hidden_layers
            point["breakdown"] = {"format": a.breakdown, "us": bd}
            print("  per layer (us): " + ", ".join(f"{k} {v:.1f}" for k, v in bd.items()), flush=True)
        for v, m in variant_models.items():
            route(v)
            try:
                bd = breakdown(m, batch, timer, stream)
            finally:
                plan.route_tile_variant("")
            bd["layer in the step"] = (t[f"int4/int4 tile {v}"]["ms"] * 1e3 - bd["head"]) / cfg.num_hidden_layers
            point.setdefault("breakdown_tile_variants", {})[v] = bd
            print(f"  per layer, tile {v} (us): " + ", ".join(f"{k} {x:.1f}" for k, x in bd.items()), flush=True)
        results["points"].append(point)
        save(results, a)
        del models, cands, caches, variant_models
        torch.cuda.empty_cache()
    # Peers after every engine measurement is recorded, each in its own process (see the module's docstring).
    for point in results["points"]:
        for name in a.peers:
            row = measure_peer(name, a, point["batch"], point["context"])
            point["rows"].append(row)
            print_row(point["batch"], point["context"], row)
            save(results, a)
    md = render(results)
    print(md)
    save(results, a, final=True)
    return 0


def measure_peer(name: str, a: argparse.Namespace, batch: int, context: int) -> dict:
    """A peer's row at one point, timed by `python scripts/decode_peers.py` in a child process; a failure (an
    exception, a crash, a timeout) is the row's "failed" reason."""
    cmd = [sys.executable, str(Path(__file__).with_name("decode_peers.py")), name, "--shape", a.shape,
           "--point", f"{batch}x{context}", "--reps", str(a.reps), "--rounds", str(a.rounds)]
    if a.layers is not None:
        cmd += ["--layers", str(a.layers)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.peer_timeout)
    except subprocess.TimeoutExpired:
        return {"candidate": name, "failed": f"no result within --peer-timeout {a.peer_timeout} s"}
    if proc.returncode == 0:
        try:
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            return {"candidate": name, "ms": r["ms"], "spread": r["spread"], "tokens_per_s": batch / r["ms"] * 1e3}
        except (IndexError, KeyError, ValueError):
            pass
    return {"candidate": name, "failed": failure_reason(proc.stderr + proc.stdout) or f"exit status {proc.returncode}"}


def failure_reason(output: str) -> str:
    """The line of a failed child's output that says why: its exception's (torch follows a CUDA error with
    advice lines), else its last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"[\w.]*(Error|Exception|Interrupt)\b", ln)]
    return (errors or lines or [""])[-1][:300]


def print_row(batch: int, context: int, row: dict) -> None:
    if "failed" in row:
        print(f"B={batch:3d} ctx={context:5d} {row['candidate']:24s} peer failed: {row['failed']}", flush=True)
        return
    print(f"B={batch:3d} ctx={context:5d} {row['candidate']:24s} {row['ms']:8.3f} ms  {row['tokens_per_s']:9.0f} tok/s"
          + (f"  {100 * row['of_floor']:5.1f}% of floor {row['floor_ms']:.3f} ms" if "floor_ms" in row else ""),
          flush=True)


def save(results: dict, a: argparse.Namespace, final: bool = False) -> None:
    """--out after every point (atomically, so a crash later keeps it whole); --md and --plot at the end."""
    if a.out:
        atomic.write_text(a.out, json.dumps(results, indent=1))
    if final and a.md:
        atomic.write_text(a.md, render(results) + "\n")
    if final and a.plot:
        with atomic.replacing(a.plot) as tmp:
            plot(results, str(tmp))


def render(results: dict) -> str:
    main = ", INT4-only cache (--cache-main none)" if results.get("cache_main") == "none" else ""
    lines = [f"{results['shape']} ({results['layers']} layers){main}, {results['gpu']}, {results['date']}", "",
             "| B | context | candidate | ms / step | tokens/s | floor ms | of floor |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for pt in results["points"]:
        for r in pt["rows"]:
            if "failed" in r:
                reason = r["failed"].replace("|", "/")
                lines.append(f"| {pt['batch']} | {pt['context']} | {r['candidate']} | peer failed: {reason} "
                             "| – | – | – |")
                continue
            fl = f"{r['floor_ms']:.3f} | {100 * r['of_floor']:.0f}%" if "floor_ms" in r else "– | –"
            lines.append(f"| {pt['batch']} | {pt['context']} | {r['candidate']} | {r['ms']:.3f} | "
                         f"{r['tokens_per_s']:.0f} | {fl} |")
    for pt in results["points"]:
        if "breakdown" in pt:
            bd = pt["breakdown"]["us"]
            lines.append(f"\nPer layer at B={pt['batch']} ctx={pt['context']} ({pt['breakdown']['format']}), us: "
                         + ", ".join(f"{k} {v:.1f}" for k, v in bd.items()))
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    pts = results["points"]
    fig, axes = plt.subplots(1, len(pts), figsize=(5 * len(pts), 4), squeeze=False)
    for ax, pt in zip(axes[0], pts):
        rows = [r for r in pt["rows"] if "ms" in r]   # a failed peer has no bar
        names = [r["candidate"] for r in rows]
        ax.barh(names, [r["ms"] for r in rows], color="tab:blue", label="measured")
        ax.barh(names, [r.get("floor_ms", 0) for r in rows], color="tab:gray", alpha=0.6, label="bytes floor")
        ax.set_title(f"B={pt['batch']}, context {pt['context']}")
        ax.set_xlabel("ms per step")
        ax.invert_yaxis()
    axes[0][0].legend()
    fig.suptitle(f"{results['shape']} decode step, {results['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
