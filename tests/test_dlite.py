"""The DLite draft head (futx.speculative.dlite), its training (dlite_train) and `futx train-draft`, on a tiny
random model on the CPU."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.speculative.dlite import (DLiteConfig, DLiteDrafter, DLiteHead, expected_acceptance, fingerprint, load,
                                    load_head)

from cli_run import futx

pytestmark = pytest.mark.usefixtures("single_thread")
REPO = Path(__file__).resolve().parents[1]
CFG = tiny_config(vocab_size=300)


@pytest.fixture(scope="module")
def target():
    return random_weights(CFG, seed=3, std=0.3)


def make_head(target, k=4, seed=0, **kw):
    torch.manual_seed(seed)
    return DLiteHead(DLiteConfig.for_target(target, k_max=k, **kw), target)


def test_config_json_round_trip(target):
    c = DLiteConfig.for_target(target, k_max=5, width=48, depth=3, target_model="somewhere",
                               training={"lr": 0.001})
    back = DLiteConfig.from_json(c.to_json())
    assert back == c and back.width == 48 and back.k_max == 5 and back.target_fingerprint == fingerprint(target)
    with pytest.raises(ValueError, match="k_max"):
        DLiteConfig(hidden_size=64, vocab_size=300, k_max=8)
    with pytest.raises(ValueError, match="not a futx DLite"):
        DLiteConfig.from_json(json.dumps({"hidden_size": 64}))
    with pytest.raises(ValueError, match="unknown fields"):
        DLiteConfig.from_json(json.dumps({**json.loads(c.to_json()), "colour": "red"}))


def test_fingerprint_is_dtype_independent_and_model_specific(target):
    assert fingerprint(target) == fingerprint(target.to(torch.bfloat16))
    assert fingerprint(target) != fingerprint(random_weights(CFG, seed=4, std=0.3))


def test_save_load_round_trip_is_bitwise(target, tmp_path):
    head = make_head(target, k=3, width=40)
    for p in head.parameters():   # not the init values: a trained-looking head
        p.data.add_(0.01 * torch.randn_like(p))
    head.save(tmp_path / "h")
    assert {f.name for f in (tmp_path / "h").iterdir()} == {"draft.json", "draft.safetensors"}
    back = load_head(tmp_path / "h", target)
    a, b = head.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert back.config == head.config
    h, last = torch.randn(5, CFG.hidden_size), torch.randint(0, CFG.vocab_size, (5,))
    assert torch.equal(head.draft(h, last, 3), back.draft(h, last, 3))
    # the file itself, or the directory, loads; the module-level loader makes the Drafter
    assert torch.equal(load_head(tmp_path / "h" / "draft.json", target).fc_in.weight, head.fc_in.weight)
    assert load(tmp_path / "h", target=target).name == "dlite"


def test_load_refuses_another_target_missing_files_and_wrong_shapes(target, tmp_path):
    head = make_head(target)
    head.save(tmp_path / "h")
    other = random_weights(CFG, seed=11, std=0.3)
    with pytest.raises(ValueError, match="fingerprint"):
        load_head(tmp_path / "h", other)
    with pytest.raises(ValueError, match="does not exist"):
        load_head(tmp_path / "nope", target)
    (tmp_path / "h2").mkdir()
    (tmp_path / "h2" / "draft.json").write_text((tmp_path / "h" / "draft.json").read_text())
    with pytest.raises(ValueError, match="draft.safetensors is missing"):
        load_head(tmp_path / "h2", target)
    # a config whose width disagrees with the tensors
    cfg = json.loads((tmp_path / "h" / "draft.json").read_text())
    (tmp_path / "h2" / "draft.json").write_text(json.dumps({**cfg, "width": 32}))
    (tmp_path / "h2" / "draft.safetensors").write_bytes((tmp_path / "h" / "draft.safetensors").read_bytes())
    with pytest.raises(ValueError, match="shape"):
        load_head(tmp_path / "h2", target)
    (tmp_path / "h2" / "draft.safetensors").write_bytes(b"not safetensors")
    (tmp_path / "h2" / "draft.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="safetensors"):
        load_head(tmp_path / "h2", target)


def test_drafter_returns_k_tokens_per_request_deterministically(target):
    drafter = DLiteDrafter(make_head(target, k=4))
    assert drafter.needs_hidden and drafter.name == "dlite"
    histories = [[1, 2, 3], [7], [4, 4, 4, 4, 9]]
    hidden = torch.randn(3, CFG.hidden_size).to(torch.bfloat16)   # the engine's dtype
    a = drafter.propose(histories, hidden, 4)
    assert len(a) == 3 and all(len(p) == 4 for p in a)
    assert all(0 <= t < CFG.vocab_size for p in a for t in p)
    assert a == drafter.propose(histories, hidden, 4)
    # batched == one request at a time; k below k_max is a prefix (greedy); above is clamped to k_max
    assert [drafter.propose([histories[i]], hidden[i:i + 1], 4)[0] for i in range(3)] == a
    assert drafter.propose(histories, hidden, 2) == [p[:2] for p in a]
    assert drafter.propose(histories, hidden, 7) == a
    assert drafter.propose(histories, hidden, 0) == [[], [], []]
    with pytest.raises(ValueError, match="hidden"):
        drafter.propose(histories, None, 4)
    with pytest.raises(ValueError, match=r"\[3, 64\]"):
        drafter.propose(histories, hidden[:2], 4)


def test_expected_acceptance():
    assert expected_acceptance([1.0, 1.0]) == 2.0
    assert expected_acceptance([0.5, 0.5, 0.0]) == pytest.approx(0.75)


def test_rollout_teacher_forcing_matches_drafts_when_fed_them(target):
    head = make_head(target, k=4)
    h, last = torch.randn(6, CFG.hidden_size), torch.randint(0, CFG.vocab_size, (6,))
    _, _, own = head.rollout(h, last, 4)
    _, _, forced = head.rollout(h, last, 4, tokens=own[:, :-1])
    assert torch.equal(own, forced) and torch.equal(own, head.draft(h, last, 4))


def repetitive_states(target, n=6, length=48, period=5):
    """A period-5 token cycle through the target: the states stage 1 trains on."""
    from futx.speculative.dlite_train import window_states

    g = torch.Generator().manual_seed(0)
    cycle = torch.randint(0, CFG.vocab_size, (period,), generator=g)
    windows = torch.stack([cycle.roll(i).repeat(length // period + 1)[:length] for i in range(n)])
    return window_states(target, windows, batch_windows=3)


def test_a_few_training_steps_reduce_the_loss(target):
    from futx.speculative.dlite_train import TrainOptions, draft_loss, evaluate, random_batch

    states = repetitive_states(target)
    assert states["hidden"].shape == (6, 48, CFG.hidden_size) and states["hidden"].dtype == torch.bfloat16
    opts = TrainOptions(k=3, batch_size=64)
    head = make_head(target, k=3)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    fixed = random_batch(states, 3, 128, torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = draft_loss(head, fixed, 3, False, opts)[0].item()
    accepted_before = evaluate(head, states, 3, own=True)["accepted_mean"]
    for _ in range(40):
        loss, _ = draft_loss(head, random_batch(states, 3, 64, gen), 3, False, opts)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = draft_loss(head, fixed, 3, False, opts)[0].item()
    assert after < 0.7 * before, (before, after)
    ev = evaluate(head, states, 3, own=True)
    print(before, after, accepted_before, ev)
    assert ev["accepted_mean"] > accepted_before + 0.3 and len(ev["accuracy"]) == 3 and "0-512" in ev["by_position"]


def test_greedy_continuations_follow_the_target(target):
    from futx.kvcache import KVCache
    from futx.reference import PackedBatch, forward
    from futx.speculative.dlite_train import greedy_continuations

    prompts = torch.randint(0, CFG.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    s = greedy_continuations(target, prompts, 5)
    assert s["tokens"].shape == (2, 5) and torch.equal(s["tokens"][:, 1:], s["greedy"][:, :-1])
    assert s["tokens"][:, 0].tolist() == prompts[:, -1].tolist() and s["start"].tolist() == [6, 6]
    ids = prompts[0].tolist()   # request 0 generated token by token with the reference forward
    cache = KVCache(CFG, 1, 12)
    lg = forward(CFG, target, torch.tensor(ids), PackedBatch.from_lengths([7]), cache)
    new = []
    for i in range(5):
        new.append(int(lg[-1].argmax()))
        lg = forward(CFG, target, torch.tensor(new[-1:]), PackedBatch.decode([7 + i]), cache)
    assert s["greedy"][0].tolist() == new


# ---- futx train-draft ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_and_text(tmp_path_factory):
    from tiny_checkpoint import save_tiny_hf

    d = tmp_path_factory.mktemp("train-draft")
    save_tiny_hf(d / "model", random_weights(CFG, seed=9, std=0.3))
    (d / "text.txt").write_text("\n".join(f"the cat sat on the mat number {i % 7}. the dog ran." for i in range(120)))
    return d


TINY = ["--seq-len", "48", "--windows", "4", "--stage1-steps", "12", "--stage2-steps", "6", "--batch-size", "16",
        "--stage2-prompts", "4", "--gen-len", "12", "--device", "cpu", "--threads", "1", "--no-progress"]


def test_train_draft_end_to_end_writes_the_head(model_and_text, tmp_path):
    d = model_and_text
    status, out, err, _ = futx(["train-draft", "--model", str(d / "model"), "--data", str(d / "text.txt"),
                                "--out", str(tmp_path / "head"), "--num-draft", "3", "--json",
                                str(tmp_path / "m.json"), *TINY], cwd=tmp_path)
    assert status == 0, err
    assert "Traceback" not in err and "saved" in out
    cfg = json.loads((tmp_path / "head" / "draft.json").read_text())
    assert cfg["k_max"] == 3 and cfg["training"]["stage1_steps_done"] == 12 and cfg["training"]["partial"] is False
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["partial"] is False and m["stage1"]["steps_done"] == 12 and m["stage2"]["steps_done"] == 6
    assert len(m["final"]["greedy_eval"]["accuracy"]) == 3
    assert list((tmp_path / "head" / "cache").glob("stage1-*/manifest.json"))
    from futx.checkpoint import load as load_checkpoint

    drafter = load(tmp_path / "head", target=load_checkpoint(d / "model"))
    assert len(drafter.propose([[5, 6]], torch.randn(1, CFG.hidden_size), 3)[0]) == 3
    assert load(tmp_path / "head").k_max == 3   # the target named in draft.json
    # a second run reads stage 1's hidden states from the cache
    status, _, err, _ = futx(["train-draft", "--model", str(d / "model"), "--data", str(d / "text.txt"),
                              "--out", str(tmp_path / "head"), "--num-draft", "3", *TINY[:-1]], cwd=tmp_path)
    assert status == 0 and "from the cache" in err, err


@pytest.mark.parametrize("args, option", [
    (["--num-draft", "0"], "--num-draft"),
    (["--num-draft", "8"], "--num-draft"),
    (["--out", "{missing}/deep/head"], "--out"),
    (["--out", "{file}"], "--out"),
    (["--data", "{missing}/t.txt"], "--data"),
    (["--data", "{dir}"], "--data"),
    (["--data", "{binary}"], "--data"),
    (["--data", "{wikitext}"], "--data"),
    (["--seq-len", "12"], "--seq-len"),
    (["--seq-len", "16", "--num-draft", "7"], "--seq-len"),
    (["--gen-len", "40", "--seq-len", "64"], "--gen-len"),
    (["--lr", "0"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--batch-size", "0"], "--batch-size"),
    (["--stage1-steps", "-1"], "--stage1-steps"),
    (["--windows", "0"], "--windows"),
    (["--device", "tpu"], "--device"),
    (["--json", "{missing}/m.json"], "--json"),
    (["--model", "{missing}"], "--model"),
    (["--cache", "{dir}/c", "--no-cache"], "--cache"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_train_draft_refuses_bad_options_in_one_line(args, option, tmp_path):
    (tmp_path / "f.txt").write_text("words\n")
    (tmp_path / "b.bin").write_bytes(b"\x00\xff" * 8)
    (tmp_path / "wiki.test.raw").write_text("text\n")
    paths = {"missing": str(tmp_path / "missing"), "dir": str(tmp_path), "file": str(tmp_path / "f.txt"),
             "binary": str(tmp_path / "b.bin"), "wikitext": str(tmp_path / "wiki.test.raw")}
    args = [a.format(**paths) for a in args]
    if "--out" not in args:
        args = ["--out", str(tmp_path / "head"), *args]
    status, out, err, seconds = futx(["train-draft", *args], cwd=tmp_path)
    lines = err.splitlines()
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith("futx train-draft: error: ") and option in lines[0], err
    assert "Traceback" not in err and out == ""
    assert seconds < 5.0
    assert not (tmp_path / "head").exists()


def test_walk_acceptance_replays_greedy_verification(target):
    """A head that drafts the continuation itself (an oracle) is accepted in full: k drafts per verification."""
    from futx.speculative.dlite_train import greedy_continuations, walk_acceptance

    prompts = torch.randint(0, CFG.vocab_size, (3, 6), generator=torch.Generator().manual_seed(7))
    s = greedy_continuations(target, prompts, 20)
    head = make_head(target, k=3)
    table = {}   # (row's hidden bytes) -> the next 3 greedy tokens
    for b in range(3):
        for i in range(20 - 3):
            table[s["hidden"][b, i].float().numpy().tobytes()] = s["greedy"][b, i + 1:i + 4].long()

    class Oracle:
        def __getattr__(self, name):
            return getattr(head, name)

        def draft(self, hidden, last, k):
            return torch.stack([table[h.float().numpy().tobytes()] for h in hidden])

        def eval(self):
            return self

        def train(self):
            return self

    w = walk_acceptance(Oracle(), s, 3)
    assert w["mean_accepted"] == 3.0 and w["mean_tokens_per_verification"] == 4.0
    assert w["verifications"] == 3 * 5   # rows 0, 4, 8, 12, 16 of 20 per sequence
    assert walk_acceptance(head, s, 3)["mean_accepted"] <= 3.0


def test_ctrl_c_saves_the_head_so_far(model_and_text, tmp_path):
    import signal

    d = model_and_text
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = list(TINY)
    args[args.index("--stage1-steps") + 1] = "1000000"   # stage 1 far longer than the test waits
    proc = subprocess.Popen([sys.executable, "-m", "futx", "train-draft", "--model", str(d / "model"), "--data",
                             str(d / "text.txt"), "--out", str(tmp_path / "head"), "--json", str(tmp_path / "m.json"),
                             *args], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list((tmp_path / "head" / "cache").glob("stage1-*/manifest.json")):   # training starts next
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(2.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    cfg = json.loads((tmp_path / "head" / "draft.json").read_text())
    m = json.loads((tmp_path / "m.json").read_text())
    assert cfg["training"]["partial"] is True and m["partial"] is True
    assert 0 < cfg["training"]["stage1_steps_done"] == m["stage1"]["steps_done"] < 1000000
    from futx.checkpoint import load as load_checkpoint

    load_head(tmp_path / "head", load_checkpoint(d / "model"))
