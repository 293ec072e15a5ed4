"""What the subcommands run on, built from their parsed options: the reference model, the decode engine (with
the kernel prefill) and the serving engine `futx serve` and `futx generate` on the engine share.

Called after validation (args.backend resolved); every import of torch and the engine happens in here.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .options import DTYPES


def set_threads(args) -> None:
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)


def load_model(args):
    """(weights, tokenizer) of the reference path for the --model/--dtype/--device/--threads options."""
    import torch

    from futx.checkpoint import load
    from futx.eval.device import setup_device
    from futx.tokenizer import load_tokenizer

    set_threads(args)
    setup_device(args.device)  # CUDA: TF32 off, so float32 means float32
    dtype = getattr(torch, DTYPES[args.dtype])
    return load(args.model, dtype=dtype, device=args.device), load_tokenizer(args.model)


def engine_device(args) -> str:
    return "cuda" if args.backend == "kernels" else args.device


def resolve_prefill(args) -> str:
    """--prefill after defaults: kernels on --backend kernels, else reference."""
    prefill = getattr(args, "prefill", None)
    if prefill is None:
        return "kernels" if args.backend == "kernels" else "reference"
    return prefill


def build_prefill(args, model, float_weights=None):
    """The kernel prefill (futx.engine.prefill.PrefillModel) over `model`'s cache, from the float checkpoint
    (gains folded, quantized to --prefill-format) or else from the packed model's own E4M3/BF16 projections;
    None when neither is at hand."""
    from futx.engine.prefill import PrefillModel, pack_prefill, prefill_from_packed

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


def paged(args) -> bool:
    """Whether the engine runs the paged cache: on every backend but the kernels by default; on the kernels when
    --pages / --cache-memory ask for it and the decode and prefill kernels read pages (KERNELS_PAGED of
    futx.engine.backends and futx.engine.prefill); never for subcommands without the cache options."""
    if getattr(args, "page_size", None) is None:
        return False
    if args.backend != "kernels":
        return True
    from futx.engine import backends, prefill

    ready = backends.KERNELS_PAGED and (prefill.KERNELS_PAGED or resolve_prefill(args) != "kernels")
    asked = bool(args.pages or args.cache_memory) or getattr(args, "cache_main", "bf16") == "none"
    if not ready and asked:
        raise ValueError("--pages / --cache-memory / --cache-main none: the kernels do not read a paged cache yet; on "
                         "--backend kernels "
                         "the cache is contiguous, --capacity positions for each of --max-batch requests")
    # on the kernels the paged cache is opt-in (--pages / --cache-memory) until the whole paged path has been run
    # end to end on a GPU (docs/serving.md); the kernels themselves are tested paged against contiguous
    return ready and asked


def cache_pages(args, capacity: int, page_bytes: int, reserved: int = 0) -> int:
    """--pages, or --cache-memory in whole pages (less `reserved` bytes: the staging pages), or by default the
    contiguous cache's memory: --max-batch requests of `capacity` positions."""
    from futx.paging import pages_for

    if args.pages:
        return args.pages
    if args.cache_memory:
        n = int((args.cache_memory * 1e9 - reserved) // page_bytes)
        if n < 1:
            raise ValueError(f"--cache-memory {args.cache_memory} GB holds no page ({page_bytes} bytes each"
                             + (f", after {reserved / 1e9:.2f} GB of staging pages)" if reserved else ")"))
        return n
    return args.max_batch * pages_for(capacity, args.page_size)


def staging_pages(args, capacity: int) -> int:
    """The INT4-only cache's staging pages (--cache-main none): --staging-pages, by default twice the pages of
    `capacity` positions (two long prompts prefilled at once); 0 when every page keeps its main copy."""
    from futx.paging import pages_for

    if getattr(args, "cache_main", "bf16") != "none":
        return 0
    least = pages_for(capacity, args.page_size)
    n = args.staging_pages or 2 * least
    if n < least:
        raise ValueError(f"--staging-pages {n}: one request of --capacity {capacity} needs {least} pages to be "
                         "prefilled")
    return n


def speculating(args) -> bool:
    return getattr(args, "speculative", "none") != "none"


def build_engine(args, capacity: int, float_weights=None):
    """(DecodeModel, GraphSteps or None) for the engine options; with --speculative the model's steps hold
    --max-batch x (--num-draft + 1) rows and the graphs are BlockGraphs (one per request bucket and width)."""
    from futx.engine.graphs import BlockGraphs, GraphSteps
    from futx.engine.load import load_packed
    from futx.engine.model import DecodeModel

    dev = engine_device(args)
    staging = staging_pages(args, capacity)   # (checked before the weights load)
    packed = load_packed(args.model, args.weights, gptq=args.gptq, group_size=args.group_size, device=dev,
                         float_weights=float_weights)
    from futx.engine.cache import EngineCache

    width = args.num_draft + 1 if speculating(args) else 1
    pages = None
    if paged(args):
        full = EngineCache.page_bytes(packed.config, args.cache, args.page_size)
        if staging:   # the INT4-only cache: pages of mirror only, beside the staging pages of both copies
            pages = cache_pages(args, capacity, EngineCache.page_bytes(packed.config, args.cache, args.page_size,
                                                                      main=False), staging * full)
        else:
            pages = cache_pages(args, capacity, full)
    model = DecodeModel(packed, args.cache, max_batch=args.max_batch, capacity=capacity,
                        backend="kernels" if args.backend == "kernels" else "emulated", device=dev,
                        max_rows=args.max_batch * width, pages=pages, page_size=getattr(args, "page_size", 128),
                        staging=staging)
    graphs = None
    if model.device.type == "cuda" and not args.no_graphs:
        graphs = BlockGraphs(model, width, max_requests=args.max_batch) if width > 1 else GraphSteps(model)
    return model, graphs


def build_drafter(args, engine):
    """The --speculative drafter (None without speculation)."""
    if not speculating(args):
        return None
    from futx.speculative.drafter import make_drafter

    model = engine.model   # a DecodeEngine (--speculative needs the decode engine)
    return make_drafter(args.speculative, args.draft, device=model.device, target=model.packed)


def tokenizer_for(spec):
    """The tokenizer of a model spec; a packed directory's own tokenizer.json, else its source checkpoint's."""
    from futx.engine.load import packed_source
    from futx.engine.packed import is_packed_dir
    from futx.tokenizer import Tokenizer, load_tokenizer

    if spec is not None and is_packed_dir(spec):
        if (Path(spec) / "tokenizer.json").is_file():
            return Tokenizer.from_hf_dir(Path(spec))
        spec = packed_source(spec)
    return load_tokenizer(spec)


def load_float_weights(args):
    """The checkpoint's float32 weights for the reference prefill (a packed directory: its recorded source),
    or None when a packed directory's checkpoint is not at hand."""
    import torch

    from futx.checkpoint import load
    from futx.engine.load import packed_source
    from futx.engine.packed import is_packed_dir

    spec = args.model
    if spec is not None and is_packed_dir(spec):
        spec = packed_source(spec)
        try:
            return None if spec is None else load(spec, dtype=torch.float32, device=engine_device(args))
        except ValueError as e:
            print(f"note: no reference prefill ({e}); prompts are read one token per decode step", file=sys.stderr)
            return None
    return load(spec, dtype=torch.float32, device=engine_device(args))


def build_serving_engine(args, capacity: int, tokenizer=None):
    """(engine, tokenizer) for the --backend/--model/engine options."""
    import torch

    from futx.serve.engines import DecodeEngine, ReferenceEngine

    if capacity < 2:
        raise ValueError(f"--capacity must be at least 2, got {capacity}")
    if args.backend == "reference":
        from futx.paging import PageLayout

        weights, tok = load_model(args)
        layout = None
        if paged(args):
            c = weights.config
            per_page = 2 * c.num_hidden_layers * c.num_key_value_heads * args.page_size * c.head_dim \
                * weights.dtype.itemsize
            layout = PageLayout.for_capacity(args.page_size, cache_pages(args, capacity, per_page), args.max_batch,
                                             capacity)
        return ReferenceEngine(weights, args.max_batch, capacity, layout), tok
    from futx.engine.packed import is_packed_dir
    from futx.quant.simulated import quantized_weights

    set_threads(args)
    tok = tokenizer or tokenizer_for(args.model)
    with torch.inference_mode():
        if args.model is not None and is_packed_dir(args.model):
            model, graphs = build_engine(args, capacity)
            weights = load_float_weights(args)
        else:
            weights = load_float_weights(args)
            model, graphs = build_engine(args, capacity, float_weights=weights)
        if resolve_prefill(args) == "kernels":
            prefill_model = build_prefill(args, model, weights)
            if prefill_model is None:
                print(f"note: no kernel prefill (no checkpoint, and the packed weights are {model.packed.weights}, "
                      f"not {args.prefill_format}); prompts are read one token per decode step", file=sys.stderr)
            prefill_graphs = None
            if prefill_model is not None and graphs is not None and prefill_model.backend == "kernels":
                from futx.engine.prefill_graphs import PrefillGraphs

                rows = min(getattr(args, "prefill_chunk", 512), capacity)
                prefill_graphs = PrefillGraphs(prefill_model, max_rows=rows, max_requests=args.max_batch)
            return DecodeEngine(model, graphs, None, prefill_model, prefill_graphs), tok
        prefill = quantized_weights(weights, "bf16") if weights is not None else None
    return DecodeEngine(model, graphs, prefill), tok
