"""Perplexity harness: protocols against direct formulas; chunked == stepwise decoding; runners; inputs."""

import math

import pytest
import torch

from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.eval import PerplexityResult, Runner, evaluate, join_rows, make_windows, read_rows
from futx.eval.perplexity import scored_per_window
from futx.kvcache import KVCache
from futx.reference import PackedBatch, forward

pytestmark = pytest.mark.usefixtures("single_thread")
CFG = tiny_config()
W = 24


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=21, dtype=torch.float64, std=0.2)


@pytest.fixture
def windows(seeded):
    return torch.randint(0, CFG.vocab_size, (3, W), generator=seeded)


def token_nll(weights, window):
    """Per-position NLL [W-1] of one window by a direct full-window forward and log-softmax."""
    logits = forward(CFG, weights, window, PackedBatch.from_lengths([W]), KVCache(CFG, 1, W, dtype=torch.float64))
    return -logits[:-1].log_softmax(-1).gather(1, window[1:, None]).squeeze(1)


def test_gptq_matches_direct_formula(weights, windows):
    r = evaluate(Runner(weights), windows, "gptq", batch_size=2, progress=False)
    nll = torch.cat([token_nll(weights, w) for w in windows])
    assert (r.windows, r.window, r.tokens) == (3, W, 3 * (W - 1))
    assert r.mean_nll == pytest.approx(float(nll.mean()), rel=1e-12)
    assert r.ppl == pytest.approx(math.exp(float(nll.mean())), rel=1e-12)


def test_serving_scores_only_decoded_positions(weights, windows):
    r = evaluate(Runner(weights), windows, "serving", batch_size=3, decode_chunk=5, progress=False)
    nll = torch.cat([token_nll(weights, w)[W // 2:] for w in windows])  # predictions made at positions >= W/2
    assert r.tokens == 3 * (W // 2 - 1) == nll.numel()
    assert r.mean_nll == pytest.approx(float(nll.mean()), rel=1e-12)


def test_all_decode_equals_gptq_without_mirror(weights, windows):
    runner = Runner(weights)
    a = evaluate(runner, windows, "all-decode", batch_size=2, decode_chunk=7, progress=False)
    b = evaluate(runner, windows, "gptq", batch_size=3, progress=False)
    assert a.tokens == b.tokens and a.mean_nll == pytest.approx(b.mean_nll, rel=1e-12)


def rounding_mirror(layer, k, v):
    return torch.round(k * 3) / 3, torch.round(v * 3) / 3


@pytest.mark.parametrize("protocol", ["serving", "all-decode"])
def test_chunked_decode_equals_stepwise(weights, windows, protocol):
    other = weights.to()
    other.layers = [l.replace(w_up=l.w_up * 0.9) for l in weights.layers]
    runner = Runner(weights, other, mirror=rounding_mirror)
    step = evaluate(runner, windows, protocol, batch_size=2, stepwise=True, progress=False)
    for chunk in (4, 64):
        chunked = evaluate(runner, windows, protocol, batch_size=3, decode_chunk=chunk, progress=False)
        assert chunked.mean_nll == pytest.approx(step.mean_nll, rel=1e-12)
    assert step.decode == "stepwise" and chunked.decode == "chunked(64)"
    # The mirror and decode weights are really used: the result differs from the plain model.
    plain = evaluate(Runner(weights), windows, protocol, progress=False)
    assert abs(plain.mean_nll - step.mean_nll) > 1e-4


def test_decode_weights_drive_all_decode(weights, windows):
    other = weights.to()
    other.layers = [l.replace(wo=l.wo * 1.3) for l in weights.layers]
    a = evaluate(Runner(weights, other), windows, "all-decode", progress=False)
    b = evaluate(Runner(other), windows, "gptq", progress=False)
    assert a.mean_nll == pytest.approx(b.mean_nll, rel=1e-12)


def test_on_batch_reports_running_results_and_merge(weights, windows):
    seen = []
    r = evaluate(Runner(weights), windows, "gptq", batch_size=2, progress=False, on_batch=seen.append)
    assert [s.windows for s in seen] == [2, 3] and seen[-1] == r
    first = evaluate(Runner(weights), windows[:2], "gptq", progress=False)
    rest = evaluate(Runner(weights), windows[2:], "gptq", progress=False)
    merged = first.merge(rest)
    assert merged.tokens == r.tokens and merged.nll_sum == pytest.approx(r.nll_sum, rel=1e-12)
    with pytest.raises(ValueError, match="same protocol"):
        first.merge(evaluate(Runner(weights), windows[:1], "all-decode", progress=False))


def test_float32_tracks_float64(weights, windows):
    r64 = evaluate(Runner(weights), windows, "gptq", progress=False)
    r32 = evaluate(Runner(weights.to(torch.float32)), windows, "gptq", progress=False)
    assert r32.ppl == pytest.approx(r64.ppl, rel=1e-5)


def test_text_rows_and_windows(tmp_path):
    f = tmp_path / "t.raw"
    f.write_bytes(" = Title = \r\n Body one .\r\n\r\n  \r\n Body two\n".encode())
    rows = read_rows(f)
    assert rows == [" = Title = ", " Body one .", " Body two"]
    assert join_rows(rows) == " = Title = \n\n Body one .\n\n Body two"
    w = make_windows(list(range(10)), 4)
    assert w.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and w.dtype == torch.int64
    assert make_windows(list(range(10)), 4, max_windows=1).shape == (1, 4)
    with pytest.raises(ValueError, match="fewer than one window"):
        make_windows(list(range(3)), 4)
    with pytest.raises(ValueError, match="does not exist"):
        read_rows(tmp_path / "missing.raw")


def test_bad_arguments(weights, windows):
    runner = Runner(weights)
    with pytest.raises(ValueError, match="unknown protocol"):
        evaluate(runner, windows, "wikitext", progress=False)
    with pytest.raises(ValueError, match="int64"):
        evaluate(runner, windows.float(), "gptq", progress=False)
    with pytest.raises(ValueError, match="positive"):
        evaluate(runner, windows, "gptq", batch_size=0, progress=False)
    assert scored_per_window("serving", 2048) == 1023 and scored_per_window("gptq", 2048) == 2047
    with pytest.raises(ValueError, match="same model shape"):
        Runner(weights, random_weights(CFG.replace(num_hidden_layers=1), dtype=torch.float64))
    assert isinstance(evaluate(runner, windows[:1], "gptq", progress=False), PerplexityResult)
