"""Serving: requests prefilled, batched continuously on the decode engine, streamed over HTTP.

    sampling.py   per-request sampling parameters and the host-side sampler
    detok.py      incremental detokenization with stop strings
    engines.py    what the scheduler steps: the reference model, or the decode engine + reference prefill
    scheduler.py  the request state machine and its loop (admit, prefill chunks, decode steps, retire)
    chat.py       chat messages -> prompt text (the tokenizer's template family)
    protocol.py   OpenAI request validation and response bodies
    server.py     the aiohttp app (/v1/completions, /v1/chat/completions, /v1/models, /health)
"""

from .sampling import SamplingParams
from .scheduler import Event, Handle, QueueFull, RequestTooLong, Scheduler

__all__ = ["Event", "Handle", "QueueFull", "RequestTooLong", "SamplingParams", "Scheduler"]
