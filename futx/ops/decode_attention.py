"""`futx::decode_attention` — one decode step of GQA attention with the cache write fused in.

For each sequence b (one new token): writes k_new[b], v_new[b] at position positions[b] of cache slot
slots[b] (BF16 main copy; for the "int4"/"e4m3" formats also the rotated, quantized mirror row and its
scale), then attends q[b] over positions [0, positions[b]] of that slot, reading the format's cache:
    bf16: k_cache/v_cache [S, Hkv, C, D] bfloat16 (the main copy)
    int4: k_mirror uint8 [S, Hkv, C/8, 32, D/8] (futx.quant.layouts key order), k_scale f32 [S, Hkv, C],
          v_mirror uint8 [S, Hkv, C, D/2], v_scale f32 [S, Hkv, C]
    e4m3: k_mirror / v_mirror float8_e4m3fn (or its uint8 view) [S, Hkv, C, D], scales f32 [S, Hkv, C]
Returns the attention output [B, Hq, D] bfloat16 (rotation undone). Positions at or past the capacity
are rejected on the host (unless `check_positions=False`, e.g. inside a CUDA graph, where the kernel
itself refuses to write and returns NaN rows instead of overwriting anything).

Paged cache (futx.paging): with `block_table` int32 [slots + 1, max_pages] and `page_size` P, the cache tensors'
first mode is the page (S = pages + 1, the last the scratch page) and C = P; position p of slot s is row p % P of
page block_table[s, p // P], for the new row and every cached one. The capacity is then max_pages * P.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from decode.attn_plan import MAX_GROUP, choose_splits, default_plan, entry_tensors, step_splits
from futx import paging
from futx.hardware import sm_count
from futx.ops import checks
from futx.ops.registration import futx_op
from futx.quant import layouts
from futx.runtime import get_kernel
from futx.runtime.catalog.decode_attention import PDL_HEAD_DIMS, VARIANTS, attn_key, qkv_key

FORMATS = ("bf16", "int4", "e4m3")
MAX_SPLITS = 64  # choose_splits never asks for more; a larger explicit count is a caller error

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_LUT: dict[torch.device, torch.Tensor] = {}


def _lut(device: torch.device) -> torch.Tensor:
    """layouts.int4_byte_lut_fp16() as the int32 words the kernel copies into shared memory."""
    if device not in _LUT:
        _LUT[device] = layouts.int4_byte_lut_fp16().contiguous().view(torch.int32).reshape(256).to(device)
    return _LUT[device]


def _counters(device: torch.device, batch: int, kv_heads: int) -> torch.Tensor:
    """Split-arrival counters. The kernel leaves them at zero, so one zeroed buffer per device serves
    every launch on that device's stream (not concurrent launches on several streams)."""
    n = batch * kv_heads
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        fresh = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        if torch.cuda.is_current_stream_capturing():
            return fresh[:n].view(batch, kv_heads)  # owned by the graph being captured; not cached
        _COUNTERS[device] = buf = fresh
    return buf[:n].view(batch, kv_heads)


def check_inputs(q, k_new, v_new, positions, slots, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale,
                 cache_format: str, rotate: bool, mirror_only: bool = False) -> None:
    """Everything that can be checked without reading device memory; raises ValueError/TypeError."""
    if cache_format not in FORMATS:
        raise ValueError(f"decode_attention: cache_format must be one of {FORMATS}, got {cache_format!r}")
    if rotate and cache_format == "bf16":
        raise ValueError("decode_attention: the BF16 main cache is never rotated (rotate=True needs a mirror)")
    checks.cuda("q", q)
    dev = q.device
    new_rows = () if k_new is None else (("k_new", k_new), ("v_new", v_new))  # None: the fused QKV entry
    for name, t in (*new_rows, ("positions", positions), ("slots", slots), ("k_cache", k_cache),
                    ("v_cache", v_cache)):
        checks.cuda(name, t, dev)
    for name, t in (("q", q), *new_rows, ("k_cache", k_cache), ("v_cache", v_cache)):
        checks.dtype(name, t, torch.bfloat16)
    checks.dtype("positions", positions, torch.int32)
    checks.dtype("slots", slots, torch.int32)
    if q.dim() != 3:
        raise ValueError(f"q must have shape [batch, q_heads, head_dim], got {list(q.shape)}")
    b, hq, d = q.shape
    if b < 1:
        raise ValueError("decode_attention: empty batch")
    if d not in (64, 128):
        raise ValueError(f"decode_attention: head dim {d} is not supported (64 or 128)")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must have shape [slots, kv_heads, capacity, head_dim], got {list(k_cache.shape)}")
    s, hkv, cap, _ = k_cache.shape
    if hkv < 1 or hq % hkv:
        raise ValueError(f"decode_attention: {hq} query heads are not a multiple of {hkv} KV heads")
    if hq // hkv > MAX_GROUP:
        raise ValueError(f"decode_attention: {hq // hkv} query heads per KV head; at most {MAX_GROUP} supported")
    checks.shape("k_cache", k_cache, (s, hkv, cap, d))
    checks.shape("v_cache", v_cache, (s, hkv, cap, d))
    for name, t in new_rows:
        checks.shape(name, t, (b, hkv, d))
    checks.shape("positions", positions, (b,))
    checks.shape("slots", slots, (b,))
    mirrors = check_mirror_tensors("decode_attention", cache_format, k_cache, k_mirror, k_scale, v_mirror, v_scale,
                                   mirror_only)
    for name, t in (("q", q), *new_rows, ("positions", positions), ("slots", slots),
                    ("k_cache", k_cache), ("v_cache", v_cache), *mirrors):
        if t is not None:
            checks.contiguous(name, t)
            checks.aligned(name, t)


def mirror_only_cache(k_cache: torch.Tensor, k_scale) -> bool:
    """A paged cache whose mirror holds more pages than its main copy (staging pages: futx.paging, the INT4-only
    cache): its kernels write mirror rows only (the `.mo` entries of decode attention and futx.ops.qkv_rows)."""
    return isinstance(k_scale, torch.Tensor) and k_scale.dim() == 3 and k_scale.shape[0] > k_cache.shape[0]


def mirror_extent(k_cache: torch.Tensor, k_scale: Optional[torch.Tensor]) -> int:
    """Slots (pages) of the mirror: k_cache's first extent, or the mirror's own when the main copy holds fewer
    (a paged cache of staging pages: futx.paging, the INT4-only cache)."""
    return k_cache.shape[0] if k_scale is None else k_scale.shape[0]


def check_mirror_tensors(op: str, cache_format: str, k_cache, k_mirror, k_scale, v_mirror, v_scale,
                         mirror_only: bool = False) -> tuple:
    """Devices, dtypes and shapes of a cache's mirror tensors against its main copy k_cache [S, Hkv, C, D];
    returns them as (name, tensor) pairs. mirror_only: the mirror may hold more pages than the main copy (a
    paged cache whose main copy is staging pages only; only its kernels that write no main row accept it)."""
    s, hkv, cap, d = k_cache.shape
    if mirror_only and k_scale is not None:
        if k_scale.dim() != 3 or k_scale.shape[0] < s:
            raise ValueError(f"{op}: a mirror-only cache's mirror must hold at least the main copy's {s} pages, "
                             f"k_scale is {list(k_scale.shape)}")
        s = k_scale.shape[0]
    elif k_scale is not None and k_scale.dim() == 3 and k_scale.shape[0] > s:
        raise ValueError(f"{op}: the mirror holds {k_scale.shape[0]} pages but the main copy {s}: a mirror-only "
                         "cache (staging main pages) runs only on the engine's paged fused-QKV entry")
    mirrors = (("k_mirror", k_mirror), ("k_scale", k_scale), ("v_mirror", v_mirror), ("v_scale", v_scale))
    if cache_format == "bf16":
        if any(t is not None for _, t in mirrors):
            raise ValueError(f"{op}: cache_format 'bf16' takes no mirror tensors")
        return mirrors
    for name, t in mirrors:
        if t is None:
            raise ValueError(f"{op}: cache_format {cache_format!r} needs {name}")
        checks.cuda(name, t, k_cache.device)
    checks.dtype("k_scale", k_scale, torch.float32)
    checks.dtype("v_scale", v_scale, torch.float32)
    checks.shape("k_scale", k_scale, (s, hkv, cap))
    checks.shape("v_scale", v_scale, (s, hkv, cap))
    if cache_format == "int4":
        layouts.INT4_KEY.check(d, cap)
        checks.dtype("k_mirror", k_mirror, torch.uint8)
        checks.dtype("v_mirror", v_mirror, torch.uint8)
        checks.shape("k_mirror", k_mirror, (s, hkv, cap // 8, layouts.WARP, layouts.INT4_KEY.bytes_per_lane(d)))
        checks.shape("v_mirror", v_mirror, (s, hkv, cap, d // 2))
    else:
        checks.multiple("k_cache", cap, 8, "capacity")  # 16-byte aligned scale rows for cp.async
        checks.dtype("k_mirror", k_mirror, (torch.float8_e4m3fn, torch.uint8))
        checks.dtype("v_mirror", v_mirror, (torch.float8_e4m3fn, torch.uint8))
        checks.shape("k_mirror", k_mirror, (s, hkv, cap, d))
        checks.shape("v_mirror", v_mirror, (s, hkv, cap, d))
    return mirrors


def check_block_table(op: str, block_table, page_size: int, k_cache: torch.Tensor) -> None:
    """A paged launch's table and page size against the cache tensors (device, dtype, shape only: its entries
    are checked with the positions, check_paged_rows)."""
    if block_table is None:
        if page_size:
            raise ValueError(f"{op}: page_size {page_size} given without a block_table")
        return
    try:
        paging.check_page_size(page_size)
    except ValueError as exc:
        raise ValueError(f"{op}: a block_table needs its page_size: {exc}") from None
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor, got {type(block_table).__name__}")
    checks.dtype("block_table", block_table, paging.TABLE_DTYPE)
    if block_table.dim() != 2 or block_table.shape[0] < 1 or block_table.shape[1] < 1:
        raise ValueError(f"block_table must be [slots + 1, max_pages] with both >= 1, got {list(block_table.shape)}")
    checks.contiguous("block_table", block_table)
    if k_cache.shape[2] != page_size:
        raise ValueError(f"{op}: paged cache tensors hold {k_cache.shape[2]} positions per page (k_cache "
                         f"{list(k_cache.shape)}), but page_size is {page_size}")
    checks.cuda("block_table", block_table, k_cache.device)


def check_paged_rows(positions: torch.Tensor, slots: torch.Tensor, block_table: torch.Tensor, page_size: int,
                     pages: int, scratch_page: Optional[int] = None) -> None:
    """Host-side checks of a paged launch (reads the table rows back): check_positions over the table's span and
    slots, every entry of the batch's table rows a page of the cache (the kernel reads them unchecked), each new
    row on a page its request owns (futx.paging.check_rows) and no two new rows on the same page row. pages: the
    cache tensors' page extent (the scratch page included); scratch_page: default the last (pages - 1)."""
    check_positions(positions, slots, block_table.shape[1] * page_size, block_table.shape[0])
    rows = block_table[slots.long()]
    if bool(((rows < 0) | (rows >= pages)).any()):
        bad = int(((rows < 0) | (rows >= pages)).any(1).nonzero()[0, 0])
        raise ValueError(f"decode_attention: block_table row {int(slots[bad])} holds entries outside the cache's "
                         f"{pages} pages: {rows[bad].tolist()}")
    paging.check_rows(block_table, slots, positions, page_size, pages - 1 if scratch_page is None else scratch_page)
    page, off = paging.locate(block_table, slots, positions, page_size)
    flat = page.long() * page_size + off
    if torch.unique(flat).numel() != flat.numel():
        raise ValueError("decode_attention: two sequences write the same page row (their block tables share a page)")


def check_positions(positions: torch.Tensor, slots: torch.Tensor, capacity: int, num_slots: int) -> None:
    """Host-side range checks (one device->host copy): every new row must fit, and no two sequences may
    write the same slot."""
    pos, slt = positions.cpu(), slots.cpu()
    if int(pos.min()) < 0:
        raise ValueError(f"decode_attention: negative position {int(pos.min())} (context length must be >= 1)")
    if int(pos.max()) >= capacity:
        bad = int(pos.argmax())
        raise ValueError(f"decode_attention: KV cache overflow: sequence {bad} writes position {int(pos[bad])} "
                         f"but the capacity is {capacity}; allocate a larger cache")
    if int(slt.min()) < 0 or int(slt.max()) >= num_slots:
        raise ValueError(f"decode_attention: slot out of range [0, {num_slots}): {int(slt.min())}..{int(slt.max())}")
    if torch.unique(slt).numel() != slt.numel():
        raise ValueError(f"decode_attention: two sequences share a cache slot: {slt.tolist()}")


def resolve(cache_format: str, head_dim: int, rotate: bool, variant: str, page_size: int = 0):
    """(kernel variant, its plan) for a launch: "" (the default kernel) unless a variant is asked for."""
    if variant not in VARIANTS or (variant and (cache_format, head_dim, rotate) != ("int4", 128, True)):
        raise ValueError(f"decode_attention: kernel variant {variant!r} does not exist for {cache_format!r} "
                         f"d{head_dim} rotate={rotate}; variants {sorted(VARIANTS)} ('' everywhere, the others for "
                         "rotated INT4 at head dim 128)")
    if variant and page_size:
        raise ValueError(f"decode_attention: kernel variant {variant!r} has no paged-cache kernel (the tuning "
                         "variants are contiguous only)")
    return variant, default_plan(cache_format, head_dim, rotate, **VARIANTS[variant], page_size=page_size)


def _launch(q, k_new, v_new, positions, slots, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale,
            cache_format, rotate, softmax_scale, num_splits, max_context, check_positions_on_host, variant,
            out, qkv=None, rope=None, block_table=None, page_size=0, pdl=False) -> None:
    """Validate, size the split-KV workspace and launch. With `qkv` (and `rope`) the fused entry of the engine
    runs: q, k_new, v_new are None and come from qkv's heads. With `block_table` the paged cache's kernel. pdl: the
    fused entry's programmatic dependent launch (decode_attention_qkv_)."""
    # a paged cache whose mirror holds more pages than its main copy (staging pages: the INT4-only cache) runs the
    # fused entry's mirror-only kernel, which writes no main-copy row
    mirror_only = qkv is not None and block_table is not None and cache_format != "bf16" \
        and mirror_only_cache(k_cache, k_scale)
    if qkv is not None:
        _check_fused(qkv, rope, out, k_cache, block_table, page_size)
        q = out  # same shape and device: what check_inputs validates the query against
    check_inputs(q, k_new, v_new, positions, slots, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale,
                 cache_format, rotate, mirror_only)
    if qkv is None:  # (the fused entry checked it with its RoPE table)
        check_block_table("decode_attention", block_table, page_size, k_cache)
    checks.cuda("out", out, q.device)
    checks.dtype("out", out, torch.bfloat16)
    checks.shape("out", out, tuple(q.shape))
    checks.contiguous("out", out)
    checks.aligned("out", out)
    b, hq, d = q.shape
    s, hkv = k_cache.shape[:2]
    cap = _capacity(k_cache, block_table, page_size)
    if not 0 <= num_splits <= MAX_SPLITS or max_context < 0:
        raise ValueError(f"decode_attention: num_splits must be in [0, {MAX_SPLITS}] (0 = automatic) and "
                         f"max_context >= 0, got {num_splits} and {max_context}")
    paged = block_table is not None
    variant, plan = resolve(cache_format, d, rotate, variant, page_size if paged else 0)
    if check_positions_on_host and not torch.cuda.is_current_stream_capturing():
        if paged:
            check_paged_rows(positions, slots, block_table, page_size, mirror_extent(k_cache, k_scale), s - 1)
        else:
            check_positions(positions, slots, cap, s)
    if num_splits == 0:
        num_splits = auto_splits(plan, qkv is not None, b, hkv, max_context or cap, sm_count(q.device))
    scale = softmax_scale if softmax_scale > 0 else 1.0 / math.sqrt(d)
    ws_o = torch.empty(b, hkv, num_splits, MAX_GROUP, d, dtype=torch.float32, device=q.device)
    ws_ml = torch.empty(b, hkv, num_splits, MAX_GROUP, 2, dtype=torch.float32, device=q.device)
    fused = qkv is not None
    key = qkv_key(cache_format, d, rotate, plan.page_size, mirror_only, pdl) if fused else \
        attn_key(cache_format, d, rotate, variant, plan.page_size)
    given = dict(q=q, k_new=k_new, v_new=v_new, qkv=qkv, rope=rope, positions=positions, slots=slots,
                 block_table=block_table, k_cache=k_cache, v_cache=v_cache, k_mirror=k_mirror, k_scale=k_scale,
                 v_mirror=v_mirror, v_scale=v_scale, out=out, ws_o=ws_o, ws_ml=ws_ml,
                 counters=_counters(q.device, b, hkv))
    if cache_format != "bf16":  # the kernel reads the mirrors as bytes
        given.update(k_mirror=k_mirror.view(torch.uint8), v_mirror=v_mirror.view(torch.uint8))
    if cache_format == "int4":
        given["lut"] = _lut(q.device)
    # the entry's declared tensors, in its argument order (decode.attn_plan.entry_tensors: the one table)
    get_kernel(key)(*(given[name] for name in entry_tensors(cache_format, fused, paged)), scale)


def auto_splits(plan, fused: bool, batch: int, kv_heads: int, context: int, sms: int) -> int:
    """The split count of a launch that names none: the fused entry is the engine step's launch, split by the
    step's rule (decode.attn_plan.step_splits, routing rule A8); the plain op by the standalone rule."""
    return (step_splits if fused else choose_splits)(plan, batch, kv_heads, context, sms)


def _capacity(k_cache: torch.Tensor, block_table, page_size: int) -> int:
    """Positions one sequence can address: the cache's position extent, or (paged) its table row's span."""
    return k_cache.shape[2] if block_table is None else block_table.shape[1] * page_size


_MUTATED = ("k_cache", "v_cache", "k_mirror", "k_scale", "v_mirror", "v_scale")


# ---- the engine's entry: q, k, v straight from the QKV projection, RoPE in the kernel ------------------
def _check_fused(qkv, rope, out, k_cache, block_table, page_size: int) -> None:
    checks.cuda("out", out)
    checks.cuda("qkv", qkv, out.device)
    checks.dtype("qkv", qkv, torch.bfloat16)
    checks.cuda("rope", rope, qkv.device)
    checks.dtype("rope", rope, torch.float32)
    if out.dim() != 3 or qkv.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"qkv [B, Hq + 2 Hkv, D], out [B, Hq, D] and k_cache [slots, Hkv, capacity, D] expected, "
                         f"got {list(qkv.shape)}, {list(out.shape)}, {list(k_cache.shape)}")
    b, hq, d = out.shape
    hkv = k_cache.shape[1]
    check_block_table("decode_attention", block_table, page_size, k_cache)
    cap = _capacity(k_cache, block_table, page_size)
    checks.shape("qkv", qkv, (b, hq + 2 * hkv, d))
    if rope.dim() != 2 or rope.shape[1] != d or rope.shape[0] < cap:
        raise ValueError(f"rope must be float32 [rows >= capacity {cap}, D = {d}] (cos | sin per position), got "
                         f"{list(rope.shape)}")
    for name, t in (("qkv", qkv), ("rope", rope)):
        checks.contiguous(name, t)
        checks.aligned(name, t)


@futx_op("decode_attention_qkv_", mutates_args=(*_MUTATED, "out"))
def decode_attention_qkv_(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, k_mirror: Optional[torch.Tensor], k_scale: Optional[torch.Tensor],
                          v_mirror: Optional[torch.Tensor], v_scale: Optional[torch.Tensor], rope: torch.Tensor,
                          out: torch.Tensor, cache_format: str, rotate: bool = False, softmax_scale: float = 0.0,
                          num_splits: int = 0, max_context: int = 0, check_positions_on_host: bool = True,
                          block_table: Optional[torch.Tensor] = None, page_size: int = 0, pdl: bool = False) -> None:
    """decode_attention_ for the decode engine: q, k_new, v_new are heads [0, Hq), [Hq, Hq + Hkv) and
    [Hq + Hkv, Hq + 2 Hkv) of qkv [B, Hq + 2 Hkv, D] (the QKV projection's output, viewed), and the kernel
    applies rotate-half RoPE to q and the new k row with rope[position] = (cos of the D/2 angles, their sin),
    rounding them to bf16 as an unfused RoPE would store them. out [B, Hq, D] bf16. block_table, page_size: a
    paged cache (module docstring).

    pdl: launch as a programmatic dependent of the kernel before it (the `.pdl` kernels: the same results, its
    first cache tiles requested while that kernel finishes, the kernel after it released at its start). Only where
    the cache rows before every row's position, positions, slots and the block table were written before the
    step's first kernel began: the decode step, never a block (verify) step, whose rows' K/V are written just
    before (futx.engine.backends, rule E5)."""
    if pdl and out.shape[-1] not in PDL_HEAD_DIMS:
        raise ValueError(f"decode_attention_qkv_: the dependent launch (pdl=True) is built for head dims "
                         f"{PDL_HEAD_DIMS}, got {out.shape[-1]}")
    _launch(None, None, None, positions, slots, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale, cache_format,
            rotate, softmax_scale, num_splits, max_context, check_positions_on_host, "", out, qkv, rope, block_table,
            page_size, pdl)


@decode_attention_qkv_.register_fake
def _(qkv, positions, slots, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale, rope, out, cache_format,
      rotate=False, softmax_scale=0.0, num_splits=0, max_context=0, check_positions_on_host=True, block_table=None,
      page_size=0, pdl=False):
    return None


@futx_op("decode_attention", mutates_args=_MUTATED)
def decode_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, positions: torch.Tensor,
                     slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     k_mirror: Optional[torch.Tensor], k_scale: Optional[torch.Tensor],
                     v_mirror: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                     cache_format: str, rotate: bool = False, softmax_scale: float = 0.0, num_splits: int = 0,
                     max_context: int = 0, check_positions_on_host: bool = True, variant: str = "",
                     block_table: Optional[torch.Tensor] = None, page_size: int = 0) -> torch.Tensor:
    """See the module docstring. softmax_scale 0 means 1/sqrt(D); num_splits 0 chooses the split-KV
    count from batch, KV heads and max_context (0 = the capacity) for this GPU's SM count; variant
    selects a kernel variant (futx.runtime.catalog.decode_attention.VARIANTS; "" = the default kernel;
    "table" = INT4 keys through the 256-entry shared-memory table; variants are tuning space: register them
    first with scripts/tuning_space.py); block_table, page_size: a paged cache (module docstring)."""
    out = torch.empty_like(q)
    _launch(q, k_new, v_new, positions, slots, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale,
            cache_format, rotate, softmax_scale, num_splits, max_context, check_positions_on_host, variant, out,
            block_table=block_table, page_size=page_size)
    return out


@decode_attention.register_fake
def _(q, k_new, v_new, positions, slots, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale, cache_format,
      rotate=False, softmax_scale=0.0, num_splits=0, max_context=0, check_positions_on_host=True, variant="",
      block_table=None, page_size=0):
    return torch.empty_like(q)


@futx_op("decode_attention_", mutates_args=(*_MUTATED, "out"))
def decode_attention_(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      k_mirror: Optional[torch.Tensor], k_scale: Optional[torch.Tensor],
                      v_mirror: Optional[torch.Tensor], v_scale: Optional[torch.Tensor], out: torch.Tensor,
                      cache_format: str, rotate: bool = False, softmax_scale: float = 0.0, num_splits: int = 0,
                      max_context: int = 0, check_positions_on_host: bool = True, variant: str = "",
                      block_table: Optional[torch.Tensor] = None, page_size: int = 0) -> None:
    """decode_attention writing into a caller-provided `out` [B, Hq, D] bf16 (CUDA-graph friendly)."""
    _launch(q, k_new, v_new, positions, slots, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale,
            cache_format, rotate, softmax_scale, num_splits, max_context, check_positions_on_host, variant, out,
            block_table=block_table, page_size=page_size)


@decode_attention_.register_fake
def _(q, k_new, v_new, positions, slots, k_cache, v_cache, k_mirror, k_scale, v_mirror, v_scale, out,
      cache_format, rotate=False, softmax_scale=0.0, num_splits=0, max_context=0, check_positions_on_host=True,
      variant="", block_table=None, page_size=0):
    return None


# ---- cache allocation for callers and tests ---------------------------------------------------------
@dataclass
class DecodeCache:
    """One layer's decode cache: the BF16 main copy plus (for "int4"/"e4m3") its mirror."""

    fmt: str
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_mirror: Optional[torch.Tensor] = None
    k_scale: Optional[torch.Tensor] = None
    v_mirror: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None

    @classmethod
    def allocate(cls, fmt: str, slots: int, kv_heads: int, capacity: int, head_dim: int,
                 device: torch.device | str = "cuda", main_slots: Optional[int] = None) -> "DecodeCache":
        """main_slots: the main copy's own (smaller) first extent, for a paged cache of staging main pages
        (futx.paging: the INT4-only cache); default `slots`."""
        if fmt not in FORMATS:
            raise ValueError(f"DecodeCache: unknown format {fmt!r}; known {FORMATS}")
        if main_slots is not None and (fmt == "bf16" or not 1 <= main_slots <= slots):
            raise ValueError(f"DecodeCache: main_slots {main_slots} needs a mirror format and 1..{slots}")
        shape = (slots, kv_heads, capacity, head_dim)
        main = (slots if main_slots is None else main_slots, kv_heads, capacity, head_dim)
        kw = dict(device=device)
        c = cls(fmt, torch.zeros(main, dtype=torch.bfloat16, **kw), torch.zeros(main, dtype=torch.bfloat16, **kw))
        if fmt == "bf16":
            return c
        c.k_scale = torch.zeros(shape[:3], dtype=torch.float32, **kw)
        c.v_scale = torch.zeros(shape[:3], dtype=torch.float32, **kw)
        if fmt == "int4":
            layouts.INT4_KEY.check(head_dim, capacity)
            c.k_mirror = torch.zeros(slots, kv_heads, capacity // 8, layouts.WARP,
                                     layouts.INT4_KEY.bytes_per_lane(head_dim), dtype=torch.uint8, **kw)
            c.v_mirror = torch.zeros(slots, kv_heads, capacity, head_dim // 2, dtype=torch.uint8, **kw)
        else:
            c.k_mirror = torch.zeros(shape, dtype=torch.uint8, **kw).view(torch.float8_e4m3fn)
            c.v_mirror = torch.zeros(shape, dtype=torch.uint8, **kw).view(torch.float8_e4m3fn)
        return c

    def tensors(self) -> tuple:
        return (self.k_cache, self.v_cache, self.k_mirror, self.k_scale, self.v_mirror, self.v_scale)

    def cache_bytes(self, contexts) -> int:
        """Bytes attention reads for these context lengths (keys, values and their scales)."""
        tokens = int(sum(contexts))
        kv_heads, d = self.k_cache.shape[1], self.k_cache.shape[3]
        per = {"bf16": 2 * 2 * d, "e4m3": 2 * d + 8, "int4": d + 8}[self.fmt]
        return tokens * kv_heads * per


def attend(q, k_new, v_new, positions, slots, cache: DecodeCache, rotate: bool = False, out=None,
           **kw) -> torch.Tensor:
    """Convenience wrapper over the two ops with a DecodeCache (writes into `out` when given)."""
    if out is None:
        return torch.ops.futx.decode_attention(q, k_new, v_new, positions, slots, *cache.tensors(), cache.fmt,
                                               rotate, **kw)
    torch.ops.futx.decode_attention_(q, k_new, v_new, positions, slots, *cache.tensors(), out, cache.fmt,
                                     rotate, **kw)
    return out
