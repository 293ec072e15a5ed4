"""Every subcommand refuses every bad option before any work: `futx CMD ...` as a subprocess exits with status 2,
one line on stderr that names the option, no traceback, in under 5 s (no model loads)."""

from pathlib import Path

import pytest
import torch

from cli_run import futx

REPO = Path(__file__).resolve().parents[1]
LIMIT_S = 5.0
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without CUDA")

# (arguments, the option the message names[, a mark]); {missing} is a directory that does not exist, {dir} one
# that does, {text} a UTF-8 file, {binary} a file that is not UTF-8, {file} some regular file
CASES = {
    "generate": [
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--max-batch", "65"], "--max-batch"),
        (["--max-batch", "x"], "--max-batch"),
        (["--threads", "0"], "--threads"),
        (["--device", "banana"], "--device"),
        (["--dtype", "int8"], "--dtype"),
        (["--prompt", " "], "--prompt"),
        (["--prompts", "{dir}"], "--prompts"),
        (["--prompts", "{binary}"], "--prompts"),
        (["--prompts", "{missing}/p.txt"], "--prompts"),
        (["--model", "{missing}"], "--model"),
        (["--model", "{text}"], "--model"),
        (["--gptq", "{missing}/g.safetensors"], "--gptq"),
        (["--group-size", "96"], "--group-size"),
        (["--weights", "int8"], "--weights"),
        (["--prefill-format", "fp4"], "--prefill-format"),
        (["--backend", "kernels"], "--backend", NO_CUDA),
        (["--page-size", "200"], "--page-size"),
        (["--cache-main", "none"], "--cache-main"),
        (["--backend", "emulated", "--cache", "bf16", "--cache-main", "none"], "--cache-main"),
        (["--backend", "emulated", "--staging-pages", "4"], "--staging-pages"),
        (["--backend", "emulated", "--cache-main", "none", "--staging-pages", "0"], "--staging-pages"),
        (["--backend", "emulated", "--cache-main", "none", "--page-size", "256"], "--cache-main"),
    ],
    "ppl": [
        (["--prefill-context", "mirror"], "--prefill-context"),
        (["--backend", "emulated", "--protocol", "all-decode", "--prefill-context", "main"], "--prefill-context"),
        (["--json", "{missing}/r.json", "--max-windows", "1"], "--json"),
        (["--json", "{dir}"], "--json"),
        (["--jsonl", "{missing}/r.jsonl"], "--jsonl"),
        (["--device", "banana"], "--device"),
        (["--device", "cuda:7"], "--device"),
        (["--batch-size", "0"], "--batch-size"),
        (["--window", "1"], "--window"),
        (["--window", "3", "--protocol", "gptq", "serving", "--text", "{text}"], "--window"),
        (["--max-windows", "0"], "--max-windows"),
        (["--decode-chunk", "0"], "--decode-chunk"),
        (["--max-batch", "0"], "--max-batch"),
        (["--text", "{dir}"], "--text"),
        (["--text", "{binary}"], "--text"),
        (["--text", "{missing}/t.txt"], "--text"),
        (["--protocol", "wikitext"], "--protocol"),
        (["--backend", "emulated", "--protocol", "gptq", "--text", "{text}"], "--protocol"),
    ],
    "pack": [
        ([], "--out"),
        (["--out", "{missing}/deep/packed"], "--out"),
        (["--out", "{file}"], "--out"),
        (["--out", "{dir}/p", "--weights", "bf16", "--gptq", "{file}"], "--gptq"),
        (["--out", "{dir}/p", "--device", "tpu"], "--device"),
        (["--out", "{dir}/p", "--group-size", "0"], "--group-size"),
    ],
    "serve": [
        (["--port", "70000"], "--port"),
        (["--port", "-1"], "--port"),
        (["--capacity", "1"], "--capacity"),
        (["--max-queue", "0"], "--max-queue"),
        (["--prefill-chunk", "0"], "--prefill-chunk"),
        (["--max-batch", "65"], "--max-batch"),
        (["--host", ""], "--host"),
        (["--threads", "-2"], "--threads"),
        (["--backend", "reference", "--prefill", "kernels"], "--prefill"),
        (["--page-size", "100"], "--page-size"),
        (["--page-size", "64"], "--page-size"),
        (["--pages", "0"], "--pages"),
        (["--pages", "4", "--cache-memory", "1"], "--cache-memory"),
        (["--cache-memory", "0"], "--cache-memory"),
        (["--cache-main", "none"], "--cache-main"),
        (["--backend", "emulated", "--cache", "bf16", "--cache-main", "none"], "--cache-main"),
        (["--backend", "emulated", "--staging-pages", "4"], "--staging-pages"),
        (["--backend", "emulated", "--cache-main", "none", "--staging-pages", "3", "--capacity", "2048"],
         "--staging-pages"),
        (["--token-budget", "0"], "--token-budget"),
    ],
    "build": [
        ([], "--out"),
        (["--out", "{file}"], "--out"),
        (["--out", "{missing}/deep/aot"], "--out"),
        (["--out", "{dir}/aot", "--jobs", "0"], "--jobs"),
        (["--out", "{dir}/aot", "--chain", "no_factory"], "--chain"),
        (["--out", "{dir}/aot", "--ab", "fp16"], "--ab"),
    ],
    "train-draft": [
        ([], "--out"),
        (["--out", "{missing}/deep/head"], "--out"),
        (["--out", "{file}"], "--out"),
        (["--out", "{dir}/h", "--num-draft", "8"], "--num-draft"),
        (["--out", "{dir}/h", "--data", "{missing}/t.txt"], "--data"),
        (["--out", "{dir}/h", "--data", "{binary}"], "--data"),
        (["--out", "{dir}/h", "--seq-len", "16", "--num-draft", "7"], "--seq-len"),
        (["--out", "{dir}/h", "--lr", "0"], "--lr"),
        (["--out", "{dir}/h", "--device", "tpu"], "--device"),
    ],
    "bench": [
        (["decode", "--points", "65x1024"], "--points"),
        (["decode", "--points", "1x0"], "--points"),
        (["decode", "--points", "banana"], "--points"),
        (["decode", "--json", "{missing}/b.json"], "--json"),
        (["decode", "--out", "{dir}"], "--out"),
        (["decode", "--md", "{missing}/b.md"], "--md"),
        (["decode", "--plot", "{missing}/b.png"], "--plot"),
        (["decode", "--reps", "0"], "--reps"),
        (["decode", "--rounds", "0"], "--rounds"),
        (["decode", "--layers", "0"], "--layers"),
        (["decode", "--weights", "int8"], "--weights"),
        (["decode", "--cache", "int4,int4"], "--cache"),
        (["decode", "--peers", "nope"], "--peers"),
        (["decode", "--shape", "llama-9"], "--shape"),
        (["decode", "--weights", "int4", "--cache", "int4", "--breakdown", "bf16/bf16"], "--breakdown"),
        (["decode", "--weights", "bf16", "--breakdown", "", "--glue"], "--glue"),
        (["nope"], "what"),
    ],
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-validation")
    (d / "text.txt").write_text("some words to score " * 40)
    (d / "binary.bin").write_bytes(b"\x00\x01\xfe\xff" * 16)
    return {"missing": str(d / "missing"), "dir": str(d), "text": str(d / "text.txt"),
            "binary": str(d / "binary.bin"), "file": str(d / "text.txt")}




@pytest.mark.parametrize("command, args, option", [
    pytest.param(cmd, args, option, marks=marks, id=f"{cmd} {' '.join(args)}")
    for cmd, cases in CASES.items() for args, option, *marks in cases])
def test_a_bad_option_is_one_line_before_any_work(command, args, option, paths):
    args = [a.format(**paths) for a in args]
    status, out, err, seconds = futx([command, *args], cwd=paths["dir"])
    lines = err.splitlines()
    prog = "futx bench decode" if command == "bench" and args[0] == "decode" else f"futx {command}"
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and option in lines[0], err
    assert "Traceback" not in err and out == ""
    assert seconds < LIMIT_S, f"{seconds:.1f} s: something loaded before the options were checked"


def test_ppl_with_a_bad_json_path_starts_no_work(paths, tmp_path):
    """The issue's case: the run used to evaluate for minutes and then lose the result in a traceback."""
    status, out, err, seconds = futx(["ppl", "--jsonl", str(tmp_path / "running.jsonl"), "--text", paths["text"],
                                      "--json", "/nonexistent/dir/x.json", "--max-windows", "1"], cwd=tmp_path)
    assert status == 2 and err == "futx ppl: error: argument --json: directory /nonexistent/dir does not exist\n"
    assert out == "" and list(tmp_path.iterdir()) == [] and seconds < LIMIT_S


def test_every_subcommand_is_in_the_table():
    from futx.cli import app

    app.build_parser()
    assert set(CASES) == set(app.COMMANDS)
