"""Epilogue policies: what the prefill GEMM does with its accumulators, chosen at compile time.

The mainloop (`futx/prefill/mainloop.py`) finishes a tile of FP32 accumulators in registers (64 rows x tile_n
per consumer warpgroup) and walks it in output *subtiles* (64 rows x epi_n columns). For every subtile
it hands each thread's values to the policy chain as a `Frag`: `frag.vals[i]` is a register, and
`frag.coord(i)` its global (row, column). Policies compose left to right, e.g.

    Chain(ScaleRestore(rho=True), SwiGLU("interleaved"), StoreFP8())

Three kinds of step:
  * "map"    elementwise on the fragment (`visit`), before or after a pair step; a map with
             `whole_tile = True` (and every map before it) instead runs once per tile on all of the
             thread's accumulators, e.g. RoPE, whose channel pairs sit D/2 columns apart;
  * "pair"   combines two accumulator columns into one output column (`combine`), halving N;
             the engine gathers the partner values and restores the standard register layout;
  * "store"  the last step: converts the fragment to the output dtype (`convert`); the engine then
             writes it through shared memory and a TMA store into the output tensor D.

A policy declares the runtime tensors it needs (`args`, in order; the op passes them after D) and
may keep per-thread state in registers across tiles. Hooks, all optional, all traced at compile time:

    setup(self, ctx, *tensors) -> state   once per thread, before the persistent tile loop
    prefetch(self, state, tile)           before the tile's mainloop: issue global loads into registers
                                          (their latency hides behind the MMAs)
    begin_tile(self, state, tile)         after the mainloop: e.g. publish prefetched values to smem
                                          (`smem_floats` words, ctx.smem()[tile.parity, i], shared by
                                          the ctx.epi_threads threads working on this tile (256 in
                                          the coop schedule, 128 in pingpong), ctx.epi_tid; the engine
                                          syncs them)
    visit(self, state, frag)              (map) edit frag.vals in place
    end_tile(self, state, tile)           after the tile's last subtile (e.g. write row partials)
    combine(self, state, gate, up)        (pair) two FP32 values -> one
    convert(self, state, frag)            (store) -> TensorSSA of `out_dtype`
    finish(self, state)                   after the last tile (e.g. publish an amax)

State must not be rebound inside the loops: keep mutable values in register tensors
(`cute.make_rmem_tensor`) created in `setup`. Out-of-range rows/columns (M, N are runtime values
and tiles overhang them) are dropped by the TMA store; policies that read vectors clamp the index
(`ctx.row_clamp`, `ctx.col_clamp`) and policies that write memory themselves must mask.

Writing a new policy: see README.md ("Writing an epilogue policy") for a worked example.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from epilogues.dsl import Int32, cute, cutlass

# dtype names of Arg and out_dtype -> the DSL's type names (looked up only when a kernel compiles)
_DTYPES = {"f32": "Float32", "f64": "Float64", "bf16": "BFloat16", "e4m3": "Float8E4M3FN", "i32": "Int32"}


@dataclass(frozen=True)
class Arg:
    """A runtime tensor a policy reads or writes.

    shape: symbols "m" (rows = tokens), "n" (GEMM columns), "n_out" (columns of D), ints, or other
    names (free extents; equal names must agree). Tensors are contiguous (row-major).
    """

    name: str
    dtype: str
    shape: tuple
    writes: bool = False

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"Arg {self.name!r}: dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")

    @property
    def cute_dtype(self):
        return getattr(cutlass, _DTYPES[self.dtype])


class Policy:
    """Base class of one epilogue step (see module docstring).

    The class attributes (or what __init__ sets) are the policy's one declaration: op validation, the
    fake kernel, the kernel key and `futx build` all read them from the chain. Two host-side hooks
    (plain Python, run by the op before any launch) cover what shapes alone cannot say:
        check(sizes, tensors, tile_n)   raise ValueError for inputs the kernel cannot serve
        out_width(n, tensors)           D's width when it is not N / n_ratio (QKV: the Q columns)
    """

    kind = "map"
    args: tuple = ()
    out_dtype = None       # store steps: the dtype of D ("bf16", "e4m3")
    name = "policy"
    space = "any"          # "out": only in output coordinates (after a pair step, if the chain has one)
    wide_subtile_regs = False   # True: needs the 32-column subtile (e.g. keeps a subtile-sized prefetch)
    whole_tile = False     # map that sees all of the thread's accumulators at once (e.g. RoPE pairs
                           # channels D/2 apart, which sit in different subtiles); maps before it do too

    def smem_floats(self, tile_n: int) -> int:
        """Float32 words of CTA-shared smem per tile (double-buffered by the engine; ctx.smem())."""
        return 0

    def prefetch(self, state, tile) -> None:
        pass

    def key(self) -> str:
        """Short readable name (messages, documentation); kernels are keyed by `fingerprint`."""
        return self.name

    def check(self, sizes: dict, tensors: dict, tile_n: int) -> None:
        """Host-side validation beyond the declared shapes (sizes: m, n, n_out and the free symbols)."""

    def out_width(self, n: int, tensors: dict) -> int | None:
        """Columns of D when they are not N / n_ratio (None: the default)."""
        return None

    def static_params(self) -> dict:
        """The instance's compile-time configuration (part of the fingerprint)."""
        return {k: v for k, v in sorted(vars(self).items())}

    def setup(self, ctx: Any, *tensors) -> Any:
        return tuple(tensors)

    def begin_tile(self, state, tile) -> None:
        pass

    def visit(self, state, frag) -> None:
        pass

    def end_tile(self, state, tile) -> None:
        pass

    def combine(self, state, gate, up):
        raise NotImplementedError

    def convert(self, state, frag):
        raise NotImplementedError

    def finish(self, state) -> None:
        pass


@dataclass
class Tile:
    """Where the current tile sits (global indices of this warpgroup's 64-row slab)."""

    row0: Int32        # first row
    col0: Int32        # first accumulator (GEMM N) column (split SwiGLU: see ctx.gemm_col)
    out_col0: Int32    # first column of D
    tn: Int32          # tile column index
    parity: Int32      # 0/1 alternating per tile: which half of a policy's smem to use


class Frag:
    """One thread's values of one subtile, with their global coordinates.

    vals: FP32 register tensor (edit in place). coord(i) -> (row, col); the column is a GEMM column
    before a pair step and a D column after it. local(i) -> (row in the 64-row slab, column in the
    tile: accumulator column before a pair step, output column after), e.g. to index policy smem.
    `row_slot(i)` in {0, 1}: each thread holds exactly two rows of a 64-row slab (WGMMA layout), so
    per-row values can be cached per tile in 2 registers. `tile` is the current Tile and `subtile`
    the (compile-time) index of this output subtile (ctx.n_sub per tile).
    """

    def __init__(self, vals, coord_fn, row_slot_fn, local_fn=None):
        self.vals = vals
        self._coord = coord_fn
        self._row_slot = row_slot_fn
        self._local = local_fn

    def local(self, i: int):
        return self._local(i)

    @property
    def size(self) -> int:
        return cute.size(self.vals)

    def coord(self, i: int):
        return self._coord(i)

    def row_slot(self, i: int) -> int:
        return self._row_slot(i)


class Chain:
    """An ordered composition of policies: maps, at most one pair step, then one store."""

    def __init__(self, *steps: Policy):
        if not steps or steps[-1].kind != "store":
            raise ValueError("an epilogue chain must end with a store policy (StoreBF16, StoreFP8, ...)")
        if any(s.kind == "store" for s in steps[:-1]):
            raise ValueError("only the last step of a chain may store")
        pairs = [i for i, s in enumerate(steps) if s.kind == "pair"]
        if len(pairs) > 1:
            raise ValueError("a chain may contain at most one pair step (e.g. SwiGLU)")
        for s in steps:
            if s.kind not in ("map", "pair", "store"):
                raise ValueError(f"unknown policy kind {s.kind!r} in {type(s).__name__}")
        if pairs:
            early = [type(s).__name__ for s in steps[: pairs[0]] if getattr(s, "space", "any") == "out"]
            if early:
                raise ValueError(f"{', '.join(early)} works on output columns: place it after the pair step")
        wide = [i for i, s in enumerate(steps) if getattr(s, "whole_tile", False)]
        if wide and (pairs or any(s.kind != "map" for s in steps[: wide[-1] + 1])):
            raise ValueError("whole-tile steps (e.g. QKVPlacement) must be maps in a chain without a pair step")
        self.steps = tuple(steps)
        self._fingerprint = None
        self.n_tile = wide[-1] + 1 if wide else 0    # steps[:n_tile] run once on the whole tile
        self.tile = self.steps[: self.n_tile]
        self.pair_index = pairs[0] if pairs else None
        self.pre = self.steps[self.n_tile : self.pair_index] if pairs else self.steps[self.n_tile : -1]
        self.pair = self.steps[self.pair_index] if pairs else None
        self.post = self.steps[self.pair_index + 1 : -1] if pairs else ()
        self.store = self.steps[-1]

    @property
    def n_ratio(self) -> int:
        """GEMM columns per output column."""
        return 2 if self.pair is not None else 1

    @property
    def out(self) -> str:
        """dtype name of D ("bf16", "e4m3")."""
        return self.store.out_dtype

    @property
    def out_dtype(self):
        """The DSL type of D (compile time)."""
        return getattr(cutlass, _DTYPES[self.store.out_dtype])

    def key(self) -> str:
        return "+".join(s.key() for s in self.steps)

    def __repr__(self) -> str:
        return f"Chain({', '.join(type(s).__name__ for s in self.steps)})"

    def args(self) -> tuple:
        return tuple(a for s in self.steps for a in s.args)

    def writes(self) -> tuple:
        """Names of the tensors the kernel writes besides D."""
        return tuple(a.name for a in self.args() if a.writes)

    def out_width(self, n: int, tensors: dict) -> int:
        for s in self.steps:
            w = s.out_width(n, tensors)
            if w is not None:
                return w
        return n // self.n_ratio

    def check(self, sizes: dict, tensors: dict, tile_n: int) -> None:
        for s in self.steps:
            s.check(sizes, tensors, tile_n)

    def fingerprint(self) -> str:
        """Hash of every step's class, static parameters and source (the modules of its class and bases).

        Part of a composed chain's kernel key: editing a policy, or building it with other parameters,
        names a different kernel, so a stale compiled one is never loaded. Computed once per chain (the op
        asks at every call; a chain's classes do not change under it once built)."""
        if self._fingerprint is not None:
            return self._fingerprint
        h = hashlib.sha256()
        for step in self.steps:
            cls = type(step)
            params = repr(step.static_params())
            if " at 0x" in params:
                raise ValueError(f"{cls.__name__}: a static parameter has no stable repr ({params}); "
                                 "keep policy attributes to numbers, strings, tuples and Args")
            h.update(f"{cls.__module__}.{cls.__qualname__}|{params}|".encode())
            for base in cls.__mro__:
                if base is not object and base is not Policy:
                    h.update(_source_digest(base).encode())
        self._fingerprint = h.hexdigest()
        return self._fingerprint

    def split(self, tensors: tuple) -> list:
        """Flat runtime tensors -> one tuple per step."""
        out, i = [], 0
        for s in self.steps:
            out.append(tuple(tensors[i : i + len(s.args)]))
            i += len(s.args)
        return out

    def fake_tensors(self, m, n, n_out) -> tuple:
        """Fake D followed by every policy tensor (for compile_target); other symbols are free."""
        sym = {"m": m, "n": n, "n_out": n_out}

        def fake(dtype, shape):
            for d in shape:
                if isinstance(d, str) and d not in sym:
                    sym[d] = cute.sym_int()
            dims = tuple(sym[d] if isinstance(d, str) else d for d in shape)
            order = tuple(range(len(dims) - 1, -1, -1))
            return cute.runtime.make_fake_compact_tensor(dtype, dims, stride_order=order, assumed_align=16)

        d = fake(self.out_dtype, ("m", "n_out"))
        return (d, *(fake(a.cute_dtype, a.shape) for a in self.args()))


def _source_digest(cls) -> str:
    try:
        path = Path(inspect.getfile(cls))
    except (TypeError, OSError):   # defined interactively: its name and attributes are all there is
        return f"{cls.__module__}.{cls.__qualname__}"
    st = path.stat()
    return _file_digest(str(path), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=None)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def resolve(policy: str) -> Chain:
    """Catalog name -> Chain (the shipped compositions)."""
    from epilogues import catalog

    return catalog.chain(policy)
