"""Runtime on the GPU: the op path, CUDA-graph capture, torch.compile, and AOT == JIT bit for bit."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops():
    import futx.ops  # noqa: F401

    return torch.ops.futx


def _xy(n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, device="cuda", generator=g).bfloat16()
    y = torch.randn(n, device="cuda", generator=g).bfloat16()
    return x, y


@pytest.mark.parametrize("n", [1, 255, 256, 1000003])
def test_axpy_matches_torch(ops, n):
    x, y = _xy(n, n)
    want = (2.5 * x.float() + y.float()).bfloat16()
    ops.axpy_(x, y, 2.5)
    torch.cuda.synchronize()
    assert torch.equal(y, want)


def test_axpy_rejects_bad_input_before_launch(ops):
    x, y = _xy(64, 0)
    with pytest.raises(TypeError, match="dtype"):
        ops.axpy_(x.float(), y, 1.0)
    with pytest.raises(ValueError, match="shape"):
        ops.axpy_(x[:32], y, 1.0)
    with pytest.raises(ValueError, match="CUDA"):
        ops.axpy_(x.cpu(), y, 1.0)


def test_axpy_in_cuda_graph(ops):
    x, y = _xy(4096, 1)
    y0 = y.clone()
    ops.axpy_(x, y, 1.0)  # load/compile outside capture
    y.copy_(y0)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            ops.axpy_(x, y, 1.0)
    torch.cuda.current_stream().wait_stream(stream)
    y.copy_(y0)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    want = y0.float()
    for _ in range(3):
        want = (x.float() + want).bfloat16().float()
    assert torch.equal(y.float(), want)


def test_axpy_under_torch_compile(ops):
    x, y = _xy(512, 2)

    @torch.compile(fullgraph=True)
    def f(x, y):
        z = y * 1.0
        ops.axpy_(x, z, 3.0)
        return z

    got = f(x, y)
    torch.cuda.synchronize()
    assert torch.equal(got, (3.0 * x.float() + y.float()).bfloat16())


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None or not os.environ.get("FUTX_AOT_DIR"),
                    reason="needs both the DSL (JIT) and an AOT directory")
def test_aot_and_jit_identical():
    from futx.runtime import compile_spec, get_spec
    from futx.runtime.loader import _try_artifacts, device_arch

    spec = get_spec("smoke.axpy.bf16")
    aot = _try_artifacts(spec, device_arch())
    assert aot is not None, "no valid AOT artifact for smoke.axpy.bf16 in FUTX_AOT_DIR"
    jit = compile_spec(spec)
    x, y = _xy(100003, 3)
    y_aot, y_jit = y.clone(), y.clone()
    aot(x, y_aot, 1.5)
    jit(x, y_jit, 1.5)
    torch.cuda.synchronize()
    assert torch.equal(y_aot, y_jit)
