"""`futx pack`: quantize a checkpoint for the decode kernels once and save it (load it with --model DIR)."""

from __future__ import annotations

import argparse

from futx.engine.support import INT4_GROUPS, WEIGHT_FORMATS

from . import validators as v
from .options import MODEL_HELP, check_model_options
from .registry import register

HELP = "quantize a checkpoint for the decode kernels and save it (load it with --model DIR)"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, type=v.model, help=MODEL_HELP)
    p.add_argument("--weights", default="int4", choices=WEIGHT_FORMATS, help="decode weight format")
    p.add_argument("--gptq", default=None, type=v.input_file, help="a saved GPTQ result to use for --weights int4")
    p.add_argument("--group-size", type=v.int_choice(INT4_GROUPS), default=None,
                   help="INT4 group size (default: 128, or 64 where K needs it)")
    p.add_argument("--device", default=None, type=v.device,
                   help=f"where to quantize: {v.DEVICE_FORMS} (default: cuda if present, else cpu)")
    p.add_argument("--out", required=True, type=v.output_dir,
                   help="output directory (model.safetensors + futx-model.json)")


def validate(args: argparse.Namespace) -> None:
    check_model_options(args)
    if args.gptq and args.weights != "int4":
        raise ValueError(f"--gptq applies to --weights int4, not {args.weights}")


def run(args: argparse.Namespace) -> int:
    import shutil
    import time

    import torch

    from futx.checkpoint import resolve
    from futx.engine.load import load_packed

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


register("pack", HELP, configure, run, validate)
