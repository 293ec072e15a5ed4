"""`futx generate`: greedy generation, streamed; on the reference path, or through the serving scheduler on the
decode engine (several prompts batched with continuous batching; with --speculative, drafts verified in block
steps: the same tokens, fewer steps)."""

from __future__ import annotations

import argparse
import sys
import time

from futx import files

from . import validators as v
from .options import (add_cache_arguments, add_engine_arguments, add_model_arguments, add_speculative_arguments,
                      check_cache_options, check_engine_options, check_model_options, check_speculative_options)
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
    add_cache_arguments(p)
    add_speculative_arguments(p)
    p.add_argument("--json", default=None, type=v.output_file,
                   help="decode engine: write the outputs, steps and tokens/s (with --speculative also the "
                        "acceptance summary, per verification and per context-position bucket) to this JSON file")


def validate(args: argparse.Namespace) -> None:
    check_model_options(args)
    check_engine_options(args)
    check_cache_options(args)
    if args.prompts and args.backend == "reference":
        raise ValueError("--prompts runs on the decode engine (--backend kernels or emulated)")
    if args.prompts and not read_prompts(args):
        raise ValueError(f"--prompts: {args.prompts} holds no prompts (one per line)")
    check_speculative_options(args)
    if args.json and args.backend == "reference":
        raise ValueError("--json applies to the decode engine (--backend kernels or emulated)")


def read_prompts(args) -> list[str]:
    if args.prompts:
        return [ln for ln in files.read_text(args.prompts).splitlines() if ln.strip()]
    return [args.prompt]


def run(args: argparse.Namespace) -> int:
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

    from .models import build_drafter, build_serving_engine, tokenizer_for

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
    drafter = build_drafter(args, engine)
    scheduler = Scheduler(engine, tok, max_queue=len(prompts), drafter=drafter, num_draft=args.num_draft or 0,
                          token_budget=args.token_budget, prefix_cache=not args.no_prefix_cache)
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
    if drafter is not None:
        print(f"--speculative {args.speculative} --num-draft {args.num_draft}:", file=sys.stderr)
        for line in scheduler.acceptance.lines():
            print(line, file=sys.stderr)
    if args.json:
        import json

        from futx import atomic

        atomic.write_text(args.json, json.dumps({
            "speculative": args.speculative, "num_draft": args.num_draft, "engine": engine.describe(),
            "prompts": prompts, "outputs": [h.output for h in handles], "texts": [h.text for h in handles],
            "steps": stats.steps, "rows": stats.rows, "generated": stats.generated, "seconds": stats.seconds,
            "ms_per_step": stats.ms_per_step, "tokens_per_s": stats.tokens_per_s,
            "acceptance": scheduler.acceptance.summary() if drafter is not None else None}, indent=1) + "\n")
    return 0


register("generate", HELP, configure, run, validate)
