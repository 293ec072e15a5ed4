"""`futx train-draft`: train a DLite draft head for a model (futx.speculative.dlite_train) and save it as
OUT/draft.safetensors + OUT/draft.json (use it with --speculative dlite --draft OUT)."""

from __future__ import annotations

import argparse
import sys
from argparse import ArgumentTypeError
from pathlib import Path

from . import validators as v
from .options import MODEL_HELP, check_model_options, is_packed
from .registry import register

HELP = "train a DLite speculative-decoding draft head for a model on enwiki text (two stages)"
DEFAULTS = dict(num_draft=4, stage1_steps=6000, stage2_steps=3000, windows=256, seq_len=2048, batch_size=512,
                lr=1e-3, seed=0, width=0, depth=2, stage2_prompts=1024, gen_len=128, eval_every=1000)


def positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise ArgumentTypeError(f"{value!r} is not a number") from None
    if not x > 0 or x != x or x == float("inf"):
        raise ArgumentTypeError(f"must be a positive number, got {value}")
    return x


def configure(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--model", default=None, type=v.model, help=MODEL_HELP)
    p.add_argument("--data", default=None, type=v.text_file,
                   help="UTF-8 training text, one paragraph per line (default: "
                        "../shared/data/enwiki-sample/enwiki-sample.txt beside the repo); never the WikiText-2 test "
                        "split")
    p.add_argument("--out", required=True, type=v.output_dir,
                   help="output directory: draft.safetensors + draft.json (created)")
    p.add_argument("--num-draft", type=v.int_in(1, 7), default=d["num_draft"],
                   help="k: draft tokens per verification the head is trained for (its k_max)")
    p.add_argument("--stage1-steps", type=v.int_in(0), default=d["stage1_steps"],
                   help="stage 1 steps (teacher forcing on the target's hidden states of enwiki windows)")
    p.add_argument("--stage2-steps", type=v.int_in(0), default=d["stage2_steps"],
                   help="stage 2 steps (end to end on the target's greedy continuations)")
    p.add_argument("--windows", type=v.positive_int, default=d["windows"],
                   help="stage 1 training windows of --seq-len tokens (fewer if the text is shorter)")
    p.add_argument("--seq-len", type=v.int_in(16), default=d["seq_len"],
                   help="tokens per stage 1 window, and the longest stage 2 context")
    p.add_argument("--batch-size", type=v.positive_int, default=d["batch_size"], help="positions per training step")
    p.add_argument("--lr", type=positive_float, default=d["lr"], help="stage 1 peak learning rate (stage 2: half)")
    p.add_argument("--stage2-prompts", type=v.positive_int, default=d["stage2_prompts"],
                   help="greedy continuations generated for stage 2")
    p.add_argument("--gen-len", type=v.int_in(8), default=d["gen_len"],
                   help="tokens per greedy continuation (at most half of --seq-len)")
    p.add_argument("--width", type=v.int_in(0), default=d["width"], help="head width (0: the model's hidden size)")
    p.add_argument("--depth", type=v.positive_int, default=d["depth"], help="MLPs in the head's cell")
    p.add_argument("--eval-every", type=v.int_in(0), default=d["eval_every"],
                   help="steps between held-out evaluations (0: at the end of each stage only)")
    p.add_argument("--device", default=None, type=v.device,
                   help=f"{v.DEVICE_FORMS} (default: cuda if present, else cpu); on CUDA the target runs in bf16 "
                        f"and training under bf16 autocast")
    p.add_argument("--threads", type=v.positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=v.int_in(0), default=d["seed"], help="seed of the head's init and the sampling")
    p.add_argument("--cache", default=None, type=v.output_dir,
                   help="where stage 1 keeps the target's hidden states (safetensors chunks; reused by a later run "
                        "with the same model, text and windows) (default: OUT/cache)")
    p.add_argument("--no-cache", action="store_true", help="keep the hidden states in memory only")
    p.add_argument("--json", default=None, type=v.output_file,
                   help="write the training metrics to this JSON file (also written on Ctrl-C, marked partial)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def validate(args: argparse.Namespace) -> None:
    if args.data is None:
        from futx.speculative.dlite_data import default_data

        args.data = v.default_text_file(default_data, "--data", "../shared/data/enwiki-sample/enwiki-sample.txt")
    if Path(args.data).name == "wiki.test.raw":
        raise ValueError(f"--data {args.data}: the WikiText-2 test split is for reporting perplexity, never for "
                         f"training; use ../shared/data/enwiki-sample")
    k = args.num_draft
    if args.seq_len < 2 * (k + 2):
        raise ValueError(f"--seq-len {args.seq_len} is too short for --num-draft {k} (at least {2 * (k + 2)})")
    if args.gen_len > args.seq_len // 2:
        raise ValueError(f"--gen-len {args.gen_len} is more than half of --seq-len {args.seq_len}")
    if args.gen_len < k + 2:
        raise ValueError(f"--gen-len {args.gen_len} is too short for --num-draft {k} (at least {k + 2})")
    if args.cache is not None and args.no_cache:
        raise ValueError("--cache and --no-cache contradict each other")
    check_model_options(args)
    if is_packed(args.model):
        raise ValueError(f"--model {args.model}: train-draft needs the checkpoint the packed model was made from "
                         f"(the head reads the reference model's hidden states), not a packed directory")


def _summary(ev: dict) -> str:
    by = ", ".join(f"{b}: {x['accepted_mean']:.3f}" for b, x in ev["by_position"].items())
    return (f"per-position accuracy {ev['accuracy']}, mean accepted drafts {ev['accepted_mean']:.3f} "
            f"({ev['tokens_per_verification']:.3f} tokens per verification; by context position {by})")


def run(args: argparse.Namespace) -> int:
    import json

    import torch

    from futx.atomic import write_text
    from futx.checkpoint import DEFAULT_MODEL, load, resolve
    from futx.eval.device import setup_device
    from futx.speculative.dlite_train import TrainOptions, Trainer
    from futx.tokenizer import load_tokenizer

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dev = setup_device(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = None if args.no_cache else Path(args.cache) if args.cache else out / "cache"
    opts = TrainOptions(k=args.num_draft, seq_len=args.seq_len, windows=args.windows, stage1_steps=args.stage1_steps,
                        stage2_steps=args.stage2_steps, batch_size=args.batch_size, lr=args.lr,
                        stage2_prompts=args.stage2_prompts, gen_len=args.gen_len, width=args.width, depth=args.depth,
                        eval_every=args.eval_every, device=str(dev), seed=args.seed)
    spec = DEFAULT_MODEL if args.model is None or str(args.model).lower() == DEFAULT_MODEL \
        else str(resolve(args.model).resolve())
    tok = load_tokenizer(args.model)
    weights = load(args.model, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, device=dev)
    log = (lambda s: None) if args.no_progress else (lambda s: print(s, file=sys.stderr))
    trainer = Trainer(weights, tok, args.data, opts, cache_dir=cache, progress=not args.no_progress, log=log,
                      target_model=spec)
    print(f"DLite head for {weights.config.name} on {dev}: {trainer.head.num_parameters() / 1e6:.2f}M parameters, "
          f"k = {opts.k}; data {args.data}", file=sys.stderr)

    def save(partial: bool) -> None:
        m = trainer.metrics
        trainer.head.config.training = {**trainer.head.config.training, "partial": partial,
                                        "stage1_steps_done": m["stage1"].get("steps_done", 0),
                                        "stage2_steps_done": m["stage2"].get("steps_done", 0)}
        if "final" in m:
            trainer.head.config.training["greedy_eval"] = m["final"]["greedy_eval"]
        trainer.head.save(out)
        if args.json:
            write_text(args.json, json.dumps({**m, "partial": partial, "model": weights.config.name,
                                              "out": str(out), "data": str(args.data)}, indent=2) + "\n")

    try:
        metrics = trainer.run()
    except KeyboardInterrupt:
        m = trainer.metrics
        if m["stage1"].get("steps_done", 0) or m["stage2"].get("steps_done", 0):
            save(partial=True)
            print(f"futx train-draft: interrupted; the head so far (stage 1 {m['stage1'].get('steps_done', 0)} / "
                  f"stage 2 {m['stage2'].get('steps_done', 0)} steps) is in {out}", file=sys.stderr)
        else:
            print("futx train-draft: interrupted before any training step; nothing saved", file=sys.stderr)
        return 130
    save(partial=False)
    print(f"saved {out / 'draft.safetensors'} and {out / 'draft.json'} ({metrics['seconds']:.0f} s)")
    print(f"held-out greedy continuations: {_summary(metrics['final']['greedy_eval'])}")
    en = metrics["final"]["enwiki_eval"]
    print(f"held-out enwiki (teacher forced): accuracy {en['accuracy']}, sum of prefix products "
          f"{en['expected_accepted']:.3f}")
    return 0


register("train-draft", HELP, configure, run, validate)
