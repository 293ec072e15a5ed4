"""The persistent decode layer (decode/persistent_layer.py, issue 29): a layer's projections, attention partials
and their combine as tasks of one launch per layer for one row, or 1..8 rows (".m8": the multi-token bodies), INT4
weights, per cache format with a mirror (the INT4 mirror rotated, as the engine cache keeps it) and head dim 128; the
model shape, the table, the layer count and the split count are runtime values. `decode.persistent.ring.*`
(decode/persistent_ring.py): the same layer, one row or 1..8 (".m8"), with a producer warp streaming the weights
through a shared-memory ring (".trace": with each task's timestamps)."""

from futx.runtime.catalog.decode_attention import SOURCES as ATTENTION_SOURCES
from futx.runtime.catalog.decode_linear import _SOURCES as LINEAR_SOURCES
from futx.runtime.registry import KernelSpec

SOURCES = tuple(dict.fromkeys(("decode/persistent_layer.py", "decode/persistent_loop.py", "decode/persistent_host.py",
                               "decode/persistent_schedule.py", *LINEAR_SOURCES, *ATTENTION_SOURCES)))
RING_SOURCES = ("decode/persistent_ring.py", *SOURCES)


CACHES = ("int4", "e4m3")   # the cache mirrors the layer kernel reads (no BF16-cache plan without the byte table)
HEAD_DIM = 128
TOKENS = (1, 8)             # token columns of the projection bodies: one row, or 1..8 rows
MAX_ROWS = TOKENS[-1]
BODIES = ("tiles", "ring")  # the projection tasks' bodies: the tile GEMV's, or a producer warp's ring


def tokens_for(rows: int) -> int:
    """The kernel's token columns for a step of `rows` rows."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"the persistent layer takes 1..{MAX_ROWS} rows, got {rows}")
    return 1 if rows == 1 else MAX_ROWS


def layer_key(cache: str, head_dim: int = HEAD_DIM, tokens: int = 1) -> str:
    return f"decode.persistent.layer.{cache}.d{head_dim}" + ("" if tokens == 1 else f".m{tokens}")


def ring_key(cache: str, head_dim: int = HEAD_DIM, tokens: int = 1, trace: bool = False, variant: str = "") -> str:
    return (f"decode.persistent.ring.{cache}.d{head_dim}" + ("" if tokens == 1 else f".m{tokens}")
            + (".trace" if trace else "") + (f".{variant}" if variant else ""))


# the ring layer's tuning space (scripts/tuning_space.py; PersistentStep(body="ring", variant=...)): the consumers
# reading each stage one ahead of its math, shallower rings (the routed kernel takes as many stages as fit), an
# epilogue warp, the consumers taking 2 or 4 stages at a time (their units' math in one basic block)
RING_TUNING = {"la": (("lookahead", True),), "s4": (("stages", 4),), "s8": (("stages", 8),),
               "ew": (("epilogue_warp", True),), "g2": (("group", 2),), "g4": (("group", 4),),
               "ewg2": (("epilogue_warp", True), ("group", 2)),
               # an attention partial's first cache tiles requested before its counter wait (issue 29 item 2)
               "pf": (("early_tiles", True),),
               "ewg2pf": (("epilogue_warp", True), ("group", 2), ("early_tiles", True))}
# diagnostic, wrong outputs: the consumers take and release every stage without its arithmetic (the layer at what the
# stream, the dependencies and attention allow; scripts/bench_ring_variants.py times it beside the others)
RING_TUNING["nm"] = (("no_math", True),)
RING_DIAGNOSTIC = ("nm",)
# also built traced (one row), for scripts/persistent_trace.py --variant
RING_TRACED_TUNING = ("g2", "ewg2", "nm", "pf", "ewg2pf")


def ring_spec(cache: str, tokens: int = 1, trace: bool = False, variant: str = "") -> KernelSpec:
    """The ring layer's kernel for one cache format, row kind and variant ("": the routed one, else RING_TUNING's)."""
    return KernelSpec(
        key=ring_key(cache, HEAD_DIM, tokens, trace, variant), module="decode.persistent_ring",
        params=(("cache", cache), ("head_dim", HEAD_DIM), ("trace", trace), ("tokens", tokens),
                *RING_TUNING.get(variant, ())),
        sources=RING_SOURCES, expect_sass=("HMMA",),
        doc=f"a decode layer ({'M = 1' if tokens == 1 else '1 <= M <= 8 as shared memory fits'}, INT4 weights "
            f"streamed by a producer warp through a shared-memory ring, {cache} cache mirror) as tasks of one "
            "persistent launch"
            + (", writing each task's timestamps (diagnostic: futx.engine.persistent_trace)" if trace else "")
            + (f"; tuning variant {variant}: {dict(RING_TUNING[variant])}" if variant else ""))


SPECS = [
    KernelSpec(key=layer_key(cache, HEAD_DIM, tokens), module="decode.persistent_layer",
               params=(("cache", cache), ("head_dim", HEAD_DIM), ("tokens", tokens)),
               sources=SOURCES, expect_sass=("HMMA",),
               doc=f"a decode layer ({'M = 1' if tokens == 1 else '1 <= M <= 8'}, INT4 weights, {cache} cache "
                   "mirror) as tasks of one persistent launch")
    for cache in CACHES for tokens in TOKENS
]
SPECS += [ring_spec(cache, tokens, trace) for cache in CACHES for tokens in TOKENS for trace in (False, True)]
