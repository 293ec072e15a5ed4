"""CPU smoke test of scripts/bench_serving.py: the emulated engine on a tiny shape, in-process."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


PAGED = ["--pages", "8", "--shared-prefix", "128", "--capacity", "256", "--max-batch", "1"]
INT4_ONLY = [*PAGED, "--staging-pages", "2"]


@pytest.mark.parametrize("extra", [[], ["--rate", "50"], PAGED, INT4_ONLY],
                         ids=["offline", "poisson", "paged-prefix", "int4-only-prefix"])
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
    assert m["prefix_hit_tokens"] == (3 * 128 if extra in (PAGED, INT4_ONLY) else 0)
    assert res["config"]["staging_pages"] == (2 if extra is INT4_ONLY else None)
    assert m["prefilled_tokens"] == m["prompt_tokens"] - 4 - m["prefix_hit_tokens"]
    assert m["prefill_fraction"] + m["decode_fraction"] <= 1 + 1e-6
    assert "| requests/s |" in (tmp_path / "bench_serving.md").read_text()


def test_bench_serving_rate_sweep(tmp_path):
    from scripts.bench_serving import main

    assert main(["--backend", "emulated", "--layers", "2", "--requests", "3", "--warmup", "1", "--rates", "20,40",
                 "--out", str(tmp_path), *INT4_ONLY]) == 0
    doc = json.loads((tmp_path / "bench_serving_sweep.json").read_text())
    assert [r["config"]["rate"] for r in doc["runs"]] == [20.0, 40.0] and doc["tpot_target_ms"] == 50.0
    assert all(r["metrics"]["errors"] == 0 for r in doc["runs"])
    assert "Highest rate with TPOT p99" in (tmp_path / "bench_serving_sweep.md").read_text()
    with pytest.raises(SystemExit, match="--rates"):
        main(["--backend", "emulated", "--rates", "fast"])
    with pytest.raises(SystemExit, match="--staging-pages needs --pages"):
        main(["--backend", "emulated", "--staging-pages", "2"])
