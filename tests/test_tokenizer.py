"""Tokenizer: the GGUF-embedded BPE against published SmolLM2 token ids, round trips, HF directories."""

import json

import pytest

from futx.tokenizer import Tokenizer, load_tokenizer

# Published SmolLM2 (Hugging Face tokenizer) ids of the default chat prompt asking for France's capital,
# and of a French sentence (accents, spacing before "?").
CHAT_FRANCE = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
               8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
FRENCH = ("Quelle est la capitale de la France ? Réponds en une phrase.",
          [65, 2726, 290, 1264, 2618, 47765, 1121, 367, 2618, 4649, 9148, 428, 2756, 96, 19870, 430, 16520, 8715, 30])


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_gguf):
    return load_tokenizer()


def test_published_ids(smollm2_tok):
    assert smollm2_tok.encode(smollm2_tok.chat_prompt("What is the capital of France?")) == CHAT_FRANCE
    assert smollm2_tok.encode(FRENCH[0]) == FRENCH[1]
    assert smollm2_tok.encode("hello world") == [28120, 905]
    assert smollm2_tok.vocab_size == 49152 and not smollm2_tok.add_bos
    assert smollm2_tok.eos_ids == {0, 2}


def test_digits_are_split_one_by_one(smollm2_tok):
    ids = smollm2_tok.encode("In 2024, 135M")
    assert [smollm2_tok.decode([i]) for i in ids] == ["In", " ", "2", "0", "2", "4", ",", " ", "1", "3", "5", "M"]


def test_wikitext_round_trip(smollm2_tok):
    from futx.eval.data import default_text
    from futx.eval import join_rows, read_rows

    text = default_text()
    if text is None:
        pytest.skip("../shared/data/wikitext-2-raw/wiki.test.raw is not beside the repository")
    joined = join_rows(read_rows(text))
    ids = smollm2_tok.encode(joined)
    assert len(ids) == 301_948  # the count docs/results.md reports
    assert smollm2_tok.decode(ids) == joined


def test_hf_directory_tokenizer(tmp_path, smollm2_tok):
    smollm2_tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.encode(FRENCH[0]) == FRENCH[1] and 2 in tok.eos_ids and not tok.add_bos
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    assert Tokenizer.from_hf_dir(tmp_path).encode("hello world") == [1, 28120, 905]


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="cannot read"):
        Tokenizer.from_hf_dir(tmp_path)
    from futx.checkpoint.gguf import save_gguf
    from futx.checkpoint.synthetic import random_weights, tiny_config
    path = save_gguf(tmp_path / "m.gguf", random_weights(tiny_config()))
    with pytest.raises(ValueError, match="lacks metadata key 'tokenizer.ggml.model'"):
        Tokenizer.from_gguf(path)


def test_encode_rejects_non_text(smollm2_tok):
    with pytest.raises(ValueError, match="expects a str"):
        smollm2_tok.encode([1, 2])
