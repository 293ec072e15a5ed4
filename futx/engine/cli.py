"""`futx generate` / `futx ppl` on the decode engine, and `futx pack` (quantize a checkpoint once, load it fast)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .support import CACHE_FORMATS, MAX_BATCH, WEIGHT_FORMATS, check_batch

BACKENDS = ("auto", "kernels", "reference", "emulated")
PREFILLS = ("kernels", "reference")
PREFILL_FORMATS = ("e4m3", "bf16")


def add_engine_arguments(p: argparse.ArgumentParser, batch_default: int) -> None:
    g = p.add_argument_group("decode engine (kernel path)")
    g.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="kernels: futx's decode kernels (Hopper GPU); reference: the PyTorch reference model; "
                        "emulated: the kernel path's arithmetic in PyTorch (any device); auto (default): kernels "
                        "when a Hopper GPU is present, else reference")
    g.add_argument("--weights", default="int4", choices=WEIGHT_FORMATS, help="decode weight format (default int4)")
    g.add_argument("--cache", default="int4", choices=CACHE_FORMATS,
                   help="KV-cache mirror that decode attention reads (int4 = Hadamard-rotated INT4; default)")
    g.add_argument("--gptq", default=None, help="a saved GPTQ result (python -m futx.quant.gptq) for --weights int4")
    g.add_argument("--group-size", type=int, default=None, help="INT4 group size (default 128, or 64 where K needs)")
    g.add_argument("--max-batch", type=int, default=batch_default, help=f"rows per step (1..{MAX_BATCH})")
    g.add_argument("--no-graphs", action="store_true", help="run steps eagerly instead of replaying CUDA graphs")
    g.add_argument("--prefill", default=None, choices=PREFILLS,
                   help="how prompts are prefilled on the engine: kernels = futx's packed prefill block (FP8 or "
                        "BF16 GEMMs with fused epilogues, prefill attention; emulated in PyTorch on --backend "
                        "emulated); reference = the BF16 reference path (float32). Default: kernels on --backend "
                        "kernels, else reference")
    g.add_argument("--prefill-format", default="e4m3", choices=PREFILL_FORMATS,
                   help="prefill weight/operand format for --prefill kernels (default e4m3)")
    g.add_argument("--prefill-glue", default="auto", choices=("auto", "eager", "kernel", "compiled"),
                   help="the kernel prefill's per-row FP8 quantization of activations: kernel (futx's kernel, "
                        "one launch; the default on --backend kernels), eager (torch ops, the same bytes; the "
                        "default elsewhere) or compiled (torch.compile; can differ in the last bit)")


def engine_device(args) -> str:
    return "cuda" if args.backend == "kernels" else args.device


def resolve_prefill(args) -> str:
    """--prefill after defaults: kernels on --backend kernels, else reference (args.backend resolved)."""
    prefill = getattr(args, "prefill", None)
    if prefill is None:
        return "kernels" if args.backend == "kernels" else "reference"
    if prefill == "kernels" and args.backend == "reference":
        raise ValueError("--prefill kernels runs on the decode engine (--backend kernels, or emulated for its "
                         "PyTorch emulation); --backend reference prefills on the reference model")
    return prefill


def build_prefill(args, model, float_weights=None):
    """The kernel prefill (futx.engine.prefill.PrefillModel) over `model`'s cache, from the float checkpoint
    (gains folded, quantized to --prefill-format) or else from the packed model's own E4M3/BF16 projections;
    None when neither is at hand."""
    from .prefill import PrefillModel, pack_prefill, prefill_from_packed

    fmt = getattr(args, "prefill_format", None) or "e4m3"
    packed = model.packed
    if float_weights is not None:
        weights = pack_prefill(float_weights, fmt, device=model.device, embed=packed.embed, lm_head=packed.lm_head)
    elif packed.weights == fmt:
        weights = prefill_from_packed(packed)
    else:
        return None
    return PrefillModel(weights, model.cache, "kernels" if model.backend == "kernels" else "emulated",
                        glue=getattr(args, "prefill_glue", None) or "auto")


def build_engine(args, capacity: int, float_weights=None):
    """(DecodeModel, GraphSteps or None) for the engine options."""
    from .graphs import GraphSteps
    from .load import load_packed
    from .model import DecodeModel

    check_batch(args.max_batch)  # before packing, which takes the time
    dev = engine_device(args)
    packed = load_packed(args.model, args.weights, gptq=args.gptq, group_size=args.group_size, device=dev,
                         float_weights=float_weights)
    model = DecodeModel(packed, args.cache, max_batch=args.max_batch, capacity=capacity,
                        backend="kernels" if args.backend == "kernels" else "emulated", device=dev)
    graphs = None
    if model.device.type == "cuda" and not args.no_graphs:
        graphs = GraphSteps(model)
    return model, graphs


def tokenizer_for(spec):
    from futx.tokenizer import load_tokenizer

    from .packed import is_packed_dir

    if spec is not None and is_packed_dir(spec):
        from .load import packed_source

        tok_json = Path(spec) / "tokenizer.json"
        if tok_json.is_file():
            from futx.tokenizer import Tokenizer

            return Tokenizer.from_hf_dir(Path(spec))
        spec = packed_source(spec)
    return load_tokenizer(spec)


# ---- futx generate --backend kernels ---------------------------------------------------------------------
def read_prompts(args) -> list[str]:
    if args.prompts:
        lines = [ln.rstrip("\n") for ln in Path(args.prompts).read_text(encoding="utf-8").splitlines()]
        prompts = [ln for ln in lines if ln.strip()]
        if not prompts:
            raise ValueError(f"{args.prompts} holds no prompts (one per line)")
        return prompts
    return [args.prompt]


def run_generate(args) -> int:
    """Prompts through the serving scheduler (prefill, then continuous batching on the decode step)."""
    import time

    from futx.serve.cli import build_serving_engine
    from futx.serve.sampling import SamplingParams
    from futx.serve.scheduler import Scheduler

    if args.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {args.max_new_tokens}")
    tok = tokenizer_for(args.model)
    prompts = read_prompts(args)
    ids = [tok.encode(tok.chat_prompt(p) if args.chat else p) for p in prompts]
    for i, x in enumerate(ids):
        if not x:
            raise ValueError(f"prompt {i} encodes to no tokens")
    capacity = max(len(x) for x in ids) + args.max_new_tokens
    engine, tok = build_serving_engine(args, capacity, tok)
    single = len(prompts) == 1
    out = sys.stdout
    scheduler = Scheduler(engine, tok, max_queue=len(prompts))
    params = SamplingParams(max_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)

    def stream(ev) -> None:
        out.write(ev.text)
        out.flush()

    if single and not args.chat:
        out.write(prompts[0])
        out.flush()
    t0 = time.perf_counter()
    handles = [scheduler.submit(x, params, sink=stream if single else (lambda ev: None)) for x in ids]
    scheduler.run_until_idle()
    stats = scheduler.stats
    stats.seconds = time.perf_counter() - t0
    if single:
        out.write("\n")
    else:
        for i, (p, h) in enumerate(zip(prompts, handles)):
            out.write(f"[{i}] {p}{h.text}\n")
    out.flush()
    for i, h in enumerate(handles):
        if h.finish_reason == "error":
            raise ValueError(f"prompt {i}: {h.error}")
    read = (f"{scheduler.prefill_tokens} prompt tokens prefilled" if engine.prefills
            else "prompts are read one token per step")
    print(f"\n[{engine.describe()}] {len(prompts)} prompt(s), {stats.steps} steps ({stats.rows} rows; {read}), "
          f"{stats.generated} tokens generated: {stats.ms_per_step:.3f} ms per step (median, host loop included), "
          f"{stats.tokens_per_s:.1f} generated tokens/s", file=sys.stderr)
    return 0


# ---- futx ppl --backend kernels --------------------------------------------------------------------------
def run_ppl(args, windows, text, n_text_tokens: int) -> int:
    import torch
    from tqdm.auto import tqdm

    from futx.eval.device import describe
    from futx.eval.perplexity import format_table, scored_per_window
    from futx.quant.simulated import quantized_weights

    from .packed import is_packed_dir
    from .perplexity import PROTOCOLS, evaluate_engine

    bad = [p for p in args.protocol if p not in PROTOCOLS]
    if bad:
        raise ValueError(f"protocol {bad[0]!r} is a prefill of whole windows, which the decode engine does not run "
                         f"yet; use {' / '.join(PROTOCOLS)} with --backend {args.backend}")
    if args.model is not None and is_packed_dir(args.model):
        raise ValueError("futx ppl needs the checkpoint (for the reference prefill and the float LM head), "
                         "not a packed directory")
    from futx.checkpoint import load

    dev = engine_device(args)
    weights = load(args.model, dtype=torch.float32, device=dev)
    results = []
    prefill_kind = resolve_prefill(args)
    with torch.inference_mode():
        model, graphs = build_engine(args, windows.shape[1], float_weights=weights)
        prefill, prefill_model = None, None
        if "serving" in args.protocol and prefill_kind == "kernels":
            prefill_model = build_prefill(args, model, weights)
        elif "serving" in args.protocol:
            prefill = quantized_weights(weights, "bf16")
        total = sum(windows.shape[0] * scored_per_window(p, windows.shape[1]) for p in args.protocol)
        with tqdm(total=total, unit="tok", desc="ppl (engine)", disable=args.no_progress) as bar:
            for p in dict.fromkeys(args.protocol):
                results.append(evaluate_engine(model, windows, p, weights, prefill_weights=prefill, graphs=graphs,
                                               bar=bar, prefill_model=prefill_model))
    if prefill_model is not None:
        prefill_note = f"; the serving protocol's first half is prefilled by the {prefill_model.describe()}"
        saturated = sum(s.saturations() for s in prefill_model.states.values())
        if prefill_model.fmt == "e4m3":
            prefill_note += f" ({saturated} saturated SwiGLU FP8 values)"
    else:
        prefill_note = ("; the serving protocol's first half is prefilled on the BF16 reference path (float32, "
                        "BF16-valued weights)")
    print(f"{n_text_tokens} tokens in the text; {windows.shape[0]} windows of {windows.shape[1]} on the "
          f"{model.backend} path: weights {model.packed.weights}, cache {model.cache.fmt}, one token per step"
          + (prefill_note if "serving" in args.protocol else ""))
    print(format_table(results, model=weights.config.name, text=str(text)))
    if args.json:
        where = describe(model.device)
        Path(args.json).write_text(json.dumps([
            {"protocol": r.protocol, "windows": r.windows, "window": r.window, "scored_tokens": r.tokens,
             "nll_sum": r.nll_sum, "mean_nll": r.mean_nll, "ppl": r.ppl, "seconds": r.seconds,
             "backend": model.backend, "weights": model.packed.weights, "cache": model.cache.fmt,
             "prefill": (None if r.protocol != "serving" else
                         f"kernels-{prefill_model.fmt}" if prefill_model is not None else "reference-bf16"),
             "model": weights.config.name, **where} for r in results], indent=2) + "\n")
    return 0


# ---- futx pack ---------------------------------------------------------------------------------------------
def _configure_pack(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF Llama directory, .gguf file or 'smollm2-135m' (default)")
    p.add_argument("--weights", default="int4", choices=WEIGHT_FORMATS)
    p.add_argument("--gptq", default=None, help="a saved GPTQ result to use for --weights int4")
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--device", default=None, help="where to quantize (default: cuda if present, else cpu)")
    p.add_argument("--out", required=True, help="output directory (model.safetensors + futx-model.json)")


def _run_pack(args) -> int:
    import shutil
    import time

    import torch

    from futx.checkpoint import resolve

    from .load import load_packed

    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    packed = load_packed(args.model, args.weights, gptq=args.gptq, group_size=args.group_size, device=dev)
    out = packed.save(args.out)
    src = resolve(args.model)
    if src.is_dir() and (src / "tokenizer.json").is_file():
        shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
    gb = packed.projection_bytes() / 1e9
    print(f"packed {packed.config.name} ({packed.weights}, group {packed.group_size}) into {out}: {gb:.3f} GB of "
          f"projections, {time.perf_counter() - t0:.1f} s")
    return 0


def register_commands() -> None:
    from futx.cli import COMMANDS, register

    if "pack" in COMMANDS:  # main() may run more than once in a process (tests)
        return
    register("pack", "quantize a checkpoint for the decode kernels and save it (load it with --model DIR)",
             _configure_pack, _run_pack)
