"""The greedy-argmax kernel (engine.argmax_rows, rule E7) against torch.argmax, exactly: random logits with planted
ties (before and after the first maximum, across CTA boundaries), NaNs, rows of -inf, padded row strides, odd row
counts, repeated calls (its counters left at zero), CUDA-graph replay, and the engine's step with E7 on."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _run(x):
    import futx.ops  # noqa: F401  (registers torch.ops.futx.*)

    out = torch.full((x.shape[0],), -7, dtype=torch.int64, device=x.device)   # poisoned
    torch.ops.futx.argmax_rows_(x, out)
    return out


def _planted(m, v, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, v, generator=g, device="cuda").to(torch.bfloat16)
    for r in range(m):
        kind = r % 5
        top = x[r].max() + 1
        if kind == 1 and v > 1:      # the same maximum in two CTAs (or twice in one at small V)
            a, b = sorted(torch.randint(0, v, (2,), generator=g, device="cuda").tolist())
            x[r, a] = x[r, b] = top
        elif kind == 2:              # a NaN beats every number
            x[r, int(torch.randint(0, v, (1,), generator=g, device="cuda"))] = float("nan")
        elif kind == 3:              # all -inf: index 0
            x[r] = float("-inf")
        elif kind == 4 and v > 2048:  # ties at the two sides of a CTA boundary
            x[r, 2047] = x[r, 2048] = top
    return x


@pytest.mark.parametrize("v", [8, 64, 2048, 2056, 49152, 128256])
@pytest.mark.parametrize("m", [1, 3, 8, 33])
def test_equals_torch_argmax(m, v):
    x = _planted(m, v, seed=m * 1000 + v)
    want = torch.argmax(x, dim=-1)
    for _ in range(3):   # the counters must be back at zero after each call
        assert torch.equal(_run(x), want)


def test_padded_row_stride_and_quantized_like_ties():
    buf = torch.randint(-3, 4, (6, 4104), device="cuda").to(torch.bfloat16)   # many exact ties
    x = buf[:, :4096]
    assert torch.equal(_run(x), torch.argmax(x, dim=-1))


def test_graph_replay():
    import futx.ops  # noqa: F401  (registers torch.ops.futx.*)

    x = _planted(4, 128256, seed=5)
    out = torch.full((4,), -7, dtype=torch.int64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.futx.argmax_rows_(x, out)   # warm-up: the workspace exists before capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            torch.ops.futx.argmax_rows_(x, out)
    torch.cuda.current_stream().wait_stream(s)
    for seed in (6, 7, 8):
        x.copy_(_planted(4, 128256, seed=seed))
        out.fill_(-7)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.argmax(x, dim=-1))


def test_graph_captured_without_a_warm_up_on_its_stream():
    """A capture on a stream with no workspace yet gets one of the graph's own (its counters zeroed in the graph)."""
    import futx.ops  # noqa: F401  (registers torch.ops.futx.*)

    x = _planted(3, 49152, seed=9)
    assert torch.equal(_run(x), torch.argmax(x, dim=-1))   # eager on this stream: the kernel loaded
    out = torch.full((3,), -7, dtype=torch.int64, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):   # torch's own capture stream
        torch.ops.futx.argmax_rows_(x, out)
    for seed in (10, 11):
        x.copy_(_planted(3, 49152, seed=seed))
        out.fill_(-7)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.argmax(x, dim=-1))


def test_step_with_the_argmax_kernel(monkeypatch):
    """E7 on: the same logits and next tokens as torch.argmax's step, and the kernel ran."""
    import futx.ops.argmax_rows as am
    from futx.checkpoint.synthetic import random_weights
    from futx.engine import DecodeModel, pack_model

    from engine_gpu_model import small_config

    weights = random_weights(small_config(128), seed=7, std=0.05).to(device="cuda")
    calls = []
    kernel_op = am.argmax_rows_
    monkeypatch.setattr(am, "argmax_rows_", lambda x, out: (calls.append(x.shape), kernel_op(x, out)))
    toks = torch.randint(0, 512, (3, 5), generator=torch.Generator().manual_seed(6))
    out = []
    for kernel in (False, True):
        m = DecodeModel(pack_model(weights, "int4", progress=False), "int4", max_batch=3, capacity=64, device="cuda",
                        keep_logits=True)
        m.ops.argmax_kernel = kernel
        steps = []
        for s in range(toks.shape[1]):
            m.step(m.load_inputs(toks[:, s].tolist(), [2 + s, 9 + s, 30 + s], [0, 1, 2]))
            steps.append((m.buffers.next_tokens[:3].clone(), m.buffers.logits[:3].clone()))
        out.append(steps)
    assert len(calls) == toks.shape[1]
    for (t0, l0), (t1, l1) in zip(*out):
        assert torch.equal(l1, l0) and torch.equal(t1, t0)
        assert torch.equal(t1, torch.argmax(l1, dim=-1))
