"""Prefill attention kernels (futx/prefill/attention.py): causal GQA over a packed batch, reading the BF16
KV cache the QKV prefill epilogue wrote. One variant per head dim over a contiguous cache, and one per head dim
and page size over a paged cache (futx.paging: K/V tiles through a block table); batch, request count, head
counts (GQA group 1..16), slot / page counts, capacity and table width are runtime values. No DSL imports."""

from futx.runtime.registry import KernelSpec

SOURCES = ("futx/prefill/attention.py", "futx/hardware.py")
HEAD_DIMS = (64, 128)
PAGE_SIZES = (128, 256)   # the paged variants built ahead of time (futx.paging.DEFAULT_PAGE_SIZE and one more)


def attn_key(head_dim: int, page_size: int = 0) -> str:
    return f"prefill.attn.bf16.d{head_dim}" + (f".p{page_size}" if page_size else "")


SPECS = [
    KernelSpec(key=attn_key(d), module="futx.prefill.attention", params=(("head_dim", d),), sources=SOURCES,
               expect_sass=("HGMMA",),
               doc=f"causal GQA prefill attention over a packed batch (chunked-prefill starts), head dim {d}: "
                   "TMA K/V ring, WGMMA Q K^T and P V, online softmax")
    for d in HEAD_DIMS
] + [
    KernelSpec(key=attn_key(d, p), module="futx.prefill.attention", params=(("head_dim", d), ("page_size", p)),
               sources=SOURCES, expect_sass=("HGMMA",),
               doc=f"causal GQA prefill attention over a paged cache (pages of {p} positions, K/V tiles through "
                   f"the block table), head dim {d}")
    for d in HEAD_DIMS for p in PAGE_SIZES
]
