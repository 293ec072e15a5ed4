"""CPU checks of the warp-specialized E4M3 projection (decode/skinny_ws_e4m3.py): the stage's swizzle, each lane's
shared loads, prmt and E4M3 -> bf16 conversion (the kernel's own functions, on a numpy model of 32 lanes) reproduce
wgmma's standard A fragment of W bit for bit, the loads are bank-conflict-free, and the compiled kernel (sm_90a) has
the instruction mix the design promises, no spills and its MMAs in flight."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("cutlass")

from decode import dequant, plan  # noqa: E402
from decode import skinny_ws_e4m3 as e4  # noqa: E402
from futx.quant import layouts  # noqa: E402
from lane_emulator import NpOps, bf16_to_f64, halves  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LANES = np.arange(32)
STAGE_BASE = 3 * e4.WT_BYTES   # a stage of the ring (the ring starts 1024-aligned; stages are 8 KB apart)


class Ops(NpOps):
    prmt_r = staticmethod(NpOps.prmt)   # the numpy prmt takes a per-lane selector array as well


OPS = Ops()


def _e4m3_rows(seed: int) -> np.ndarray:
    """A [128, 64] tile of e4m3 bytes: random, plus both zeros, every subnormal, +-448 and +-the smallest normal, in
    every lane's bytes (NaN encodings 0x7F / 0xFF left out: the format never stores them)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (e4.TILE_ROWS, e4.UNIT_K), generator=gen, dtype=torch.int32).numpy().astype(np.uint8)
    special = np.array([0x00, 0x80, *range(0x01, 0x08), *range(0x81, 0x88), 0x7E, 0xFE, 0x08, 0x88], dtype=np.uint8)
    w.reshape(-1)[:: 7][: 40 * len(special)] = np.tile(special, 40)
    w[(w & 0x7F) == 0x7F] ^= 1
    return w


def _stage(w: np.ndarray) -> np.ndarray:
    """Shared memory holding the tile in stage STAGE_BASE as TMA's 64-byte swizzle writes it."""
    mem = np.zeros(STAGE_BASE + e4.WT_BYTES + 64, dtype=np.uint8)
    r, b = np.meshgrid(np.arange(e4.TILE_ROWS), np.arange(e4.UNIT_K), indexing="ij")
    mem[STAGE_BASE + e4.swizzled(r, b)] = w[r, b]
    return mem


def _lds32(mem):
    def load(addr):
        a = np.asarray(addr, dtype=np.int64)
        assert (a % 4 == 0).all(), "ld.shared.b32 needs 4-byte aligned addresses"
        b = [mem[a + i].astype(np.int64) for i in range(4)]
        return (b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24).astype(np.uint32).view(np.int32)
    return load


def _e4m3_value(byte):
    return torch.from_numpy(np.asarray(byte, dtype=np.uint8)).view(torch.float8_e4m3fn).double().numpy()


def test_swizzle_is_tma_64_byte_swizzle():
    """`swizzled` is Swizzle<2,4,3> of the row-major [128 x 64] byte offset (TMA's 64-byte swizzle, address bits [4, 5]
    ^= bits [7, 8]), a permutation of each row's 16-byte chunks; row g + 8 and word B keep the chunk phase."""
    r, b = np.meshgrid(np.arange(e4.TILE_ROWS), np.arange(e4.UNIT_K), indexing="ij")
    off = r * e4.W_ROW + b
    assert (e4.swizzled(r, b) == off ^ ((off >> 3) & 0x30)).all()
    assert (np.sort(e4.swizzled(r, b), axis=1) == off).all()
    assert (e4.swizzled(r + 8, b) == e4.swizzled(r, b) + e4.ROW8).all()
    low = b % 16 < 8
    assert (e4.swizzled(r, b + 8)[low] == e4.swizzled(r, b)[low] + e4.WORD_B).all()
    assert e4.swizzled(5, 35) == 5 * 64 + ((2 ^ 2) << 4) + 3   # a hand-computed one


def test_selectors():
    """[A0, B0, A1, B1]: bytes 0, 4, 1, 5 of {B:A} for even t, 2, 6, 3, 7 for odd t."""
    assert (e4.SEL_EVEN, e4.SEL_ODD) == (0x5140, 0x7362)
    assert list(e4.lane_selector(LANES)) == [0x5140, 0x7362] * 16


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lane_words_give_the_standard_a_fragment(seed):
    """For every consumer warp, lane and k16 step: the kernel's loads + prmt + E4M3Format.a_operands give registers
    a0..a3 = bf16 pairs (W[g, 2t], W[g, 2t+1]), row g + 8, k + 8 (wgmma's m64nTk16 A fragment of the warp's 16 rows),
    exactly the float value of each e4m3 byte (negative values, subnormals, +-448 included)."""
    w = _e4m3_rows(seed)
    load = _lds32(_stage(w))
    fmt = dequant.E4M3Format()
    consts = fmt.consts(OPS)
    g, t = LANES // 4, LANES % 4
    for cw in range(8):
        offs = e4.lane_offsets(cw, LANES)
        words = e4.lane_words(load, tuple(STAGE_BASE + o for o in offs), e4.lane_selector(LANES), OPS)
        a_ops = fmt.a_operands(words, consts, OPS)
        assert len(a_ops) == e4.K_STEPS
        for j, regs in enumerate(a_ops):
            for reg, (dr, dk) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):
                row = cw * 16 + g + dr
                k = layouts.MMA_K * j + 2 * t + dk
                lo, hi = halves(regs[reg])
                np.testing.assert_array_equal(bf16_to_f64(lo), _e4m3_value(w[row, k]), f"warp {cw} step {j} a{reg}")
                np.testing.assert_array_equal(bf16_to_f64(hi), _e4m3_value(w[row, k + 1]),
                                              f"warp {cw} step {j} a{reg} high half")


def test_loads_are_bank_conflict_free():
    """Each of a lane's 16 ld.shared.b32 per unit: the warp's 32 addresses touch at most one word per bank (lanes t and
    t ^ 1 read the same word: a broadcast), so each is one shared-memory wavefront."""
    for cw in range(8):
        offs = e4.lane_offsets(cw, LANES)
        for row in (0, e4.ROW8):
            for off in offs:
                for word in (0, e4.WORD_B):
                    addr = STAGE_BASE + 1024 * 7 + np.asarray(off) + row + word   # any 1024-aligned ring base
                    banks = {}
                    for a in addr:
                        banks.setdefault((a // 4) % 32, set()).add(a // 4)
                    assert all(len(v) == 1 for v in banks.values()), f"bank conflict: warp {cw}, {banks}"


def test_registered_in_the_tuning_space():
    """The E4M3 ws / wsk keys of every token bucket exist (tuning space unless routed), with this module among their
    fingerprinted sources."""
    from tuning import tuning_space

    from futx.runtime.catalog import decode_linear

    keys = {s.key: s for s in tuning_space().specs("decode.skinny.e4m3.*.ws*")}
    routed = {s.key: s for s in decode_linear.SPECS if s.key.startswith("decode.skinny.e4m3.") and ".ws" in s.key}
    for m in plan.SKINNY_M_TILES:
        for v in plan.E4M3_WS_VARIANTS:
            for e in plan.EPILOGUES:
                key = plan.skinny_key("e4m3", 128, e, m, v)
                spec = keys.get(key) or routed.get(key)
                assert spec is not None, key
                assert "decode/skinny_ws_e4m3.py" in spec.sources
    assert not set(keys) & set(routed)


def test_compile_target_refuses_what_the_e4m3_kernel_lacks():
    from decode import skinny_dispatch

    with pytest.raises(ValueError, match="TMA"):
        skinny_dispatch.compile_target("e4m3", mma="ws", warps=8, nb_per_warp=1, weights_tma=True)
    with pytest.raises(ValueError, match="INT4 and E4M3"):
        skinny_dispatch.compile_target("bf16", mma="ws", warps=8, nb_per_warp=1)


_SASS = r"""
import json, os, sys
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
sys.path[:0] = [{root!r}, {scripts!r}]
import sass_loop_stats as s
from futx.runtime.catalog import decode_linear
from futx.runtime.compiler import sass_stats
spec = decode_linear.skinny_spec("e4m3", 128, {epi!r}, {m}, {v!r})
txt = s.compile_sass(spec)
body = s.hot_loop(*s.parse(txt), min_mma=4)
ops = {{}}
for _, op, _ in body:
    ops[op.split(".")[0]] = ops.get(op.split(".")[0], 0) + 1
print("JSON" + json.dumps({{"stats": sass_stats(txt), "loop": ops}}))
"""


@pytest.mark.parametrize("epi,m,v", [("store", 32, "ws"), ("swiglu", 64, "wsk"), ("residual", 16, "ws")])
def test_sass(epi, m, v):
    """Compiled for sm_90a: warpgroup MMA, no local memory, the MMAs kept in flight (one wait per unit of 4), two units
    per loop trip, and per unit (1 KB of weights per warp) 16 LDS, 8 PRMT (one per 4 weights), 16 HMUL2, 4 HGMMA."""
    code = _SASS.format(root=str(ROOT), scripts=str(ROOT / "scripts"), epi=epi, m=m, v=v)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "CUTE_DSL_ARCH": "sm_90a"})
    line = [x for x in res.stdout.splitlines() if x.startswith("JSON")]
    assert line, res.stdout[-2000:] + res.stderr[-4000:]
    out = json.loads(line[0][4:])
    sass, loop = out["stats"], out["loop"]
    assert sass["HGMMA"] > 0 and sass["LDL"] == 0 and sass["STL"] == 0, sass
    assert sass["WARPGROUP.DEPBAR"] * 2 < sass["HGMMA"], f"wgmma serialized: {sass}"
    units = loop.get("HGMMA", 0) // e4.K_STEPS
    assert units == 2, f"a loop trip holds two units (their A operands in different registers): {loop}"
    assert tuple(loop.get(op, 0) / units for op in ("LDS", "PRMT", "HMUL2")) == (16, 8, 16), loop


def test_plan_of_the_e4m3_ws_kernel():
    """Forced by kernel="skinny", variant="ws" / "wsk": its key, one CTA per SM, splits and stream-K shares counted in
    64-k units."""
    c = plan.choose("e4m3", 128, "swiglu", 24, 28672, 4096, 132, kernel="skinny", variant="wsk")
    assert (c.key, c.split, c.variant) == ("decode.skinny.e4m3.m32.swiglu.wsk", 132, "wsk")
    g = plan.choose("e4m3", 128, "residual", 40, 4096, 14336, 132, kernel="skinny", variant="ws")
    assert (g.key, g.split) == ("decode.skinny.e4m3.m64.residual.ws", 4)   # 32 tiles x 4 = 128 of 132 SMs
    assert plan.skinny_max_split("e4m3", 128, 2096, 4160, "ws") == 65
    assert plan.skinny_max_split("e4m3", 128, 2096, 4160, "wsk") == 65 * 17
    assert plan.skinny_workspace("wsk", 132, 28672, 24) == 132 * 2 * plan.TILE_N * 32
