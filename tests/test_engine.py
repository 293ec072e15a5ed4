"""The decode engine on the CPU: packed model and its files, the cache writer, the step (emulated backend)
against the simulated-quantization model, batching, graph buckets and CLI errors."""

import json

import pytest
import torch

from futx import cli
from futx.checkpoint.synthetic import random_weights, tiny_config
from futx.engine import DecodeModel, PackedModel, pack_model
from futx.engine.cache import EngineCache
from futx.engine.generate import generate
from futx.engine.graphs import bucket_of, buckets_for
from futx.engine.packed import dequantize_weight
from futx.engine.perplexity import evaluate_engine
from futx.engine.support import UnsupportedModel, check_model
from futx.eval import Runner, evaluate
from futx.quant.fold import fold_layer
from futx.quant.formats import weight_format
from futx.quant import hadamard, layouts
from futx.quant.kv_mirror import CacheMirror, quantize_int4_rows
from futx.quant.simulated import QuantSpec, simulate
from futx.reference import PackedBatch, forward_hidden

pytestmark = pytest.mark.usefixtures("single_thread")
# head dim 64 (a decode-attention size), GQA group 2, K and N on the kernels' granularity
CFG = tiny_config(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, num_hidden_layers=2, vocab_size=300)
FORMATS = ("bf16", "e4m3", "int4")


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_projections_are_the_folded_quantized_weights(weights, fmt):
    packed = pack_model(weights, fmt, progress=False)
    assert packed.group_size == 64  # K = 192 is not a multiple of 128
    quant = weight_format(fmt).fake_quantize
    for layer, p in zip(weights.layers, packed.layers):
        f = fold_layer(layer)
        g = packed.group_size
        want_qkv = torch.cat([quant(f.wq, g), quant(f.wk, g), quant(f.wv, g)])
        torch.testing.assert_close(dequantize_weight(p.qkv), want_qkv, rtol=0, atol=0)
        gu = dequantize_weight(p.gateup)
        torch.testing.assert_close(gu[0::2], quant(f.w_gate, g), rtol=0, atol=0)  # gate/up interleaved
        torch.testing.assert_close(gu[1::2], quant(f.w_up, g), rtol=0, atol=0)
        torch.testing.assert_close(dequantize_weight(p.o), quant(f.wo, g), rtol=0, atol=0)
        torch.testing.assert_close(dequantize_weight(p.down), quant(f.w_down, g), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_model_save_load_round_trip(weights, fmt, tmp_path):
    packed = pack_model(weights, fmt, progress=False)
    packed.save(tmp_path / "m")
    back = PackedModel.load(tmp_path / "m")
    assert back.config == packed.config and back.weights == fmt and back.group_size == packed.group_size
    assert back.lm_head is not back.embed  # tiny_config is untied
    for a, b in zip(packed.layers, back.layers):
        for proj in ("qkv", "o", "gateup", "down"):
            torch.testing.assert_close(dequantize_weight(getattr(a, proj)), dequantize_weight(getattr(b, proj)),
                                       rtol=0, atol=0)
    meta = json.loads((tmp_path / "m" / "futx-model.json").read_text())
    meta["layout_version"] = 999
    (tmp_path / "m" / "futx-model.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="layout"):
        PackedModel.load(tmp_path / "m")


def test_gptq_grids_pack_like_round_to_nearest(weights):
    from futx.quant.gptq import Int4Model
    from futx.quant.int4 import quantize_int4

    rtn = {}
    for i, layer in enumerate(weights.layers):
        f = fold_layer(layer)
        for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            rtn[f"layers.{i}.{name}"] = quantize_int4(getattr(f, name), 64)
    grid = Int4Model(CFG.name, 64, rtn, {k: "rtn" for k in rtn})
    a, b = pack_model(weights, "int4", gptq=grid, progress=False), pack_model(weights, "int4", progress=False)
    for la, lb in zip(a.layers, b.layers):
        for proj in ("qkv", "o", "gateup", "down"):
            assert torch.equal(getattr(la, proj).packed, getattr(lb, proj).packed)
            assert torch.equal(getattr(la, proj).scales, getattr(lb, proj).scales)
    with pytest.raises(ValueError, match="GPTQ"):
        pack_model(weights, "e4m3", gptq=grid, progress=False)


@pytest.mark.parametrize("fmt", FORMATS)
def test_cache_rows_hold_the_mirror_values(fmt, seeded):
    cache = EngineCache(CFG, fmt, slots=3, capacity=24, device="cpu")
    k = torch.randn(7, 2, 64, generator=seeded).to(torch.bfloat16)
    v = torch.randn(7, 2, 64, generator=seeded).to(torch.bfloat16)
    positions = torch.tensor([0, 1, 2, 9, 10, 11, 12])
    slots = torch.tensor([1, 1, 1, 2, 2, 2, 2])
    cache.write_rows(0, slots, positions, k, v)
    mirror = CacheMirror(fmt, rotate=fmt == "int4") if fmt != "bf16" else CacheMirror("bf16")
    rk, rv = cache.read(0, 1, 3)
    torch.testing.assert_close(rk.transpose(0, 1), mirror.row(k[:3].float()), rtol=0, atol=1e-6)
    torch.testing.assert_close(rv.transpose(0, 1), mirror.row(v[:3].float()), rtol=0, atol=1e-6)
    rk, _ = cache.read(0, 2, 13)
    torch.testing.assert_close(rk[:, 9:13].transpose(0, 1), mirror.row(k[3:].float()), rtol=0, atol=1e-6)
    assert torch.equal(cache.layers[0].k_cache[1, :, :3].transpose(0, 1), k[:3])  # main copy: the BF16 rows
    with pytest.raises(ValueError, match="overflow"):
        cache.write_rows(0, torch.tensor([0]), torch.tensor([24]), k[:1], v[:1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_cache_rows_written_head_by_head_store_the_same_bytes(fmt, seeded):
    """write_rows(heads=...) (a persistent-layer task writes its own KV head's row): each head's row is rotated,
    scaled and quantized on its own, so writing the heads one by one stores what one write of all of them does."""
    k = torch.randn(5, 2, 64, generator=seeded).to(torch.bfloat16)
    v = torch.randn(5, 2, 64, generator=seeded).to(torch.bfloat16)
    positions, slots = torch.tensor([0, 7, 8, 9, 23]), torch.tensor([0, 1, 1, 2, 3])
    a, b = (EngineCache(CFG, fmt, slots=3, capacity=24, device="cpu", keep_values=True) for _ in range(2))
    a.write_rows(0, slots, positions, k, v)
    for h in (1, 0):
        b.write_rows(0, slots, positions, k[:, h:h + 1], v[:, h:h + 1], heads=slice(h, h + 1))
    for ta, tb in zip([*a.layers[0].tensors(), *a.values[0]], [*b.layers[0].tensors(), *b.values[0]]):
        if ta is not None:
            assert torch.equal(ta.view(torch.uint8) if ta.dtype == torch.float8_e4m3fn else ta,
                               tb.view(torch.uint8) if tb.dtype == torch.float8_e4m3fn else tb)
    with pytest.raises(ValueError, match="heads slice"):
        b.write_rows(0, slots, positions, k, v, heads=slice(0, 1))


@pytest.mark.parametrize("fmt", FORMATS)
def test_mirror_rows_store_what_write_rows_stores(fmt, seeded):
    """mirror_rows (unchecked, CUDA-graph capturable: the prefill's writer) stores the bytes write_rows stores,
    and an INT4 key row lands in its block exactly where layouts.pack_int4_keys puts it (rows in any order,
    blocks partly filled)."""
    k = torch.randn(19, 2, 64, generator=seeded).to(torch.bfloat16)
    v = torch.randn(19, 2, 64, generator=seeded).to(torch.bfloat16)
    positions = torch.cat([torch.randperm(16, generator=seeded), torch.tensor([3, 4, 5])])
    slots = torch.tensor([1] * 16 + [3] * 3)   # slot 3: the scratch slot
    a, b = (EngineCache(CFG, fmt, slots=3, capacity=24, device="cpu") for _ in range(2))
    a.write_rows(0, slots, positions, k, v)
    b.layers[0].k_cache[slots, :, positions] = k
    b.layers[0].v_cache[slots, :, positions] = v
    b.mirror_rows(0, slots, positions)
    for ta, tb in zip(a.layers[0].tensors(), b.layers[0].tensors()):
        if ta is not None:
            assert torch.equal(ta.view(torch.uint8) if ta.dtype == torch.float8_e4m3fn else ta,
                               tb.view(torch.uint8) if tb.dtype == torch.float8_e4m3fn else tb)
    if fmt == "int4":
        order = torch.argsort(positions[:16])
        kq, _ = quantize_int4_rows(hadamard.rotate(k[order].float()))          # [16 tokens, Hkv, D]
        assert torch.equal(a.layers[0].k_mirror[1, :, :2], layouts.pack_int4_keys(kq.transpose(0, 1)))


def _emulated(weights, wf, cf, batch=3, capacity=48):
    return DecodeModel(pack_model(weights, wf, progress=False), cf, max_batch=batch, capacity=capacity,
                       backend="emulated", device="cpu")


@pytest.mark.parametrize("wf", FORMATS)
@pytest.mark.parametrize("cf", FORMATS)
def test_step_follows_the_simulated_model(weights, wf, cf):
    """Same function as futx.quant.simulated up to the BF16 storage of activations (which the simulated
    float32 model does not round): final hidden states agree to a few percent and greedy tokens mostly."""
    model = _emulated(weights, wf, cf)
    sim = simulate(weights, QuantSpec(decode_weights=wf, cache=cf, group_size=64))
    ref_cache = sim.new_cache(3, 48)
    toks = torch.randint(0, CFG.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    for s in range(16):
        model.run(toks[:, s].tolist(), [s] * 3, [0, 1, 2])
        h = model.buffers.hidden[:3].float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + CFG.rms_norm_eps) * weights.final_norm
        ref = forward_hidden(CFG, sim.decode, toks[:, s], PackedBatch.decode([s] * 3), ref_cache, phase="decode")
        err = float((h - ref).norm() / ref.norm())
        assert err < (0.02 if cf == "bf16" else 0.1), (s, err)


def test_batched_requests_of_different_lengths_equal_requests_alone(weights):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3], [40, 41, 42, 43]]
    model = _emulated(weights, "int4", "int4")
    together, stats = generate(model, prompts, max_new_tokens=5)
    assert stats.generated == 15 and stats.steps == 7 + 5 - 1
    alone = [generate(_emulated(weights, "int4", "int4", batch=1), [p], max_new_tokens=5)[0][0] for p in prompts]
    assert together == alone


def test_more_prompts_than_slots_take_freed_slots(weights):
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8, 9, 10], [11, 12]]
    model = _emulated(weights, "bf16", "bf16", batch=2)
    out, _ = generate(model, prompts, max_new_tokens=3)
    alone = [generate(_emulated(weights, "bf16", "bf16", batch=1), [p], max_new_tokens=3)[0][0] for p in prompts]
    assert out == alone


def test_engine_perplexity_matches_the_simulated_model(weights):
    windows = torch.randint(0, CFG.vocab_size, (3, 32), generator=torch.Generator().manual_seed(5))
    for protocol in ("all-decode", "serving"):
        model = _emulated(weights, "int4", "int4", batch=2, capacity=32)
        sim = simulate(weights, QuantSpec(decode_weights="int4", cache="int4", group_size=64))
        runner = Runner(sim.prefill, sim.decode, mirror=sim.mirror)
        ref = evaluate(runner, windows, protocol, batch_size=3, decode_chunk=4, progress=False)
        got = evaluate_engine(model, windows, protocol, weights, prefill_weights=sim.prefill)
        assert got.tokens == ref.tokens
        assert abs(got.mean_nll - ref.mean_nll) < 0.01 * ref.mean_nll


def test_buckets():
    assert buckets_for(32) == (1, 2, 4, 8, 16, 24, 32)
    assert buckets_for(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert buckets_for(12) == (1, 2, 4, 8, 12)
    assert bucket_of(3, buckets_for(32)) == 4 and bucket_of(17, buckets_for(32)) == 24
    with pytest.raises(ValueError, match="exceeds"):
        bucket_of(13, buckets_for(12))


def test_step_inputs_are_checked(weights):
    model = _emulated(weights, "bf16", "bf16", batch=2, capacity=16)
    with pytest.raises(ValueError, match="overflow"):
        model.run([1], [16], [0])
    with pytest.raises(ValueError, match="distinct"):
        model.run([1, 2], [0, 0], [1, 1])
    with pytest.raises(ValueError, match="token ids"):
        model.run([300], [0], [0])
    with pytest.raises(ValueError, match="rows"):
        model.run([1, 2, 3], [0, 0, 0], [0, 1, 2])


def test_unsupported_shapes_name_the_dimension():
    with pytest.raises(UnsupportedModel, match="head_dim = 16"):
        check_model(tiny_config())
    with pytest.raises(UnsupportedModel, match="query heads"):
        check_model(CFG.replace(num_attention_heads=32, num_key_value_heads=2))
    with pytest.raises(UnsupportedModel, match="K = 96"):
        check_model(CFG.replace(intermediate_size=96))
    with pytest.raises(UnsupportedModel, match="group size"):
        check_model(CFG.replace(hidden_size=192), "int4", 128)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, weights):
    from tiny_checkpoint import save_tiny_hf

    return save_tiny_hf(tmp_path_factory.mktemp("engine-tiny"), weights)


def test_cli_generate_and_ppl_on_the_emulated_engine(model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the heat\n\nhello there\nx\n")
    assert cli.main(["generate", "--model", str(model_dir), "--backend", "emulated", "--prompts", str(prompts),
                     "--max-new-tokens", "4", "--ignore-eos", "--max-batch", "2", "--weights", "e4m3",
                     "--cache", "int4"]) == 0
    out, err = capsys.readouterr()
    assert out.count("\n[") == 2 and out.startswith("[0] the heat") and "ms per step" in err
    text = tmp_path / "text.txt"
    text.write_text("some words to score " * 40)
    assert cli.main(["ppl", "--model", str(model_dir), "--backend", "emulated", "--text", str(text), "--window",
                     "32", "--max-windows", "2", "--protocol", "all-decode", "serving", "--no-progress",
                     "--max-batch", "2"]) == 0
    out, _ = capsys.readouterr()
    assert "| all-decode | 2 | 32 |" in out and "| serving | 2 | 32 |" in out and "reference path" in out


def test_cli_pack_then_generate_from_the_packed_directory(model_dir, tmp_path, capsys):
    out_dir = tmp_path / "packed"
    assert cli.main(["pack", "--model", str(model_dir), "--weights", "int4", "--out", str(out_dir)]) == 0
    assert (out_dir / "tokenizer.json").is_file()
    assert cli.main(["generate", "--model", str(out_dir), "--backend", "emulated", "--prompt", "the heat",
                     "--max-new-tokens", "3", "--ignore-eos"]) == 0
    a, _ = capsys.readouterr()
    assert cli.main(["generate", "--model", str(model_dir), "--backend", "emulated", "--prompt", "the heat",
                     "--max-new-tokens", "3", "--ignore-eos"]) == 0
    b, _ = capsys.readouterr()
    assert a.splitlines()[-1] == b.splitlines()[-1]
    assert cli.main(["generate", "--model", str(out_dir), "--backend", "emulated", "--weights", "bf16"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without a GPU")
def test_cli_kernels_without_a_gpu_is_a_clear_error(model_dir, capsys):
    assert cli.main(["generate", "--model", str(model_dir), "--backend", "kernels"]) == 2
    assert "Hopper" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(model_dir), "--backend", "emulated", "--max-batch", "65"]) == 2


def test_emulated_norm_linear_scales_outputs_where_the_kernels_fuse_the_row_factor(weights):
    """At M = 1 and, on this small grid, M = 3 (INT4 g128, the fused tile GEMVs) the kernel path scales the float32
    outputs by the row factor, so the emulated step does too; at M = 9 the row-factor kernel stores a normalized
    bf16 row first."""
    from decode import plan
    from futx.engine.backends import EmulatedOps, fused_norm, rms_rows, row_products
    from futx.quant.fold import rms_row_factor

    cfg = tiny_config(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, num_hidden_layers=1, vocab_size=300)
    packed = pack_model(random_weights(cfg, seed=5), "int4", progress=False)
    w = packed.layers[0].qkv
    ops = EmulatedOps()
    gen = torch.Generator().manual_seed(0)
    for m in (1, 3, 9):
        x = (torch.randn(m, 256, generator=gen) * 3).bfloat16()
        assert fused_norm(x, w, "store") == plan.fuses_norm("int4", 128, "store", m, *w.shape) == (m < 9)
        y = ops.norm_linear(x, w, "store", 1e-5)
        if m < 9:
            want = (row_products(x.float(), dequantize_weight(w).T) * rms_row_factor(x, 1e-5)[:, None]).bfloat16()
        else:
            want = ops.linear(rms_rows(x, 1e-5), w, "store")
        assert torch.equal(y, want)


def test_emulated_projection_rows_do_not_depend_on_the_batch():
    """EmulatedOps' float32 products take each row alone (backends.row_products), so a verify step's rows round
    as the plain step's do, whatever the CPU's GEMM does with more rows."""
    from futx.engine.backends import EmulatedOps

    cfg = tiny_config(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, num_hidden_layers=1, vocab_size=300)
    w = pack_model(random_weights(cfg, seed=6), "int4", progress=False).layers[0].gateup
    ops = EmulatedOps()
    x = (torch.randn(7, 256, generator=torch.Generator().manual_seed(1)) * 2).bfloat16()
    whole = ops.norm_linear(x, w, "swiglu", 1e-5)
    assert torch.equal(whole, torch.cat([ops.norm_linear(x[i:i + 1], w, "swiglu", 1e-5) for i in range(7)]))
