"""Real futx ops under torch.compile(fullgraph=True) and CUDA-graph capture (issue 6)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def int4_case():
    import futx.ops  # noqa: F401
    from futx.quant.int4 import quantize_int4

    g = torch.Generator().manual_seed(7)
    w = torch.randn(256, 512, generator=g) * 0.05
    q = quantize_int4(w, group_size=128)
    x = torch.randn(1, 512, generator=g).bfloat16()
    ref = (x.double() @ q.dequantize(torch.float64).T).float()
    return q.packed.cuda(), q.scales.cuda(), x.cuda(), ref.cuda()


def _close(got, ref):
    err = (got.float() - ref).norm() / ref.norm()
    assert torch.isfinite(got.float()).all() and err < 1e-2, f"relative error {err:.3g}"


def test_decode_linear_int4_under_torch_compile(int4_case):
    packed, scales, x, ref = int4_case

    @torch.compile(fullgraph=True)
    def f(x):
        y = torch.ops.futx.decode_linear_int4(x, packed, scales, 128, "store", None)
        return y.float() * 2.0

    _close(f(x) / 2.0, ref)


def test_decode_linear_int4_in_cuda_graph(int4_case):
    packed, scales, x, ref = int4_case
    static_x = x.clone()
    torch.ops.futx.decode_linear_int4(static_x, packed, scales, 128, "store", None)  # load outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.futx.decode_linear_int4(static_x, packed, scales, 128, "store", None)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _close(out, ref)
