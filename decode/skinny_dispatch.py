"""The skinny decode projection's registry factory: picks the kernel class of a variant's parameters
(decode.plan.SKINNY_VARIANTS) among the skinny kernels and builds it with its fake arguments.

The kernels form a one-way tree: `skinny.py` holds the base class (the mma.sync ring kernel) and the shared
constants; `skinny_regs.py`, `skinny_wgmma.py` and `skinny_ws.py` subclass it (`skinny_wgmma.py` also builds on
`skinny_regs.py`, `skinny_ws_e4m3.py` on `skinny_ws.py`). Only this module knows all of them, and none of them
imports it (tests/test_import_graph.py).
"""

from __future__ import annotations

from cutlass import Int32

from . import skinny_wgmma as wg
from .signature import fake_args, fake_split_args
from .skinny import NB_PER_WARP, WARPS, Skinny
from .skinny_regs import SkinnyRegs


def compile_target(fmt: str = "int4", group_size: int = 128, epilogue: str = "store", m_tiles: int = 4,
                   warps: int = WARPS, nb_per_warp: int = NB_PER_WARP, stages: int = 0, ctas_per_sm: int = 0,
                   mma: str = "sync", overlap: bool = False, chains: int = 0, weights: str = "ring",
                   prefetch: int = 0, reduce: str = "global", min_ctas: int = 0, schedule: str = "grid",
                   weights_tma: bool = False):
    """Registry factory (ctas_per_sm only steers the host's split choice, decode.plan.SKINNY_VARIANTS; it is
    a parameter so that variants that differ in it are distinct registry entries). `warps` and `nb_per_warp`
    are registry parameters with one value per `mma`: "sync" (decode/skinny.py), "wgmma" (the tuning space's
    decode/skinny_wgmma.py, INT4; `overlap` is its option) or "ws" (decode/skinny_ws.py, INT4 g128; E4M3:
    decode/skinny_ws_e4m3.py). `chains`: the mma.sync kernel's accumulation chains per token group (0:
    stream.mma_unit's default). `weights`: "ring"
    (decode/skinny.py: through the shared-memory ring) or "regs" (streamed into registers in batches of
    `prefetch` units: decode/skinny_regs.py, or with "wgmma" skinny_wgmma.SkinnyRegsWgmma). `reduce`: how
    split-K CTAs combine (skinny.REDUCES; "cluster": mma.sync only, at most decode.plan.CLUSTER_MAX CTAs per
    tile). `min_ctas` ("regs", mma.sync): CTAs per SM that ptxas must fit (a register bound; 0: none).
    `schedule` ("ws" only): "grid" (tiles x split CTAs) or "stream" (persistent stream-K, decode/skinny_ws.py);
    `weights_tma` ("ws" only): its weights and scales by 2D TMA."""
    if mma == "ws":
        from . import skinny_ws   # only the warp-specialized variants import (and fingerprint) its files

        shape = (warps, nb_per_warp, weights, reduce, chains, prefetch, overlap, min_ctas)
        if fmt not in ("int4", "e4m3") or shape != (skinny_ws.CONSUMER_WARPS, 1, "ring", "global", 0, 0, False, 0):
            raise ValueError("the warp-specialized skinny kernel serves INT4 and E4M3 with its own 8 consumer warps of "
                             "one n-block and no other option")
        if fmt == "e4m3":
            from . import skinny_ws_e4m3

            if weights_tma:
                raise ValueError("the E4M3 warp-specialized kernel always loads its weights by TMA (no weights_tma)")
            return skinny_ws_e4m3.make_target(epilogue, m_tiles, stages, schedule)
        return skinny_ws.make_target(group_size, epilogue, m_tiles, stages, schedule=schedule, weights_tma=weights_tma)
    if mma == "wgmma":
        if fmt != "int4":
            raise ValueError(f"the wgmma skinny kernel serves INT4 weights, got {fmt!r}")
        shape = (wg.WARPS, wg.NB_PER_WARP)
    elif mma == "sync":
        shape = (WARPS, NB_PER_WARP)
    else:
        raise ValueError(f"mma must be 'sync' or 'wgmma', got {mma!r}")
    if schedule != "grid" or weights_tma:
        raise ValueError("only the warp-specialized kernel (mma='ws') has a schedule and TMA weights")
    if weights not in ("ring", "regs"):
        raise ValueError(f"weights must be 'ring' or 'regs', got {weights!r}")
    if reduce == "cluster" and mma != "sync":
        raise ValueError("the cluster split-K is the mma.sync kernels'")
    if weights == "regs" and (warps, nb_per_warp) == (2 * WARPS, NB_PER_WARP // 2):
        shape = (warps, nb_per_warp)   # the same 128-channel tile, one n-block per warp
    if (warps, nb_per_warp) != shape:
        raise ValueError(f"the {mma} skinny kernel runs {shape[0]} warps of {shape[1]} n-blocks, "
                         f"got warps={warps}, nb_per_warp={nb_per_warp}")
    if mma == "wgmma" and weights == "regs":
        op = wg.SkinnyRegsWgmma(group_size, epilogue, m_tiles, stages, prefetch, overlap)
    elif mma == "wgmma":
        op = wg.SkinnyWgmma(group_size, epilogue, m_tiles, stages, overlap)
    elif weights == "regs":
        op = SkinnyRegs(fmt, group_size, epilogue, m_tiles, stages, warps, nb_per_warp, prefetch, chains, reduce,
                        min_ctas)
    else:
        op = Skinny(fmt, group_size, epilogue, m_tiles, stages, chains=chains, reduce=reduce)
    x, w, s, r, y, stream_ = fake_args(fmt, epilogue)
    return op, (x, w, s, r, y, *fake_split_args(), Int32(1), stream_)
