"""`futx ppl`: perplexity of a text file, on the reference path or through the decode engine."""

from __future__ import annotations

import argparse

from futx.eval.protocols import ENGINE_PROTOCOLS, PROTOCOLS, WINDOW

from . import validators as v
from .options import add_engine_arguments, add_model_arguments, check_engine_options, check_model_options, is_packed
from .ppl_results import RunningResults
from .registry import register

HELP = "perplexity of a text file (gptq / serving / all-decode protocols)"


def configure(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--text", default=None, type=v.text_file,
                   help="UTF-8 text file (default: ../shared/data/wikitext-2-raw/wiki.test.raw beside the repo)")
    p.add_argument("--protocol", nargs="+", default=["gptq"], choices=PROTOCOLS, help="one or more protocols")
    p.add_argument("--window", type=v.int_in(2), default=WINDOW, help="tokens per window")
    p.add_argument("--max-windows", type=v.positive_int, default=None,
                   help="evaluate only the first N windows (default: all)")
    p.add_argument("--batch-size", type=v.positive_int, default=8, help="windows evaluated together")
    p.add_argument("--decode-chunk", type=v.positive_int, default=128,
                   help="new tokens per request per decode call (exactly equivalent to token-by-token)")
    p.add_argument("--stepwise", action="store_true", help="decode one token per call (slow on CPU)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", default=None, type=v.output_file,
                   help="write the results to this JSON file, rewritten after every batch (marked partial until "
                        "the run ends)")
    p.add_argument("--jsonl", default=None, type=v.output_file,
                   help="append the running result after every batch (partial results)")
    add_engine_arguments(p, batch_default=32)
    p.add_argument("--prefill-context", default=None, choices=("main", "mirror"),
                   help="serving protocol, --prefill kernels: prefill the first half in two chunks, the second "
                        "reading the first from the BF16 main copy (main) or through the decode mirror (mirror: "
                        "how a prompt sees a cached prefix on the INT4-only cache, --cache-main none)")
    p.set_defaults(backend="reference")


def validate(args: argparse.Namespace) -> None:
    if args.text is None:
        from futx.eval.data import default_text

        args.text = v.default_text_file(default_text, "--text", "../shared/data/wikitext-2-raw/wiki.test.raw")
    if "serving" in args.protocol and args.window < 4:   # half prefilled, the rest decoded: w/2 - 1 scored
        raise ValueError(f"--window {args.window} scores no token under --protocol serving (it needs at least 4)")
    check_model_options(args)
    check_engine_options(args)
    if args.backend != "reference":
        bad = [p for p in args.protocol if p not in ENGINE_PROTOCOLS]
        if bad:
            raise ValueError(f"--protocol {bad[0]} is a prefill of whole windows, which the decode engine does not "
                             f"run yet; use {' / '.join(ENGINE_PROTOCOLS)} with --backend {args.backend}")
        if is_packed(args.model):
            raise ValueError("--model: futx ppl needs the checkpoint (for the reference prefill and the float LM "
                             "head), not a packed directory")
    if args.prefill_context is not None:
        from .models import resolve_prefill

        if args.backend == "reference" or "serving" not in args.protocol or resolve_prefill(args) != "kernels":
            raise ValueError("--prefill-context applies to --protocol serving with --prefill kernels on the decode "
                             "engine (--backend kernels, or emulated)")


def _windows(tok, args):
    """(windows [n, W], tokens in the text): tokenized before any weights load, so a short text fails fast."""
    from futx.eval.perplexity import join_rows, make_windows, read_rows

    ids = tok.encode(join_rows(read_rows(args.text)))
    return make_windows(ids, args.window, args.max_windows), len(ids)


def run(args: argparse.Namespace) -> int:
    if args.backend == "reference":
        return _run_reference(args)
    return _run_engine(args)


def _run_reference(args: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm

    from futx.eval.device import describe
    from futx.eval.perplexity import evaluate, scored_per_window
    from futx.eval.runner import Runner
    from futx.tokenizer import load_tokenizer

    from .models import load_model

    windows, n_ids = _windows(load_tokenizer(args.model), args)
    weights, _ = load_model(args)
    runner = Runner(weights)
    where = describe(weights.device)

    def record(r) -> dict:
        return {"protocol": r.protocol, "windows": r.windows, "window": r.window, "scored_tokens": r.tokens,
                "decode": r.decode, "nll_sum": r.nll_sum, "mean_nll": r.mean_nll, "ppl": r.ppl,
                "seconds": r.seconds, "model": weights.config.name, "dtype": args.dtype, "text": str(args.text),
                "text_tokens": n_ids, **where}

    running = RunningResults(args.json, args.jsonl, windows.shape[0], record)
    # Protocols take turns batch by batch, so an interrupted run holds all of them on the same windows.
    protocols = list(dict.fromkeys(args.protocol))
    total = sum(windows.shape[0] * scored_per_window(p, args.window) for p in protocols)
    try:
        with torch.inference_mode(), tqdm(total=total, unit="tok", desc="ppl", disable=args.no_progress) as bar:
            for i in range(0, windows.shape[0], args.batch_size):
                for p in protocols:
                    r = evaluate(runner, windows[i:i + args.batch_size], p, batch_size=args.batch_size,
                                 decode_chunk=args.decode_chunk, stepwise=args.stepwise, bar=bar)
                    running.update(running.results[p].merge(r) if p in running.results else r)
                    bar.set_postfix({q: f"{x.ppl:.3f}" for q, x in running.results.items()})
    except KeyboardInterrupt:
        return running.report_interrupted("futx ppl", weights.config.name, args.text)
    print(f"{n_ids} tokens in the text; {windows.shape[0]} windows of {args.window} evaluated")
    print(running.table(weights.config.name, args.text))
    return 0


def _run_engine(args: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm

    from futx.checkpoint import load
    from futx.eval.device import describe
    from futx.eval.perplexity import scored_per_window
    from futx.engine.perplexity import evaluate_engine
    from futx.quant.simulated import quantized_weights

    from .models import build_engine, build_prefill, engine_device, resolve_prefill, tokenizer_for

    windows, n_ids = _windows(tokenizer_for(args.model), args)
    weights = load(args.model, dtype=torch.float32, device=engine_device(args))
    prefill_kind = resolve_prefill(args)
    protocols = list(dict.fromkeys(args.protocol))
    with torch.inference_mode():
        model, graphs = build_engine(args, windows.shape[1], float_weights=weights)
        prefill, prefill_model = None, None
        if "serving" in protocols and prefill_kind == "kernels":
            prefill_model = build_prefill(args, model, weights)
        elif "serving" in protocols:
            prefill = quantized_weights(weights, "bf16")
    where = describe(model.device)

    def record(r) -> dict:
        return {"protocol": r.protocol, "windows": r.windows, "window": r.window, "scored_tokens": r.tokens,
                "nll_sum": r.nll_sum, "mean_nll": r.mean_nll, "ppl": r.ppl, "seconds": r.seconds,
                "backend": model.backend, "weights": model.packed.weights, "cache": model.cache.fmt,
                "prefill": (None if r.protocol != "serving" else
                            f"kernels-{prefill_model.fmt}" if prefill_model is not None else "reference-bf16"),
                "prefill_context": args.prefill_context if r.protocol == "serving" else None,
                "model": weights.config.name, **where}

    running = RunningResults(args.json, args.jsonl, windows.shape[0], record)
    total = sum(windows.shape[0] * scored_per_window(p, windows.shape[1]) for p in protocols)
    try:
        with torch.inference_mode(), tqdm(total=total, unit="tok", desc="ppl (engine)",
                                          disable=args.no_progress) as bar:
            for p in protocols:
                evaluate_engine(model, windows, p, weights, prefill_weights=prefill, graphs=graphs, bar=bar,
                                prefill_model=prefill_model, on_batch=running.update,
                                prefill_context=args.prefill_context if p == "serving" else None)
    except KeyboardInterrupt:
        return running.report_interrupted("futx ppl", weights.config.name, args.text)
    if prefill_model is not None:
        prefill_note = f"; the serving protocol's first half is prefilled by the {prefill_model.describe()}"
        saturated = sum(s.saturations() for s in prefill_model.states.values())
        if prefill_model.fmt == "e4m3":
            prefill_note += f" ({saturated} saturated SwiGLU FP8 values)"
    else:
        prefill_note = ("; the serving protocol's first half is prefilled on the BF16 reference path (float32, "
                        "BF16-valued weights)")
    print(f"{n_ids} tokens in the text; {windows.shape[0]} windows of {windows.shape[1]} on the "
          f"{model.backend} path: weights {model.packed.weights}, cache {model.cache.fmt}, one token per step"
          + (prefill_note if "serving" in protocols else ""))
    print(running.table(weights.config.name, args.text))
    return 0


register("ppl", HELP, configure, run, validate)
