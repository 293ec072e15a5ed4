"""The evaluation hot loops run on the "meta" device: no host read of a device value (a GPU sync: it
raises on meta tensors) and no CPU tensor mixed into device arithmetic (it raises too). This is how
the CPU CI checks the code paths the GPU run (scripts/gpu/quality_gpu.sh) takes on CUDA."""

import importlib.util
from pathlib import Path

import pytest
import torch

from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.eval import Runner
from futx.eval.perplexity import window_nll
from futx.kvcache import KVCache
from futx.quant.kv_mirror import CacheMirror
from futx.reference import PackedBatch, block
from futx.reference.model import tokens_checked
from futx.rope import cos_sin

pytestmark = pytest.mark.usefixtures("single_thread")
CFG = tiny_config(vocab_size=300, intermediate_size=128)
META = torch.device("meta")


class _Bar:
    def update(self, n):
        pass


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=1).to(device=META)


@pytest.mark.parametrize("protocol,chunk", [("gptq", 4), ("serving", 1), ("all-decode", 5)])
@pytest.mark.parametrize("mirror", [None, CacheMirror("bf16")], ids=["no-mirror", "bf16-mirror"])
def test_perplexity_windows_make_no_host_reads(weights, protocol, chunk, mirror):
    tokens = torch.randint(0, CFG.vocab_size, (3, 16)).to(META)
    with tokens_checked():
        out = window_nll(Runner(weights, mirror=mirror), tokens, protocol, chunk, _Bar())
    assert out.device == META and out.shape == ()


def test_quality_table_scoring_makes_no_host_reads(weights):
    spec = importlib.util.spec_from_file_location("qt_meta", Path(__file__).resolve().parents[1] / "scripts"
                                                  / "quality_table.py")
    qt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qt)
    runner = Runner(weights, mirror=CacheMirror("bf16"))
    tokens = torch.randint(0, CFG.vocab_size, (2, 16)).to(META)
    sums = torch.zeros(3, dtype=torch.float64, device=META)
    with tokens_checked():
        for protocol in ("all-decode", "serving"):
            for hidden, tgt in qt.scored_hidden(runner, tokens, protocol, 6):
                qt.score_rows(sums, weights.output_weight, hidden, tgt, hidden, 5)
                qt.score_rows(sums, weights.output_weight, hidden, tgt, None, 5)


def test_quantized_cache_mirror_reads_only_its_nan_check(weights):
    """The INT4/E4M3 mirrors check their rows for NaN/Inf (one host read per layer and call), nothing else."""
    k = torch.zeros(4, CFG.num_key_value_heads, CFG.head_dim, device=META)
    with pytest.raises((NotImplementedError, RuntimeError)) as e:
        CacheMirror("int4", rotate=True)(0, k, k)
    assert "meta" in str(e.value).lower() or "item" in str(e.value).lower()


def test_reference_block_on_uniform_batches(weights):
    """GPTQ calibration and the per-layer study drive `block` directly on uniform batches."""
    one = CFG.replace(num_hidden_layers=1)
    b, w = 3, 12
    batch = PackedBatch.from_lengths([w] * b, device=META)
    cache = KVCache(one, b, w, device=META)
    x = torch.zeros(b * w, CFG.hidden_size, device=META)
    y = block(one, weights.layers[0], 0, x, batch, cache, "prefill", cos_sin(CFG, batch.row_position))
    dec = PackedBatch.from_lengths([4] * b, [8] * b, device=META)
    block(one, weights.layers[0], 0, y.view(b, w, -1)[:, 8:].reshape(-1, CFG.hidden_size), dec, cache, "decode")
