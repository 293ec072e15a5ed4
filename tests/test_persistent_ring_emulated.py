"""CPU check of the ring layer's projection data path (decode/persistent_ring.py) on the lane emulator
(tests/lane_emulator.py): the producer's copies of a task's stages into the ring's slots
(decode.persistent_host.ring_weights_at / ring_scales_at), the input rows staged chunk by chunk (ring_piece_offset,
ring_row_stride, ring_chunk_stages), and the consumer warps' own reads of both (RingProjection._xs_lane, the
kernel's lane offsets ring_lane_at / ring_unit_scales_at, and the tile GEMV's `_ring_read` and `_x_frags` run on
numpy lanes) must give x @ dequant(W)^T to float64 rounding: one row and several, inputs of one chunk and of
several, and a ring that wraps inside a task. Shared memory starts poisoned (NaN), so a read of a byte nobody
wrote shows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("cutlass")

from decode import gemv_tile  # noqa: E402
from decode.persistent_host import (RING_PIECE, RING_PIECES, RING_STAGE_BYTES, RING_STAGE_K,  # noqa: E402
                                    RING_STAGE_SCALE_BYTES, RING_STAGE_UNITS, ring_chunk_stages, ring_lane_at,
                                    ring_piece_offset, ring_regions, ring_row_stride, ring_scales_at,
                                    ring_unit_scales_at, ring_weights_at)
from decode.persistent_ring import RingProjection  # noqa: E402
from futx.quant import int4  # noqa: E402
from lane_emulator import LANES, OPS, ld16, ldsm_x4, mma  # noqa: E402,I001

POISON = 0xFF   # bf16 0xFFFF and float16 0xFFFF are NaN


class SharedLoads:
    """decode.ptx's shared-memory loads, on one CTA's shared memory as a byte array (addresses: one per lane)."""

    def __init__(self, smem: np.ndarray):
        self.smem = smem

    def lds_v4(self, addr):
        return ld16(self.smem, addr)

    def lds_f16_to_f32(self, addr):
        return np.array([self.smem[a:a + 2].view(np.float16)[0] for a in np.asarray(addr)], dtype=np.float64)

    def ldsm_x4(self, addr):
        return ldsm_x4(self.smem, addr)


def ring_tasks(x: torch.Tensor, q, nbs, stages: int, body_bytes: int, tokens: int, monkeypatch) -> np.ndarray:
    """y [M, 16 * len(nbs)] of one CTA's consecutive projection tasks on n-blocks `nbs` (the ring's stages counted
    across them, as both sides of the kernel count them)."""
    m, k = x.shape
    proj = RingProjection("store", False, stages, body_bytes, tokens)
    r = ring_regions(stages, tokens)
    smem = np.full(r["body"] + body_bytes, POISON, dtype=np.uint8)
    monkeypatch.setattr(gemv_tile, "ptx", SharedLoads(smem))
    w_bytes = q.packed.numpy().view(np.uint8).reshape(-1)
    s_bytes = q.scales.numpy().view(np.uint8).reshape(-1)
    x_bytes = x.view(torch.int16).numpy().view(np.uint8).reshape(-1)
    fmt, consts = proj.fmt, proj.fmt.consts(OPS)
    n_st = k // RING_STAGE_K
    chunk = ring_chunk_stages(body_bytes, m, tokens)
    assert chunk >= 1
    row_stride = ring_row_stride(chunk, n_st)
    xs = r["body"]
    out, i = [], 0
    for nb in nbs:
        acc = np.zeros((16, 8))
        for st0 in range(0, n_st, chunk):
            st1 = min(n_st, st0 + chunk)
            smem[xs:] = POISON
            for warp in range(RING_STAGE_UNITS):   # each warp stages the pieces of the units it multiplies
                for row in range(m):
                    for c in range((st1 - st0) * RING_PIECES):
                        off = ring_piece_offset(c, warp)
                        src = row * k * 2 + st0 * RING_STAGE_K * 2 + off
                        smem[xs + row * row_stride + off:][:RING_PIECE] = x_bytes[src:src + RING_PIECE]
            for st in range(st0, st1):
                slot = (i + st) % stages
                w_at, s_at = r["weights"] + slot * RING_STAGE_BYTES, r["scales"] + slot * RING_STAGE_SCALE_BYTES
                smem[w_at:w_at + RING_STAGE_BYTES] = w_bytes[ring_weights_at(nb, k, st):][:RING_STAGE_BYTES]
                smem[s_at:s_at + RING_STAGE_SCALE_BYTES] = s_bytes[ring_scales_at(nb, k, st):][:RING_STAGE_SCALE_BYTES]
                for warp in range(RING_STAGE_UNITS):
                    cur = proj._ring_read(w_at + ring_lane_at(warp, LANES), s_at + ring_unit_scales_at(warp),
                                          LANES // 4)
                    xs_lane = proj._xs_lane(xs, LANES, m, row_stride, mn=np.minimum)
                    u = (st - st0) * RING_STAGE_UNITS + warp
                    part = np.zeros((16, 8))
                    for b in range(proj.bpu):
                        a_ops = fmt.a_operands(cur[4 * b:4 * b + 4], consts, OPS)
                        for a, bb in zip(a_ops, proj._x_frags(xs_lane, u * proj.bpu + b)):
                            part = mma(a, bb, part)
                    s_lo, s_hi = cur[-2], cur[-1]   # channels g and g + 8 of lane 4g + t
                    acc += part * np.concatenate([s_lo[0::4], s_hi[0::4]])[:, None]
        i += n_st
        out.append(acc[:, :m].T)   # B column j is row j (one row: every column holds it)
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("k,m,tokens,chunk,stages,nbs", [
    (2048, 1, 1, 0, 3, (0, 2, 1)),     # one row, one chunk; 2 stages per task on 3 slots: the ring wraps mid-task
    (1024, 8, 8, 0, 2, (1, 0)),        # eight rows
    (3072, 3, 8, 2, 4, (2, 0)),        # three rows staged in chunks of 2 and 1 stages
    (4096, 5, 8, 1, 3, (1,)),          # five rows, one stage per chunk
])
def test_ring_projection_reads_what_the_producer_and_the_staging_wrote(k, m, tokens, chunk, stages, nbs, seeded,
                                                                       monkeypatch):
    n = 48
    w = torch.randn(n, k, generator=seeded)
    x = torch.randn(m, k, generator=seeded).to(torch.bfloat16)
    q = int4.quantize_int4(w, 128)
    # a body of `chunk` stages of m rows (0: the whole input at once)
    per = (chunk or k // RING_STAGE_K) * RING_STAGE_K * 2
    body = m * per + (m * 16 if tokens > 1 else 0)
    got = ring_tasks(x, q, nbs, stages, body, tokens, monkeypatch)
    ref = (x.double() @ q.dequantize(torch.float64).T).numpy()
    want = np.concatenate([ref[:, nb * 16:(nb + 1) * 16] for nb in nbs], axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
