"""The decode engine: a packed model, its KV cache and the decode step on futx's kernels.

    packed.py     the packed-model format (quantize once, save, load)
    support.py    what the kernels can serve (clear errors naming the dimension)
    cache.py      the KV cache in the kernels' layout (main copy + mirror, scratch slot)
    backends.py   the step's operations: futx kernels, or their PyTorch emulation
    model.py      the decode step, top to bottom
    graphs.py     the step captured per batch-size bucket as a CUDA graph (block steps: per bucket and width)
    generate.py   greedy generation with continuous batching over cache slots
    speculative.py speculative greedy generation: drafts verified in block steps (futx.speculative)
    perplexity.py perplexity through the engine (all-decode and serving protocols)
    load.py       a packed model from a checkpoint or a packed directory (what the `futx` commands call)
    persistent_reference.py  the persistent decode layer's task table run task by task in torch (issue 29)

The names below are imported on first use, so `futx.engine.support` stays cheap for the command line.
"""

from futx.lazy import lazy_exports

_EXPORTS = {"DecodeModel": "model", "StepBuffers": "model", "PackedModel": "packed", "pack_model": "packed",
            "random_packed": "packed"}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
