"""Speculative decoding in the serving scheduler (futx serve / futx generate on the engine), on the CPU: greedy
requests get the tokens of the plain scheduler, with and without a prefill; sampled requests are served by
rejection sampling; stops, max_tokens, /health and the `futx serve` options."""

import pytest
import torch

from futx import cli
from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.engine import DecodeModel, pack_model
from futx.engine.generate import generate
from futx.quant.simulated import quantized_weights
from futx.serve import SamplingParams, Scheduler
from futx.serve.engines import DecodeEngine, ReferenceEngine
from futx.speculative.ngram import NgramDrafter
from futx.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")
CFG = tiny_config(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, num_hidden_layers=2, vocab_size=300)


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=3)   # its greedy outputs repeat themselves: n-gram drafts get accepted


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, weights):
    from tiny_checkpoint import save_tiny_hf

    return save_tiny_hf(tmp_path_factory.mktemp("spec-serve"), weights,
                        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"))


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_hf_dir(model_dir)


@pytest.fixture(scope="module")
def packed(weights):
    return pack_model(weights, "int4", progress=False)


def _engine(packed, weights, batch, k=0, prefill=True):
    model = DecodeModel(packed, "int4", max_batch=batch, capacity=96, backend="emulated", device="cpu",
                        max_rows=batch * (k + 1))
    return DecodeEngine(model, None, quantized_weights(weights, "bf16") if prefill else None)


def _run(sched, prompts, params):
    hs = [sched.submit(p, params) for p in prompts]
    sched.run_until_idle()
    return hs


PROMPTS = ["the heat the heat the heat the", "hello there hello there", "x", "abcabcabcabcab", "no repeats"]


@pytest.mark.parametrize("prefill", [True, False])
@pytest.mark.parametrize("k", [2, 6])
def test_greedy_requests_get_the_plain_schedulers_tokens(packed, weights, tok, prefill, k):
    ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    base = Scheduler(_engine(packed, weights, 2, prefill=prefill), tok, prefill_chunk=7)
    plain = _run(base, ids, params)
    sched = Scheduler(_engine(packed, weights, 2, k, prefill), tok, prefill_chunk=7, drafter=NgramDrafter(),
                      num_draft=k)
    spec = _run(sched, ids, params)
    assert [h.output for h in spec] == [h.output for h in plain]
    assert [h.text for h in spec] == [h.text for h in plain]
    assert all(h.finish_reason == "length" and len(h.output) == 12 for h in spec)
    assert sched.acceptance.summary()["accepted"] > 0 and sched.stats.steps < base.stats.steps
    if not prefill:   # prompts read by the decode step, in blocks: still generate()'s tokens
        want, _ = generate(_engine(packed, weights, 2).model, ids, 12)
        assert [h.output for h in spec] == want
    assert sched.load["speculative"]["drafter"] == "ngram"


def test_stops_eos_and_max_tokens_inside_a_verification(packed, weights, tok):
    ids = [tok.encode(p) for p in PROMPTS]
    plain = _run(Scheduler(_engine(packed, weights, 2), tok), ids, SamplingParams(max_tokens=12, ignore_eos=True))
    stop = plain[0].text[3:5]     # a stop string inside the first request's text
    eos = plain[3].output[4]
    for params in (SamplingParams(max_tokens=12, stop=(stop,), ignore_eos=True), SamplingParams(max_tokens=3),
                   SamplingParams(max_tokens=12)):
        a = _run(Scheduler(_engine(packed, weights, 2), tok, eos_ids={eos}), ids, params)
        b = _run(Scheduler(_engine(packed, weights, 2, 7), tok, eos_ids={eos}, drafter=NgramDrafter(), num_draft=7),
                 ids, params)
        assert [(h.output, h.text, h.finish_reason) for h in a] == [(h.output, h.text, h.finish_reason) for h in b]


def test_sampled_requests_are_served_by_rejection_sampling(packed, weights, tok):
    """Temperature > 0 with drafts: right lengths, seeded runs repeat, and on a repetitive prompt the first
    token's frequencies over seeds follow the target's distribution (it is sampled from the same logits)."""
    ids = [tok.encode("abcabcabcabcab")]
    k = 4

    def sched():
        return Scheduler(_engine(packed, weights, 1, k), tok, drafter=NgramDrafter(), num_draft=k)

    p = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, seed=5, ignore_eos=True)
    a, b = _run(sched(), ids, p)[0], _run(sched(), ids, p)[0]
    assert a.output == b.output and len(a.output) == 8
    s = sched()
    hs = _run(s, ids * 6, SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True))
    assert all(len(h.output) == 6 for h in hs) and s.acceptance.verifications > 0


def test_scheduler_checks_the_engine_holds_the_blocks(packed, weights, tok):
    with pytest.raises(ValueError, match="block steps"):
        Scheduler(_engine(packed, weights, 2, 1), tok, drafter=NgramDrafter(), num_draft=3)
    with pytest.raises(ValueError, match="block steps"):
        Scheduler(ReferenceEngine(weights, 2, 32), tok, drafter=NgramDrafter(), num_draft=2)
    with pytest.raises(ValueError, match="num_draft"):
        Scheduler(_engine(packed, weights, 1, 7), tok, drafter=NgramDrafter(), num_draft=8)


@pytest.mark.parametrize("argv, message", [
    (["--speculative", "dlite"], "--speculative dlite needs --draft FILE"),
    (["--num-draft", "2"], "--num-draft applies to --speculative ngram or dlite"),
    (["--speculative", "ngram", "--max-batch", "16", "--num-draft", "4"], "= 80 rows per step; a step holds 64"),
    (["--speculative", "ngram", "--backend", "reference"], "runs on the decode engine"),
])
def test_cli_serve_speculative_options_are_checked(model_dir, capsys, argv, message):
    assert cli.main(["serve", "--model", str(model_dir), "--backend", "emulated", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("futx serve: error: ") and message in err[0], err


def test_serve_help_names_the_speculative_options(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--speculative {none,ngram,dlite}" in out and "--num-draft" in out and "rejection sampling" in out
