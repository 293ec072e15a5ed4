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
    with pytest.raises(ValueError, match="does not fit this model: it runs on the kernel backend only"):
        DecodeModel(packed, "int4", max_batch=1, capacity=64, backend="emulated", device="cpu", persistent=True)
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
    assert p.parse_args([]).persistent == []
    for bad in ("0", "65", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["--persistent", bad])
