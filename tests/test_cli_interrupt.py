"""Ctrl-C in `futx ppl` keeps the windows already scored: the --json file holds them, marked partial, the
table is printed, stderr says so, and the exit status is 130."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from futx.checkpoint.synthetic import random_weights, tiny_config

REPO = Path(__file__).resolve().parents[1]
WINDOWS = 2000   # far more than the run can score between its first result and the signal, even on a fast machine
# K and N on the kernels' granularity and head dim 64, so the emulated engine serves it too
CFG = tiny_config(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, num_hidden_layers=2, vocab_size=300)


@pytest.fixture(scope="module")
def model_and_text(tmp_path_factory):
    from tiny_checkpoint import save_tiny_hf

    d = tmp_path_factory.mktemp("interrupt")
    save_tiny_hf(d / "model", random_weights(CFG, seed=5))
    line = " row : the weather is 17 degrees and the wind is from the west .\n"   # byte-level: a token a byte
    (d / "text.txt").write_text(line * (WINDOWS * 32 // len(line) + 1))
    return d / "model", d / "text.txt"


@pytest.mark.parametrize("engine", [[], ["--backend", "emulated", "--protocol", "all-decode", "--max-batch", "2"]],
                         ids=["reference", "emulated-engine"])
def test_interrupted_ppl_keeps_its_partial_result(model_and_text, tmp_path, engine):
    model, text = model_and_text
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "futx", "ppl", "--model", str(model), "--text", str(text),
                             "--window", "32", "--max-windows", str(WINDOWS), "--batch-size", "1", "--threads", "1",
                             "--no-progress", "--json", str(out), *engine],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not out.exists():   # the first batch's result is on disk: interrupt the run
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no result within 300 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    rows = json.loads(out.read_text())
    assert proc.returncode == 130, stderr
    assert len(rows) == 1 and rows[0]["partial"] is True and rows[0]["windows_planned"] == WINDOWS
    assert 1 <= rows[0]["windows"] < WINDOWS
    assert "Traceback" not in stderr and "interrupted" in stderr and f"partial results in {out}" in stderr
    assert f"| {rows[0]['protocol']} | {rows[0]['windows']} | 32 |" in stdout   # the table of what was kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]           # no temporary file left behind
