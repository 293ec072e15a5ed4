"""The persistent kernel's task loop (decode/persistent_loop.py, tuning-space key decode.persistent.chain) on the
GPU: a chain of rounds whose tiles read three tiles of the round before, written by other CTAs, ordered only by one
counter; the result equals the torch reference bit for bit (a missing acquire, release or L1 bypass shows as stale
values), for 1..264 resident CTAs, and the counter ends at rounds x tiles."""

import sys
from pathlib import Path

import pytest
import torch

from decode import persistent_host as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def chain():
    import tuning_space

    from futx.runtime import get_kernel

    tuning_space.register()
    return get_kernel("decode.persistent.chain")


@pytest.mark.parametrize("layers,tiles,ctas", [(1, 1, 1), (5, 7, 3), (40, 132, 132), (40, 264, 264), (12, 300, 77)])
def test_chain_equals_the_reference(chain, layers, tiles, ctas):
    table, counters = pl.chain_table(layers, tiles, ctas)
    x = torch.full((layers + 1, tiles * pl.THREADS), float("nan"), device="cuda")
    x[0] = torch.randn(tiles * pl.THREADS, device="cuda") * 1e-3
    want = pl.chain_reference(x[0].cpu(), layers)
    for _ in range(3):   # again on the same buffers: the counters zeroed before each launch
        counters = counters.cuda().zero_()
        chain(table.cuda(), counters, x)
        torch.cuda.synchronize()
        assert torch.equal(x.cpu(), want)
        assert counters.item() == layers * tiles
        x[1:].fill_(float("nan"))
