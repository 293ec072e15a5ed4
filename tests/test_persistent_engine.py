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


def test_bench_decode_takes_persistent_split_counts():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from scripts import bench_engine

    p = bench_engine.build_parser()
    assert p.parse_args(["--persistent", "auto,8"]).persistent == ["auto", 8]
    assert p.parse_args([]).persistent == []
    for bad in ("0", "65", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["--persistent", bad])
