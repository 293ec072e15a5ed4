"""Compile entry points of decode attention over a paged cache (futx.paging): the contiguous entries of
decode.attention with the block table [slots + 1, max_pages] int32 after `slots`; the cache tensors' first mode is
the page and their position extent the page size (attn_plan.entry_tensors(fmt, fused_qkv, paged=True)).

Kept apart from decode.attention so that the contiguous entries stay as they were; the kernel is the same class,
its plan's page_size selects the paged addressing at trace time.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32


def make_paged_entry(plan, kern):
    """The jit entry of a paged plan (kern: its decode.attention.DecodeAttention)."""
    if plan.fused_qkv:
        return _fused(plan, kern)
    if plan.fmt == "bf16":
        @cute.jit
        def decode_attention_paged_bf16(q: cute.Tensor, k_new: cute.Tensor, v_new: cute.Tensor,
                                        positions: cute.Tensor, slots: cute.Tensor, block_table: cute.Tensor,
                                        k_cache: cute.Tensor, v_cache: cute.Tensor, out: cute.Tensor,
                                        ws_o: cute.Tensor, ws_ml: cute.Tensor, counters: cute.Tensor,
                                        softmax_scale: Float32, stream):
            kern.launch(kern.tensors(q=q, k_new=k_new, v_new=v_new, positions=positions, slots=slots,
                                     block_table=block_table, k_cache=k_cache, v_cache=v_cache, out=out, ws_o=ws_o,
                                     ws_ml=ws_ml, counters=counters), softmax_scale, stream)
        return decode_attention_paged_bf16
    if plan.fmt == "int4":
        @cute.jit
        def decode_attention_paged_int4(q: cute.Tensor, k_new: cute.Tensor, v_new: cute.Tensor,
                                        positions: cute.Tensor, slots: cute.Tensor, block_table: cute.Tensor,
                                        k_cache: cute.Tensor, v_cache: cute.Tensor, k_mirror: cute.Tensor,
                                        k_scale: cute.Tensor, v_mirror: cute.Tensor, v_scale: cute.Tensor,
                                        lut: cute.Tensor, out: cute.Tensor, ws_o: cute.Tensor, ws_ml: cute.Tensor,
                                        counters: cute.Tensor, softmax_scale: Float32, stream):
            kern.launch(kern.tensors(q=q, k_new=k_new, v_new=v_new, positions=positions, slots=slots,
                                     block_table=block_table, k_cache=k_cache, v_cache=v_cache, k_mirror=k_mirror,
                                     k_scale=k_scale, v_mirror=v_mirror, v_scale=v_scale, lut=lut, out=out,
                                     ws_o=ws_o, ws_ml=ws_ml, counters=counters), softmax_scale, stream)
        return decode_attention_paged_int4

    @cute.jit
    def decode_attention_paged_e4m3(q: cute.Tensor, k_new: cute.Tensor, v_new: cute.Tensor, positions: cute.Tensor,
                                    slots: cute.Tensor, block_table: cute.Tensor, k_cache: cute.Tensor,
                                    v_cache: cute.Tensor, k_mirror: cute.Tensor, k_scale: cute.Tensor,
                                    v_mirror: cute.Tensor, v_scale: cute.Tensor, out: cute.Tensor, ws_o: cute.Tensor,
                                    ws_ml: cute.Tensor, counters: cute.Tensor, softmax_scale: Float32, stream):
        kern.launch(kern.tensors(q=q, k_new=k_new, v_new=v_new, positions=positions, slots=slots,
                                 block_table=block_table, k_cache=k_cache, v_cache=v_cache, k_mirror=k_mirror,
                                 k_scale=k_scale, v_mirror=v_mirror, v_scale=v_scale, out=out, ws_o=ws_o,
                                 ws_ml=ws_ml, counters=counters), softmax_scale, stream)
    return decode_attention_paged_e4m3


def _fused(plan, kern):
    """The engine's paged entries: q, k, v from the QKV projection's output, RoPE in the kernel."""
    if plan.fmt == "bf16":
        @cute.jit
        def decode_attention_paged_qkv_bf16(qkv: cute.Tensor, positions: cute.Tensor, slots: cute.Tensor,
                                            block_table: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor,
                                            rope: cute.Tensor, out: cute.Tensor, ws_o: cute.Tensor,
                                            ws_ml: cute.Tensor, counters: cute.Tensor, softmax_scale: Float32,
                                            stream):
            kern.launch(kern.tensors(qkv=qkv, positions=positions, slots=slots, block_table=block_table,
                                     k_cache=k_cache, v_cache=v_cache, rope=rope, out=out, ws_o=ws_o, ws_ml=ws_ml,
                                     counters=counters), softmax_scale, stream)
        return decode_attention_paged_qkv_bf16
    if plan.fmt == "int4":
        @cute.jit
        def decode_attention_paged_qkv_int4(qkv: cute.Tensor, positions: cute.Tensor, slots: cute.Tensor,
                                            block_table: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor,
                                            k_mirror: cute.Tensor, k_scale: cute.Tensor, v_mirror: cute.Tensor,
                                            v_scale: cute.Tensor, lut: cute.Tensor, rope: cute.Tensor,
                                            out: cute.Tensor, ws_o: cute.Tensor, ws_ml: cute.Tensor,
                                            counters: cute.Tensor, softmax_scale: Float32, stream):
            kern.launch(kern.tensors(qkv=qkv, positions=positions, slots=slots, block_table=block_table,
                                     k_cache=k_cache, v_cache=v_cache, k_mirror=k_mirror, k_scale=k_scale,
                                     v_mirror=v_mirror, v_scale=v_scale, lut=lut, rope=rope, out=out, ws_o=ws_o,
                                     ws_ml=ws_ml, counters=counters), softmax_scale, stream)
        return decode_attention_paged_qkv_int4

    @cute.jit
    def decode_attention_paged_qkv_e4m3(qkv: cute.Tensor, positions: cute.Tensor, slots: cute.Tensor,
                                        block_table: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor,
                                        k_mirror: cute.Tensor, k_scale: cute.Tensor, v_mirror: cute.Tensor,
                                        v_scale: cute.Tensor, rope: cute.Tensor, out: cute.Tensor, ws_o: cute.Tensor,
                                        ws_ml: cute.Tensor, counters: cute.Tensor, softmax_scale: Float32, stream):
        kern.launch(kern.tensors(qkv=qkv, positions=positions, slots=slots, block_table=block_table,
                                 k_cache=k_cache, v_cache=v_cache, k_mirror=k_mirror, k_scale=k_scale,
                                 v_mirror=v_mirror, v_scale=v_scale, rope=rope, out=out, ws_o=ws_o, ws_ml=ws_ml,
                                 counters=counters), softmax_scale, stream)
    return decode_attention_paged_qkv_e4m3
