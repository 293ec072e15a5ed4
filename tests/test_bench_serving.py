"""CPU smoke test of scripts/bench_serving.py: the emulated engine on a tiny shape, in-process."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


PAGED = ["--pages", "8", "--shared-prefix", "128", "--capacity", "256", "--max-batch", "1"]


@pytest.mark.parametrize("extra", [[], ["--rate", "50"], PAGED], ids=["offline", "poisson", "paged-prefix"])
def test_bench_serving_smoke(tmp_path, extra):
    from scripts.bench_serving import main

    assert main(["--backend", "emulated", "--layers", "2", "--requests", "4", "--warmup", "1",
                 "--out", str(tmp_path), *extra]) == 0
    res = json.loads((tmp_path / "bench_serving.json").read_text())
    m = res["metrics"]
    assert res["shape"] == "tiny" and res["layers"] == 2 and res["backend"] == "emulated"
    assert res["config"]["rate"] == (50.0 if "--rate" in extra else None)
    assert m["requests"] == 4 and m["errors"] == 0
    drawn = [r["max_tokens"] for r in res["requests"]]
    assert m["output_tokens"] == sum(drawn) and [r["generated"] for r in res["requests"]] == drawn
    assert all(r["finish_reason"] == "length" for r in res["requests"])
    for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "wall_s", "mean_batch",
                "prefill_fraction", "decode_fraction"):
        assert m[key] > 0, key
    assert m["total_tokens_per_s"] > m["output_tokens_per_s"]
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        s = m[key]
        assert 0 < s["p50"] <= s["p99"] <= s["max"] + 1e-9, key
    assert m["ttft_ms"]["p99"] <= m["e2e_ms"]["max"] + 1e-9
    assert m["decode_steps"] >= max(drawn) and 1 <= m["mean_batch"] <= 4
    # prompt[:-1] per request, less the shared system prompt's page after the first (one request at a time)
    assert m["prefix_hit_tokens"] == (3 * 128 if extra is PAGED else 0)
    assert m["prefilled_tokens"] == m["prompt_tokens"] - 4 - m["prefix_hit_tokens"]
    assert m["prefill_fraction"] + m["decode_fraction"] <= 1 + 1e-6
    assert "| requests/s |" in (tmp_path / "bench_serving.md").read_text()
