"""Host side of the CUDA-graph prefill (futx.engine.prefill_graphs): row buckets and the padded batch metadata."""

import pytest
import torch

from futx.engine.prefill_graphs import MetaLayout, row_buckets


def test_row_buckets():
    assert row_buckets(512) == (16, 32, 64, 128, 256, 512)
    assert row_buckets(1000) == (16, 32, 64, 128, 256, 512, 768, 1000)
    assert row_buckets(100) == (16, 32, 64, 100)
    assert row_buckets(8) == (8,)
    with pytest.raises(ValueError):
        row_buckets(0)


def test_padded_batch_metadata():
    """Real rows first, then one padding request in the scratch slot at positions 0.., then empty requests."""
    lay = MetaLayout(rows=16, requests=4)
    buf = torch.full((lay.size,), -1, dtype=torch.int32)
    tokens = torch.tensor([5, 6, 7, 8, 9])
    lay.fill(buf, tokens, [3, 2], [0, 10], [1, 0], bucket=8, scratch=7)
    v = lay.views(buf, 8)
    assert v["tokens"].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert v["row_slot"].tolist() == [1, 1, 1, 0, 0, 7, 7, 7]
    assert v["row_pos"].tolist() == [0, 1, 2, 10, 11, 0, 1, 2]
    assert v["cu"].tolist() == [0, 3, 5, 8, 8]
    assert v["start"].tolist() == [0, 10, 0, 0]
    assert v["slot"].tolist() == [1, 0, 7, 7]
    assert v["last"].tolist() == [2, 4, 0, 0]
    # an exact fit: the padding request is empty
    lay.fill(buf, torch.arange(8), [8], [3], [2], bucket=8, scratch=7)
    v = lay.views(buf, 8)
    assert v["cu"].tolist() == [0, 8, 8, 8, 8] and v["row_pos"].tolist() == list(range(3, 11))
    assert all(a % 4 == 0 for a, _ in lay.spans.values())   # 16-byte aligned views


def test_capture_buckets_order_and_pool(monkeypatch):
    """The capture loop both graph runners share (futx.engine.graphs.capture_buckets), with torch.cuda stubbed:
    largest bucket first, inputs prepared before the warm-up, warm-up on the capture stream, then one capture
    per bucket, each after the first in the pool of the one before (torch hands back the same pool)."""
    import contextlib

    from futx.engine import graphs as g

    log = []

    class Graph:
        def __init__(self):
            self.id = len([e for e in log if e[0] == "graph"])
            log.append(("graph", self.id))

        def pool(self):
            return f"pool{self.id}"

    class Stream:
        def synchronize(self):
            log.append(("sync",))

    @contextlib.contextmanager
    def graph(gr, pool=None, stream=None):
        log.append(("capture", gr.id, pool))
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(g, "fresh_cublas_workspace", lambda: log.append(("fresh",)))
    out = g.capture_buckets([8, 32, 16], Stream(), lambda b: log.append(("prepare", b)),
                            lambda b: log.append(("body", b)), warmup=2)
    assert list(out) == [32, 16, 8]
    assert log[:8] == [("prepare", 32), ("body", 32), ("body", 32), ("sync",), ("fresh",), ("graph", 0),
                       ("capture", 0, None), ("body", 32)]
    assert ("capture", 1, "pool0") in log and ("capture", 2, "pool1") in log
