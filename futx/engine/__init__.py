"""The decode engine: a packed model, its KV cache and the decode step on futx's kernels.

    packed.py     the packed-model format (quantize once, save, load)
    support.py    what the kernels can serve (clear errors naming the dimension)
    cache.py      the KV cache in the kernels' layout (main copy + mirror, scratch slot)
    backends.py   the step's operations: futx kernels, or their PyTorch emulation
    model.py      the decode step, top to bottom
    graphs.py     the step captured per batch-size bucket as a CUDA graph
    generate.py   greedy generation with continuous batching over cache slots
    perplexity.py perplexity through the engine (all-decode and serving protocols)
    load.py, cli.py  what `futx generate / ppl / pack` call
"""

from .model import DecodeModel, StepBuffers
from .packed import PackedModel, pack_model, random_packed

__all__ = ["DecodeModel", "PackedModel", "StepBuffers", "pack_model", "random_packed"]
