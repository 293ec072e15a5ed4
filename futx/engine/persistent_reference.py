"""What each task of the persistent decode layer computes (issue 29), executable: a torch interpreter of
`decode.persistent_schedule`'s task table on an emulated `DecodeModel`.

The table says which tiles a task writes (`FIELDS`: kind, layer, a0..a3) and which counters order it; this module
says what goes into those tiles, with the numerics of the emulated backend (`EmulatedOps`, the kernel path's
specification): the same float32 products, the same BF16 roundings, the same cache writer and the same cache
values read. It runs the per-CTA lists as the GPU would, one task at a time from a CTA whose head task's waits
are met (round robin, or a seeded random order: another interleaving), writing the task's tiles and then
incrementing its counters. So it proves the plan computes the engine's decode step
(tests/test_persistent_reference.py), and a kernel can be checked task by task against it (`TableRun.buffers`).

Differences from the engine's step, both by construction of split-KV attention and nowhere else:
  * a (row, KV head) of several splits merges float32 partials (max, sum, unnormalized output per split, as
    decode/attention.py's workspace holds them, with natural exp where the kernel uses exp2 of prescaled scores)
    instead of one softmax over the whole context: the attention output can differ by float32 rounding, so by
    one BF16 step where that rounding crosses a BF16 boundary;
  * everything else (projections per tile, epilogues, row factors, RoPE, one split's softmax, the new cache rows)
    is computed with the engine's own operations on slices, bit for bit the same on the CPU.

Buffers are the plan's logical ones (a version per layer, initially NaN), with checks a kernel does not make:
every read tile must have been written (else `ReadBeforeWrite`: a wait is missing), no tile is written twice,
a table whose CTAs can no longer advance raises `persistent_schedule.Deadlock` naming the stuck tasks and
counters, and one that ends early leaves outputs unwritten (an error). Races on the kernel's physical buffers
(one scratch for every layer, the residual stream in place) are `persistent_schedule.verify`'s part.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from decode.attn_plan import default_plan
from decode.persistent_schedule import END, F, FIELDS, KINDS, PROJECTIONS, Deadlock, Schedule, task_table
from futx.quant.fold import rms_row_factor

from .backends import apply_rope_f32, fused_norm, row_products
from .packed import dequantize_weight



class ReadBeforeWrite(AssertionError):
    """A task read a tile that no task had written yet: its waits do not order it after the tile's writer."""


@dataclass
class TableRun:
    hidden: torch.Tensor              # bf16 [M, H]: the residual stream after the table's last layer
    logits: Optional[torch.Tensor]    # bf16 [M, V] when the table holds the LM head
    order: list                       # (CTA, list index) of every task, in the order they ran
    counters: list                    # the counters' final values
    buffers: dict                     # (buffer, layer) -> every logical buffer's final values, as the plan's
                                      # tiles name them ("part": [M, Hkv x splits, group, D + 2]: O, max, sum)


def task_name(row: Sequence[int]) -> str:
    """A table row as decode.persistent_schedule.Task.name spells the task."""
    kind, layer, a = KINDS[row[F["kind"]]], row[F["layer"]], row[F["a0"]:F["a0"] + 4]
    if kind == "attn_partial":
        return f"L{layer} {kind} r{a[0]} h{a[1]} s{a[2]}"
    if kind == "attn_combine":
        return f"L{layer} {kind} r{a[0]} h{a[1]}"
    if kind in ("row_factor", "row_factor2"):
        return f"L{layer} {kind}"
    return f"L{layer} {kind}[{a[0]}:{a[1]}]"


def run_schedule(model, schedule: Schedule, tokens, positions, slots,
                 order: Union[str, int] = "round-robin", ring: bool = False) -> TableRun:
    """`run_task_table` of a schedule: its table and launch constants, checked against the model and inputs."""
    g = schedule.graph
    if g.config != model.config:
        raise ValueError("the schedule was built for another model config")
    tt = default_plan(model.cache.fmt, model.config.head_dim, fused_qkv=True).tile_tokens
    if g.tile_tokens != tt:
        raise ValueError(f"the schedule has {g.tile_tokens}-token attention tiles, the {model.cache.fmt} cache's "
                         f"attention {tt}: build it with cache={model.cache.fmt!r}")
    contexts = tuple(int(p) + 1 for p in torch.as_tensor(positions).tolist())
    if contexts != g.contexts:
        raise ValueError(f"the schedule was built for contexts {g.contexts}, the inputs have {contexts} "
                         "(context = position + 1)")
    return run_task_table(model, task_table(schedule), len(g.counters), tokens, positions, slots,
                          tile_tokens=g.tile_tokens, order=order, ring=ring)


def run_task_table(model, table: torch.Tensor, counters: int, tokens, positions, slots, *,
                   tile_tokens: Optional[int] = None, order: Union[str, int] = "round-robin",
                   ring: bool = False) -> TableRun:
    """Run a task table (`persistent_schedule.task_table`: int32 [CTAs, tasks + 1, len(FIELDS)]) for one decode
    step of `model` (a DecodeModel with backend="emulated") on rows `tokens` at `positions` in cache `slots`;
    writes the new K/V rows into model.cache as the engine's step does (its other state is untouched).
    counters: words of the counter array (len(graph.counters)); tile_tokens: attention's tile (default: the
    decode attention plan of the model's cache format). No split count is needed: a partial's tokens follow
    from its row's context and the splits holding tiles (`split_tiles`). order: "round-robin" over the CTAs
    whose next task can run, or an int seed of a random choice among them. ring: the ring layer's protocol
    (decode/persistent_ring.py): a CTA's projection task right after one of the same kind and layer does not wait,
    and a CTA holds its signals over a run of tasks of one layer that signal the same counters, adding the run's
    count after its last task."""
    return _Interpreter(model, table, counters, tokens, positions, slots, tile_tokens).run(order, ring)


def split_tiles(context: int, tile_tokens: int, active: int) -> int:
    """Tiles per split of a row at `context` tokens whose attention has `active` splits holding tiles.
    build_graph (as decode/attention.py) gives each of `splits` splits ceil(tiles / splits) tiles, and then
    active = ceil(tiles / per); per = ceil(tiles / active) recovers it whatever `splits` was (an identity of
    ceilings, tested), so the table's (split, active) fields locate a partial's tokens without the split count.
    Raises when no split size gives `active` non-empty splits (a table made for another context)."""
    tiles = -(-context // tile_tokens)
    per = -(-tiles // active) if active >= 1 else 0
    if not per or -(-tiles // per) != active:
        raise ValueError(f"{active} splits cannot hold the {tiles} {tile_tokens}-token tiles of context {context}")
    return per


class _Interpreter:
    def __init__(self, model, table, counters, tokens, positions, slots, tile_tokens):
        if getattr(model, "backend", None) != "emulated" or model.cache.values is None:
            raise ValueError("the task interpreter runs on a DecodeModel with backend='emulated' (it reads the "
                             "cache values the emulated engine keeps)")
        c = self.config = model.config
        self.model, self.cache, self.device = model, model.cache, model.device
        self.counters = _positive("counters", counters)
        self.tile_tokens = _positive("tile_tokens", tile_tokens if tile_tokens is not None else
                                     default_plan(model.cache.fmt, c.head_dim, fused_qkv=True).tile_tokens)
        self.tokens, self.positions, self.slots = (torch.as_tensor(x).to(self.device, torch.int64).reshape(-1)
                                                   for x in (tokens, positions, slots))
        m = self.m = self.tokens.numel()
        if not 1 <= m or self.positions.numel() != m or self.slots.numel() != m:
            raise ValueError(f"one position and one slot per token: {m} tokens, {self.positions.numel()} "
                             f"positions, {self.slots.numel()} slots")
        if int(self.tokens.min()) < 0 or int(self.tokens.max()) >= c.vocab_size:
            raise ValueError(f"token ids must lie in [0, {c.vocab_size})")
        if int(self.positions.min()) < 0 or int(self.positions.max()) >= model.capacity:
            raise ValueError(f"positions must lie in [0, {model.capacity}), got {self.positions.tolist()}")
        if (int(self.slots.min()) < 0 or int(self.slots.max()) > self.cache.slots
                or self.slots.unique().numel() != m):
            raise ValueError(f"slots must be distinct and in [0, {self.cache.slots}], got {self.slots.tolist()}")
        self.lists = _lists(table, counters, c.num_hidden_layers, m, c.num_key_value_heads)
        rows = [r for lst in self.lists for r in lst]
        kinds = [KINDS[r[F["kind"]]] for r in rows]
        self.head = "lm_head" in kinds
        # the part scratch: a slot per (KV head, split) up to the most splits any partial names
        self.splits = max((r[F["a3"]] for r, k in zip(rows, kinds) if k == "attn_partial"), default=1)
        self.layers = max((r[F["layer"]] for r, k in zip(rows, kinds) if k not in ("lm_head", "row_factor")),
                          default=-1) + 1
        if self.layers == 0:
            raise ValueError("the table holds no decode layer")
        if self.head and self.layers != c.num_hidden_layers:
            raise ValueError(f"a table with the LM head must hold all {c.num_hidden_layers} layers, it holds "
                             f"{self.layers}")
        for r, k in zip(rows, kinds):   # the final norm and the head come after the last layer, as layer `layers`
            if (k == "lm_head") != (r[F["layer"]] == self.layers) and k != "row_factor":
                raise ValueError(f"{task_name(r)}: the LM head is layer {self.layers} of this table, decode "
                                 f"layers 0..{self.layers - 1}")
        self.store = _Store(self)
        self.store.put("h", 0, slice(None), slice(None), model.packed.embed[self.tokens], None)
        self._weights: dict = {}

    # ---- the loop: CTAs advance one task at a time ----------------------------------------------------------
    def run(self, order, ring: bool = False) -> TableRun:
        if order != "round-robin" and not isinstance(order, int):
            raise ValueError(f"order must be 'round-robin' or an int seed, got {order!r}")
        rng = random.Random(order) if isinstance(order, int) else None
        lists, count, pos, done, nxt = self.lists, [0] * self.counters, [0] * len(self.lists), [], 0
        staged = [None] * len(lists)   # ring: (kind, layer) of the CTA's last task where a projection
        held = [0] * len(lists)        # ring: tasks whose signals the CTA holds

        def can_run(c):
            row = lists[c][pos[c]]
            if ring and staged[c] == (row[F["kind"]], row[F["layer"]]):
                return True
            return all(count[k] >= t for k, t in _waits(row))

        while True:
            live = [c for c in range(len(lists)) if pos[c] < len(lists[c])]
            if not live:
                break
            ready = [c for c in live if can_run(c)]
            if not ready:
                self._deadlock(live, pos, count)
            if rng is None:   # the first ready CTA at or after the one after the last to run
                c = min(ready, key=lambda x: (x - nxt) % len(lists))
                nxt = c + 1
            else:
                c = rng.choice(ready)
            row = lists[c][pos[c]]
            self.execute(row)
            held[c] += 1
            after = lists[c][pos[c] + 1] if pos[c] + 1 < len(lists[c]) else None
            if ring:
                staged[c] = (row[F["kind"]], row[F["layer"]]) if KINDS[row[F["kind"]]] in PROJECTIONS else None
            hold = ring and after is not None and all(after[F[f]] == row[F[f]] for f in ("layer", "signal0",
                                                                                           "signal1"))
            if not hold:
                for k in row[F["signal0"]], row[F["signal1"]]:
                    if k >= 0:
                        count[k] += held[c]
                held[c] = 0
            done.append((c, pos[c]))
            pos[c] += 1
        self.store.check_complete()
        logits = self.store.get("logits", self.layers, slice(None), slice(None), None) if self.head else None
        return TableRun(self.store.get("h", self.layers, slice(None), slice(None), None), logits, done, count,
                        dict(self.store.values))

    def _deadlock(self, live, pos, count):
        lines, stuck = [], []
        for c in live:
            row = self.lists[c][pos[c]]
            k, t = next((k, t) for k, t in _waits(row) if count[k] < t)
            stuck.append((c, task_name(row)))
            lines.append(f"  CTA {c} runs {task_name(row)}, waiting on counter {k} ({count[k]} of {t})")
        left = sum(len(lst) - p for lst, p in zip(self.lists, pos))
        raise Deadlock(f"deadlock: {len(live)} of {len(self.lists)} CTAs wait forever with {left} tasks left:\n"
                       + "\n".join(lines), stuck)

    # ---- the tasks -------------------------------------------------------------------------------------------
    def execute(self, row):
        kind, layer, a = KINDS[row[F["kind"]]], row[F["layer"]], row[F["a0"]:F["a0"] + 4]
        name = task_name(row)
        if kind in ("row_factor", "row_factor2"):
            src, dst = ("h", "rf") if kind == "row_factor" else ("hmid", "rf2")
            x = self.store.get(src, layer, slice(None), slice(None), name)
            self.store.put(dst, layer, slice(None), slice(None), rms_row_factor(x, self.config.rms_norm_eps)[:, None],
                           name)
        elif kind == "attn_partial":
            self.attn_partial(layer, *a, name)
        elif kind == "attn_combine":
            self.attn_combine(layer, *a[:3], name)
        else:
            self.projection(kind, layer, a[0], a[1], name)

    def weight(self, kind, layer):
        """The float32 values the projection multiplies by (the packed weight, dequantized once per run)."""
        if kind == "lm_head":
            return self.model.packed.lm_head
        w = getattr(self.model.packed.layers[layer], "gateup" if kind == "gate_up" else kind)
        if id(w) not in self._weights:
            self._weights[id(w)] = (w, dequantize_weight(w))
        return self._weights[id(w)]

    def projection(self, kind, layer, a0, a1, name):
        """Weight rows [a0, a1) of the projection and their epilogue, as EmulatedOps computes the whole one."""
        st, all_ = self.store, slice(None)
        n = self.config.projection_shapes()[kind][0] if kind != "lm_head" else self.config.vocab_size
        if not 0 <= a0 < a1 <= n:
            raise ValueError(f"{name}: weight rows [{a0}, {a1}) outside the projection's {n}")
        if kind == "lm_head":   # futx.reference.rms_norm with the final gain, then the BF16 head
            x, rf = st.get("h", layer, all_, all_, name), st.get("rf", layer, all_, all_, name)
            gain = self.model.packed.final_norm.to(torch.bfloat16)
            h = (x.float() * rf).to(torch.bfloat16) * gain
            st.put("logits", layer, all_, slice(a0, a1), h @ self.weight(kind, layer)[a0:a1].T, name)
            return
        w, wf = self.weight(kind, layer)
        wt = wf[a0:a1].T
        if kind in ("qkv", "gate_up"):   # EmulatedOps.norm_linear: the row factor of `rf` (or `rf2`)
            src, rfn, epi = ("h", "rf", "store") if kind == "qkv" else ("hmid", "rf2", "swiglu")
            x, rf = st.get(src, layer, all_, all_, name), st.get(rfn, layer, all_, all_, name)
            if self.model.ops.glue == "fused" and fused_norm(x, w, epi):   # the row factor scales the outputs
                y = row_products(x.float(), wt) * rf
            else:                                                        # a normalized BF16 row first
                y = row_products((x.float() * rf).to(torch.bfloat16).float(), wt)
            if kind == "qkv":
                st.put("qkv", layer, all_, slice(a0, a1), y.to(torch.bfloat16), name)
            else:   # rows 2j gate, 2j + 1 up (packed._interleave): SwiGLU columns [a0 / 2, a1 / 2)
                if a0 % 2 or a1 % 2:
                    raise ValueError(f"{name}: gate/up tiles hold whole gate/up row pairs, not rows [{a0}, {a1})")
                z = torch.nn.functional.silu(y[:, 0::2]) * y[:, 1::2]
                st.put("act", layer, all_, slice(a0 // 2, a1 // 2), z.to(torch.bfloat16), name)
            return
        src, res, dst = ("attn", "h", "hmid") if kind == "o" else ("act", "hmid", "h")
        x = st.get(src, layer, all_, all_, name)
        r = st.get(res, layer, all_, slice(a0, a1), name)   # the residual epilogue: this tile's columns
        y = row_products(x.float(), wt) + r.float()
        st.put(dst, layer + (kind == "down"), all_, slice(a0, a1), y.to(torch.bfloat16), name)

    def _split(self, name, r, active):
        """(tiles per split, context) of row r."""
        ctx = int(self.positions[r]) + 1
        try:
            return split_tiles(ctx, self.tile_tokens, active), ctx
        except ValueError as e:
            raise ValueError(f"{name}: row {r}: {e}") from None

    def attn_partial(self, layer, r, h, s, active, name):
        """Split s of row r's attention for KV head h's query group over its tokens; the last split first writes
        the new K/V row of head h (RoPE on k, as split_rope) into the cache, as the attention kernel does."""
        c, st = self.config, self.store
        g, d, q = c.group_size, c.head_dim, c.q_size
        per, ctx = self._split(name, r, active)
        if not 0 <= s < active:
            raise ValueError(f"{name}: split {s} outside the {active} holding tiles")
        rows, pos = slice(r, r + 1), self.positions[r:r + 1]
        table = self.model.rope
        qh = st.get("qkv", layer, rows, slice(h * g * d, (h + 1) * g * d), name).view(1, g, d)
        qh = apply_rope_f32(qh, table, pos).to(torch.bfloat16)
        if s == active - 1:   # holds the new token
            k = st.get("qkv", layer, rows, slice(q + h * d, q + (h + 1) * d), name).view(1, 1, d)
            v = st.get("qkv", layer, rows, slice(q + c.kv_size + h * d, q + c.kv_size + (h + 1) * d), name)
            k = apply_rope_f32(k, table, pos).to(torch.bfloat16)
            self.cache.write_rows(layer, self.slots[r:r + 1], pos, k, v.view(1, 1, d), heads=slice(h, h + 1))
            st.put("kv", layer, rows, slice(h, h + 1), torch.ones(1, 1), name)
        lo, hi = s * per * self.tile_tokens, min(ctx, (s + 1) * per * self.tile_tokens)
        kk, vv = self.cache.attended_values(layer, self.slots[r:r + 1], hi)
        kk, vv = kk[:, h:h + 1, lo:hi], vv[:, h:h + 1, lo:hi]                   # [1, 1, tokens, D]
        scores = (qh.float().view(1, 1, g, d) @ kk.transpose(-1, -2)) / math.sqrt(d)   # [1, 1, g, tokens]
        if active == 1:   # one split: the engine's softmax, straight into the attention output
            out = torch.softmax(scores, dim=-1) @ vv
            st.put("attn", layer, rows, slice(h * g * d, (h + 1) * g * d), out.reshape(1, g * d).to(torch.bfloat16),
                   name)
            return
        big = scores.amax(dim=-1, keepdim=True)
        e = torch.exp(scores - big)
        part = torch.cat([e @ vv, big, e.sum(dim=-1, keepdim=True)], dim=-1)    # [1, 1, g, D + 2]: O, m, l
        st.put("part", layer, rows, slice(h * self.splits + s, h * self.splits + s + 1), part.view(1, 1, g, d + 2),
               name)

    def attn_combine(self, layer, r, h, active, name):
        """Row r's KV head h: its `active` split partials merged (decode/splitkv_combine.merge_splits)."""
        c = self.config
        g, d = c.group_size, c.head_dim
        self._split(name, r, active)
        parts = self.store.get("part", layer, slice(r, r + 1), slice(h * self.splits, h * self.splits + active),
                               name)[0]   # [active, g, D + 2]
        o, m, l = parts[..., :d], parts[..., d:d + 1], parts[..., d + 1:]
        f = torch.exp(m - m.amax(dim=0))
        out = (f * o).sum(dim=0) / (f * l).sum(dim=0)
        self.store.put("attn", layer, slice(r, r + 1), slice(h * g * d, (h + 1) * g * d),
                       out.reshape(1, g * d).to(torch.bfloat16), name)


class _Store:
    """The logical buffers of the step (one version per layer, as the plan's tiles name them), with a mask of
    the elements written: a read of unwritten elements or a second write is an error naming the task."""

    def __init__(self, run: _Interpreter):
        c, m, dev = run.config, run.m, run.device
        g, d = c.group_size, c.head_dim
        bf, f32 = torch.bfloat16, torch.float32
        self.spec = {"h": ((m, c.hidden_size), bf), "hmid": ((m, c.hidden_size), bf), "rf": ((m, 1), f32),
                     "rf2": ((m, 1), f32), "qkv": ((m, c.qkv_size), bf), "kv": ((m, c.num_key_value_heads), f32),
                     "part": ((m, c.num_key_value_heads * run.splits, g, d + 2), f32), "attn": ((m, c.q_size), bf),
                     "act": ((m, c.intermediate_size), bf), "logits": ((m, c.vocab_size), bf)}
        self.run, self.dev = run, dev
        self.values: dict = {}
        self.written: dict = {}

    def _buf(self, buf, layer):
        key = (buf, layer)
        if key not in self.values:
            shape, dtype = self.spec[buf]
            self.values[key] = torch.full(shape, float("nan"), dtype=dtype, device=self.dev)   # poison
            self.written[key] = torch.zeros(shape[:2], dtype=torch.bool)
        return self.values[key], self.written[key]

    def get(self, buf, layer, rows, cols, task):
        val, mask = self._buf(buf, layer)
        if not bool(mask[rows, cols].all()):
            raise ReadBeforeWrite(f"{task} reads {_tile(buf, layer, rows, cols, mask)} before it is written: "
                                  "its waits do not order it after the tile's writer")
        return val[rows, cols]

    def put(self, buf, layer, rows, cols, value, task):
        val, mask = self._buf(buf, layer)
        if bool(mask[rows, cols].any()):
            raise AssertionError(f"{task} writes {_tile(buf, layer, rows, cols, mask)}, which another task wrote")
        val[rows, cols] = value.to(val.device, val.dtype)
        mask[rows, cols] = True

    def check_complete(self):
        """What the step hands on is all written: the new cache rows of every layer and head, the last residual
        stream, the logits with the LM head (a table missing tasks ends here)."""
        need = [("kv", layer) for layer in range(self.run.layers)] + [("h", self.run.layers)]
        need += [("logits", self.run.layers)] if self.run.head else []
        for buf, layer in need:
            _, mask = self._buf(buf, layer)
            if not bool(mask.all()):
                missing = int((~mask).sum())
                raise AssertionError(f"the table ran to its end with {missing} elements of {buf}{layer} unwritten")


def _tile(buf, layer, rows, cols, mask) -> str:
    r = range(mask.shape[0])[rows]
    c = range(mask.shape[1])[cols]
    return f"{buf}{layer}[{r.start}:{r.stop}, {c.start}:{c.stop}]"


def _positive(what, x) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < 1:
        raise ValueError(f"{what} must be a positive integer, got {x!r}")
    return x


def _waits(row):
    return [(row[F[w]], row[F[t]]) for w, t in (("wait0", "target0"), ("wait1", "target1")) if row[F[w]] >= 0]


def _lists(table, counters, layers, m, kv_heads) -> list:
    """The table's per-CTA task rows (up to the first row of kind -1), checked field by field."""
    if not isinstance(table, torch.Tensor) or table.dim() != 3 or table.shape[2] != len(FIELDS):
        raise ValueError(f"a task table is int [CTAs, tasks + 1, {len(FIELDS)}], got "
                         f"{tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__}")
    out = []
    for c, cta in enumerate(table.tolist()):
        lst = []
        for j, row in enumerate(cta):
            kind = row[F["kind"]]
            if kind == END:
                break
            if not 0 <= kind < len(KINDS):
                raise ValueError(f"CTA {c} row {j}: kind {kind} is not an index of KINDS")
            name = task_name(row)
            top = layers if KINDS[kind] in ("row_factor", "lm_head") else layers - 1   # the head: layer `layers`
            if not 0 <= row[F["layer"]] <= top:
                raise ValueError(f"CTA {c} row {j} ({name}): layer outside 0..{top} (the model has {layers})")
            for w in ("wait0", "wait1", "signal0", "signal1"):
                if not -1 <= row[F[w]] < counters:
                    raise ValueError(f"CTA {c} row {j} ({name}): {w} = {row[F[w]]} outside the {counters} counters")
            if KINDS[kind] in ("attn_partial", "attn_combine"):
                if not (0 <= row[F["a0"]] < m and 0 <= row[F["a1"]] < kv_heads):
                    raise ValueError(f"CTA {c} row {j} ({name}): row or KV head outside M = {m}, {kv_heads} heads")
            lst.append(row)
        else:
            raise ValueError(f"CTA {c}: its list has no end row (kind -1)")
        out.append(lst)
    return out
