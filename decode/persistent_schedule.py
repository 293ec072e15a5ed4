"""Host plan of the persistent decode kernel (issue 29): a decode layer (or the whole step) for 1..8 rows as
tasks on resident CTAs, ordered through global-memory counters at tile granularity instead of kernel boundaries.
Pure Python (no DSL): the CPU tests check the plan, the DSL kernel reads its table (`task_table`).

Task graph. Each task names the tiles (buffer, rows, columns) it reads and writes. Buffers are single-assignment
per layer ("qkv3" is layer 3's QKV output), so a task's dependencies are the writers of what it reads: derived,
never listed, so a shape or tile-width change moves the edges with the tiles. The kernel's physical buffers (one
QKV scratch for every layer, the residual stream updated in place) are checked by `verify`: each overwrite is
ordered after every access of the version before.

Counters. A task waits only for the producers not already implied by another of its producers (the transitive
reduction: QKV waits for the row factor, not also for the down blocks before it). Tasks with the same reduced set
share one counter, and the same set one layer later is the same counter, so a whole step needs 2 Hkv + M Hkv + 5
words (row factor; per KV head its Q blocks and its Q/K/V blocks; per (row, KV head) the split-KV partials; all
attention; the O output; the second row factor; the SwiGLU output; the down output): each consumer polls one word
and each producer adds 1 to one or two. Targets are cumulative over layers (layer l waits for the producers of
layers <= l), so the counters are zeroed once per launch and never reset mid-kernel, where a reset would race with
a late reader; sound because each layer's producers of a counter run after all of the layer before's (`verify`).

Assignment. Tasks are numbered in a topological order (per layer: row factor; per KV head the QKV blocks that
feed it first, then its attention; O; row factor; gate/up; down). In that order each task goes to the CTA the
cost model frees first, so every CTA's list increases in it. Then no deadlock can occur whatever the real
durations: the lowest-numbered unfinished task heads its CTA's list and everything it waits for is lower.

`simulate` runs the lists under a duration model (HBM bytes at an equal share of 4.36 TB/s per CTA, weights or
cache bytes up to `prefetch_bytes` streamed before the wait): a model for comparing plans, not a measurement.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Optional, Sequence, Union

from decode.attn_plan import MAX_GROUP, choose_splits, default_plan
from decode.gemv_layout import CHANNELS, TOKENS, UNIT_BYTES
from decode.plan import TILE_WARPS_LARGE_K
from futx.config import LlamaConfig

HBM_BYTES_PER_S = 4.36e12  # measured read-only ceiling of the H200 (docs/results.md; scripts/bench_engine.py)
SMS = 132
MAX_ROWS = TOKENS          # the multi-token tile GEMV's token columns: 1..8 rows per projection task
CTAS_PER_SM = 2            # one CTA can stream while the other waits at a counter
PREFETCH_UNITS = 2         # decode/gemv_tile.py DEFAULT_PREFETCH (a DSL module): units per warp per batch
# weights a CTA requests before its wait: the tile GEMV's first batch, in the registers of 8 warps
PREFETCH_BYTES = TILE_WARPS_LARGE_K * PREFETCH_UNITS * UNIT_BYTES
KINDS = ("row_factor", "qkv", "attn_partial", "attn_combine", "o", "row_factor2", "gate_up", "down", "lm_head")
PROJECTIONS = ("qkv", "o", "gate_up", "down")
DEFAULT_WIDTHS = {"qkv": CHANNELS, "o": CHANNELS, "gate_up": CHANNELS, "down": CHANNELS, "lm_head": 8 * CHANNELS}
# the kernel's task table: int32 [ctas, longest list + 1, len(FIELDS)], a row of kind END ends each list
FIELDS = ("kind", "layer", "a0", "a1", "a2", "a3", "wait0", "target0", "wait1", "target1", "signal0", "signal1")
F = {name: i for i, name in enumerate(FIELDS)}
END = -1
END_ROW = (END, 0, 0, 0, 0, 0, -1, 0, -1, 0, -1, -1)   # no arguments, no waits (-1), no signals (-1)


def int4_bytes(n: int, k: int, group_size: int) -> int:
    """INT4 weights of an n x k projection: a nibble per weight and an fp16 scale per group (the floor formula of
    scripts/bench_decode_linear.py)."""
    return n * k // 2 + n * (k // group_size) * 2


class Tile(NamedTuple):
    buf: str      # logical buffer, versioned by `layer`
    layer: int
    r0: int       # rows [r0, r1), columns [c0, c1)
    r1: int
    c0: int
    c1: int

    def overlap(self, o: "Tile") -> int:
        return max(0, min(self.r1, o.r1) - max(self.r0, o.r0)) * max(0, min(self.c1, o.c1) - max(self.c0, o.c0))

    @property
    def area(self) -> int:
        return (self.r1 - self.r0) * (self.c1 - self.c0)

    def __str__(self) -> str:
        return f"{self.buf}{self.layer}[{self.r0}:{self.r1}, {self.c0}:{self.c1}]"


@dataclass
class Task:
    id: int
    kind: str
    layer: int
    args: tuple               # projections (lo, hi) weight rows; attn_partial (row, head, split, active);
                              # attn_combine (row, head, active)
    reads: tuple
    writes: tuple
    stream_bytes: int = 0     # bytes from HBM the model counts: weights, or the cache rows attended
    weight_bytes: int = 0     # the projections' INT4 (LM head BF16) weights, for the floor
    waits: list = field(default_factory=list)     # [(counter id, target)]
    signals: list = field(default_factory=list)   # [counter id], each +1 when the task's tiles are written

    @property
    def name(self) -> str:
        a = self.args
        if self.kind == "attn_partial":
            detail = f" r{a[0]} h{a[1]} s{a[2]}"
        elif self.kind == "attn_combine":
            detail = f" r{a[0]} h{a[1]}"
        elif a:
            detail = f"[{a[0]}:{a[1]}]"
        else:
            detail = ""
        return f"L{self.layer} {self.kind}{detail}"


@dataclass
class Counter:
    id: int
    name: str
    generations: dict = field(default_factory=dict)   # consumer layer -> producer task ids

    def target(self, layer: int) -> int:
        return sum(len(p) for g, p in self.generations.items() if g <= layer)


@dataclass
class Graph:
    config: LlamaConfig
    m: int
    contexts: tuple
    layers: int
    head: bool
    splits: int
    tile_tokens: int
    group_size: int
    widths: dict
    tasks: list
    counters: list
    layer_starts: list               # first task id of each layer (the final norm / LM head: layer `layers`)
    shapes: dict                     # (buf, layer) -> (rows, columns) of each buffer handed on
    producers: dict                  # read tile -> writer ids
    fused_norm: bool = False         # build_graph's kernel-form options (see there)
    every_split: bool = False

    def deps(self, t: Task) -> set:
        return {p for r in t.reads for p in self.producers[r]}


def _blocks(n: int, width: int):
    return [(lo, min(lo + width, n)) for lo in range(0, n, width)]


def _check(config: LlamaConfig, m: int, contexts: tuple, widths: dict, group_size: int, cache: str, sms: int):
    if not isinstance(m, int) or not 1 <= m <= MAX_ROWS:
        raise ValueError(f"the persistent decode kernel takes 1 <= M <= {MAX_ROWS} rows, got M = {m!r}")
    if len(contexts) != m:
        raise ValueError(f"one context per row: {len(contexts)} contexts for M = {m}")
    for c in contexts:
        if not isinstance(c, int) or not 1 <= c <= config.max_position_embeddings:
            raise ValueError(f"context {c!r} outside 1..{config.max_position_embeddings} (max_position_embeddings)")
    if config.group_size > MAX_GROUP:
        raise ValueError(f"GQA group {config.group_size} ({config.num_attention_heads} query heads over "
                         f"{config.num_key_value_heads} KV heads): decode attention takes at most {MAX_GROUP}")
    default_plan(cache, config.head_dim)   # raises naming an unsupported head dim or cache format
    for kind, w in widths.items():
        if kind not in DEFAULT_WIDTHS:
            raise ValueError(f"tile width for unknown task kind {kind!r}; known: {sorted(DEFAULT_WIDTHS)}")
        if not isinstance(w, int) or w <= 0 or w % CHANNELS:
            raise ValueError(f"{kind} tile width {w!r} is not a positive multiple of {CHANNELS} weight rows")
    for proj, (n, k) in config.projection_shapes().items():
        if n % CHANNELS:
            raise ValueError(f"{proj} output size N = {n} is not a multiple of {CHANNELS}")
        if k % group_size:
            raise ValueError(f"{proj} input size K = {k} is not a multiple of the INT4 group size {group_size} "
                             "(use group_size=64, as futx.engine.packed.default_group_size does)")
    if not isinstance(sms, int) or sms < 1:
        raise ValueError(f"sms must be a positive integer, got {sms!r}")


# ---- the task graph -----------------------------------------------------------------------------------------
def build_graph(config: LlamaConfig, m: int, context: Union[int, Sequence[int]], *, layers: int = 1,
                head: bool = False, sms: int = SMS, widths: Optional[Mapping[str, int]] = None,
                cache: str = "int4", group_size: int = 128, splits: Optional[int] = None,
                fused_norm: bool = False, every_split: bool = False) -> Graph:
    """The task graph of `layers` decode layers (and with `head` the final norm and LM head) for `m` rows at
    `context` tokens (one value, or one per row, the new token included); `widths`: weight rows per projection
    task (multiples of 16); `splits`: split-KV count (None: decode attention's own, `attn_plan.choose_splits`).

    The kernel's form (decode/persistent_layer.py): `fused_norm` leaves out the layers' row-factor tasks (QKV and
    gate/up compute the RMSNorm factor of their input themselves, the M = 1 tile GEMV's fused norm), so two links
    of each layer's chain go; `every_split` gives every (row, KV head) all `splits` partials, each reading the
    new K/V columns: which splits hold tiles and which one holds the new token are the kernel's run-time choice
    (from the row's position, as decode/attention.py decides), so one table serves every context up to `context`
    (the contexts then only weigh the model's bytes)."""
    contexts = (context,) * m if isinstance(context, int) else tuple(context)
    widths = {**DEFAULT_WIDTHS, **(widths or {})}
    _check(config, m, contexts, widths, group_size, cache, sms)
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers must be a positive integer, got {layers!r}")
    c = config
    aplan = default_plan(cache, c.head_dim, fused_qkv=True)
    if splits is None:
        splits = choose_splits(aplan, m, c.num_key_value_heads, max(contexts), sms)
    elif not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be a positive integer, got {splits!r}")
    g, d, q, kv, hid = c.group_size, c.head_dim, c.q_size, c.kv_size, c.hidden_size
    row_bytes = aplan.k_row_bytes + aplan.v_row_bytes + (8 if aplan.quantized else 0)  # + K and V f32 scales
    shapes_nk = c.projection_shapes()
    tasks: list[Task] = []
    shapes: dict = {}

    def add(kind, layer, args, reads, writes, stream=0, weights=0):
        tasks.append(Task(len(tasks), kind, layer, args, tuple(reads), tuple(writes), stream, weights))

    def tile(buf, layer, c0, c1, r0=0, r1=m):
        return Tile(buf, layer, r0, r1, c0, c1)

    def projection(kind, layer, n, k, reads, dst, bf16=False):
        """One task per `widths[kind]` weight rows; reads(lo, hi) its input tiles, dst(lo, hi) its output."""
        for lo, hi in _blocks(n, widths[kind]):
            w = (hi - lo) * k * 2 if bf16 else int4_bytes(hi - lo, k, group_size)
            add(kind, layer, (lo, hi), reads(lo, hi), [dst(lo, hi)], w, w)

    def head_of(col):   # the KV head whose attention reads QKV output column `col` (rows: q | k | v heads)
        return col // (g * d) if col < q else (col - q) % kv // d

    qkv_first = {b: min(map(head_of, range(*b))) for b in _blocks(c.qkv_size, widths["qkv"])}
    for L in range(layers):
        shapes.update({("rf", L): (m, 1), ("qkv", L): (m, c.qkv_size), ("kv", L): (m, c.num_key_value_heads),
                       ("attn", L): (m, q), ("hmid", L): (m, hid), ("rf2", L): (m, 1),
                       ("act", L): (m, c.intermediate_size), ("h", L + 1): (m, hid)})
        if fused_norm:
            del shapes[("rf", L)], shapes[("rf2", L)]
        else:
            add("row_factor", L, (), [tile("h", L, 0, hid)], [tile("rf", L, 0, 1)])
        norm_in = [] if fused_norm else [tile("rf", L, 0, 1)]
        k = shapes_nk["qkv"][1]
        for h in range(c.num_key_value_heads):   # the QKV blocks that first feed head h, then h's attention
            for (lo, hi), first in qkv_first.items():
                if first == h:
                    w = int4_bytes(hi - lo, k, group_size)
                    add("qkv", L, (lo, hi), [tile("h", L, 0, hid)] + norm_in, [tile("qkv", L, lo, hi)], w, w)
            for r, ctx in enumerate(contexts):
                tiles = -(-ctx // aplan.tile_tokens)
                per = -(-tiles // splits)
                active = -(-tiles // per)     # splits holding tiles, as decode/attention.py counts them
                if every_split:
                    active = splits           # the kernel skips the empty ones
                qcols = tile("qkv", L, h * g * d, (h + 1) * g * d, r, r + 1)
                kvcols = [tile("qkv", L, q + h * d, q + (h + 1) * d, r, r + 1),
                          tile("qkv", L, q + kv + h * d, q + kv + (h + 1) * d, r, r + 1)]
                out = tile("attn", L, h * g * d, (h + 1) * g * d, r, r + 1)
                for s in range(active):
                    last = s == active - 1    # holds the new token: reads its K/V columns, writes its cache row
                    t0, t1 = s * per, min(tiles, (s + 1) * per)
                    tokens = max(0, min(ctx, t1 * aplan.tile_tokens) - t0 * aplan.tile_tokens)
                    part = tile("part", L, h * splits + s, h * splits + s + 1, r, r + 1)
                    writes = [out if active == 1 else part] + ([tile("kv", L, h, h + 1, r, r + 1)] if last else [])
                    add("attn_partial", L, (r, h, s, active), [qcols] + (kvcols if last or every_split else []),
                        writes, tokens * row_bytes)
                if active > 1:
                    add("attn_combine", L, (r, h, active), [tile("part", L, h * splits, h * splits + active, r, r + 1)],
                        [out])
        projection("o", L, *shapes_nk["o"], lambda lo, hi: [tile("attn", L, 0, q), tile("h", L, lo, hi)],
                   lambda lo, hi: tile("hmid", L, lo, hi))
        if not fused_norm:
            add("row_factor2", L, (), [tile("hmid", L, 0, hid)], [tile("rf2", L, 0, 1)])
        norm2_in = [] if fused_norm else [tile("rf2", L, 0, 1)]
        projection("gate_up", L, *shapes_nk["gate_up"], lambda lo, hi: [tile("hmid", L, 0, hid)] + norm2_in,
                   lambda lo, hi: tile("act", L, lo // 2, hi // 2))   # rows 2j gate, 2j+1 up
        projection("down", L, *shapes_nk["down"],
                   lambda lo, hi: [tile("act", L, 0, c.intermediate_size), tile("hmid", L, lo, hi)],
                   lambda lo, hi: tile("h", L + 1, lo, hi))
    if head:   # the final norm and the BF16 LM head, as layer index `layers`
        L = layers
        shapes.update({("rf", L): (m, 1), ("logits", L): (m, c.vocab_size)})
        add("row_factor", L, (), [tile("h", L, 0, hid)], [tile("rf", L, 0, 1)])
        projection("lm_head", L, c.vocab_size, hid, lambda lo, hi: [tile("h", L, 0, hid), tile("rf", L, 0, 1)],
                   lambda lo, hi: tile("logits", L, lo, hi), bf16=True)
    starts = [0] + [t.id for a, t in zip(tasks, tasks[1:]) if t.layer != a.layer]
    graph = Graph(c, m, contexts, layers, head, splits, aplan.tile_tokens, group_size, widths, tasks, [], starts,
                  shapes, {}, fused_norm, every_split)
    _derive(graph)
    return graph


INPUTS = {("h", 0)}   # what the step reads that no task writes: the embedded rows (the cache and weights are
                      # not tiles: nothing in the step writes them but the new cache rows, buffer "kv")


def _bits(mask: int, base: int) -> list:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1 + base)
        mask ^= low
    return out


def _resolve(graph: Graph) -> None:
    """graph.producers: every read tile -> the tasks writing it (raises on a double write, a write outside its
    buffer, and a read of columns nobody writes)."""
    index = {}
    for t in graph.tasks:
        for w in t.writes:
            index.setdefault((w.buf, w.layer), []).append((w.c0, w.r0, w, t.id))
    for key, lst in index.items():
        lst.sort(key=lambda e: e[:2])
        index[key] = ([e[0] for e in lst], lst, max(e[2].c1 - e[2].c0 for e in lst))

    def writers(r: Tile):
        c0s, lst, widest = index[(r.buf, r.layer)]
        return [(w, i) for _, _, w, i in lst[bisect_left(c0s, r.c0 - widest + 1):bisect_left(c0s, r.c1)]
                if w.overlap(r)]

    for t in graph.tasks:
        for w in t.writes:
            other = [graph.tasks[i].name for _, i in writers(w) if i != t.id]
            if other:
                raise ValueError(f"{t.name} writes {w}, which {', '.join(other)} also writes")
        for r in t.reads:
            if r in graph.producers:
                continue
            if (r.buf, r.layer) not in index:
                if (r.buf, r.layer) not in INPUTS:
                    raise ValueError(f"{t.name} reads {r}, which no task writes")
                graph.producers[r] = ()
                continue
            ws = writers(r)
            if sum(w.overlap(r) for w, _ in ws) != r.area:
                raise ValueError(f"{t.name} reads {r}, parts of which no task writes")
            graph.producers[r] = tuple(sorted(i for _, i in ws))
            if graph.producers[r][-1] >= t.id:
                raise ValueError(f"{t.name} reads {r} from {graph.tasks[graph.producers[r][-1]].name}, numbered "
                                 "after it: the task order is not topological")


def check_outputs(graph: Graph) -> None:
    """Every buffer the layers hand on (QKV, new cache rows, attention, residuals, SwiGLU, row factors, logits)
    is written exactly once: no two writes overlap (`_resolve`), none leaves its buffer, and they fill it."""
    written: dict = {}
    for t in graph.tasks:
        for w in t.writes:
            shape = graph.shapes.get((w.buf, w.layer))
            if shape is not None:
                if not (0 <= w.r0 < w.r1 <= shape[0] and 0 <= w.c0 < w.c1 <= shape[1]):
                    raise ValueError(f"{t.name} writes {w} outside {w.buf}{w.layer}{list(shape)}")
                written[(w.buf, w.layer)] = written.get((w.buf, w.layer), 0) + w.area
    for key, (rows, cols) in graph.shapes.items():
        if written.get(key, 0) != rows * cols:
            raise ValueError(f"{key[0]}{key[1]}: {written.get(key, 0)} of {rows * cols} elements written")


def _derive(graph: Graph) -> None:
    """Producers of every read, then each task's wait: the transitive reduction of its producers, one counter per
    distinct reduced set (the same set one layer later is the same counter, with a cumulative target).
    Ancestor sets are bit masks over a window of two layers (a task reads only its own and the previous layer),
    so a whole step costs no more per layer than one layer does."""
    _resolve(graph)
    check_outputs(graph)
    tasks, starts = graph.tasks, graph.layer_starts
    span = max(b - a for a, b in zip(starts, starts[1:] + [len(tasks)]))   # keeps layer-relative bits >= 0
    base, anc, memo, layer = 0, {}, {}, 0
    counters: dict = {}
    for t in tasks:
        if t.layer != layer:   # slide the window: bits are task id - base, base = first id of the previous layer
            layer = t.layer
            new = starts[layer - 1]
            anc = {i: a >> (new - base) for i, a in anc.items() if i >= new}
            base, memo = new, {}
        strict = direct = 0
        for r in t.reads:
            e = memo.get(r)
            if e is None:
                ps = graph.producers[r]
                if ps and ps[0] < base:
                    raise ValueError(f"{t.name} reads {r} from {tasks[ps[0]].name}, more than one layer back")
                pm = a = 0
                for p in ps:
                    pm |= 1 << (p - base)
                    a |= anc[p]
                e = memo[r] = (pm, a)
            direct |= e[0]
            strict |= e[1]
        anc[t.id] = direct | strict
        reduced = direct & ~strict
        if not reduced:
            continue
        offset = starts[layer] - base
        key = reduced << (span - offset)   # the producer set relative to the consumer's layer
        ctr = counters.get(key)
        if ctr is None:
            ctr = counters[key] = Counter(len(counters), "")
            graph.counters.append(ctr)
        if layer not in ctr.generations:
            ids = _bits(reduced, base)
            ctr.generations[layer] = tuple(ids)
            for p in ids:
                if ctr.id in tasks[p].signals:
                    raise ValueError(f"{tasks[p].name} would count twice on counter {ctr.id}")
                tasks[p].signals.append(ctr.id)
            if not ctr.name:
                kinds = sorted({tasks[p].kind for p in ids})
                where = (f" r{t.args[0]} h{t.args[1]}" if t.kind == "attn_combine"
                         else f" h{t.args[1]}" if t.kind == "attn_partial" else "")
                ctr.name = f"{'+'.join(kinds)} x{len(ids)} -> {t.kind}{where}"
        t.waits = [(ctr.id, ctr.target(layer))]


# ---- assignment ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Model:
    """Duration model (an assumption, not a measurement): every CTA streams its task's HBM bytes (weights, or
    the cache rows attended) at an equal share of `bandwidth`, so C busy CTAs together read at the full rate;
    activations come from L2 and cost only `task_s`; the first `prefetch_bytes` are requested before the wait;
    a waiter sees a counter reach its target `handoff_s` after the last increment."""
    bandwidth: float = HBM_BYTES_PER_S
    task_s: float = 0.0
    handoff_s: float = 0.0
    prefetch_bytes: int = PREFETCH_BYTES

    def times(self, graph: Graph, ctas: int) -> tuple[list, list]:
        """(duration, part of it before the wait) of every task on a machine of `ctas` CTAs."""
        rate = self.bandwidth / ctas
        return ([self.task_s + t.stream_bytes / rate for t in graph.tasks],
                [min(t.stream_bytes, self.prefetch_bytes) / rate for t in graph.tasks])


@dataclass
class Schedule:
    graph: Graph
    lists: list          # per CTA, the task ids it runs in order
    model: Model = Model()

    def __post_init__(self):
        seen = sorted(i for lst in self.lists for i in lst)
        if seen != list(range(len(self.graph.tasks))):
            raise ValueError("every task must be assigned to exactly one CTA")

    @property
    def ctas(self) -> int:
        return len(self.lists)


def list_order(task: Task) -> tuple:
    """The order every CTA's list follows (`assign`): layer, then kind (KINDS order), then id."""
    return task.layer, KINDS.index(task.kind), task.id


def assign(graph: Graph, ctas: int, model: Model = Model()) -> Schedule:
    """Each task, layer by layer and within a layer kind by kind (KINDS order, then id), to the CTA the model frees
    first (ties: the lowest CTA): list scheduling, whose per-CTA lists increase in that order, which is topological
    (a task reads only earlier kinds of its layer and the layers before), and so cannot deadlock. Kind by kind, not
    in id order (where a head's attention follows the QKV blocks that feed it): a CTA's attention task never sits
    before one of its own QKV tasks, which would hold that QKV block (and every attention waiting for it) behind
    the attention's wait and run (measured on the H200: the 8B layer's QKV phase took 20 µs so, for 3 of bytes)."""
    if not isinstance(ctas, int) or ctas < 1:
        raise ValueError(f"ctas must be a positive integer, got {ctas!r}")
    dur, pre = model.times(graph, ctas)
    end = [0.0] * len(graph.tasks)
    done: dict = {}    # (counter, generation) -> modelled end of its last producer
    free = [(0.0, c) for c in range(ctas)]
    lists: list = [[] for _ in range(ctas)]
    for t in sorted(graph.tasks, key=list_order):
        ready = 0.0
        for k, _ in t.waits:
            for g, ps in graph.counters[k].generations.items():
                if g <= t.layer:
                    if (k, g) not in done:
                        done[(k, g)] = max(end[p] for p in ps)
                    ready = max(ready, done[(k, g)] + model.handoff_s)
        f, c = heapq.heappop(free)
        end[t.id] = max(f + pre[t.id], ready) + dur[t.id] - pre[t.id]
        heapq.heappush(free, (end[t.id], c))
        lists[c].append(t.id)
    return Schedule(graph, lists, model)


def make_schedule(config: LlamaConfig, m: int, context: Union[int, Sequence[int]], *, layers: int = 1,
                  head: bool = False, sms: int = SMS, ctas_per_sm: int = CTAS_PER_SM, ctas: Optional[int] = None,
                  widths: Optional[Mapping[str, int]] = None, cache: str = "int4", group_size: int = 128,
                  splits: Optional[int] = None, model: Model = Model(), fused_norm: bool = False,
                  every_split: bool = False) -> Schedule:
    """build_graph + assign on `ctas` (default sms x ctas_per_sm) resident CTAs."""
    graph = build_graph(config, m, context, layers=layers, head=head, sms=sms, widths=widths, cache=cache,
                        group_size=group_size, splits=splits, fused_norm=fused_norm, every_split=every_split)
    return assign(graph, ctas if ctas is not None else sms * ctas_per_sm, model)


# ---- simulation and checks ----------------------------------------------------------------------------------
class Deadlock(RuntimeError):
    """Some CTAs wait forever; `cycle` holds the (CTA, task name) pairs that wait on one another."""

    def __init__(self, message: str, cycle: list):
        super().__init__(message)
        self.cycle = cycle


@dataclass
class SimResult:
    start: list      # per task: when its CTA takes it up (its prefetch begins)
    ready: list      # when its waits are met and it reads its inputs
    end: list        # when its tiles are written and its counters incremented
    makespan: float
    busy: float      # sum of the task durations / (CTAs x makespan)


def _durations(schedule: Schedule, durations) -> tuple[list, list]:
    dur, pre = schedule.model.times(schedule.graph, schedule.ctas)
    if durations is None:
        return dur, pre
    tasks = schedule.graph.tasks
    given = [float(durations(t) if callable(durations) else durations[t.id]) for t in tasks]
    if any(x < 0 for x in given):
        raise ValueError("task durations must be >= 0")
    return given, [g * (p / d if d else 0.0) for g, p, d in zip(given, pre, dur)]   # the model's prefetch share


def simulate(schedule: Schedule, durations: Union[None, Mapping[int, float], Callable[[Task], float]] = None
             ) -> SimResult:
    """Run every CTA's list in order: a task starts when its CTA is free, streams its prefetch, waits until its
    counters reach their targets (+ the model's handoff), then runs the rest; its end increments its counters.
    `durations`: seconds per task id (a mapping) or per task (a callable); None: the schedule's model.
    Raises Deadlock naming the cycle of CTAs and tasks when some lists can never finish."""
    g, lists = schedule.graph, schedule.lists
    tasks, handoff = g.tasks, schedule.model.handoff_s
    dur, pre = _durations(schedule, durations)
    n = len(tasks)
    start, ready, end = [None] * n, [None] * n, [None] * n
    count = [0] * len(g.counters)
    reached: list = [[] for _ in g.counters]      # increment times of each counter, in order
    blocked: dict = {}                             # counter -> CTAs whose head task waits on it
    pos = [0] * len(lists)
    events: list = []

    def attempt(c):
        i = lists[c][pos[c]]
        r = start[i] + pre[i]
        for k, target in tasks[i].waits:
            if count[k] < target:
                blocked.setdefault(k, set()).add(c)
                return
            r = max(r, reached[k][target - 1] + handoff)
        ready[i], end[i] = r, r + dur[i] - pre[i]
        heapq.heappush(events, (end[i], c))

    for c in range(len(lists)):
        if lists[c]:
            start[lists[c][0]] = 0.0
            attempt(c)
    while events:
        now, c = heapq.heappop(events)
        for k in tasks[lists[c][pos[c]]].signals:
            count[k] += 1
            reached[k].append(now)
            for w in sorted(blocked.pop(k, ())):
                attempt(w)
        pos[c] += 1
        if pos[c] < len(lists[c]):
            start[lists[c][pos[c]]] = now
            attempt(c)
    stuck = [c for c in range(len(lists)) if pos[c] < len(lists[c])]
    if stuck:
        _deadlock(schedule, pos, stuck, count, end)
    makespan = max((e for e in end), default=0.0)
    busy = sum(dur) / (len(lists) * makespan) if makespan else 1.0
    return SimResult(start, ready, end, makespan, busy)


def _deadlock(schedule: Schedule, pos: list, stuck: list, count: list, end: list):
    """Follow 'waits for a producer queued on CTA c2' from a stuck CTA until a CTA repeats: the cycle."""
    g, lists = schedule.graph, schedule.lists
    where = {i: c for c, lst in enumerate(lists) for i in lst}
    step = {}
    for c in stuck:
        t = g.tasks[lists[c][pos[c]]]
        k, target = next((k, x) for k, x in t.waits if count[k] < x)
        ctr = g.counters[k]
        missing = [p for gen, ps in ctr.generations.items() if gen <= t.layer for p in ps if end[p] is None]
        p = missing[0]
        step[c] = (t, ctr, target, count[k], p, where[p])
    path, c = [], stuck[0]
    while c not in path:
        path.append(c)
        c = step[c][5]
    cycle = path[path.index(c):]
    lines = []
    for c in cycle:
        t, ctr, target, have, p, c2 = step[c]
        head = g.tasks[lists[c2][pos[c2]]].name
        lines.append(f"  CTA {c} runs {t.name}, waiting on counter {ctr.id} '{ctr.name}' ({have} of {target}); it "
                     f"needs {g.tasks[p].name}, " + (f"queued behind {head} on CTA {c2}" if g.tasks[p].name != head
                                                     else f"the head of CTA {c2}"))
    raise Deadlock(f"deadlock: {len(stuck)} of {len(lists)} CTAs wait forever; the cycle:\n" + "\n".join(lines),
                   [(c, step[c][0].name) for c in cycle])


def check(schedule: Schedule, result: Optional[SimResult] = None) -> SimResult:
    """Every task reads its inputs only after all of their writers have ended, in the simulated run (`result`,
    or the schedule's model run here)."""
    result = result or simulate(schedule)
    g, memo = schedule.graph, {}
    for t in g.tasks:
        for r in t.reads:
            if r not in memo:
                memo[r] = max(g.producers[r], key=lambda p: result.end[p], default=None)
            p = memo[r]
            if p is not None and result.end[p] > result.ready[t.id]:
                raise AssertionError(f"{t.name} reads {r} at {result.ready[t.id] * 1e6:.3f} us, before "
                                     f"{g.tasks[p].name} writes it ({result.end[p] * 1e6:.3f} us)")
    return result


def physical(buf: str, layer: int) -> tuple:
    """Where the kernel keeps a logical buffer: the residual stream in place (h, hmid), one scratch per kind for
    every layer, the new cache rows (kv) and the logits where they belong."""
    if buf in ("h", "hmid"):
        return ("x", 0)
    return (buf, layer) if buf in ("kv", "logits") else (buf, 0)


def verify(schedule: Schedule, place: Callable[[str, int], tuple] = physical) -> None:
    """Static proof obligations, for any task durations (bit masks over the whole graph: meant for a few layers):
    1. what each task reads is written by tasks its waits order before it (through counters, transitively);
    2. a counter's producers of layer l all run after those of the layer before (cumulative targets are exact);
    3. every CTA list increases in one topological order of the waits (no deadlock);
    4. in the buffers as `place` lays them out, each overwrite is ordered after every access of the version
       before (no write-after-read or write-after-write race)."""
    g = schedule.graph
    anc = [0] * len(g.tasks)
    level: dict = {}   # (counter, generation) -> its producers and their ancestors
    masks: dict = {}   # read tile -> its producers
    for t in g.tasks:
        for k, _ in t.waits:
            for gen, ps in g.counters[k].generations.items():
                if gen <= t.layer:
                    if (k, gen) not in level:
                        m = 0
                        for p in ps:
                            if p >= t.id or list_order(g.tasks[p]) >= list_order(t):
                                raise AssertionError(f"{t.name} waits for {g.tasks[p].name}, numbered or listed "
                                                     "after it")
                            m |= anc[p] | 1 << p
                        level[(k, gen)] = m
                    anc[t.id] |= level[(k, gen)]
        for r in t.reads:
            if r not in masks:
                masks[r] = sum(1 << p for p in g.producers[r])
            if masks[r] & ~anc[t.id]:
                p = _bits(masks[r] & ~anc[t.id], 0)[0]
                raise AssertionError(f"{t.name} reads {r} from {g.tasks[p].name}, which its waits do not order "
                                     "before it")
    for ctr in g.counters:
        gens = sorted(ctr.generations)
        for a, b in zip(gens, gens[1:]):
            before = sum(1 << p for p in ctr.generations[a])
            for p in ctr.generations[b]:
                if before & ~anc[p]:
                    raise AssertionError(f"counter {ctr.id} '{ctr.name}': {g.tasks[p].name} (layer {b}) may count "
                                         f"before all of layer {a}'s producers have")
    for c, lst in enumerate(schedule.lists):   # every list follows list_order, topological as checked above
        for a, b in zip(lst, lst[1:]):
            if list_order(g.tasks[a]) > list_order(g.tasks[b]):
                raise AssertionError(f"CTA {c} runs {g.tasks[a].name} before {g.tasks[b].name}, against the "
                                     "lists' topological order: deadlock-freedom is not guaranteed")
    _verify_places(g, anc, place)


def _verify_places(g: Graph, anc: list, place) -> None:
    access: dict = {}   # physical buffer -> {logical buffer: {tile: mask of the tasks reading or writing it}}
    writes: dict = {}   # logical buffer -> [(tile, writer)]
    for t in g.tasks:
        for x in t.reads + t.writes:
            acc = access.setdefault(place(x.buf, x.layer), {}).setdefault((x.buf, x.layer), {})
            acc[x] = acc.get(x, 0) | 1 << t.id
        for x in t.writes:
            writes.setdefault((x.buf, x.layer), []).append((x, t.id))
    for phys, logical in access.items():
        # versions in the order they are written (inputs first); each must be ordered after the one before
        order = sorted(logical, key=lambda key: writes[key][0][1] if key in writes else -1)
        for v, w in zip(order, order[1:]):
            for wt, b in writes.get(w, ()):
                before = 0
                for at, mask in logical[v].items():
                    if at.r0 < wt.r1 and wt.r0 < at.r1 and at.c0 < wt.c1 and wt.c0 < at.c1:
                        before |= mask
                before &= ~anc[b] & ~(1 << b)   # a task may read its own tile before overwriting it
                if before:
                    a = _bits(before, 0)[0]
                    raise AssertionError(f"{g.tasks[b].name} overwrites {wt} in {phys[0]} while {g.tasks[a].name} "
                                         f"may still use {v[0]}{v[1]} there")


# ---- reports and the kernel's table -------------------------------------------------------------------------
def bytes_by_kind(graph: Graph) -> dict:
    """HBM bytes per task kind: INT4 weights and scales of the projections, BF16 LM head, cache rows attended."""
    out: dict = {}
    for t in graph.tasks:
        if t.stream_bytes:
            out[t.kind] = out.get(t.kind, 0) + t.stream_bytes
    return out


def projection_floor_s(graph: Graph, bandwidth: float = HBM_BYTES_PER_S) -> float:
    """One layer's four INT4 projections at the HBM rate: the project's per-layer bytes floor (docs/results.md)."""
    return sum(t.weight_bytes for t in graph.tasks if t.kind in PROJECTIONS) / graph.layers / bandwidth


def floor_s(graph: Graph, bandwidth: float = HBM_BYTES_PER_S) -> float:
    """Every HBM byte of the graph (weights, LM head, cache rows) at the HBM rate."""
    return sum(t.stream_bytes for t in graph.tasks) / bandwidth


def task_table(schedule: Schedule):
    """The kernel's input: int32 [ctas, longest list + 1, len(FIELDS)]; row j of CTA c is its j-th task:
    kind (index in KINDS; -1 ends the list), layer, four arguments (projections: first and last + 1 weight row;
    attn_partial: row, KV head, split, splits holding tiles; attn_combine: row, KV head, splits), up to two
    (counter, target) waits and two counters to increment (-1: none)."""
    import torch

    g = schedule.graph
    width = max(len(lst) for lst in schedule.lists) + 1
    rows = []
    for lst in schedule.lists:
        cta = []
        for i in lst:
            t = g.tasks[i]
            if len(t.waits) > 2 or len(t.signals) > 2 or len(t.args) > 4:
                raise ValueError(f"{t.name}: {len(t.waits)} waits, {len(t.signals)} signals, {len(t.args)} arguments"
                                 " do not fit the table (2, 2, 4): narrower tiles")
            waits = [x for w in t.waits for x in w] + [-1, 0] * (2 - len(t.waits))
            cta.append([KINDS.index(t.kind), t.layer, *t.args, *[0] * (4 - len(t.args)), *waits,
                        *t.signals, *[-1] * (2 - len(t.signals))])
        cta += [list(END_ROW)] * (width - len(cta))
        rows.append(cta)
    return torch.tensor(rows, dtype=torch.int32)
