"""scripts/quality_table.py (ppl, layers) and scripts/gpu/render_results.py on a tiny random model.

The GPU run (scripts/gpu/quality_gpu.sh) executes exactly these code paths with --device cuda and the
real model; here they run on the CPU in seconds."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from futx.checkpoint.hf import save_hf
from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.eval import Runner, evaluate, join_rows, make_windows, read_rows
from futx.quant import gptq

pytestmark = pytest.mark.usefixtures("single_thread")
ROOT = Path(__file__).resolve().parents[1]
CFG = tiny_config(vocab_size=300, intermediate_size=128, num_hidden_layers=2)


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    path = tmp_path_factory.mktemp("tinyq")
    model = path / "model"
    weights = random_weights(CFG, seed=3, std=0.3)
    save_hf(model, weights)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Backend(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.save(str(model / "tokenizer.json"))
    text = path / "text.txt"
    text.write_text("\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(6)) + "\n")
    calib = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    gfile = path / "gptq.safetensors"
    gptq.save(gptq.quantize_model(weights, calib, 64, progress=False), gfile)
    return path, model, text, gfile


def test_quality_ppl_layers_outliers_and_render(setup):
    path, model, text, gfile = setup
    qt = _module(ROOT / "scripts" / "quality_table.py", "quality_table_under_test")
    rr = _module(ROOT / "scripts" / "gpu" / "render_results.py", "render_results_under_test")
    work = path / "work"
    work.mkdir()
    common = ["--model", str(model), "--text", str(text), "--window", "32", "--group-size", "64",
              "--gptq", str(gfile)]
    try:
        qt.main(["ppl", *common, "--windows", "3", "--batch", "2", "--chunk", "7", "--out", str(work / "quality.jsonl")])
        qt.main(["layers", *common, "--layers", "0,1", "--prefill", "8", "--decode-tokens", "4",
                 "--independent-windows", "2", "--cascade-windows", "3", "--batch", "2",
                 "--out", str(work / "layers.json")])
    finally:
        torch.set_grad_enabled(True)
    rows = [json.loads(x) for x in (work / "quality.jsonl").read_text().splitlines()]
    assert len(rows) == len(qt.DEFAULT_CONFIGS)
    by = {r["config"]: r for r in rows}
    for p in ("all-decode", "serving"):
        base = by[f"{p}:bf16/bf16:bf16"]
        assert base["kl"] == 0 and base["top1"] == 1 and base["windows"] == 3
        assert base["tokens"] == 3 * (31 if p == "all-decode" else 15)
    # the BF16 baseline equals the reference harness on the same BF16-valued model (chunking is exact)
    models = qt.Models(__import__("futx.checkpoint", fromlist=["load"]).load(model), 64, str(gfile))
    from futx.quant.formats import cache_format
    from futx.tokenizer import load_tokenizer
    win = make_windows(load_tokenizer(model).encode(join_rows(read_rows(text))), 32, 3)
    r = evaluate(Runner(models.get("bf16"), mirror=cache_format("bf16").mirror()), win, "all-decode",
                 batch_size=3, decode_chunk=5, progress=False)
    assert math.isclose(r.nll_sum, by["all-decode:bf16/bf16:bf16"]["nll_sum"], rel_tol=1e-5)
    # a quantized configuration differs from its baseline
    q = by["all-decode:bf16/int4-rtn:int4-unrotated"]
    assert q["kl"] > 0 and q["top1"] < 1
    layers = json.loads((work / "layers.json").read_text())
    assert set(layers["independent"]["0"]) == {"rtn", "gptq"} and layers["setup"]["cascade_windows"] == 3
    assert all(0 < v < 10 for d in layers["cascaded"].values() for v in d.values())

    md = work / "results.md"
    rr.main(["--work", str(work), "--json", str(work / "results.json"), "--md", str(md)])
    out = md.read_text()
    assert "| all-decode | bf16 / int4-gptq | int4 |" in out and "Per-layer relative RMS error" in out
    rr.main(["--results", str(work / "results.json"), "--md", str(work / "again.md")])
    assert (work / "again.md").read_text() == out


def test_ppl_budget_and_missing_gptq(setup, capsys):
    path, model, text, _ = setup
    qt = _module(ROOT / "scripts" / "quality_table.py", "quality_table_under_test2")
    out = path / "budget.jsonl"
    try:
        qt.main(["ppl", "--model", str(model), "--text", str(text), "--window", "32", "--windows", "1",
                 "--budget-s", "0", "--out", str(out)])
    finally:
        torch.set_grad_enabled(True)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["config"] for r in rows) == ["all-decode:bf16/bf16:bf16", "serving:bf16/bf16:bf16"]
    assert "SKIPPED" in capsys.readouterr().out
