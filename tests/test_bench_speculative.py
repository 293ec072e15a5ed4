"""`futx bench speculative` (scripts/bench_speculative.py) on the CPU: prompt placement, the chat builder and the
whole code path on the emulated engine with a tiny model (the numbers mean nothing here; the H200 run measures)."""

import json
import sys
from pathlib import Path

import pytest

from futx import cli
from futx.checkpoint.synthetic import random_weights, tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts import spec_prompts as sp  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
CFG = tiny_config(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, num_hidden_layers=2, vocab_size=300)
TEXT = "".join(f" = Article {i} = \n\n {'word%d ' % i * 60}\n\n" for i in range(12))


def test_prompts_land_in_their_ranges():
    ranges = sp.parse_ranges("0-512,512-1024")
    assert sp.prompt_length(0, 512, 256) == 64 and sp.prompt_length(512, 1024, 256) == 512
    with pytest.raises(ValueError, match="do not fit"):
        sp.prompt_length(512, 600, 256)
    with pytest.raises(ValueError, match="LO-HI"):
        sp.parse_ranges("0-x")
    ps = sp.wiki_prompts(list(range(5000)), ranges, 3, 256)
    assert [len(p.ids) for p in ps] == [64] * 3 + [512] * 3 and {p.range for p in ps} == {"0-512", "512-1024"}
    assert all(p.ids == list(range(p.ids[0], p.ids[0] + len(p.ids))) for p in ps)   # contiguous windows


class CharTok:
    def encode(self, s):
        return [ord(c) % 256 for c in s]

    def token_id(self, s):
        return 1 if s == "<|im_start|>" else None


def test_chat_prompts_are_multi_turn_and_fit():
    from futx.serve.chat import render_chat

    arts = sp.articles(TEXT)
    assert len(arts) == 12 and arts[0][0] == "Article 0"
    ps = sp.chat_prompts(CharTok(), render_chat, arts, [(0, 2000), (2000, 6000)], 2, 100)
    for p in ps:
        lo, hi = map(int, p.range.split("-"))
        assert len(p.ids) + 100 <= hi
    text = "".join(map(chr, ps[-1].ids))
    assert text.count("<|im_start|>user") >= 2 and text.endswith("<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_checkpoint import save_tiny_hf

    return save_tiny_hf(tmp_path_factory.mktemp("bench-spec"), random_weights(CFG, seed=3),
                        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"))


def test_bench_speculative_on_the_emulated_engine(model_dir, tmp_path, capsys):
    text = tmp_path / "wiki.txt"
    text.write_text(TEXT)
    out = tmp_path / "s.json"
    assert cli.main(["bench", "speculative", "--model", str(model_dir), "--backend", "emulated", "--no-graphs",
                     "--text", str(text), "--ranges", "0-100,100-200", "--prompts", "2", "--gen-len", "12",
                     "--batches", "1,2", "--num-draft", "3", "--rounds", "1", "--out", str(out),
                     "--md", str(tmp_path / "s.md")]) == 0
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert {(r["corpus"], r["batch"], r["draft"]) for r in rows} == {
        (c, b, d) for c in ("wiki", "chat") for b in (1, 2) for d in ("none", "ngram")}
    for r in rows:
        assert r["tokens"] == 4 * 12 and r["tokens_per_s"] > 0
        if r["draft"] == "ngram":
            assert r["identical_groups"] == r["groups"]        # greedy speculation changes nothing
            assert r["acceptance"]["verifications"] > 0
    assert "| wiki | 1 | ngram |" in (tmp_path / "s.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--drafts", "none,dlite"], "needs --draft"),
    (["--batches", "16", "--num-draft", "4"], "exceed the step's 64 rows"),
    (["--drafts", "eagle"], "is not one of none, ngram, dlite"),
])
def test_bench_speculative_options(model_dir, capsys, argv, message):
    assert cli.main(["bench", "speculative", "--model", str(model_dir), "--backend", "emulated", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
