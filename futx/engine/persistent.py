"""The persistent decode layer's host side (issue 29): the task table of a model's whole step at 1..8 rows, its
counters and scratch, and the layer launches (decode/persistent_layer.py, registry `decode.persistent.layer.*`:
one row on the one-token bodies, 2..8 rows on the multi-token ones; or, `body="ring"`,
decode/persistent_ring.py, registry `decode.persistent.ring.*`: a producer warp streams the weights; 1..8 rows).

A table is built once per model and row count, on the first step of that many rows (decode.persistent_schedule,
kernel form: fused row factors, every split-KV partial in the table, the split count chosen for the cache's capacity
as the attention op chooses it; a CUDA graph's warm-up step builds it before the capture), so one table serves every
context: which splits hold tiles and which one writes the new token is the kernel's choice at run time, from the
row's position. A step zeroes the counters (targets are cumulative over the layers) and launches the layer kernel
once per layer; the residual stream is updated in place.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from futx.runtime.catalog.persistent import (BODIES, CACHES as FORMATS, HEAD_DIM, MAX_ROWS, RING_DIAGNOSTIC,
                                             RING_TRACED_TUNING, RING_TUNING, layer_key, ring_key, tokens_for)


def fitting_rows(config) -> int:
    """The most rows (<= MAX_ROWS) whose task bodies fit one CTA's shared memory for this model shape: the
    multi-token bodies stage every row of a projection's input (8 rows of the 8B down projection fit; 4 of the
    70B's, K = 28672)."""
    from decode.gemv_layout import tile_smem
    from decode.persistent_host import LAYER_WARPS
    from futx.hardware import SMEM_PER_CTA

    c = config
    inputs = ((c.hidden_size, True), (c.q_size, False), (c.hidden_size, True), (c.intermediate_size, False))
    best = 0
    for rows in range(1, MAX_ROWS + 1):
        tokens = tokens_for(rows)
        need = max(tile_smem(k, LAYER_WARPS, norm, tokens=tokens, rows=rows, red_in_x=tokens > 1)["total"]
                   for k, norm in inputs) + 16   # + the task index's word (decode/persistent_layer.py)
        if need <= SMEM_PER_CTA:
            best = rows
    return best


def ring_misfit(config, cache: str, rows: int = 1) -> Optional[str]:
    """Why the ring layer (decode/persistent_ring.py) cannot run `rows` rows of this model shape with this cache (None:
    it can): every projection's K must be whole ring stages (a projection task stages its input rows in chunks of
    whole stages, so any row count up to MAX_ROWS fits)."""
    from decode.persistent_host import layer_plan, ring_chunk_stages, ring_k_misfit

    c = config
    why = ring_k_misfit((c.hidden_size, c.q_size, c.intermediate_size))
    if why is None and ring_chunk_stages(layer_plan(cache, c.head_dim).smem_bytes, rows, tokens_for(rows)) < 1:
        why = f"one ring stage of {rows} rows does not fit the ring layer's shared memory"
    return why


def unsupported(model, rows: int = 1, body: str = "tiles") -> Optional[str]:
    """Why the persistent layer (`body` "tiles": decode/persistent_layer.py, "ring": decode/persistent_ring.py)
    cannot run this DecodeModel's steps of `rows` rows (None: it can)."""
    from decode.attn_plan import MAX_GROUP

    c, p = model.config, model.packed
    if model.backend != "kernels":
        return "it runs on the kernel backend only"
    if p.weights != "int4" or p.group_size != 128:
        return f"it needs INT4 g128 weights, the model has {p.weights} g{p.group_size}"
    if model.cache.fmt not in FORMATS:
        return f"it reads an INT4 or E4M3 cache mirror, the cache is {model.cache.fmt}"
    if getattr(model.cache, "layout", None) is not None:
        return "it reads a contiguous cache, not a paged one"
    if c.head_dim != HEAD_DIM or c.num_attention_heads // c.num_key_value_heads > MAX_GROUP:
        return f"it is built for head dim {HEAD_DIM} and GQA groups <= {MAX_GROUP}"
    if body not in BODIES:
        raise ValueError(f"body must be one of {BODIES}, got {body!r}")
    if not 1 <= rows <= MAX_ROWS:
        return f"it takes 1..{MAX_ROWS} rows, not {rows}"
    if body == "ring":
        return ring_misfit(c, model.cache.fmt, rows)
    fit = fitting_rows(c)
    if rows > fit:
        return f"{rows} rows of this model's projection inputs do not fit shared memory (at most {fit})"
    return None


def layer_starts(table: torch.Tensor, layers: int) -> torch.Tensor:
    """int32 [ctas, layers + 1]: CTA c runs its table rows starts[c, l] .. starts[c, l + 1] - 1 in layer l's launch
    (a CTA's list runs in task order, hence layer by layer; END rows are past every layer)."""
    from decode.persistent_host import END, F

    kind, layer = table[..., F["kind"]], table[..., F["layer"]]
    live = kind != END
    counts = torch.stack([(live & (layer == lay)).sum(dim=1) for lay in range(layers)], dim=1)
    starts = torch.zeros(table.shape[0], layers + 1, dtype=torch.int32)
    starts[:, 1:] = torch.cumsum(counts, dim=1)
    return starts


def check_ring_waits(table: torch.Tensor) -> None:
    """The ring layer keeps a projection's staged row for the CTA's next task of the same kind and skips that task's
    wait (decode/persistent_ring.py): sound only if every task of a kind in a layer waits on one counter for one
    target, and none on a second counter. Raises ValueError naming the first kind where the table breaks that."""
    from decode.persistent_host import F
    from decode.persistent_schedule import KINDS, PROJECTIONS

    flat = table.reshape(-1, table.shape[-1])
    if (flat[:, F["wait1"]] >= 0).any():
        raise ValueError("the ring layer waits on one counter per task, the table has tasks with two")
    for name in PROJECTIONS:
        rows = flat[flat[:, F["kind"]] == KINDS.index(name)]
        keys = rows[:, [F["layer"], F["wait0"], F["target0"]]].unique(dim=0)
        if keys.shape[0] != keys[:, 0].unique().numel():
            raise ValueError(f"the ring layer needs every {name} task of a layer to wait for one counter and target")


class PersistentMisfit(ValueError):
    """The persistent layer cannot run this model's steps (its format, shape or row count; `unsupported` says why)."""


class PersistentStep:
    """Steps of 1..`max_rows` rows of one DecodeModel (its cache and weights) on the persistent layer kernel (both
    bodies take the same table and arguments)."""

    def __init__(self, model, ctas: Optional[int] = None, splits: Optional[int] = None,
                 max_rows: Optional[int] = None, body: str = "tiles", trace: bool = False, variant: str = "",
                 diagnostic: bool = False):
        """ctas: CTAs of every launch (default one per SM); splits: the split-KV count of every row count (default
        the attention op's choice per row count); max_rows: the most rows a step takes (default the model's
        max_rows, at most what fits); body: "tiles" (the tile GEMV bodies) or "ring" (a producer warp
        streams the weights); trace: the ring's traced kernel, each step's task timestamps kept in
        `tables(1)["trace"]` (futx.engine.persistent_trace reads them); variant: a ring tuning-space kernel
        (futx.runtime.catalog.persistent.RING_TUNING; scripts/tuning_space.py registers them); diagnostic: allow the
        variants in RING_DIAGNOSTIC, which compute wrong outputs (timing only)."""
        from futx.hardware import sm_count

        c, dev = model.config, model.device
        if max_rows is None:
            fit = MAX_ROWS if body == "ring" else fitting_rows(c)
            max_rows = max(1, min(model.max_rows, fit))
        if trace and body != "ring":
            raise ValueError("only the ring layer keeps a task trace (body='ring')")
        if variant and (body != "ring" or variant not in RING_TUNING or model.cache.fmt != "int4"
                        or (trace and variant not in RING_TRACED_TUNING)):
            raise ValueError(f"variant {variant!r}: the ring layer's tuning variants are {sorted(RING_TUNING)} "
                             f"(body='ring', an INT4 cache; traced: {list(RING_TRACED_TUNING)})")
        if variant in RING_DIAGNOSTIC and not diagnostic:
            raise ValueError(f"variant {variant!r} computes wrong outputs (a timing diagnostic): pass diagnostic=True")
        why = unsupported(model, max_rows, body)   # every row count up to max_rows fits if it does
        if why is not None:
            raise PersistentMisfit(f"the persistent decode layer does not fit this model: {why}")
        self.model = model
        sms = sm_count(dev)
        self.ctas = ctas or sms   # one CTA per SM (the layer kernel's registers), all co-resident
        if not 1 <= self.ctas <= sms:
            raise ValueError(f"ctas must be 1..{sms} (co-resident, one per SM), got {self.ctas}")
        self.max_rows, self.fixed_splits, self.body, self.trace, self.variant = max_rows, splits, body, trace, variant
        self._tables: dict = {}   # rows -> its splits, table, starts, counters, split workspace and kernel
        bf = dict(dtype=torch.bfloat16, device=dev)
        self.qkv = torch.empty(max_rows, c.qkv_size, **bf)
        self.attn = torch.empty(max_rows, c.num_attention_heads, c.head_dim, **bf)
        self.hmid = torch.empty(max_rows, c.hidden_size, **bf)
        self.act = torch.empty(max_rows, c.intermediate_size, **bf)
        self.scale = 1.0 / math.sqrt(c.head_dim)

    def tables(self, rows: int) -> dict:
        """The task table of `rows` rows and what goes with it (built on first use)."""
        if rows in self._tables:
            return self._tables[rows]
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"this persistent step takes 1..{self.max_rows} rows, got {rows}")
        from decode.attn_plan import MAX_GROUP, choose_splits
        from decode.persistent_host import layer_plan
        from decode.persistent_schedule import make_schedule, task_table
        from futx.hardware import sm_count
        from futx.runtime import get_kernel

        m = self.model
        c, dev, fmt = m.config, m.device, m.cache.fmt
        splits = self.fixed_splits
        if splits is None:
            splits = choose_splits(layer_plan(fmt, c.head_dim), rows, c.num_key_value_heads, m.capacity,
                                   sm_count(dev))
        layers = len(m.packed.layers)
        sched = make_schedule(c, rows, m.capacity, layers=layers, ctas=self.ctas, cache=fmt, splits=splits,
                              fused_norm=True, every_split=True)
        table = task_table(sched)
        if self.body == "ring":
            check_ring_waits(table)
        f32 = dict(dtype=torch.float32, device=dev)
        t = dict(splits=splits, table=table.to(dev), starts=layer_starts(table, layers).to(dev),
                 counters=torch.zeros(len(sched.graph.counters), dtype=torch.int32, device=dev),
                 ws_o=torch.empty(rows, c.num_key_value_heads, splits, MAX_GROUP, c.head_dim, **f32),
                 ws_ml=torch.empty(rows, c.num_key_value_heads, splits, MAX_GROUP, 2, **f32),
                 kernel=get_kernel(ring_key(fmt, c.head_dim, tokens_for(rows), self.trace, self.variant)
                                   if self.body == "ring"
                                   else layer_key(fmt, c.head_dim, tokens_for(rows))))
        if self.trace:
            from decode.persistent_host import TRACE_FIELDS

            t["trace"] = torch.full((*table.shape[:2], len(TRACE_FIELDS)), -1, dtype=torch.int64, device=dev)
        self._tables[rows] = t
        return t

    def run(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Every layer on the residual stream x [M, H] bf16, 1 <= M <= max_rows (updated in place; returned)."""
        m = self.model
        c = m.config
        rows = x.shape[0] if x.dim() == 2 else 0
        if (x.dim() != 2 or not 1 <= rows <= self.max_rows or x.shape[1] != c.hidden_size
                or x.dtype != torch.bfloat16 or not x.is_contiguous()):
            raise ValueError(f"the persistent step takes 1..{self.max_rows} contiguous bf16 rows [M, "
                             f"{c.hidden_size}], got {tuple(x.shape)} {x.dtype}")
        if positions.shape != (rows,) or slots.shape != (rows,):
            raise ValueError(f"positions and slots must be [{rows}], got {tuple(positions.shape)} and "
                             f"{tuple(slots.shape)}")
        t = self.tables(rows)
        qkv, attn = self.qkv[:rows], self.attn[:rows]
        heads = qkv.view(rows, -1, c.head_dim)
        attn2 = attn.view(rows, c.q_size)
        hmid, act = self.hmid[:rows], self.act[:rows]
        counters = t["counters"]
        counters.zero_()
        trace = t.get("trace")
        if trace is not None:
            trace.fill_(-1)
        for i, w in enumerate(m.packed.layers):
            kc, vc, km, ks, vm, vs = m.cache.layers[i].tensors()
            t["kernel"](t["table"], t["starts"], i, counters, x, w.qkv.packed, w.qkv.scales, qkv, attn2,
                        w.o.packed, w.o.scales, hmid, w.gateup.packed, w.gateup.scales, act, w.down.packed,
                        w.down.scales, heads, positions, slots, kc, vc, km.view(torch.uint8), ks,
                        vm.view(torch.uint8), vs, m.rope, attn, t["ws_o"], t["ws_ml"], c.rms_norm_eps, self.scale,
                        trace)
        return x
