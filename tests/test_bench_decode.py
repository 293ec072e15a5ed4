"""`futx bench decode` and its peers (scripts/bench_engine.py, scripts/decode_peers.py): the gpt-fast-style peer at
64 rows, its input checks, and a failing peer costing only its own row."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from futx.checkpoint.synthetic import tiny_config

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from scripts import bench_engine, decode_peers  # noqa: E402

# K a multiple of tinygemm's 128 and the group, head dim 64
CFG = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, num_hidden_layers=2, vocab_size=300)


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
def test_gptfast_peer_runs_64_rows_on_the_cpu(fmt):
    torch.manual_seed(0)
    peer = decode_peers.GptFastPeer(fmt, CFG, 64, 96, device="cpu", capture=False, compile=False)
    peer.step()
    assert peer.next.shape == (64,) and 0 <= int(peer.next.min()) and int(peer.next.max()) < CFG.vocab_size


def test_gptfast_peer_checks_its_indices_before_any_launch():
    peer = decode_peers.GptFastPeer("bf16", CFG, 4, 32, device="cpu", capture=False, compile=False)
    peer.tokens[2] = CFG.vocab_size
    with pytest.raises(ValueError, match="token ids: 4 values in .*needs 4 in 0..299"):
        peer.check_inputs()
    peer.tokens[2] = 0
    peer.pos.fill_(32)
    with pytest.raises(ValueError, match="positions"):
        peer.check_inputs()
    with pytest.raises(ValueError, match="K = 192 must be a multiple of 128"):
        decode_peers.check_shapes("int4", CFG.replace(hidden_size=192), 1, 32)
    with pytest.raises(ValueError, match="positive"):
        decode_peers.check_shapes("bf16", CFG, 0, 32)


def test_a_failing_peer_is_a_row_and_the_engines_rows_stay(tmp_path, capsys):
    """On this machine the peer's own process fails (no CUDA): its row says why; the results file, the Markdown
    and the printed table keep every engine row."""
    a = bench_engine.build_parser().parse_args(["--peers", "gptfast-int4", "--points", "64x1024", "--layers", "1",
                                                "--out", str(tmp_path / "b.json"), "--md", str(tmp_path / "b.md")])
    row = bench_engine.measure_peer("gptfast-int4", a, 64, 1024)
    assert row == {"candidate": "gptfast-int4", "failed": "the peers need a CUDA GPU"}
    a.peer_timeout = 0.01   # no child starts Python that fast: a timeout is a row as well
    assert bench_engine.measure_peer("gptfast-int4", a, 64, 1024)["failed"].startswith("no result within")
    results = {"gpu": "-", "shape": "llama-3.1-8b", "layers": 1, "date": "-", "points": [
        {"batch": 64, "context": 1024, "rows": [
            {"candidate": "int4/int4", "ms": 2.0, "spread": 0.01, "tokens_per_s": 32000.0, "floor_ms": 1.0,
             "of_floor": 0.5}, row]}]}
    bench_engine.save(results, a, final=True)
    assert json.loads((tmp_path / "b.json").read_text()) == results
    md = (tmp_path / "b.md").read_text()
    assert "| 64 | 1024 | int4/int4 | 2.000 |" in md and "| gptfast-int4 | peer failed: the peers need a CUDA GPU" in md
    bench_engine.print_row(64, 1024, row)
    assert "gptfast-int4" in capsys.readouterr().out


def test_a_peer_failure_reason_is_its_exception_line():
    cuda_assert = ("/pytorch/aten/src/ATen/native/cuda/IndexKernel.cu:111: Assertion `idx < size` failed.\n"
                   "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                   "RuntimeError: CUDA error: device-side assert triggered\n"
                   "CUDA kernel errors might be asynchronously reported at some other API call.\n"
                   "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")
    assert bench_engine.failure_reason(cuda_assert) == "RuntimeError: CUDA error: device-side assert triggered"
    assert bench_engine.failure_reason("the peers need a CUDA GPU\n") == "the peers need a CUDA GPU"
    assert bench_engine.failure_reason("") == ""


def test_bench_options_are_checked_without_torch_or_a_gpu():
    a = bench_engine.build_parser().parse_args(["--points", "1x1024,64x1024", "--weights", "int4", "--cache",
                                                "int4,bf16", "--peers", "gptfast-int4,transformers"])
    assert a.points == [(1, 1024), (64, 1024)] and a.weights == ["int4"] and a.cache == ["int4", "bf16"]
    assert a.peers == ["gptfast-int4", "transformers"] and a.breakdown == "int4/int4" and not a.pdl_attention
    assert bench_engine.build_parser().parse_args(["--pdl-attention"]).pdl_attention   # rule E5's comparison
    assert bench_engine.build_parser().parse_args(["--attention-splits", "1,4, 16"]).attention_splits == [1, 4, 16]
    both = bench_engine.build_parser().parse_args(["--pdl-attention", "--final-norm-kernel"])
    assert [n for n, _ in bench_engine.engine_rules(both, 8)] == ["pdl-attention", "final-norm-kernel",
                                                                  "pdl-attention+final-norm-kernel"]
    # each rule alone has the other off (a routed rule must not ride along), both together both on
    assert [r for _, r in bench_engine.engine_rules(both, 8)] == [
        {"pdl_attention_rows": 8, "final_norm_kernel": False}, {"pdl_attention_rows": 0, "final_norm_kernel": True},
        {"pdl_attention_rows": 8, "final_norm_kernel": True}]
    only_e6 = bench_engine.build_parser().parse_args(["--final-norm-kernel"])
    assert bench_engine.engine_rules(only_e6, 8) == [("final-norm-kernel", {"final_norm_kernel": True})]
    # the plain step they are compared with runs with both off, whatever futx.engine.backends routes
    assert bench_engine.rules_off(both) == {"pdl_attention_rows": 0, "final_norm_kernel": False}
    assert bench_engine.rules_off(bench_engine.build_parser().parse_args([])) == {}
    e7 = bench_engine.build_parser().parse_args(["--argmax-kernel", "--final-norm-kernel"])   # rule E7 beside E6
    assert bench_engine.engine_rules(e7, 4) == [
        ("final-norm-kernel", {"final_norm_kernel": True, "argmax_kernel": False}),
        ("argmax-kernel", {"final_norm_kernel": False, "argmax_kernel": True}),
        ("final-norm-kernel+argmax-kernel", {"final_norm_kernel": True, "argmax_kernel": True})]
    assert bench_engine.build_parser().parse_args(["--capacity", "8192"]).capacity == 8192
    assert bench_engine.build_parser().parse_args([]).capacity is None
    for bad in ("0", "65", "x"):
        with pytest.raises(SystemExit):
            bench_engine.build_parser().parse_args(["--attention-splits", bad])


@pytest.mark.gpu
def test_the_issue_command_measures_every_point_and_the_peer_at_64_rows(tmp_path):
    """Issue 31, item 4: this command crashed at 64x1024 (the peer's device-side assert took the engine's graph
    replay down with it). Every engine row is there, and the peer, in its own process, runs at every point."""
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "-m", "futx", "bench", "decode", "--weights", "int4", "--cache", "int4",
                        "--points", "1x1024,32x4096,64x1024", "--peers", "gptfast-int4", "--breakdown", "",
                        "--rounds", "3", "--reps", "5", "--out", str(out)], capture_output=True, text=True,
                       timeout=1800, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    points = json.loads(out.read_text())["points"]
    assert [(p["batch"], p["context"]) for p in points] == [(1, 1024), (32, 4096), (64, 1024)]
    for p in points:
        rows = {row["candidate"]: row for row in p["rows"]}
        assert rows["int4/int4"]["ms"] > 0
        assert "gptfast-int4" in rows
    failed = {(p["batch"], p["context"]): row["failed"] for p in points for row in p["rows"] if "failed" in row}
    assert not failed, failed


def test_int4_only_cache_option_builds_the_served_cache_and_steps_on_the_emulated_engine():
    """--cache-main none: the bench's cache is futx serve's INT4-only cache (mirror-only pages owned by each
    slot, a main copy of one request's pages + 1); a decode step runs on it (the emulated engine here, the kernels on the H200)."""
    from futx.engine import DecodeModel, random_packed

    with pytest.raises(SystemExit):
        bench_engine.build_parser().parse_args(["--cache", "int4,bf16", "--cache-main", "none"])
    with pytest.raises(SystemExit):
        bench_engine.build_parser().parse_args(["--cache", "int4", "--cache-main", "none", "--speculative"])
    a = bench_engine.build_parser().parse_args(["--weights", "int4", "--cache", "int4", "--cache-main", "none"])
    assert a.cache_main == "none"
    cache, kw = bench_engine.decode_cache(CFG, "int4", 3, 200, "cpu", "none", emulated=True)
    assert kw == {"pages": 6, "page_size": 128, "staging": 2, "capacity": 256}
    assert cache.layers[0].k_cache.shape[0] == 3 and cache.layers[0].k_scale.shape[0] == 3 + 6
    assert cache.table[:3, :2].tolist() == [[3, 4], [5, 6], [7, 8]]
    cache.randomize(0)
    m = DecodeModel(random_packed(CFG, "int4", seed=0, device="cpu"), "int4", max_batch=3, backend="emulated",
                    device="cpu", shared_cache=cache, **kw)
    m.load_inputs([1, 2, 3], [199, 150, 5], [0, 1, 2])
    m.step(3)
    assert m.buffers.next_tokens[:3].min() >= 0
    flat, none = bench_engine.decode_cache(CFG, "int4", 3, 200, "cpu")
    assert none == {} and flat.layout is None
