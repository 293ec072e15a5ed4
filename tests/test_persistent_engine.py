"""CPU checks of the persistent layer's host side (futx.engine.persistent): which models it takes and why not,
and the per-layer row ranges of the step's task table that each launch runs."""

import pytest
import torch

from decode import persistent_schedule as ps
from decode.persistent_host import END, F
from futx.checkpoint.synthetic import tiny_config
from futx.config import preset
from futx.engine import DecodeModel
from futx.engine import persistent as pers
from futx.engine.packed import random_packed


def test_layer_starts_split_each_ctas_list_by_layer():
    cfg = preset("layer-1b")
    sched = ps.make_schedule(cfg, 1, 300, layers=3, ctas=7, splits=4, fused_norm=True, every_split=True)
    table = ps.task_table(sched)
    starts = pers.layer_starts(table, 3)
    assert starts.shape == (7, 4) and starts.dtype == torch.int32
    for c in range(7):
        for lay in range(3):
            rows = table[c, starts[c, lay]:starts[c, lay + 1]]
            assert (rows[:, F["layer"]] == lay).all() and (rows[:, F["kind"]] != END).all()
        assert (table[c, starts[c, 3]:, F["kind"]] == END).all()
    assert int(starts[:, 3].sum()) == len(sched.graph.tasks)


def test_the_step_routes_only_where_the_kernel_fits():
    cfg = tiny_config(head_dim=128, num_attention_heads=4, num_key_value_heads=2, hidden_size=256,
                      intermediate_size=512, num_hidden_layers=1, vocab_size=256)
    packed = random_packed(cfg, "int4", device="cpu", seed=1)
    m = DecodeModel(packed, "int4", max_batch=1, capacity=64, backend="emulated", device="cpu", persistent=None)
    assert m.persistent is None
    assert "kernel backend" in pers.unsupported(m)
    for how in (True, "ring"):
        with pytest.raises(ValueError, match="does not fit this model: it runs on the kernel backend only"):
            DecodeModel(packed, "int4", max_batch=1, capacity=64, backend="emulated", device="cpu", persistent=how)
    with pytest.raises(ValueError, match="persistent must be None, False, True or 'ring'"):
        DecodeModel(packed, "int4", max_batch=1, capacity=64, backend="emulated", device="cpu", persistent="rings")
    m.backend = "kernels"   # what the kernel backend would be told about other models
    assert pers.unsupported(m) is None
    m.cache.fmt = "bf16"
    assert "INT4 or E4M3 cache mirror" in pers.unsupported(m)


def test_rows_that_fit_shared_memory():
    """The multi-token bodies stage every row of a projection's input, their partials over the rows: 8 rows of
    the 8B down projection (K = 14336) fit, 4 of the 70B's (K = 28672); past MAX_ROWS or the fit, a reason."""
    from decode.gemv_layout import tile_smem
    from futx.hardware import SMEM_PER_CTA

    assert pers.fitting_rows(preset("llama-3.1-8b")) == 8 and pers.fitting_rows(preset("layer-70b")) == 4
    assert tile_smem(14336, 8, tokens=8, rows=8, red_in_x=True)["total"] + 16 <= SMEM_PER_CTA
    assert tile_smem(14336, 8, tokens=8, rows=8)["total"] > SMEM_PER_CTA   # without the overlap: 7 rows
    r = tile_smem(1024, 8, True, tokens=8, rows=1, red_in_x=True)   # the partials outgrow one short row
    assert r["red"] == 0 and r["ss"] == 8 * 16 * 8 * 4 and r["total"] == r["ss"] + 8 * 8 * 4
    with pytest.raises(ValueError, match="multi-token"):
        tile_smem(4096, 8, red_in_x=True)
    cfg = tiny_config(head_dim=128, num_attention_heads=4, num_key_value_heads=2, hidden_size=256,
                      intermediate_size=512, num_hidden_layers=1, vocab_size=256)
    m = DecodeModel(random_packed(cfg, "int4", device="cpu", seed=1), "int4", max_batch=1, capacity=64,
                    backend="emulated", device="cpu")
    m.backend = "kernels"
    assert pers.unsupported(m, 8) is None
    assert "1..8 rows" in pers.unsupported(m, 9)
    m.config = preset("layer-70b")
    assert "5 rows" in pers.unsupported(m, 5) and "at most 4" in pers.unsupported(m, 5)


def test_bench_decode_takes_persistent_split_counts():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from scripts import bench_engine

    from futx.ops.decode_attention import MAX_SPLITS

    assert bench_engine.ATTENTION_MAX_SPLITS == MAX_SPLITS
    p = bench_engine.build_parser()
    assert p.parse_args(["--persistent", "auto,8"]).persistent == ["auto", 8]
    assert p.parse_args(["--persistent", "ring,ring:16,4"]).persistent == [("ring", "auto"), ("ring", 16), 4]
    assert p.parse_args([]).persistent == []
    for bad in ("0", "65", "x", "ring:0", "ring:x", "rings"):
        with pytest.raises(SystemExit):
            p.parse_args(["--persistent", bad])


def test_ring_layer_fits_the_served_shapes_and_says_why_not():
    """decode/persistent_ring.py: whole ring stages (K a multiple of 1024), the ring beside the attention scratch,
    where a projection stages its input rows a chunk of whole stages at a time; a clear reason otherwise."""
    from decode.persistent_host import (RING_STAGE_K, layer_plan, ring_chunk_stages, ring_k_misfit, ring_kernel_stages,
                                        ring_regions, ring_stages)
    from futx.hardware import SMEM_PER_CTA

    for cache, tokens, stages in (("int4", 1, 13), ("e4m3", 1, 14), ("int4", 8, 12), ("e4m3", 8, 13)):
        att = layer_plan(cache, 128).smem_bytes
        assert ring_stages(att, SMEM_PER_CTA, tokens) == stages == ring_kernel_stages(att, tokens)
        r = ring_regions(stages, tokens)
        assert r["body"] % 1024 == 0 and r["body"] + att <= SMEM_PER_CTA
        assert ring_regions(stages + 1, tokens)["body"] + att > SMEM_PER_CTA
        assert r["weights"] >= r["rows"] + 96 and r["rows"] % 16 == 0 and r["scales"] - r["weights"] == stages * 8 * 1024
        assert r["ss"] - r["red"] == 8 * 16 * 4 * (8 if tokens > 1 else 1)
    # chunks: one row of the 70B's down input (28 stages) in one; 8 rows of the 8B's (14 stages) in two of 7
    att = layer_plan("int4", 128).smem_bytes
    assert ring_chunk_stages(att, 1) == att // 2048 >= 28
    assert ring_chunk_stages(att, 8, 8) == 7 and 8 * (7 * 2048 + 16) <= att < 8 * (8 * 2048 + 16)
    assert ring_chunk_stages(att, 4, 8) == 14
    assert ring_k_misfit((4096, 14336)) is None and "[2816]" in ring_k_misfit((1024, 2816))
    with pytest.raises(ValueError, match="2..16 stages"):
        ring_regions(1)
    for name in ("llama-3.1-8b", "layer-70b", "layer-1b"):
        assert pers.ring_misfit(preset(name), "int4", 8) is None, name
    cfg = tiny_config(head_dim=128, num_attention_heads=8, num_key_value_heads=2, hidden_size=1024,
                      intermediate_size=2816, num_hidden_layers=1, vocab_size=256)
    m = DecodeModel(random_packed(cfg, "int4", device="cpu", seed=1), "int4", max_batch=2, capacity=64,
                    backend="emulated", device="cpu")
    m.backend = "kernels"
    assert f"multiple of {RING_STAGE_K}, got [2816]" in pers.unsupported(m, 1, "ring")
    assert pers.unsupported(m, 1) is None   # the tile bodies take any K of whole groups
    m.config = cfg.replace(intermediate_size=3072)
    assert pers.unsupported(m, 1, "ring") is None and pers.unsupported(m, 8, "ring") is None
    assert "1..8 rows" in pers.unsupported(m, 9, "ring")
    with pytest.raises(ValueError, match="body must be one of"):
        pers.unsupported(m, 1, "rings")
    with pytest.raises(ValueError, match="only the ring layer keeps a task trace"):
        pers.PersistentStep(m, trace=True)
    for bad in (dict(variant="la"), dict(body="ring", variant="s99"), dict(body="ring", trace=True, variant="la")):
        with pytest.raises(ValueError, match="tuning variants are"):
            pers.PersistentStep(m, **bad)
    # the no-arithmetic diagnostic computes wrong outputs: asked for by name only
    with pytest.raises(ValueError, match="wrong outputs"):
        pers.PersistentStep(m, body="ring", variant="nm")


@pytest.mark.parametrize("name,ctas", [("llama-3.1-8b", 132), ("llama-3.1-8b", 7), ("layer-70b", 132),
                                       ("layer-1b", 264)])
def test_ring_tables_wait_once_per_kind_and_layer(name, ctas):
    """The ring layer skips a same-kind task's wait and reuses its staged row: every projection task of a layer
    waits for one (counter, target), in the tables the engine builds (kernel form, one row); a table breaking it is
    refused."""
    sched = ps.make_schedule(preset(name), 1, 1030, layers=3, ctas=ctas, splits=4, fused_norm=True, every_split=True)
    table = ps.task_table(sched)
    pers.check_ring_waits(table)
    broken = table.clone()
    rows = (broken[..., F["kind"]] == ps.KINDS.index("o")) & (broken[..., F["layer"]] == 1)
    c, j = rows.nonzero()[0].tolist()
    broken[c, j, F["target0"]] += 1
    with pytest.raises(ValueError, match="every o task of a layer"):
        pers.check_ring_waits(broken)
    broken = table.clone()
    broken[c, j, F["wait1"]] = 0
    with pytest.raises(ValueError, match="two"):
        pers.check_ring_waits(broken)


@pytest.mark.parametrize("k,rows,tokens", [(4096, 1, 1), (28672, 1, 1), (14336, 8, 8), (8192, 8, 8), (3072, 3, 8),
                                           (28672, 8, 8), (1024, 5, 8)])
def test_ring_staging_covers_each_unit_once_where_its_warp_reads_it(k, rows, tokens):
    """decode/persistent_ring.py's activation staging (decode.persistent_host.ring_piece_offset, the kernel's own
    formula): chunk by chunk, every lane's pieces of every row land where the warp's MMAs read its unit of that stage
    ((stage - chunk start) x 8 + warp units in), each 16-byte piece of the input exactly once, inside the body, and
    no warp's pieces where another warp reads."""
    from decode.gemv_layout import X_ROW_PAD
    from decode.persistent_host import (RING_PIECES, RING_STAGE_K, RING_STAGE_UNITS, RING_UNIT_X_BYTES, layer_plan,
                                        ring_chunk_stages, ring_piece_offset)

    body = layer_plan("int4", 128).smem_bytes
    n_st = k // RING_STAGE_K
    chunk = ring_chunk_stages(body, rows, tokens)
    row_stride = min(chunk, n_st) * RING_STAGE_K * 2 + X_ROW_PAD
    seen = set()
    for st0 in range(0, n_st, chunk):
        st1 = min(n_st, st0 + chunk)
        owner = {}
        for warp in range(RING_STAGE_UNITS):
            for row in range(rows):
                for c in range((st1 - st0) * RING_PIECES):   # every lane's c (lane, lane + 32, ...)
                    off = ring_piece_offset(c, warp)
                    smem = row * row_stride + off
                    src = row * k * 2 + st0 * RING_STAGE_K * 2 + off
                    assert 0 <= smem and smem + 16 <= body
                    assert src not in seen and src + 16 <= (row + 1) * k * 2
                    seen.add(src)
                    assert owner.setdefault(smem, warp) == warp
                    # the MMA side: the warp's unit of stage st sits (st - st0) * 8 + warp units into the chunk
                    st = st0 + c // RING_PIECES
                    u = (st - st0) * RING_STAGE_UNITS + warp
                    assert u * RING_UNIT_X_BYTES <= off < (u + 1) * RING_UNIT_X_BYTES
    assert len(seen) == rows * k * 2 // 16
