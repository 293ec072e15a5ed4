"""`futx serve`, and the serving engine that `futx generate` on the decode engine shares."""

from __future__ import annotations

import argparse
import sys

PREFILL_NOTE = ("Prompts are prefilled by --prefill: kernels (the default on --backend kernels) runs futx's packed "
                "prefill block (FP8 or BF16 GEMMs with fused epilogues and prefill attention; the chunks of all "
                "requests in one batch, replayed as CUDA graphs per row bucket unless --no-graphs), writing K/V and "
                "the decode mirror straight into the engine's cache; reference (the default elsewhere) prefills "
                "on the BF16 reference path (float32, BF16-valued weights; chunked, request by request) and "
                "writes the K/V rows into the engine's cache. On --backend reference the whole model is the "
                "PyTorch reference.")


def load_float_weights(args):
    """The checkpoint's float32 weights for the reference prefill (a packed directory: its recorded source),
    or None when a packed directory's checkpoint is not at hand."""
    import torch

    from futx.checkpoint import load
    from futx.engine.cli import engine_device
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
    """(engine, tokenizer) for the --backend/--model/engine options; args.backend already resolved."""
    import torch

    from futx.engine.cli import build_engine, build_prefill, resolve_prefill, tokenizer_for
    from futx.engine.support import check_batch

    from .engines import DecodeEngine, ReferenceEngine

    check_batch(args.max_batch)
    prefill_kind = resolve_prefill(args)
    if capacity < 2:
        raise ValueError(f"--capacity must be at least 2, got {capacity}")
    if args.backend == "reference":
        from futx.cli import load_model

        weights, tok = load_model(args)
        return ReferenceEngine(weights, args.max_batch, capacity), tok
    from futx.engine.packed import is_packed_dir
    from futx.quant.simulated import quantized_weights

    if args.threads is not None:  # load_model does this on the reference path
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    tok = tokenizer or tokenizer_for(args.model)
    with torch.inference_mode():
        if args.model is not None and is_packed_dir(args.model):
            model, graphs = build_engine(args, capacity)  # checks --weights against the directory first
            weights = load_float_weights(args)
        else:
            weights = load_float_weights(args)
            model, graphs = build_engine(args, capacity, float_weights=weights)
        if prefill_kind == "kernels":
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


# ---- futx serve --------------------------------------------------------------------------------------------
def configure(p: argparse.ArgumentParser) -> None:
    from futx.cli import add_model_arguments
    from futx.engine.cli import add_engine_arguments

    p.description = ("An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health) "
                     "with continuous batching on the decode engine. " + PREFILL_NOTE)
    add_model_arguments(p)
    add_engine_arguments(p, batch_default=8)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model config's name)")
    g.add_argument("--capacity", type=int, default=2048, help="cache positions per request: prompt + max_tokens")
    g.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot; more get 503")
    g.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens prefilled per scheduler tick")


def run(args) -> int:
    import asyncio
    import logging

    from futx.engine.load import resolve_backend

    from .scheduler import Scheduler
    from .server import App, start_site

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    args.backend = resolve_backend(args.backend)
    engine, tok = build_serving_engine(args, args.capacity)
    scheduler = Scheduler(engine, tok, max_queue=args.max_queue, prefill_chunk=args.prefill_chunk)
    name = args.served_model_name or engine.config.name
    app = App(scheduler, tok, (name,), engine.config.vocab_size).build()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def main() -> None:
        runner = await start_site(app, args.host, args.port)
        host, port = runner.addresses[0][:2]
        print(f"futx serve: {engine.describe()}; up to {engine.max_batch} requests of {engine.capacity} "
              f"positions; model '{name}'", file=sys.stderr)
        print(f"futx serve: listening on http://{host}:{port}/v1", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    scheduler.start()
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        scheduler.stop()
    return 0


def register_commands() -> None:
    from futx.cli import COMMANDS, register

    if "serve" in COMMANDS:  # main() may run more than once in a process (tests)
        return
    register("serve", "OpenAI-compatible HTTP server with continuous batching (/v1/completions, "
             "/v1/chat/completions)", configure, run)
