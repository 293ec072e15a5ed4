"""The paged engine cache on the CPU: the cache writers and readers through the block table, and the emulated
engine (packed prefill in chunks, then decode steps) giving the same tokens paged as contiguous, pages assigned
at random."""

import pytest
import torch

from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.engine import DecodeModel, pack_model
from futx.engine.cache import EngineCache
from futx.engine.prefill import PrefillModel, pack_prefill, prefill_tokens
from futx.paging import PageLayout

pytestmark = pytest.mark.usefixtures("single_thread")
CFG = tiny_config(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, num_hidden_layers=2, vocab_size=300)
FORMATS = ("bf16", "e4m3", "int4")
P = 128


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=3)


def random_pages(gen, pages, slots, per_slot):
    perm = torch.randperm(pages, generator=gen).tolist()
    return [perm[i * per_slot:(i + 1) * per_slot] for i in range(slots)]


def plain(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("keep", (False, True))
def test_paged_cache_stores_and_reads_what_the_contiguous_cache_does(fmt, keep, seeded):
    lay = PageLayout.for_capacity(P, pages=9, slots=2, capacity=3 * P)
    flat = EngineCache(CFG, fmt, 2, 3 * P, "cpu", keep_values=keep)
    paged = EngineCache(CFG, fmt, 2, 3 * P, "cpu", keep_values=keep, layout=lay)
    owned = random_pages(seeded, 9, 2, 3)
    owned[1] = owned[1][:2]                  # slot 1 holds positions [0, 256) only
    for s, pages in enumerate(owned):
        paged.set_pages(s, pages)
    n = 300
    slots = torch.tensor([0] * n + [1] * 200)
    positions = torch.cat([torch.randperm(n, generator=seeded), torch.arange(200)])
    k = torch.randn(len(slots), 2, 64, generator=seeded).to(torch.bfloat16)
    v = torch.randn(len(slots), 2, 64, generator=seeded).to(torch.bfloat16)
    for c in (flat, paged):
        c.write_rows(1, slots, positions, k, v)
    for s, length in ((0, n), (1, 200), (0, 17)):
        for a, b in zip(flat.read(1, s, length), paged.read(1, s, length)):
            assert torch.equal(a, b)
    if keep:
        rows = torch.tensor([1, 0, 1])
        for a, b in zip(flat.attended_values(1, rows, 250), paged.attended_values(1, rows, 250)):
            assert torch.equal(a[0, :, :200], b[0, :, :200]) and torch.equal(a[1], b[1])
    # each page holds its positions' bytes exactly as the slot holds them
    pg = owned[0][1]
    for ta, tb in zip(flat.layers[1].tensors(), paged.layers[1].tensors()):
        if ta is not None:
            per = tb.shape[2]
            assert torch.equal(plain(ta)[0, :, per:2 * per], plain(tb)[pg])
    with pytest.raises(ValueError, match="has no page"):
        paged.write_rows(0, torch.tensor([1]), torch.tensor([3 * P - 1]), k[:1], v[:1])
    with pytest.raises(ValueError, match="table row holds 3"):
        paged.set_pages(0, [0, 1, 2, 3])


def _engine(weights, paged, slots=3, capacity=3 * P, pages=9):
    packed = pack_model(weights, "int4", progress=False)
    model = DecodeModel(packed, "int4", max_batch=slots, capacity=capacity, backend="emulated", device="cpu",
                        pages=pages if paged else None)
    pm = PrefillModel(pack_prefill(weights, "e4m3"), model.cache, "emulated", initial_amax=8.0)
    return model, pm


def _run(model, pm, prompts, cut, steps):
    """Chunked prefill of prompt[:-1] (the first chunk cut[b] tokens), then greedy decode steps."""
    slots = list(range(len(prompts)))
    prefill_tokens(pm, [p[:c] for p, c in zip(prompts, cut)], slots=slots)
    prefill_tokens(pm, [p[c:-1] for p, c in zip(prompts, cut)], starts=cut, slots=slots)
    toks = [p[-1] for p in prompts]
    pos = [len(p) - 1 for p in prompts]
    out = [[] for _ in prompts]
    for _ in range(steps):
        nxt = model.run(toks, pos, slots).tolist()
        for o, t in zip(out, nxt):
            o.append(t)
        toks, pos = nxt, [p + 1 for p in pos]
    return out


def test_paged_engine_gives_the_contiguous_tokens(weights):
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in (260, 131, 40)]
    cut = [150, 128, 7]
    flat = _run(*_engine(weights, False), prompts, cut, 6)
    model, pm = _engine(weights, True)
    for s, pages in enumerate(random_pages(gen, 9, 3, 3)):
        model.cache.set_pages(s, pages)
    assert _run(model, pm, prompts, cut, 6) == flat


def test_the_kernels_take_a_paged_cache_unless_switched_off(weights, monkeypatch):
    """KERNELS_PAGED (on since the paged kernels merged) is the switch: off, the kernel ops refuse a paged cache
    before touching it; on, the check passes (the kernels themselves: tests/test_decode_attention_paged_gpu.py)."""
    from futx.engine import backends

    model, _ = _engine(weights, True, slots=1, pages=3)
    assert backends.KERNELS_PAGED
    backends.check_kernel_cache(model.cache)
    monkeypatch.setattr(backends, "KERNELS_PAGED", False)
    backends.check_kernel_cache(_engine(weights, False, slots=1)[0].cache)   # contiguous: always fine
    with pytest.raises(ValueError, match="paged KV cache is not built into the decode kernels"):
        backends.KernelOps.attention(None, None, None, None, model.cache, 0, None, None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, weights):
    from tiny_checkpoint import save_tiny_hf

    return save_tiny_hf(tmp_path_factory.mktemp("paged-tiny"), weights)


def test_cli_generate_on_one_page_gives_the_default_outputs(model_dir, tmp_path, capsys):
    """futx generate --pages 1: the prompts take turns on the one page (admission by pages), same tokens."""
    import json

    from futx import cli

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the heat\nhello there\nx\n")
    outs = []
    for extra in ([], ["--pages", "1"], ["--pages", "1", "--no-prefix-cache", "--page-size", "256"]):
        out = tmp_path / f"gen{len(outs)}.json"
        assert cli.main(["generate", "--model", str(model_dir), "--backend", "emulated", "--prompts", str(prompts),
                         "--max-new-tokens", "4", "--ignore-eos", "--max-batch", "2", "--json", str(out),
                         *extra]) == 0
        outs.append(json.loads(out.read_text())["outputs"])
    capsys.readouterr()
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 3


def test_cli_generate_on_the_int4_only_cache_gives_the_default_outputs(model_dir, tmp_path, capsys):
    """futx generate --cache-main none: prompts prefilled on staging pages, decoded on mirror-only pages."""
    import json

    from futx import cli

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the heat\nhello there\nx\n")
    outs = []
    for extra in (["--pages", "4"], ["--cache-main", "none", "--pages", "2"],
                  ["--cache-main", "none", "--cache", "e4m3", "--staging-pages", "1", "--cache-memory", "0.01"]):
        out = tmp_path / f"gen{len(outs)}.json"
        assert cli.main(["generate", "--model", str(model_dir), "--backend", "emulated", "--prompts", str(prompts),
                         "--max-new-tokens", "4", "--ignore-eos", "--max-batch", "2", "--json", str(out),
                         *extra]) == 0
        outs.append(json.loads(out.read_text())["outputs"])
    capsys.readouterr()
    assert outs[0] == outs[1] and len(outs[0]) == len(outs[2]) == 3
