"""`futx serve`: an OpenAI-compatible HTTP server with continuous batching on the decode engine."""

from __future__ import annotations

import argparse
import sys

from . import validators as v
from .options import (add_cache_arguments, add_engine_arguments, add_model_arguments, add_speculative_arguments,
                      check_cache_options, check_engine_options, check_model_options, check_speculative_options)
from .registry import register

HELP = "OpenAI-compatible HTTP server with continuous batching (/v1/completions, /v1/chat/completions)"
PREFILL_NOTE = ("Prompts are prefilled by --prefill: kernels (the default on --backend kernels) runs futx's packed "
                "prefill block (FP8 or BF16 GEMMs with fused epilogues and prefill attention; the chunks of all "
                "requests in one batch, replayed as CUDA graphs per row bucket unless --no-graphs), writing K/V and "
                "the decode mirror straight into the engine's cache; reference (the default elsewhere) prefills "
                "on the BF16 reference path (float32, BF16-valued weights; chunked, request by request) and "
                "writes the K/V rows into the engine's cache. On --backend reference the whole model is the "
                "PyTorch reference. With --speculative ngram|dlite every decode step verifies up to --num-draft "
                "drafts per request in one block step (greedy requests: the same tokens; sampled requests: "
                "speculative rejection sampling, the same distribution); /health reports the acceptance.")


def configure(p: argparse.ArgumentParser) -> None:
    p.description = ("An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health, "
                     "/metrics in the Prometheus text format) "
                     "with continuous batching on the decode engine. " + PREFILL_NOTE)
    add_model_arguments(p)
    add_engine_arguments(p, batch_default=8)
    add_cache_arguments(p)
    add_speculative_arguments(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", type=v.nonempty, help="address to listen on")
    g.add_argument("--port", type=v.int_in(0, 65535), default=8000, help="port (0 picks a free one)")
    g.add_argument("--served-model-name", default=None, type=v.nonempty,
                   help="the model name clients send (default: the model config's name)")
    g.add_argument("--capacity", type=v.int_in(2), default=2048, help="cache positions per request: prompt + "
                   "max_tokens")
    g.add_argument("--max-queue", type=v.positive_int, default=64, help="requests that may wait for a slot; more "
                   "get 503")
    g.add_argument("--prefill-chunk", type=v.positive_int, default=512, help="prompt tokens prefilled per scheduler "
                   "tick")


def validate(args: argparse.Namespace) -> None:
    check_model_options(args)
    check_engine_options(args)
    check_cache_options(args)
    check_speculative_options(args)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from futx.serve.scheduler import Scheduler
    from futx.serve.server import App, start_site

    from .models import build_drafter, build_serving_engine

    engine, tok = build_serving_engine(args, args.capacity)
    scheduler = Scheduler(engine, tok, max_queue=args.max_queue, prefill_chunk=args.prefill_chunk,
                          drafter=build_drafter(args, engine), num_draft=args.num_draft or 0,
                          token_budget=args.token_budget, prefix_cache=not args.no_prefix_cache)
    name = args.served_model_name or engine.config.name
    app = App(scheduler, tok, (name,), engine.config.vocab_size).build()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def main() -> None:
        runner = await start_site(app, args.host, args.port)
        host, port = runner.addresses[0][:2]
        spec = (f"; speculative {args.speculative}, up to {args.num_draft} drafts per request and step"
                if args.speculative != "none" else "")
        lay = scheduler.layout
        pages = ("" if lay is None else f", {lay.pages} cache pages of {lay.page_size} positions (prefix cache "
                 f"{'on' if scheduler.prefix is not None else 'off'})")
        print(f"futx serve: {engine.describe()}; up to {engine.max_batch} requests of {engine.capacity} "
              f"positions{pages}; model '{name}'{spec}", file=sys.stderr)
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


register("serve", HELP, configure, run, validate)
