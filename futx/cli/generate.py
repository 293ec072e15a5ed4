"""`futx generate`: greedy generation, streamed; on the reference path, or through the serving scheduler on the
decode engine (several prompts batched with continuous batching)."""

from __future__ import annotations

import argparse
import sys
import time

from futx import files

from . import validators as v
from .options import (add_engine_arguments, add_model_arguments, add_speculative_arguments, check_engine_options,
                      check_model_options, check_speculative_options)
from .registry import register

HELP = "greedy generation on the reference path (streams tokens, reports tokens/s)"


def configure(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--prompt", default="The capital of France is", type=v.nonempty, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=v.positive_int, default=64, help="tokens to generate at most")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--prompts", default=None, type=v.text_file,
                   help="a UTF-8 text file of prompts, one per line, generated together (engine backends)")
    add_engine_arguments(p, batch_default=8)
    add_speculative_arguments(p)
    p.add_argument("--json", default=None, type=v.output_file,
                   help="with --speculative: write the outputs, tokens/s and the acceptance summary (per "
                        "verification and per context-position bucket) to this JSON file")


def validate(args: argparse.Namespace) -> None:
    check_model_options(args)
    check_engine_options(args)
    if args.prompts and args.backend == "reference":
        raise ValueError("--prompts runs on the decode engine (--backend kernels or emulated)")
    if args.prompts and not read_prompts(args):
        raise ValueError(f"--prompts: {args.prompts} holds no prompts (one per line)")
    check_speculative_options(args)
    if args.json and args.speculative == "none":
        raise ValueError("--json applies to --speculative ngram or dlite")


def read_prompts(args) -> list[str]:
    if args.prompts:
        return [ln for ln in files.read_text(args.prompts).splitlines() if ln.strip()]
    return [args.prompt]


def run(args: argparse.Namespace) -> int:
    if args.speculative != "none":
        return _run_speculative(args)
    return _run_reference(args) if args.backend == "reference" else _run_engine(args)


def _run_reference(args: argparse.Namespace) -> int:
    import torch

    from futx.kvcache import KVCache
    from futx.reference import PackedBatch, forward

    from .models import load_model

    weights, tok = load_model(args)
    config = weights.config
    ids = tok.encode(tok.chat_prompt(args.prompt) if args.chat else args.prompt)
    if not ids:
        raise ValueError("--prompt encodes to no tokens")
    cache = KVCache(config, 1, len(ids) + args.max_new_tokens, dtype=weights.dtype, device=weights.device)
    out = sys.stdout
    out.write(args.prompt if not args.chat else "")
    out.flush()

    with torch.inference_mode():
        t0 = time.perf_counter()
        tokens = torch.tensor(ids, device=weights.device)
        logits = forward(config, weights, tokens, PackedBatch.from_lengths([len(ids)], device=weights.device), cache)
        t_prefill = time.perf_counter() - t0
        generated: list[int] = []
        shown = ""
        t1 = time.perf_counter()
        for step in range(args.max_new_tokens):
            nxt = int(logits[-1].argmax())
            if nxt in tok.eos_ids and not args.ignore_eos:
                break
            generated.append(nxt)
            text = tok.decode(generated, skip_special=True)
            if not text.endswith("\ufffd"):  # hold back an incomplete UTF-8 sequence
                out.write(text[len(shown):])
                out.flush()
                shown = text
            if step + 1 == args.max_new_tokens:
                break
            pos = len(ids) + len(generated) - 1
            logits = forward(config, weights, torch.tensor([nxt], device=weights.device),
                             PackedBatch.decode([pos], device=weights.device), cache, phase="decode")
        t_decode = time.perf_counter() - t1
    out.write(tok.decode(generated, skip_special=True)[len(shown):])  # whatever was held back
    out.flush()
    n = len(generated)
    rate = n / t_decode if t_decode > 0 else float("inf")
    print(f"\n\n[{config.name}, {args.dtype} on {args.device}] prefill {len(ids)} tokens in {t_prefill:.2f} s; "
          f"generated {n} tokens in {t_decode:.2f} s: {rate:.1f} tokens/s", file=sys.stderr)
    return 0


def _run_engine(args: argparse.Namespace) -> int:
    """Prompts through the serving scheduler (prefill, then continuous batching on the decode step)."""
    from futx.serve.sampling import SamplingParams
    from futx.serve.scheduler import Scheduler

    from .models import build_serving_engine, tokenizer_for

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


def _run_speculative(args: argparse.Namespace) -> int:
    """Greedy generation with drafts verified in block steps (futx.engine.speculative): prompts are read by the
    decode step num-draft + 1 tokens at a time (no prefill), the output is the target's greedy decoding."""
    import json

    import torch

    from futx import atomic
    from futx.engine.graphs import BlockGraphs
    from futx.engine.load import load_packed
    from futx.engine.model import DecodeModel
    from futx.engine.speculative import generate_speculative
    from futx.speculative.drafter import make_drafter

    from .models import engine_device, set_threads, tokenizer_for

    set_threads(args)
    tok = tokenizer_for(args.model)
    prompts = read_prompts(args)
    ids = [tok.encode(tok.chat_prompt(p) if args.chat else p) for p in prompts]
    for i, x in enumerate(ids):
        if not x:
            raise ValueError(f"prompt {i} encodes to no tokens")
    k = args.num_draft
    dev = engine_device(args)
    with torch.inference_mode():
        packed = load_packed(args.model, args.weights, gptq=args.gptq, group_size=args.group_size, device=dev)
        model = DecodeModel(packed, args.cache, max_batch=args.max_batch,
                            capacity=max(len(x) for x in ids) + args.max_new_tokens,
                            backend="kernels" if args.backend == "kernels" else "emulated", device=dev,
                            max_rows=args.max_batch * (k + 1))
        graphs = None
        if model.device.type == "cuda" and not args.no_graphs:
            graphs = BlockGraphs(model, k + 1, max_requests=args.max_batch)
        drafter = make_drafter(args.speculative, args.draft, device=model.device)
        single = len(prompts) == 1
        out = sys.stdout
        shown, generated = "", []

        def stream(index: int, token: int) -> None:
            nonlocal shown
            generated.append(token)
            text = tok.decode(generated, skip_special=True)
            if not text.endswith("\ufffd"):  # hold back an incomplete UTF-8 sequence
                out.write(text[len(shown):])
                out.flush()
                shown = text

        if single and not args.chat:
            out.write(prompts[0])
            out.flush()
        eos = () if args.ignore_eos else tok.eos_ids
        outputs, stats = generate_speculative(model, ids, args.max_new_tokens, eos_ids=eos, drafter=drafter,
                                              num_draft=k, graphs=graphs, on_token=stream if single else None)
    texts = [tok.decode(o, skip_special=True) for o in outputs]
    if single:
        out.write(texts[0][len(shown):] + "\n")
    else:
        for i, (p, t) in enumerate(zip(prompts, texts)):
            out.write(f"[{i}] {p}{t}\n")
    out.flush()
    print(f"\n[{packed.weights}/{args.cache} on {model.backend}, --speculative {args.speculative} --num-draft {k}] "
          f"{len(prompts)} prompt(s), {stats.steps} steps ({stats.rows} rows; prompts read up to {k + 1} tokens per "
          f"step), {stats.generated} tokens generated: {stats.ms_per_step:.3f} ms per step (median), "
          f"{stats.tokens_per_s:.1f} generated tokens/s", file=sys.stderr)
    for line in stats.acceptance.lines():
        print(line, file=sys.stderr)
    if args.json:
        atomic.write_text(args.json, json.dumps({
            "speculative": args.speculative, "num_draft": k, "backend": model.backend, "weights": packed.weights,
            "cache": args.cache, "prompts": prompts, "outputs": outputs, "texts": texts, **stats.summary()},
            indent=2) + "\n")
    return 0


register("generate", HELP, configure, run, validate)
