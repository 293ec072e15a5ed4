"""Prefill attention kernels (futx/prefill/attention.py): causal GQA over a packed batch, reading the BF16
KV cache the QKV prefill epilogue wrote. One variant per head dim; batch, request count, head counts
(GQA group 1..16), slot count and capacity are runtime values. No DSL imports."""

from futx.runtime.registry import KernelSpec

SOURCES = ("futx/prefill/attention.py", "futx/hardware.py")
HEAD_DIMS = (64, 128)


def attn_key(head_dim: int) -> str:
    return f"prefill.attn.bf16.d{head_dim}"


SPECS = [
    KernelSpec(key=attn_key(d), module="futx.prefill.attention", params=(("head_dim", d),), sources=SOURCES,
               expect_sass=("HGMMA",),
               doc=f"causal GQA prefill attention over a packed batch (chunked-prefill starts), head dim {d}: "
                   "TMA K/V ring, WGMMA Q K^T and P V, online softmax")
    for d in HEAD_DIMS
]
