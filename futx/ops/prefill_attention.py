"""`futx::prefill_attention` — causal GQA attention of a packed prefill batch over the BF16 KV cache.

    out = futx.ops.prefill_attention.attention(q, k_cache, v_cache, cu_seqlens, start_pos, slot)

q [M, Hq, D] bfloat16: the packed new rows of R requests (RoPE applied; what futx.ops.prefill.qkv returns);
k_cache, v_cache [slots, Hkv, capacity, D] bfloat16: one layer's main cache, already holding these rows
(the QKV epilogue wrote them) and every earlier position of each request;
cu_seqlens [R + 1], start_pos [R], slot [R] int32 (futx.reference.batch.PackedBatch: cu_seqlens,
start_positions, slots): request r owns rows [cu_seqlens[r], cu_seqlens[r+1]) at positions start_pos[r],
start_pos[r] + 1, ... of cache slot slot[r], and row i attends to positions [0, start_pos[r] + i]
(chunked prefill when start_pos[r] > 0). Returns out [M, Hq, D] bfloat16 (the caller may pass `out`).
D is 64 or 128 and the GQA group Hq / Hkv is 1..16 (a work tile stacks 128 // G tokens x G heads into its 128
MMA rows; the rest stay idle when G does not divide 128). scale 0 (or None) means 1 / sqrt(D).

Paged cache (futx.paging): table= the block table int32 [slots + 1, max_pages] and page_size= P (a multiple of
128 with a built variant: futx.runtime.catalog.prefill_attention.PAGE_SIZES); k_cache, v_cache are then the
paged layer's [pages + 1, Hkv, P, D] and slot[r] indexes the table: position p of request r is row p % P of
page table[slot[r], p // P]. Pages a request does not reach are never read; rows past its end in its last
page may hold anything.

Everything is validated before the launch; the ranges (cu_seqlens non-decreasing from 0 to M,
start_pos + length <= capacity (paged: max_pages * P), 0 <= slot < slots (paged: table rows), paged: the
table entries the requests reach name pages of the cache) need the int32 vectors (and the table) on the host:
one device->host copy, skipped while a CUDA graph is being captured or with check_ranges_on_host=False.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from futx import paging
from futx.ops import checks
from futx.ops.registration import futx_op
from futx.runtime import get_kernel
from futx.runtime.catalog.prefill_attention import HEAD_DIMS, PAGE_SIZES, attn_key

TILE_M = 128     # kernel rows per work tile: 128 // G tokens x G query heads
MAX_GROUP = 16   # largest GQA group (query heads per KV head) the op accepts


def check_inputs(q, k_cache, v_cache, cu_seqlens, start_pos, slot, out, scale: float) -> None:
    """Everything that can be checked without reading device memory; raises ValueError/TypeError."""
    checks.cuda("q", q)
    dev = q.device
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("cu_seqlens", cu_seqlens),
                    ("start_pos", start_pos), ("slot", slot), ("out", out)):
        checks.cuda(name, t, dev)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        checks.dtype(name, t, torch.bfloat16)
    for name, t in (("cu_seqlens", cu_seqlens), ("start_pos", start_pos), ("slot", slot)):
        checks.dtype(name, t, torch.int32)
    if q.dim() != 3:
        raise ValueError(f"q must have shape [rows, q_heads, head_dim], got {list(q.shape)}")
    m, hq, d = q.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"prefill_attention: head dim {d} is not supported ({' or '.join(map(str, HEAD_DIMS))})")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must have shape [slots, kv_heads, capacity, head_dim], got {list(k_cache.shape)}")
    s, hkv, cap, _ = k_cache.shape
    checks.shape("k_cache", k_cache, (s, hkv, cap, d))
    checks.shape("v_cache", v_cache, (s, hkv, cap, d))
    if s < 1 or cap < 1:
        raise ValueError(f"prefill_attention: empty cache {list(k_cache.shape)}")
    if hkv < 1 or hq < 1 or hq % hkv:
        raise ValueError(f"prefill_attention: {hq} query heads are not a multiple of {hkv} KV heads")
    if hq // hkv > MAX_GROUP:
        raise ValueError(f"prefill_attention: {hq // hkv} query heads per KV head; the GQA group must be at most "
                         f"{MAX_GROUP}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have shape [requests + 1] with at least one request, "
                         f"got {list(cu_seqlens.shape)}")
    r = cu_seqlens.shape[0] - 1
    checks.shape("start_pos", start_pos, (r,))
    checks.shape("slot", slot, (r,))
    checks.shape("out", out, (m, hq, d))
    if not (scale >= 0.0 and math.isfinite(scale)):
        raise ValueError(f"prefill_attention: scale must be a finite positive number (0 = 1/sqrt(D)), got {scale}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out),
                    ("cu_seqlens", cu_seqlens), ("start_pos", start_pos), ("slot", slot)):
        checks.contiguous(name, t)
        checks.aligned(name, t)


def check_table(table, page_size: int, k_cache, device) -> None:
    """The paged arguments (module docstring), without reading device memory; nothing to check for a contiguous
    cache (table None, page_size 0)."""
    if table is None:
        if page_size:
            raise ValueError(f"prefill_attention: page_size {page_size} without a block table (pass table=, or "
                             "page_size=0 for a contiguous cache)")
        return
    try:
        paging.check_page_size(page_size)
    except ValueError as exc:
        raise ValueError(f"prefill_attention: {exc}") from None
    if page_size not in PAGE_SIZES:
        raise ValueError(f"prefill_attention: no paged variant for page size {page_size} (built: "
                         f"{', '.join(map(str, PAGE_SIZES))})")
    checks.cuda("table", table, device)
    checks.dtype("table", table, paging.TABLE_DTYPE)
    if table.dim() != 2 or table.shape[0] < 1 or table.shape[1] < 1:
        raise ValueError(f"table must have shape [slots + 1, max_pages] (both >= 1), got {list(table.shape)}")
    if k_cache.shape[2] != page_size:
        raise ValueError(f"prefill_attention: the paged caches hold pages of {k_cache.shape[2]} positions "
                         f"(k_cache [pages + 1, Hkv, P, D] = {list(k_cache.shape)}) but page_size is {page_size}")
    checks.contiguous("table", table)
    checks.aligned("table", table, 4)


def check_ranges(cu_seqlens, start_pos, slot, rows: int, capacity: int, num_slots: int, table=None,
                 page_size: int = 0, num_pages: int = 0) -> None:
    """Host-side range checks (one device->host copy of the three int32 vectors, and of a paged cache's table:
    capacity = max_pages * page_size, num_slots = its rows, and the entries reached must lie in [0, num_pages))."""
    cu, st, sl = (t.cpu().to(torch.int64) for t in (cu_seqlens, start_pos, slot))
    if int(cu[0]) != 0 or int(cu[-1]) != rows or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"prefill_attention: cu_seqlens must rise from 0 to the {rows} rows of q, got {cu.tolist()}")
    if bool((st < 0).any()):
        raise ValueError(f"prefill_attention: negative start position {int(st.min())}")
    end = st + cu[1:] - cu[:-1]
    if bool((end > capacity).any()):
        bad = int(end.argmax())
        per = f" ({capacity // page_size} pages of {page_size})" if table is not None else ""
        raise ValueError(f"prefill_attention: KV cache overflow: request {bad} reaches position {int(end[bad])} "
                         f"but the capacity is {capacity}{per}")
    if int(sl.min()) < 0 or int(sl.max()) >= num_slots:
        raise ValueError(f"prefill_attention: slot out of range [0, {num_slots}): {int(sl.min())}..{int(sl.max())}")
    if table is None:
        return
    tab = table.cpu().to(torch.int64)
    for r in range(len(sl)):
        used = tab[int(sl[r]), :paging.pages_for(int(end[r]), page_size)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
            raise ValueError(f"prefill_attention: request {r}: block table row {int(sl[r])} names page "
                             f"{int(used.max()) if int(used.max()) >= num_pages else int(used.min())} but the cache "
                             f"has pages [0, {num_pages})")


def _launch(q, k_cache, v_cache, cu_seqlens, start_pos, slot, out, scale, check_ranges_on_host, table,
            page_size) -> None:
    check_inputs(q, k_cache, v_cache, cu_seqlens, start_pos, slot, out, scale)
    check_table(table, page_size, k_cache, q.device)
    if check_ranges_on_host and not torch.cuda.is_current_stream_capturing():
        if table is None:
            check_ranges(cu_seqlens, start_pos, slot, q.shape[0], k_cache.shape[2], k_cache.shape[0])
        else:
            check_ranges(cu_seqlens, start_pos, slot, q.shape[0], table.shape[1] * page_size, table.shape[0],
                         table, page_size, k_cache.shape[0])
    if q.shape[0] == 0:
        return
    d = q.shape[2]
    paged = () if table is None else (table,)   # the paged variant's extra argument, after slot
    get_kernel(attn_key(d, page_size))(q, k_cache, v_cache, cu_seqlens, start_pos, slot, *paged, out,
                                       scale if scale > 0 else 1.0 / math.sqrt(d))


@futx_op("prefill_attention_", mutates_args=("out",))
def prefill_attention_(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens: torch.Tensor,
                       start_pos: torch.Tensor, slot: torch.Tensor, out: torch.Tensor, scale: float = 0.0,
                       check_ranges_on_host: bool = True, table: Optional[torch.Tensor] = None,
                       page_size: int = 0) -> None:
    """See the module docstring; writes out [M, Hq, D] (CUDA-graph friendly)."""
    _launch(q, k_cache, v_cache, cu_seqlens, start_pos, slot, out, scale, check_ranges_on_host, table, page_size)


@prefill_attention_.register_fake
def _(q, k_cache, v_cache, cu_seqlens, start_pos, slot, out, scale=0.0, check_ranges_on_host=True, table=None,
      page_size=0):
    return None


@futx_op("prefill_attention")
def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens: torch.Tensor,
                      start_pos: torch.Tensor, slot: torch.Tensor, scale: float = 0.0,
                      check_ranges_on_host: bool = True, table: Optional[torch.Tensor] = None,
                      page_size: int = 0) -> torch.Tensor:
    """See the module docstring; returns out [M, Hq, D] bfloat16."""
    out = torch.empty_like(q)
    _launch(q, k_cache, v_cache, cu_seqlens, start_pos, slot, out, scale, check_ranges_on_host, table, page_size)
    return out


@prefill_attention.register_fake
def _(q, k_cache, v_cache, cu_seqlens, start_pos, slot, scale=0.0, check_ranges_on_host=True, table=None,
      page_size=0):
    return torch.empty_like(q)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens: torch.Tensor,
              start_pos: torch.Tensor, slot: torch.Tensor, scale: Optional[float] = None,
              out: Optional[torch.Tensor] = None, check_ranges_on_host: bool = True,
              table: Optional[torch.Tensor] = None, page_size: int = 0) -> torch.Tensor:
    """Causal GQA prefill attention (module docstring); writes into `out` when given. table / page_size: a paged
    cache's block table and page size (futx.paging)."""
    s = 0.0 if scale is None else float(scale)
    if out is None:
        return torch.ops.futx.prefill_attention(q, k_cache, v_cache, cu_seqlens, start_pos, slot, s,
                                                check_ranges_on_host, table, page_size)
    torch.ops.futx.prefill_attention_(q, k_cache, v_cache, cu_seqlens, start_pos, slot, out, s, check_ranges_on_host,
                                      table, page_size)
    return out
