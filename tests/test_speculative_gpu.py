"""Speculative decoding on the H200 (issue 27): the verify (block) step on the kernels — its pre-written K/V rows
are the attention kernel's own bytes, its rows follow the emulated block step and the plain kernel steps, the
one-launch ("prewrite") and per-column block attention agree, graph replay equals eager — and speculative
greedy generation on the kernels is plain greedy generation up to near-ties of the target's logits (the
verify step's projections run at another M than the plain step's, see TIE).

    python -m pytest -q -m gpu tests/test_speculative_gpu.py
"""

import pytest
import torch

from futx.checkpoint.synthetic import random_weights
from futx.engine import DecodeModel, pack_model
from futx.engine.backends import KernelOps, split_rope
from futx.engine.generate import generate
from futx.engine.graphs import BlockGraphs
from futx.engine.speculative import generate_speculative
from futx.speculative.ngram import NgramDrafter

from engine_gpu_model import FORMATS, small_config, weights  # noqa: F401

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def packed(weights):
    return {f: pack_model(weights, f, progress=False) for f in FORMATS}


def _model(packed, wf, cf, backend="kernels", batch=4, capacity=96, rows=None, block="prewrite"):
    m = DecodeModel(packed[wf], cf, max_batch=batch, capacity=capacity, backend=backend, device="cuda",
                    max_rows=rows)
    if backend == "kernels":
        m.ops.block_attention = block
    return m


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


SEQ_LEN = 30
WIDTHS = ([3, 1, 8, 2], [5, 2, 1, 8], [1, 7, 4, 3], [8, 3, 5, 1], [4, 8, 3, 6], [2, 1, 1, 4], [7, 8, 8, 6])


def _blocks_hidden(m, seqs):
    """Hidden states [requests, SEQ_LEN, H] of seqs fed as blocks of WIDTHS (different per request and step)."""
    out = torch.zeros(len(seqs), SEQ_LEN, m.config.hidden_size, device="cuda")
    starts = [0] * len(seqs)
    for widths in WIDTHS:
        blocks = [(s, starts[s], seqs[s][starts[s]:starts[s] + w]) for s, w in enumerate(widths)]
        step = m.verify(blocks)
        for s, (_, _, t) in enumerate(blocks):
            for j in range(len(t)):
                out[s, starts[s] + j] = m.buffers.hidden[step.row(s, j)].float()
            starts[s] += len(t)
    assert starts == [SEQ_LEN] * len(seqs)
    return out


def _plain_hidden(m, seqs):
    out = torch.zeros(len(seqs), SEQ_LEN, m.config.hidden_size, device="cuda")
    for p in range(SEQ_LEN):
        m.run([s[p] for s in seqs], [p] * len(seqs), list(range(len(seqs))))
        out[:, p] = m.buffers.hidden[:len(seqs)].float()
    return out


def _seqs():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 512, (SEQ_LEN,), generator=g).tolist() for _ in range(4)]


@pytest.mark.parametrize("cf", FORMATS)
def test_prewritten_rows_are_the_attention_kernels_own_bytes(packed, cf):
    """KernelOps.prewrite_rows (RoPE'd k into the main copy, v, then the mirror kernel) stores exactly what
    decode_attention_qkv_ stores for the same rows: main copy, mirror and scales, byte for byte."""
    m = _model(packed, "int4", cf)
    c = m.config
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv = (torch.randn(4, (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, generator=g,
                       device="cuda")).to(torch.bfloat16)
    positions = torch.tensor([0, 7, 13, 40], dtype=torch.int32, device="cuda")
    slots = torch.tensor([2, 0, 3, 1], dtype=torch.int32, device="cuda")
    out = torch.empty(4, c.num_attention_heads, c.head_dim, dtype=torch.bfloat16, device="cuda")
    a = _model(packed, "int4", cf)
    b = _model(packed, "int4", cf)
    a.ops.attention(qkv, positions, slots, a.cache, 0, a.rope, out)
    KernelOps.prewrite_rows(qkv, positions, slots, b.cache, 0, b.rope)
    torch.cuda.synchronize()
    for ta, tb in zip(a.cache.layers[0].tensors(), b.cache.layers[0].tensors()):
        if ta is not None:
            assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8))


@pytest.mark.parametrize("cf", FORMATS)
@pytest.mark.parametrize("k", [1, 4, 7])
def test_block_attention_against_float64_over_the_fake_quantized_cache(packed, cf, k):
    """KernelOps.attention_block (one launch after the prewrite) for 3 requests of k + 1 rows at odd positions over
    a random cache: every row against float64 softmax attention over [0, its pos] of what the cache then holds
    (EngineCache.read: the mirror dequantized, the rotation undone), the block's earlier rows and its own included."""
    m = _model(packed, "int4", cf, batch=3, capacity=96, rows=3 * (k + 1))
    c = m.config
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    m.cache.randomize(5)
    g = torch.Generator(device="cuda").manual_seed(11 + k)
    starts = [5, 30, 61]
    positions = torch.tensor([s_ + j for s_ in starts for j in range(k + 1)], dtype=torch.int32, device="cuda")
    slots = torch.tensor([i for i in range(3) for _ in range(k + 1)], dtype=torch.int32, device="cuda")
    qkv = torch.randn(len(positions), (hq + 2 * hkv) * d, generator=g, device="cuda").to(torch.bfloat16)
    out = torch.full((len(positions), hq, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    m.ops.attention_block(qkv, positions, slots, m.cache, 0, m.rope, out, k + 1)
    q, _, _ = split_rope(qkv, c, m.rope, positions)
    for r in range(len(positions)):
        kk, vv = m.cache.read(0, int(slots[r]), int(positions[r]) + 1)          # [Hkv, pos + 1, D]
        qh = q[r].double().view(hkv, hq // hkv, d)
        p = torch.softmax((qh @ kk.double().transpose(1, 2)) / d ** 0.5, dim=-1)
        ref = (p @ vv.double()).reshape(hq, d)
        err = float((out[r].double() - ref).norm() / ref.norm())
        assert err < (1e-2 if cf == "bf16" else 3e-2), (r, err)


@pytest.mark.parametrize("wf", ["int4", "bf16"])
@pytest.mark.parametrize("cf", FORMATS)
@pytest.mark.parametrize("block", ["prewrite", "columns"])
def test_kernel_block_step_follows_the_emulated_block_step_and_the_plain_steps(packed, wf, cf, block):
    """4 requests, blocks of 1..8 rows (different per request and step) up to 30 tokens: the kernel block step
    against its emulated specification and against plain kernel steps of the same tokens, within the
    tolerance of test_engine_gpu.test_kernel_step_equals_the_emulated_step (a causality, position or race bug
    is O(1))."""
    seqs = _seqs()
    got = _blocks_hidden(_model(packed, wf, cf, rows=32, block=block), seqs)
    assert torch.isfinite(got).all()
    ref = _blocks_hidden(_model(packed, wf, cf, "emulated", rows=32), seqs)
    plain = _plain_hidden(_model(packed, wf, cf), seqs)
    tol = 1.5e-2 if cf == "bf16" else 5e-2
    assert _rel(got, ref) < tol
    assert _rel(got, plain) < tol


def test_prewrite_and_columns_block_attention_agree(packed):
    seqs = _seqs()
    a = _blocks_hidden(_model(packed, "int4", "int4", rows=32, block="prewrite"), seqs)
    b = _blocks_hidden(_model(packed, "int4", "int4", rows=32, block="columns"), seqs)
    assert _rel(a, b) < 1e-2


@pytest.mark.parametrize("cf", ("int4", "e4m3"))
def test_block_rows_kernel_prewrite_equals_the_torch_prewrite(packed, cf):
    """block_attention "kernel" (the block's rows by one futx.ops.qkv_rows launch) stores the torch prewrite's
    bytes, so every step's hidden states are equal bit for bit."""
    seqs = _seqs()
    a = _blocks_hidden(_model(packed, "int4", cf, rows=32, block="prewrite"), seqs)
    b = _blocks_hidden(_model(packed, "int4", cf, rows=32, block="kernel"), seqs)
    assert torch.equal(a, b)


def test_block_graph_replay_equals_eager(packed):
    seqs = _seqs()
    eager = _model(packed, "int4", "int4", rows=32)
    m = _model(packed, "int4", "int4", rows=32)
    graphs = BlockGraphs(m, 8)
    starts = [0] * 4
    for widths in WIDTHS:
        blocks = [(s, starts[s], seqs[s][starts[s]:starts[s] + w]) for s, w in enumerate(widths[:3])]
        e = eager.load_blocks(blocks, graphs.key(3, max(widths[:3]))[1], graphs.key(3, max(widths[:3]))[0])
        eager.step(e.rows, e.width)
        eager.read_targets(e, blocks)
        g = graphs.run(blocks)
        assert (g.width, g.requests) == (e.width, e.requests) and g.targets == e.targets
        assert torch.equal(m.buffers.hidden[:g.rows], eager.buffers.hidden[:e.rows])
        for s, (_, _, t) in enumerate(blocks):
            starts[s] += len(t)


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [3], [40, 41, 42, 43, 40, 41, 42], list(range(100, 113)),
           [9, 9, 9, 9, 9], [17, 18, 17, 18, 17]]


# A verify step runs the projections at M = requests x (k + 1) rows, a plain step at M = requests: on the kernels
# those are different kernels (GEMV, tile GEMV, skinny) whose BF16 sums round differently, as a plain step's do
# at different batch sizes. Greedy outputs therefore agree token for token up to the first near-tie of the
# target's logits, where either choice is the target's argmax within rounding: the check below.
TIE = 4e-2   # a few BF16 ulps of these logits (|logit| < 1); a wrong token is O(0.1) away


def _assert_agree_up_to_ties(packed, wf, cf, prompts, want, got):
    """got == want, or each output leaves want only where the target's two choices tie within TIE (logits of a
    batch-1 plain run over the prompt and want's tokens before the divergence)."""
    for prompt, w, g in zip(prompts, want, got):
        if g == w:
            continue
        j = next(i for i, (a, b) in enumerate(zip(w, g)) if a != b)
        m = _model(packed, wf, cf, batch=1)
        seq = list(prompt) + list(w[:j])
        for p, t in enumerate(seq):
            m.run([t], [p], [0])
        logits = m.logits(m.buffers.hidden[:1])[0].float()
        gap = float(logits[w[j]] - logits[g[j]])
        assert abs(gap) <= TIE and float(logits.max() - logits[g[j]]) <= TIE, \
            (f"prompt {prompt}: token {j} is {g[j]} with drafts but {w[j]} without; the target's logits differ "
             f"by {gap:.4f} (more than rounding: a bug, not a tie)")


@pytest.mark.parametrize("wf, cf", [("int4", "int4"), ("bf16", "bf16"), ("e4m3", "e4m3")])
@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("graphs", [False, True])
def test_speculative_greedy_equals_plain_greedy_on_the_kernels(packed, wf, cf, k, graphs):
    want, _ = generate(_model(packed, wf, cf, batch=3), PROMPTS, max_new_tokens=32)
    m = _model(packed, wf, cf, batch=3, rows=3 * (k + 1))
    g = BlockGraphs(m, k + 1, max_requests=3) if graphs else None
    got, stats = generate_speculative(m, PROMPTS, 32, drafter=NgramDrafter(), num_draft=k, graphs=g)
    _assert_agree_up_to_ties(packed, wf, cf, PROMPTS, want, got)
    assert stats.acceptance.summary()["accepted"] > 0


def test_plain_steps_on_an_engine_built_for_block_steps_replay_its_width_one_graphs(packed):
    """DecodeEngine.step on block graphs (futx serve --speculative, a request without drafts; futx bench
    speculative's `none`) replays the width-1 graph, and gives the eager plain step's tokens."""
    from futx.serve.engines import DecodeEngine

    m = _model(packed, "int4", "int4", batch=4, rows=4 * 5)     # 4 rows: a bucket, no padding rows
    e = DecodeEngine(m, BlockGraphs(m, 5, max_requests=4))
    ref = _model(packed, "int4", "int4", batch=4)
    for p in range(6):
        toks = [(7 * p + s) % 512 for s in range(4)]
        got, _ = e.step(toks, [p] * 4, [0, 1, 2, 3], False)
        want = ref.run(toks, [p] * 4, [0, 1, 2, 3]).tolist()
        assert got == want


def test_scheduler_with_drafts_on_the_kernels_equals_the_plain_scheduler(weights, tmp_path):
    """The serving path (BF16 reference prefill, then block steps replayed as CUDA graphs): greedy requests get
    the plain scheduler's tokens up to near-ties of its logits; sampled ones finish with their lengths."""
    from tiny_checkpoint import save_tiny_hf

    from futx.quant.simulated import quantized_weights
    from futx.serve import SamplingParams, Scheduler
    from futx.serve.engines import DecodeEngine
    from futx.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(save_tiny_hf(tmp_path / "m", weights.to(device="cpu")))
    packed = pack_model(weights, "int4", progress=False)
    ids = [tok.encode(p) for p in ("the heat the heat the heat", "abcabcabcab", "x", "hello there hello")]
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    def engine(k):
        m = DecodeModel(packed, "int4", max_batch=2, capacity=96, backend="kernels", device="cuda",
                        max_rows=2 * (k + 1))
        g = BlockGraphs(m, k + 1, max_requests=2) if k else None
        return m, DecodeEngine(m, g, quantized_weights(weights, "bf16"))

    # plain: one request at a time, every decode row's logits recorded by position (its slot is the only one)
    m, e = engine(0)
    step, seen = e.step, {}

    def recording(tokens, positions, slots, want_logits):
        nxt, _ = step(tokens, positions, slots, False)
        lg = m.logits(m.buffers.hidden[:len(tokens)]).float()
        for i, p in enumerate(positions):
            seen[p] = lg[i]
        return nxt, lg if want_logits else None

    e.step = recording
    plain, logits = [], []
    for x in ids:
        s = Scheduler(e, tok)
        seen.clear()
        plain.append(s.submit(x, params))
        s.run_until_idle()
        logits.append(dict(seen))
    # speculative: all at once (two rows of k + 1 per step), plus a sampled request
    m5, e5 = engine(5)
    s = Scheduler(e5, tok, drafter=NgramDrafter(), num_draft=5)
    spec = [s.submit(x, params) for x in ids]
    sampled = s.submit(ids[0], SamplingParams(max_tokens=10, temperature=0.7, seed=1, ignore_eos=True))
    s.run_until_idle()
    assert len(sampled.output) == 10
    for h, hp, lgs in zip(spec, plain, logits):
        assert len(h.output) == len(hp.output) == 24
        if h.output == hp.output:
            continue
        # the first divergence must be a near-tie of the plain run's own logits at that step
        j = next(i for i, (a, b) in enumerate(zip(hp.output, h.output)) if a != b)
        lg = lgs[len(hp.prompt) - 1 + j]
        gap = float(lg[hp.output[j]] - lg[h.output[j]])
        assert gap <= TIE, f"token {j}: {h.output[j]} with drafts, {hp.output[j]} without; logit gap {gap:.4f}"


@pytest.mark.parametrize("prefill", ["reference", "kernels"])
def test_cli_generate_speculative_on_the_kernels(tmp_path, capsys, prefill):
    """futx generate --backend kernels (CUDA graphs, either prefill) with and without --speculative ngram."""
    import json

    from futx import cli

    from tiny_checkpoint import save_tiny_hf

    w = random_weights(small_config(128), seed=7, std=0.05)
    d = save_tiny_hf(tmp_path / "m", w)
    prompts = tmp_path / "p.txt"
    prompts.write_text("the heat the heat the heat\nhello there hello there\nx\n")
    runs = []
    for extra in ([], ["--speculative", "ngram", "--num-draft", "4"]):
        out = tmp_path / f"r{len(runs)}.json"
        assert cli.main(["generate", "--model", str(d), "--backend", "kernels", "--prompts", str(prompts),
                         "--max-new-tokens", "24", "--ignore-eos", "--max-batch", "4", "--json", str(out), "--prefill", prefill,
                         *extra]) == 0
        capsys.readouterr()
        runs.append(json.loads(out.read_text()))
    # token identity up to near-ties is checked where the logits are at hand (the tests above); here: the user's
    # command runs both ways, every prompt gets its tokens, the drafts are verified and mostly agree
    assert [len(o) for o in runs[0]["outputs"]] == [len(o) for o in runs[1]["outputs"]] == [24] * 3
    assert runs[1]["acceptance"]["verifications"] > 0
    same = sum(a == b for o0, o1 in zip(runs[0]["outputs"], runs[1]["outputs"]) for a, b in zip(o0, o1))
    assert same >= 24 * 3 // 3, runs


def test_dlite_drafts_replayed_as_cuda_graphs_equal_eager_drafts(weights):
    """The DLite drafter's CUDA graphs (one per requests x k) give the eager head's drafts."""
    from futx.speculative import dlite

    torch.manual_seed(0)
    head = dlite.DLiteHead(dlite.DLiteConfig.for_target(weights, k_max=4), weights).to("cuda")
    graphed, eager = dlite.DLiteDrafter(head), dlite.DLiteDrafter(head, graphs=False)
    assert graphed.graphs and not eager.graphs
    g = torch.Generator(device="cuda").manual_seed(1)
    for n, k in ((1, 4), (3, 2), (1, 4), (3, 4)):
        hidden = torch.randn(n, weights.config.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
        hist = [[int(t)] for t in torch.randint(0, 512, (n,), generator=g, device="cuda")]
        assert graphed.propose(hist, hidden, k) == eager.propose(hist, hidden, k)
    assert len(graphed._graphs) == 3
