"""The engine's KV cache: per layer the BF16 main copy and the decode mirror, in the kernels' layout.

Slots [0, slots) hold requests; one extra *scratch* slot at index `slots` absorbs the padded rows of a
CUDA-graph bucket (they write and read only there, so real requests are never touched).

Decode steps write their new rows inside the attention kernel. `write_rows` is the checked writer for rows
computed elsewhere (a prefill on the reference path), `mirror_rows` the unchecked, CUDA-graph-capturable one
for rows a prefill kernel already put in the main copy: both store exactly what the attention kernel would
have stored for the same BF16 row (main copy, then rotation, per-row scale, quantization and fragment-order
packing from `futx.quant`), so decode cannot tell who wrote a row. `read` returns the
values decode attention uses (mirror dequantized, rotation undone), for the emulated backend and tests.

Paged mode (`layout`, a futx.paging.PageLayout): every layer's tensors hold `layout.pages` pages of
`layout.page_size` positions plus the scratch page (futx.paging's storage), `table` is the block table on the
device, and a row of (slot, position) is stored at futx.paging.locate's (page, offset). The writers and readers
here translate through the table, so their callers keep speaking slots and positions; `set_pages` fills a
slot's table row (the scheduler's page bookkeeping is futx.engine.pages). Contiguous mode: layout and table None.

Staged mode (a layout with staging pages: the INT4-only cache, futx.paging): the main copy holds only the staging
pages (+ scratch); a request is prefilled on staging pages and `copy_pages` then moves its mirror rows to its own
mirror-only pages. Rows written on mirror-only pages get no main copy (the decode kernel's `.mo` twin, and
`write_rows` here, store the mirror only).
"""

from __future__ import annotations

from typing import Optional

import torch

from futx import paging
from futx.config import LlamaConfig
from futx.ops.decode_attention import DecodeCache
from futx.quant import hadamard, layouts
from futx.quant.kv_mirror import dequantize_rows, pack_int4_key_rows, quantize_e4m3_rows, quantize_int4_rows

from .support import check_capacity


class EngineCache:
    def __init__(self, config: LlamaConfig, fmt: str, slots: int, capacity: int, device="cuda",
                 keep_values: bool = False, layout: Optional[paging.PageLayout] = None):
        """layout: the paged cache (its slots must be `slots`, its table span hold `capacity` positions)."""
        check_capacity(fmt, capacity)
        if slots < 1:
            raise ValueError(f"the cache needs at least one slot, got {slots}")
        if layout is not None and (layout.slots != slots or layout.capacity < capacity):
            raise ValueError(f"page layout for {layout.slots} slots of {layout.capacity} positions, the cache has "
                             f"{slots} slots of {capacity}")
        if layout is not None and layout.staging and fmt == "bf16":
            raise ValueError("a cache without its main copy (staging pages) needs a mirror: --cache int4 or e4m3")
        self.config, self.fmt, self.slots, self.capacity = config, fmt, slots, capacity
        self.device = torch.device(device)
        self.rotate = fmt == "int4"
        self.layout = layout
        hkv, d = config.num_key_value_heads, config.head_dim
        # the slot mode (+ the scratch slot) or the page mode (+ the scratch page) of futx.ops.decode_attention
        extent, span = (slots + 1, capacity) if layout is None else (layout.storage_pages(), layout.page_size)
        shape = (extent, hkv, span, d)
        self.table: Optional[torch.Tensor] = None if layout is None else layout.new_table(self.device)
        # per layer the tensors of futx.ops.decode_attention, in its layout (E4M3 mirrors as float8)
        main = layout.main_pages() if self.staged else None   # staged: the main copy of the staging pages only
        self.layers: list[DecodeCache] = [DecodeCache.allocate(fmt, extent, hkv, span, d, self.device, main)
                                          for _ in range(config.num_hidden_layers)]
        # keep_values: also keep what decode attention reads as float32 [S, Hkv, C, D] per layer, so the
        # emulated backend reads slices instead of unpacking the mirror every step
        self.values: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None
        if keep_values:
            self.values = [(torch.zeros(shape, device=self.device), torch.zeros(shape, device=self.device))
                           for _ in range(config.num_hidden_layers)]

    @property
    def scratch_slot(self) -> int:
        return self.slots

    @property
    def staged(self) -> bool:
        """A paged cache whose main copy holds only staging pages (the INT4-only cache)."""
        return self.layout is not None and self.layout.staging > 0

    @staticmethod
    def page_bytes(config: LlamaConfig, fmt: str, page_size: int, main: bool = True) -> int:
        """Bytes of one page over all layers (main copy unless main=False, mirror, scales): what --cache-memory
        divides."""
        one = DecodeCache.allocate(fmt, 1, config.num_key_value_heads, page_size, config.head_dim, "meta")
        kept = one.tensors() if main else one.tensors()[2:]
        return config.num_hidden_layers * sum(t.numel() * t.element_size() for t in kept if t is not None)

    # ---- the block table (paged mode) ----------------------------------------------------------------
    def set_pages(self, slot: int, pages: list[int]) -> None:
        """Slot `slot` owns `pages` (in position order); its other table entries become the scratch page."""
        lay = self._paged()
        if not 0 <= slot < self.slots:
            raise ValueError(f"cache slot {slot} out of range [0, {self.slots})")
        if len(pages) > lay.max_pages:
            raise ValueError(f"{len(pages)} pages for one request; its table row holds {lay.max_pages}")
        if pages and (min(pages) < 0 or max(pages) >= lay.storage_pages() or lay.scratch_page in pages):
            raise ValueError(f"pages must be the cache's ({lay.page_ids()}"
                             + (f" or staging {lay.staging_ids()}" if lay.staging else "")
                             + f"), got {min(pages)}..{max(pages)}")
        row = torch.full((lay.max_pages,), lay.scratch_page, dtype=paging.TABLE_DTYPE)
        row[:len(pages)] = torch.as_tensor(pages, dtype=paging.TABLE_DTYPE)
        self.table[slot].copy_(row)

    def _paged(self) -> paging.PageLayout:
        if self.layout is None:
            raise ValueError("a contiguous cache has no block table")
        return self.layout

    def locate(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The storage indices of rows (slots[m], positions[m]) (slot mode: the slots and positions; page mode:
        pages and in-page offsets by futx.paging.locate): the one translation every writer here goes through.
        Device ops, no checks, no host synchronization (capturable)."""
        if self.layout is None:
            return slots.long(), positions.long()
        pages, offs = paging.locate(self.table, slots, positions, self.layout.page_size)
        return pages.long(), offs.long()

    def gather(self, t: torch.Tensor, slot: int, length: int) -> torch.Tensor:
        """Positions [0, length) of slot `slot` of a per-layer tensor t [extent, Hkv, span, ...] as
        [Hkv, length, ...] (page mode: its pages concatenated; an INT4 key mirror's 8-token blocks count as
        positions / 8, so pass length = blocks there)."""
        if self.layout is None:
            return t[slot, :, :length]
        per = t.shape[2]                                    # positions (or key blocks) per page
        n = -(-length // per)
        g = t.index_select(0, self.table[slot, :n].long())  # [n, Hkv, per, ...]
        return g.transpose(0, 1).reshape(t.shape[1], n * per, *t.shape[3:])[:, :length]

    def attended_values(self, layer: int, slots: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept float values (keep_values) of positions [0, ctx) of each row's slot: k, v [M, Hkv, ctx, D]."""
        kv = self.values[layer]
        if self.layout is None:
            idx = slots.long()
            return kv[0][:, :, :ctx].index_select(0, idx), kv[1][:, :, :ctx].index_select(0, idx)
        p = self.layout.page_size
        n = -(-ctx // p)
        pages = self.table.index_select(0, slots.long())[:, :n].reshape(-1).long()   # [M n]
        m, hkv, d = slots.shape[0], kv[0].shape[1], kv[0].shape[3]

        def one(t):
            return t.index_select(0, pages).view(m, n, hkv, p, d).transpose(1, 2).reshape(m, hkv, n * p, d)[:, :, :ctx]
        return one(kv[0]), one(kv[1])

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Mirror rows (and kept values) of pages src[i] -> dst[i], every layer: a staged request's prefilled
        pages to its own mirror-only pages (or cached pages to staging pages). The main copy is not copied."""
        if len(src) != len(dst):
            raise ValueError(f"copy_pages: {len(src)} source pages, {len(dst)} destinations")
        if not src:
            return
        extent = self.layout.storage_pages() if self.layout is not None else 0
        if min(src + dst) < 0 or max(src + dst) >= extent or self.layout.scratch_page in src + dst:
            raise ValueError(f"copy_pages: pages must lie in [0, {extent}), the scratch page excluded")
        s = torch.as_tensor(src, dtype=torch.long, device=self.device)
        d = torch.as_tensor(dst, dtype=torch.long, device=self.device)
        for i, c in enumerate(self.layers):
            kept = [] if self.values is None else list(self.values[i])
            for t in (c.k_mirror, c.k_scale, c.v_mirror, c.v_scale, *kept):
                if t is not None:
                    if t.dtype == torch.float8_e4m3fn:   # as bytes (index kernels need not cover float8)
                        t = t.view(torch.uint8)
                    t.index_copy_(0, d, t.index_select(0, s))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.layers for t in c.tensors() if t is not None)

    def read_bytes_per_token(self) -> int:
        """Bytes decode attention reads per cached token and layer (keys, values, their scales)."""
        return self.layers[0].cache_bytes([1])

    def randomize(self, seed: int = 0) -> None:
        """Random contents in every copy (benchmarks: never time on zeros)."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for c in self.layers:
            for t in c.tensors():
                if t is None:
                    continue
                if t.dtype == torch.float8_e4m3fn:
                    t = t.view(torch.uint8)
                if t.dtype == torch.uint8:
                    r = torch.randint(0, 256, t.shape, generator=gen, device=self.device, dtype=torch.uint8)
                    t.copy_(torch.where(r & 0x7F == 0x7F, r ^ 1, r))  # no E4M3 NaN codes
                elif t.dtype == torch.float32:  # per-row scales
                    t.copy_(torch.rand(t.shape, generator=gen, device=self.device) * 0.1 + 0.01)
                else:
                    t.copy_(torch.randn(t.shape, generator=gen, device=self.device, dtype=t.dtype))

    # ---- writes of rows computed outside the decode attention kernel ----------------------------------
    def write_rows(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, heads: slice = slice(None)) -> None:
        """Store rows k, v [M, Hkv, D] of (slots[m], positions[m]) as the attention kernel would (checked on
        the host first: this reads the indices back). heads: only these KV heads (k, v [M, len(heads), D]), as a
        task of the persistent decode layer writes its own head's row; every head's row is quantized on its own,
        so writing them one by one stores the same bytes."""
        m = k.shape[0]
        if m == 0:
            return
        if int(positions.max()) >= self.capacity or int(positions.min()) < 0:
            raise ValueError(f"KV cache overflow: position {int(positions.max())} does not fit capacity "
                             f"{self.capacity}")
        if int(slots.min()) < 0 or int(slots.max()) > self.slots:
            raise ValueError(f"cache slot out of range [0, {self.slots}]")
        c = self.layers[layer]
        slots, positions = slots.to(self.device, torch.long), positions.to(self.device, torch.long)
        if self.layout is not None:
            paging.check_rows(self.table, slots, positions, self.layout.page_size, self.layout.scratch_page)
            slots, positions = self.locate(slots, positions)
        kb, vb = k.to(self.device, torch.bfloat16), v.to(self.device, torch.bfloat16)
        hs = range(self.config.num_key_value_heads)[heads]
        if heads.step not in (None, 1) or not len(hs) or kb.shape[1] != len(hs):
            raise ValueError(f"heads {heads} (a contiguous range of the {self.config.num_key_value_heads} KV heads) "
                             f"for rows of {kb.shape[1]} heads")
        if self.staged:   # rows on mirror-only pages have no main copy
            main = slots < c.k_cache.shape[0]
            c.k_cache[slots[main], heads, positions[main]] = kb[main]
            c.v_cache[slots[main], heads, positions[main]] = vb[main]
        else:
            c.k_cache[slots, heads, positions] = kb
            c.v_cache[slots, heads, positions] = vb
        self._store_mirror(layer, slots, positions, kb.float(), vb.float(), check_finite=True, heads=heads)

    def mirror_rows(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, kernel: bool = False) -> None:
        """The mirror (and kept values) of rows already in the main copy (a prefill's QKV epilogue wrote them),
        slots / positions integer [M] on the device. No checks of their ranges and no host synchronization (the
        caller validated the indices on the host), so a CUDA graph can capture it. kernel: futx's mirror kernel
        (futx.ops.mirror_rows: one launch, the decode kernel's own code) instead of the torch ops."""
        if self.fmt == "bf16" and self.values is None:
            return
        c = self.layers[layer]
        slots, positions = self.locate(slots, positions)
        if kernel:
            self.mirror_stored_rows(layer, slots, positions)
            return
        self._store_mirror(layer, slots, positions, c.k_cache[slots, :, positions].float(),
                           c.v_cache[slots, :, positions].float(), check_finite=False)

    def mirror_stored_rows(self, layer: int, at_slot: torch.Tensor, at_row: torch.Tensor) -> None:
        """`mirror_rows(kernel=True)` of rows already located (`locate`: storage indices, i.e. a paged cache's
        page and in-page row), for a caller that wrote their main copy there itself (KernelOps.prewrite_rows):
        futx's mirror kernel indexes the page-mode tensors by (page, offset) as it would (slot, position).
        Unchecked, capturable."""
        if self.fmt == "bf16" and self.values is None:
            return
        if self.values is not None:
            raise ValueError("the mirror kernel keeps no float values (a cache made with keep_values=True)")
        from futx.ops.mirror_rows import mirror_rows

        c = self.layers[layer]
        i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
        # staged: the rows are on staging pages (or the scratch page), all inside the main copy's extent; the
        # kernel sees mirrors of that extent
        n = c.k_cache.shape[0]
        mirror_rows(self.fmt, c.k_cache, c.v_cache, c.k_mirror[:n], c.k_scale[:n], c.v_mirror[:n], c.v_scale[:n],
                    i32(at_slot), i32(at_row))

    def _store_mirror(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, kf: torch.Tensor,
                      vf: torch.Tensor, check_finite: bool, heads: slice = slice(None)) -> None:
        c = self.layers[layer]
        if self.fmt == "bf16":
            if self.values is not None:
                self.values[layer][0][slots, heads, positions] = kf
                self.values[layer][1][slots, heads, positions] = vf
            return
        if self.fmt == "e4m3":
            for i, (x, mir, sc) in enumerate(((kf, c.k_mirror, c.k_scale), (vf, c.v_mirror, c.v_scale))):
                data, scale = quantize_e4m3_rows(x, check_finite)
                mir[slots, heads, positions] = data
                sc[slots, heads, positions] = scale
                if self.values is not None:
                    self.values[layer][i][slots, heads, positions] = dequantize_rows(data, scale)
            return
        q, s = quantize_int4_rows(hadamard.rotate(torch.stack([kf, vf])), check_finite)   # K and V in one pass
        if self.values is not None:
            for i in range(2):
                self.values[layer][i][slots, heads, positions] = hadamard.unrotate(dequantize_rows(q[i], s[i]))
        c.k_scale[slots, heads, positions] = s[0]
        c.v_scale[slots, heads, positions] = s[1]
        c.v_mirror[slots, heads, positions] = layouts.pack_int4_values(q[1])
        # a key row fills 4 of the 32 lanes of its 8-token block: lanes 4 (p % 8) + j
        lanes = 4 * (positions % 8)[:, None] + torch.arange(4, device=positions.device)[None, :]   # [M, 4]
        c.k_mirror[slots[:, None], heads, (positions // 8)[:, None], lanes] = pack_int4_key_rows(q[0]).transpose(1, 2)

    def main_from_mirror(self, slot: int, n: int) -> None:
        """The main copy of positions [0, n) of `slot` <- the mirror's values (`read`: what decode attention uses,
        rounded to BF16): how a prompt's later prefill chunks see earlier ones that only the mirror kept (the
        INT4-only cache's prefix hits). A BF16 cache has no mirror: nothing changes."""
        if self.fmt == "bf16" or n == 0:
            return
        if not 0 <= slot <= self.slots or not 0 < n <= self.capacity:
            raise ValueError(f"main_from_mirror: slot {slot} / {n} positions outside the cache")
        if self.staged:
            raise ValueError("main_from_mirror: a cache of staging pages keeps no main copy of its pages (stage a "
                             "request's rows with futx.engine.paged_kv.dequantize_slot on its staging pages)")
        if self.layout is not None:   # through the block table: the prefix hits' own writer
            from .paged_kv import dequantize_slot

            dequantize_slot(self, slot, n)
            return
        for layer, c in enumerate(self.layers):
            k, v = self.read(layer, slot, n)
            c.k_cache[slot, :, :n] = k.to(torch.bfloat16)
            c.v_cache[slot, :, :n] = v.to(torch.bfloat16)

    # ---- what decode attention reads -------------------------------------------------------------------
    def read(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) float32 [Hkv, length, D]: the values decode attention uses for positions [0, length)."""
        c = self.layers[layer]

        def g(t, n=length):
            return self.gather(t, slot, n)
        if self.values is not None:
            return g(self.values[layer][0]), g(self.values[layer][1])
        if self.fmt == "bf16":
            return g(c.k_cache).float(), g(c.v_cache).float()
        if self.fmt == "e4m3":
            return dequantize_rows(g(c.k_mirror), g(c.k_scale)), dequantize_rows(g(c.v_mirror), g(c.v_scale))
        blocks = -(-length // 8)
        kq = layouts.unpack_int4_keys(g(c.k_mirror, blocks))[:, :length]
        vq = layouts.unpack_int4_values(g(c.v_mirror))
        k = dequantize_rows(kq, g(c.k_scale))
        v = dequantize_rows(vq, g(c.v_scale))
        return hadamard.unrotate(k), hadamard.unrotate(v)
