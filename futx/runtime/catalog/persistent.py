"""The persistent decode layer (decode/persistent_layer.py, issue 29): a layer's projections, attention partials
and their combine as tasks of one launch per layer at M = 1, INT4 weights, per cache format with a mirror (the INT4
mirror rotated, as the engine cache keeps it) and head dim 128; the model shape, the table, the layer count and the
split count are runtime values."""

from futx.runtime.catalog.decode_attention import SOURCES as ATTENTION_SOURCES
from futx.runtime.catalog.decode_linear import _SOURCES as LINEAR_SOURCES
from futx.runtime.registry import KernelSpec

SOURCES = tuple(dict.fromkeys(("decode/persistent_layer.py", "decode/persistent_loop.py", "decode/persistent_host.py",
                               "decode/persistent_schedule.py", *LINEAR_SOURCES, *ATTENTION_SOURCES)))


CACHES = ("int4", "e4m3")   # the cache mirrors the layer kernel reads (no BF16-cache plan without the byte table)
HEAD_DIM = 128


def layer_key(cache: str, head_dim: int = HEAD_DIM) -> str:
    return f"decode.persistent.layer.{cache}.d{head_dim}"


SPECS = [
    KernelSpec(key=layer_key(cache), module="decode.persistent_layer",
               params=(("cache", cache), ("head_dim", HEAD_DIM)),
               sources=SOURCES, expect_sass=("HMMA",),
               doc=f"a decode layer (M = 1, INT4 weights, {cache} cache mirror) as tasks of one persistent launch")
    for cache in CACHES
]
