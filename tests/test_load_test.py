"""scripts/load_test.py at CI scale: `futx serve` on the reference backend with the tiny test model, driven by the
load test as a separate client process (it spawns the server on a free loopback port and stops it)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from futx.checkpoint.synthetic import random_weights, tiny_config

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "load_test.py"
sys.path.insert(0, str(SCRIPT.parent))
from load_test import MALFORMED, outcome_key  # noqa: E402
CFG = tiny_config(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, num_hidden_layers=2, vocab_size=300)
NAME = "tiny-test"
# the CI scale: 60 requests, 8 concurrent streams on 4 cache slots (so requests queue); 30% malformed (18: every
# case of the load test at least once) and 10% disconnects; long prompts of 100-400 tokens (the tiny model's
# stand-in for 2-4k) sharing a 1-page prefix, on 5 pages of 128 positions (the default would be 16: requests
# wait for pages; preemption itself is tested in test_serve_paged.py)
CI = ["--requests", "60", "--concurrency", "8", "--malformed", "0.3", "--disconnect", "0.1",
      "--long-tokens", "100:400", "--max-tokens", "4:48", "--time-limit", "90", "--seed", "1", "--shared-prefix",
      "128"]
SERVE = ["--backend", "reference", "--capacity", "512", "--max-batch", "4", "--max-queue", "16", "--threads", "1",
         "--served-model-name", NAME, "--pages", "5"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_checkpoint import save_tiny_hf

    return save_tiny_hf(tmp_path_factory.mktemp("load-tiny"), random_weights(CFG, seed=11, std=0.3),
                        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"))


def run_load_test(args, timeout):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_load_test_at_ci_scale(model_dir, tmp_path):
    out = tmp_path / "load.json"
    t0 = time.monotonic()
    p = run_load_test(["--spawn", *CI, "--json", str(out), "--server-log", str(tmp_path / "serve.log"), "--",
                       "--model", str(model_dir), *SERVE], timeout=150)
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stdout + p.stderr + (tmp_path / "serve.log").read_text()[-3000:]
    assert took < 90, took
    s = json.loads(out.read_text())
    assert s["passed"] and all(s["requirements"].values())
    kinds = s["counts"]["by_kind"]
    assert sum(k["sent"] for k in kinds.values()) == 60
    assert kinds["malformed"]["sent"] == 18 and kinds["disconnect"]["sent"] == 6
    assert s["counts"]["malformed_cases"] == sorted(MALFORMED) and s["counts"]["server_log_tracebacks"] == 0
    assert all(k["passed"] == k["sent"] for k in kinds.values())
    after = s["metrics_after"]
    assert after["futx_cache_slots_free"] == after["futx_cache_slots_total"] == 4
    assert after["futx_cache_pages_total"] == 5 and s["requirements"]["all_pages_free"]
    assert after["futx_cache_pages_free"] + after["futx_cache_pages_cached"] == 5
    assert after["futx_prefix_cache_hits_total"] > 0
    grew = {o: after[outcome_key(o)] - s["metrics_before"][outcome_key(o)]
            for o in ("ok", "client_error", "error", "overloaded")}
    assert grew["error"] == grew["overloaded"] == 0 and grew["ok"] >= kinds["chat"]["sent"] + kinds["long"]["sent"]
    assert "PASSED" in p.stdout


def test_load_test_fails_when_a_requirement_fails(model_dir, tmp_path):
    """The checks bite: a queue too short for the concurrency gets 503s, which the load test must report."""
    out = tmp_path / "load.json"
    serve = [a if a != "16" else "1" for a in SERVE]   # --max-queue 1
    p = run_load_test(["--spawn", "--requests", "24", "--concurrency", "8", "--malformed", "0", "--disconnect", "0",
                       "--long-tokens", "50:100", "--max-tokens", "16:32", "--time-limit", "60", "--json", str(out),
                       "--", "--model", str(model_dir), *serve], timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    s = json.loads(out.read_text())
    assert not s["requirements"]["no_5xx"] and not s["passed"] and "FAIL no_5xx" in p.stdout
    assert s["requirements"]["server_alive"] and s["requirements"]["all_slots_free"]


def test_load_test_refuses_a_remote_url():
    p = run_load_test(["--url", "http://192.0.2.1:8000", "--requests", "1"], timeout=30)
    assert p.returncode != 0 and "loopback" in p.stderr
