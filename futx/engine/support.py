"""What the kernel path can serve: formats, and shape checks that name the unsupported dimension.

Everything here is checked before any weight is packed or kernel launched, so a model the kernels
cannot run fails with a message, never with wrong numbers.
"""

from __future__ import annotations

from decode import plan
from futx.config import LlamaConfig

WEIGHT_FORMATS = ("int4", "e4m3", "bf16")
CACHE_FORMATS = ("int4", "e4m3", "bf16")   # "int4" is the Hadamard-rotated INT4 mirror
HEAD_DIMS = (64, 128)                       # decode attention kernels
MAX_GQA_GROUP = 8                           # query heads per KV head (decode.attn_plan.MAX_GROUP)
MAX_BATCH = plan.MAX_M                      # rows of one decode projection launch
INT4_GROUPS = (64, 128)                     # INT4 group sizes with compiled decode kernels
BLOCK_K, BLOCK_N = 64, 16                   # projection K and N granularity (futx.quant.layouts)
CACHE_ALIGN = 8                             # capacity granularity of the INT4/E4M3 mirrors


class UnsupportedModel(ValueError):
    """The model or format cannot run on the decode kernels (the message names the dimension)."""


def check_formats(weights: str, cache: str) -> None:
    if weights not in WEIGHT_FORMATS:
        raise UnsupportedModel(f"unknown weight format {weights!r}; the kernels take {', '.join(WEIGHT_FORMATS)}")
    if cache not in CACHE_FORMATS:
        raise UnsupportedModel(f"unknown cache format {cache!r}; the kernels take {', '.join(CACHE_FORMATS)}")


def check_model(config: LlamaConfig, weights: str = "bf16", group_size: int = 128) -> None:
    """Raise UnsupportedModel naming the first dimension the decode kernels cannot serve."""
    check_formats(weights, "bf16")
    c = config
    if c.head_dim not in HEAD_DIMS:
        raise UnsupportedModel(f"head_dim = {c.head_dim}: the decode attention kernels support head dims "
                               f"{HEAD_DIMS}")
    if c.group_size > MAX_GQA_GROUP:
        raise UnsupportedModel(f"{c.num_attention_heads} query heads over {c.num_key_value_heads} KV heads = "
                               f"{c.group_size} per KV head; the decode attention kernels take at most "
                               f"{MAX_GQA_GROUP}")
    for name, n, k in (("qkv", c.qkv_size, c.hidden_size), ("o", c.hidden_size, c.q_size),
                       ("gate/up", 2 * c.intermediate_size, c.hidden_size),
                       ("down", c.hidden_size, c.intermediate_size)):
        if k % BLOCK_K:
            raise UnsupportedModel(f"{name} projection input size K = {k} is not a multiple of {BLOCK_K} "
                                   "(hidden_size / intermediate_size / heads * head_dim)")
        if n % BLOCK_N:
            raise UnsupportedModel(f"{name} projection output size N = {n} is not a multiple of {BLOCK_N}")
        if weights == "int4" and k % group_size:
            raise UnsupportedModel(f"{name} projection input size K = {k} is not a multiple of the INT4 group "
                                   f"size {group_size}")
    if c.intermediate_size % 8:
        raise UnsupportedModel(f"intermediate_size = {c.intermediate_size}: the SwiGLU output must be a multiple "
                               "of 8 channels")
    if weights == "int4" and group_size not in INT4_GROUPS:
        raise UnsupportedModel(f"INT4 group size {group_size} has no decode kernel (supported: {INT4_GROUPS})")


def check_batch(max_batch: int) -> None:
    if not 1 <= max_batch <= MAX_BATCH:
        raise ValueError(f"max_batch must be in [1, {MAX_BATCH}] (rows of one decode projection), got {max_batch}")


def check_capacity(cache: str, capacity: int) -> None:
    if capacity < 1:
        raise UnsupportedModel(f"cache capacity must be positive, got {capacity}")
    if cache != "bf16" and capacity % CACHE_ALIGN:
        raise UnsupportedModel(f"cache capacity {capacity} must be a multiple of {CACHE_ALIGN} for the "
                               f"{cache} mirror")


def round_capacity(capacity: int) -> int:
    """The smallest capacity >= `capacity` every cache format accepts."""
    return -(-capacity // CACHE_ALIGN) * CACHE_ALIGN
