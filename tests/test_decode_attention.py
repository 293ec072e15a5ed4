"""Decode attention on the CPU: the kernel's index maps and bit tricks, emulated lane by lane, reproduce
q.K^T and V from the packed cache bytes (INT4 via futx.quant.layouts, E4M3 natural order); the split
rule; host-side validation. The sm_90a compile / SASS check of every variant is tests/test_kernel_compile.py
(HMMA present, no local-memory spills)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decode.attn_plan import (E4M3_PAIR_SELECTORS, AttnPlan, check_int4_key_formulas, choose_splits,
                              default_plan, int4_value_pairs, step_splits)
from futx.quant import layouts
from futx.runtime import select
from futx.runtime.catalog.decode_attention import ENGINE_CACHES, SPECS, TUNING, VARIANTS, attn_key, qkv_key


# ---- mma.sync.m16n8k16 fragment semantics (PTX ISA) -----------------------------------------------------
def a_coord(lane, reg, half):
    """(row, k) of A-fragment register `reg` (0..3), half `half`, of a 16x16 tile."""
    g, t = divmod(lane, 4)
    return g + 8 * (reg % 2), 2 * t + 8 * (reg // 2) + half


def lut_pair(byte):
    return layouts.int4_byte_lut_fp16()[int(byte)].float().tolist()


def prmt(a, b, sel):
    x = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    return sum(((x >> (8 * ((sel >> (4 * j)) & 7))) & 0xFF) << (8 * j) for j in range(4))


def e4m3_pair(word16, table):
    return [table[word16 & 0xFF], table[word16 >> 8]]


E4M3_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().tolist()


def word(row_bytes: np.ndarray, w: int) -> int:
    return int.from_bytes(bytes(row_bytes[4 * w:4 * w + 4].tolist()), "little")


@pytest.mark.parametrize("d", [64, 128])
def test_int4_key_formulas_follow_layouts(d):
    frag = check_int4_key_formulas(d)  # raises on any disagreement with futx.quant.layouts
    assert len(frag) == d // 8


def _tuning_space():
    from tuning import tuning_space

    return tuning_space()


TUNING_SPECS = _tuning_space().attention_specs()


@pytest.mark.parametrize("spec", list(SPECS) + TUNING_SPECS, ids=lambda s: s.key)
def test_every_variant_has_consistent_maps(spec):
    """Registry entries and tuning-space variants alike: valid index maps, shared memory within the SM's, and
    key = the variant whose overrides the params are (registry: only the default kernels and the engine's)."""
    p = dict(spec.param_dict)
    fmt, d, rotate = p.pop("fmt"), p.pop("head_dim"), p.pop("rotate")
    plan = default_plan(fmt, d, rotate, **p)
    plan.check_maps()
    assert plan.smem_bytes <= 227 * 1024
    page = p.pop("page_size", 0)  # a paged cache's entry: the same plan, addressed through a block table
    assert plan.page_size == page and ("page_size" in spec.param_dict) == (page > 0)
    if p.pop("fused_qkv", False):  # the engine's entry: the default plan, q/k/v from the QKV output
        mirror_only = p.pop("mirror_only", False)   # its INT4-only cache twin (no main-copy row)
        pdl = p.pop("pdl", False)                   # the decode step's dependent launch (rule E5)
        assert plan.mirror_only == mirror_only and (not mirror_only or (page and fmt != "bf16")) and plan.pdl == pdl
        assert not p and spec.key == qkv_key(fmt, d, rotate, page, mirror_only, pdl) and spec in SPECS
        return
    variant = [k for k, v in VARIANTS.items() if v == p]
    assert len(variant) == 1 and attn_key(fmt, d, rotate, variant[0], page) == spec.key
    assert (spec in SPECS) == (variant[0] == ""), "only the default kernels are in the registry; variants are tuning space"


def test_registry_is_exactly_what_the_op_launches():
    """Every decode-attention registry entry is a kernel the ops launch without `variant=` (the default kernel
    of each format, head dim and rotation the op accepts; the engine's fused-QKV entry for its cache formats),
    and every such launch has a registry entry. The INT4 variants are tuning space (scripts/tuning_space.py)."""
    from futx.ops.decode_attention import FORMATS, resolve
    from futx.runtime.catalog.decode_attention import PAGE_SIZES

    launched = set()
    for page in (0, 128):  # contiguous and paged at the default page size: every format, head dim, rotation
        for fmt in FORMATS:
            for d in (64, 128):
                for rotate in (False, True):
                    if rotate and fmt == "bf16":
                        continue  # check_inputs: the BF16 main cache is never rotated
                    variant, plan = resolve(fmt, d, rotate, "", page)
                    launched.add(attn_key(fmt, d, rotate, variant, plan.page_size))
        launched |= {qkv_key(fmt, d, rotate, page) for fmt, rotate in ENGINE_CACHES for d in (64, 128)}
    launched |= {attn_key("int4", 128, True, page_size=256), qkv_key("int4", 128, True, 256)}  # page-size study
    # the engine's entry on the INT4-only cache (a main copy of fewer pages than the mirror) for its mirror formats
    launched |= {qkv_key(fmt, d, rotate, 128, mirror_only=True) for fmt, rotate in ENGINE_CACHES if fmt != "bf16"
                 for d in (64, 128)}
    # the engine's head-dim-128 entries again as the decode step's dependent launch (futx.engine.backends, rule E5)
    launched |= {key + ".pdl" for key in launched if ".qkv" in key and ".d128." in key}
    assert {s.key for s in SPECS} == launched and PAGE_SIZES == (128, 256)
    tuning = {s.key for s in TUNING_SPECS}
    assert {s.key for s in select("decode.attn*")} - tuning == {s.key for s in SPECS}  # the package registry
    assert tuning == {attn_key("int4", 128, True, v) for v in TUNING} and not tuning & launched
    assert len(SPECS) == 2 * 16 + 2 + 4 + 9  # (10 default kernels + the engine's 3 cache formats x 2 head dims) x
    #                                      (contiguous, 128-position pages) + the 8B INT4 pair at 256 + the
    #                                      engine's mirror-only entries (INT4 / E4M3 x 2 head dims) + the 9 head-dim-128
    #                                      engine entries' dependent-launch twins


@pytest.mark.parametrize("spec", list(SPECS) + TUNING_SPECS, ids=lambda s: s.key)
def test_entry_declares_exactly_its_tensors(spec):
    """The kernel takes one AttnTensors; every compile entry declares exactly the tensors of the one table
    (attn_plan.entry_tensors, which the op launches from), then the softmax scale and the stream, and its fake
    arguments follow the same order. Fields an entry does not declare stay None (no placeholder tensors)."""
    import inspect

    from decode.attention import AttnTensors, DecodeAttention, compile_target
    from decode.attn_plan import ATTN_TENSORS, entry_tensors

    assert AttnTensors._fields == ATTN_TENSORS
    p = spec.param_dict
    fn, fake = compile_target(**p)
    names = entry_tensors(p["fmt"], p.get("fused_qkv", False), p.get("page_size", 0) > 0)
    assert set(names) <= set(ATTN_TENSORS) and len(set(names)) == len(names)
    assert tuple(inspect.signature(fn).parameters) == (*names, "softmax_scale", "stream")
    assert len(fake) == len(names) + 2
    plan = default_plan(p["fmt"], p["head_dim"], p["rotate"],
                        **{k: v for k, v in p.items() if k not in ("fmt", "head_dim", "rotate")})
    t = DecodeAttention(plan).tensors(**{n: n for n in names})
    assert [f for f in ATTN_TENSORS if getattr(t, f) is not None] == sorted(names, key=ATTN_TENSORS.index)
    with pytest.raises(TypeError):
        DecodeAttention(plan).tensors(**{n: n for n in reversed(names)})


def test_variant_resolution():
    """The op launches the default kernel unless a variant is named: INT4 "pair" dequantization of keys and
    values (no table) with lean issue; the table kernel ("table") and the other variants are tuning space
    (scripts/tuning_space.py) and exist only for rotated INT4 at head dim 128."""
    from futx.ops.decode_attention import resolve

    variant, plan = resolve("int4", 128, True, "")
    assert variant == "" and (plan.k_dequant, plan.v_dequant, plan.lean_issue) == ("pair", "pair", True)
    assert not plan.uses_lut and plan.lut_bytes == 0
    table = resolve("int4", 128, True, "table")[1]
    assert (table.k_dequant, table.v_dequant, table.lean_issue) == ("lut", "alu", False) and table.uses_lut
    for fmt in ("e4m3", "bf16"):  # the dequantization choices are INT4-only; other formats are unchanged
        p = default_plan(fmt, 128)
        assert not p.lean_issue and not p.uses_pair and not p.uses_lut
    with pytest.raises(ValueError, match="does not exist"):
        resolve("int4", 64, True, "fx")
    assert attn_key("int4", 128, True, "table") not in {s.key for s in SPECS}  # tuning space


@pytest.mark.parametrize("d", [64, 128])
def test_int4_fragments_reproduce_scores_and_values(d):
    """Emulate the INT4 path for one 16-token step: key bytes in layout order -> table -> B fragments,
    query A fragments from the plan's channel map, and value words -> nibble pairs -> table -> V^T A
    fragments; compare with q.K^T and V computed directly."""
    plan = default_plan("int4", d, False, **VARIANTS["table"])
    rng = np.random.default_rng(d)
    q = rng.integers(-7, 8, (8, d))
    k = rng.integers(-7, 8, (16, d))
    v = rng.integers(-7, 8, (16, d))
    kp = layouts.pack_int4_keys(torch.tensor(k)).numpy()      # [2 blocks, 32 lanes, D/8]
    vp = layouts.pack_int4_values(torch.tensor(v)).numpy()    # [16, D/2]

    a_q = np.zeros((plan.ktiles, 16, 16))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for tile in range(plan.ktiles):
            for r in range(2):
                ch = plan.q_channel(tile, r, t)
                for h in range(2):
                    a_q[tile, g, 2 * t + 8 * r + h] = q[g, ch + h]
    for kb in range(2):
        b = np.zeros((plan.ktiles, 16, 8))
        for lane in range(32):
            for byte, (tile, reg) in enumerate(plan.int4_key_frag):
                for h, val in enumerate(lut_pair(kp[kb, lane, byte])):
                    kk, n = layouts.b_fragment_coord(lane, reg, h)
                    b[tile, kk, n] = val
        s = sum(a_q[tile] @ b[tile] for tile in range(plan.ktiles))
        np.testing.assert_array_equal(s[:8], q @ k[8 * kb:8 * kb + 8].T)

    # the kernel's S^T = K Q^T: A (16 tokens) = (block0 reg0, block1 reg0, block0 reg1, block1 reg1),
    # B = the query registers of column g
    st = np.zeros((16, 8))
    for tile in range(plan.ktiles):
        a_k, b_q = np.zeros((16, 16)), np.zeros((16, 8))
        for lane in range(32):
            g, t = divmod(lane, 4)
            where = {frag: byte for byte, frag in enumerate(plan.int4_key_frag)}
            regs = [lut_pair(kp[blk, lane, where[(tile, r)]]) for r, blk in ((0, 0), (0, 1), (1, 0), (1, 1))]
            for reg, pair in enumerate(regs):
                for h, val in enumerate(pair):
                    a_k[a_coord(lane, reg, h)] = val
            for r in range(2):
                for h in range(2):
                    kk, n = layouts.b_fragment_coord(lane, r, h)
                    b_q[kk, n] = q[g, plan.q_channel(tile, r, t) + h]
        st += a_k @ b_q
    np.testing.assert_array_equal(st, k @ q.T)

    a_v = np.full((plan.ktiles, 16, 16), np.nan)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for cc in range(plan.value_passes()):
            w = [word(vp[tok], plan.value_word(g, cc)) for tok in plan.value_tokens(t)]
            lo01, hi01 = int4_value_pairs(w[0], w[1])
            lo23, hi23 = int4_value_pairs(w[2], w[3])
            for i in range(4):
                for reg, src in enumerate((lo01, hi01, lo23, hi23)):
                    for h, val in enumerate(lut_pair((src >> (8 * i)) & 0xFF)):
                        a_v[4 * cc + i][a_coord(lane, reg, h)] = val
    for mt in range(plan.ktiles):
        for row in range(16):
            ch = plan.out_channel(mt, row // 8, row % 8)
            np.testing.assert_array_equal(a_v[mt, row], v[:, ch], err_msg=f"tile {mt} row {row}")


@pytest.mark.parametrize("d", [64, 128])
def test_e4m3_fragments_reproduce_scores_and_values(d):
    """E4M3 keys through the swizzled stage layout and the chunk map, values through prmt pairs."""
    plan = AttnPlan("e4m3", d, tile_tokens=16)
    rng = np.random.default_rng(d + 1)
    q = rng.integers(-4, 5, (8, d)).astype(np.float64)
    kq = torch.randn(16, d).to(torch.float8_e4m3fn)
    vq = torch.randn(16, d).to(torch.float8_e4m3fn)
    k, v = kq.float().numpy(), vq.float().numpy()
    kb_, vb = kq.view(torch.uint8).numpy(), vq.view(torch.uint8).numpy()

    stage = np.zeros(plan.k_region, dtype=np.uint8)  # as issue() lays the keys out
    for row in range(16):
        for chunk in range(plan.k_row_bytes // 16):
            off = plan.k_smem_offset(row, chunk)
            stage[off:off + 16] = kb_[row, 16 * chunk:16 * chunk + 16]
    a_q = np.zeros((plan.ktiles, 16, 16))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for tile in range(plan.ktiles):
            for r in range(2):
                for h in range(2):
                    a_q[tile, g, 2 * t + 8 * r + h] = q[g, plan.q_channel(tile, r, t) + h]
    for kb in range(2):
        b = np.zeros((plan.ktiles, 16, 8))
        for lane in range(32):
            g, t = divmod(lane, 4)
            for i in range(plan.key_chunks()):
                off = plan.k_smem_offset(kb * 8 + g, t + 4 * i)
                chunk = stage[off:off + 16]
                for j in range(8):  # each 16-bit pair -> one f16x2 register
                    tile, reg = plan.key_frag(i, j)
                    for h in range(2):
                        kk, n = layouts.b_fragment_coord(lane, reg, h)
                        b[tile, kk, n] = E4M3_TABLE[int(chunk[2 * j + h])]
        s = sum(a_q[tile] @ b[tile] for tile in range(plan.ktiles))
        np.testing.assert_allclose(s[:8], q @ k[8 * kb:8 * kb + 8].T, rtol=0, atol=1e-9)

    a_v = np.full((plan.ktiles, 16, 16), np.nan)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for cc in range(plan.value_passes()):
            w = [word(vb[tok], plan.value_word(g, cc)) for tok in plan.value_tokens(t)]
            for e, sel in enumerate(E4M3_PAIR_SELECTORS):
                p01, p23 = prmt(w[0], w[1], sel), prmt(w[2], w[3], sel)
                regs = [p01 & 0xFFFF, p01 >> 16, p23 & 0xFFFF, p23 >> 16]
                for reg, r16 in enumerate(regs):
                    for h, val in enumerate(e4m3_pair(r16, E4M3_TABLE)):
                        a_v[2 * cc + e][a_coord(lane, reg, h)] = val
    for mt in range(plan.ktiles):
        for row in range(16):
            np.testing.assert_array_equal(a_v[mt, row], v[:, plan.out_channel(mt, row // 8, row % 8)])


def test_split_rule():
    p = default_plan("int4", 128)
    assert choose_splits(p, 32, 8, 4096) == 1          # 256 CTAs already fill 132 SMs twice
    assert choose_splits(p, 8, 8, 32768) >= 4          # 64 (sequence, head) pairs need splitting
    assert choose_splits(p, 1, 8, 1024) * p.warps <= -(-1024 // p.tile_tokens)  # >= 1 tile per warp
    assert choose_splits(p, 1, 8, 1) == 1


def test_step_split_rule_one_cta_per_sm():
    """Rule A8: the engine step's INT4 attention at up to 8 rows takes the split count that fills the SMs once
    (8 KV heads: 128 CTAs on 132 SMs) where the standalone rule fills them twice; other formats and larger
    batches keep the standalone rule."""
    from futx.ops.decode_attention import auto_splits

    p = default_plan("int4", 128, True)
    for batch, context, standalone, step in [(1, 1024, 8, 8), (1, 8192, 32, 16), (1, 16384, 32, 16),
                                             (2, 8192, 16, 8), (4, 8192, 8, 4), (8, 1024, 4, 2), (8, 8192, 4, 2)]:
        assert choose_splits(p, batch, 8, context) == standalone
        assert step_splits(p, batch, 8, context) == step
        assert batch * 8 * step <= 132 < batch * 8 * standalone or step == standalone
        assert auto_splits(p, True, batch, 8, context, 132) == step
        assert auto_splits(p, False, batch, 8, context, 132) == standalone
    for batch in (16, 32):
        assert step_splits(p, batch, 8, 8192) == choose_splits(p, batch, 8, 8192)
    for fmt in ("e4m3", "bf16"):
        q = default_plan(fmt, 128, fmt != "bf16")
        assert step_splits(q, 1, 8, 8192) == choose_splits(q, 1, 8, 8192)


def test_host_position_checks():
    from futx.ops.decode_attention import check_positions

    pos = torch.tensor([3, 63], dtype=torch.int32)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    check_positions(pos, slots, 64, 2)
    with pytest.raises(ValueError, match="overflow"):
        check_positions(torch.tensor([3, 64], dtype=torch.int32), slots, 64, 2)
    with pytest.raises(ValueError, match="negative position"):
        check_positions(torch.tensor([-1, 0], dtype=torch.int32), slots, 64, 2)
    with pytest.raises(ValueError, match="share a cache slot"):
        check_positions(pos, torch.tensor([1, 1], dtype=torch.int32), 64, 2)
    with pytest.raises(ValueError, match="slot out of range"):
        check_positions(pos, torch.tensor([0, 2], dtype=torch.int32), 64, 2)


def test_plan_rejects_unsupported_configs():
    with pytest.raises(ValueError, match="head dim"):
        AttnPlan("int4", 96)
    with pytest.raises(ValueError, match="never rotated"):
        AttnPlan("bf16", 128, rotate=True)
    with pytest.raises(ValueError, match="dequantization"):
        AttnPlan("int4", 128, k_dequant="alu")  # keys: table or "pair" only


def _f16x2(word):
    return np.array([word & 0xFFFF, word >> 16], dtype=np.uint16).view(np.float16).astype(np.float64)


def _fma_f16x2(x, m, a):
    """fma.rn.f16x2 on values that are exact in f16 (the kernel's only use)."""
    return _f16x2(x) * _f16x2(m) + _f16x2(a)


def test_arithmetic_dequantization_matches_the_table():
    """The prmt/lop3/f16x2 value dequantization (v_dequant "alu", the "table" variant) gives the table's values."""
    from decode.ptx import ALU_CONSTANTS as C

    rng = np.random.default_rng(5)
    for _ in range(200):
        w0, w1 = (int(x) for x in rng.integers(0, 2 ** 32, 2, dtype=np.uint64))
        x0, x1 = w0 ^ 0x88888888, w1 ^ 0x88888888
        for byte in range(4):
            # values: byte of two tokens -> (even channel of both, odd channel of both)
            x = prmt(x0, x1, byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12))
            even = _f16x2((x & C["v_lo"]) | C["magic"]) - _f16x2(C["v_sub"])
            odd = _fma_f16x2((x & C["v_hi"]) | C["magic"], C["v_mul"], C["v_add"])
            b0, b1 = (w0 >> (8 * byte)) & 0xFF, (w1 >> (8 * byte)) & 0xFF
            assert even.tolist() == [lut_pair(b0)[0], lut_pair(b1)[0]]
            assert odd.tolist() == [lut_pair(b0)[1], lut_pair(b1)[1]]


def _sub_f16x2(x, c):
    """sub.f16x2 of bit patterns x and c (exact for the kernel's operands)."""
    return _f16x2(x) - _f16x2(c)


def _pair_key_regs(w, c):
    """ptx.int4_word_to_f16x2x4_pair on one word: four (low, high) value pairs."""
    s = w >> 8
    return [_sub_f16x2((w & 0x000F000F) ^ c["p_lo"], c["p_lo"]), _sub_f16x2((w & 0x00F000F0) ^ c["p_hi"], c["p_hi"]),
            _sub_f16x2((s & 0x000F000F) ^ c["p_lo"], c["p_lo"]), _sub_f16x2((s & 0x00F000F0) ^ c["p_hi"], c["p_hi"])]


def _pair_value_regs(w0, w1, byte, c):
    """ptx.int4_token_pair_to_f16x2_pair: (even channel of both tokens, odd channel of both tokens)."""
    x = prmt(w0, w1, byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12))
    return _sub_f16x2((x & 0x000F000F) ^ c["p_lo"], c["p_lo"]), _sub_f16x2((x & 0x00F000F0) ^ c["p_hi"], c["p_hi"])


def _alu_value_regs(w0, w1, byte, c):
    """ptx.int4_token_pair_to_f16x2_alu (the default's values) on raw words."""
    x = prmt(w0 ^ 0x88888888, w1 ^ 0x88888888, byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12))
    even = _f16x2((x & c["v_lo"]) | c["magic"]) - _f16x2(c["v_sub"])
    odd = _fma_f16x2((x & c["v_hi"]) | c["magic"], c["v_mul"], c["v_add"])
    return even, odd


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("variant", ["table", ""])
def test_int4_arithmetic_fragments_reproduce_scores_and_values(d, variant):
    """Emulate, lane by lane, the arithmetic paths for one 16-token step: the table kernel's values (prmt +
    xor + lop3 + f16 ops) and the default's "pair" keys (nibbles 16 bits apart, query permuted through
    plan.q_pair) and values; compare with q.K^T and V computed directly."""
    from decode.ptx import ALU_CONSTANTS as C

    plan = default_plan("int4", d, True, **VARIANTS[variant])
    plan.check_maps()
    rng = np.random.default_rng(d + 3)
    q = rng.integers(-7, 8, (8, d))
    k = rng.integers(-7, 8, (16, d))
    v = rng.integers(-7, 8, (16, d))
    kp = layouts.pack_int4_keys(torch.tensor(k)).numpy()      # [2 blocks, 32 lanes, D/8]
    vp = layouts.pack_int4_values(torch.tensor(v)).numpy()    # [16, D/2]

    if plan.k_dequant == "pair":
        st = np.zeros((16, 8))
        for tile in range(plan.ktiles):
            a_k, b_q = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
            for lane in range(32):
                g, t = divmod(lane, 4)
                regs = {}
                for blk in range(2):
                    for r in range(2):
                        j, m, _ = plan.int4_pair_map[(tile, r)]
                        regs[(blk, r)] = _pair_key_regs(word(kp[blk, lane], j), C)[m]
                # A fragment of 16 tokens: (block 0 reg 0, block 1 reg 0, block 0 reg 1, block 1 reg 1)
                for reg, key in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
                    for h in range(2):
                        a_k[a_coord(lane, reg, h)] = regs[key][h]
                for r in range(2):  # as query_fragments builds it: two aligned f16-pair words, one prmt
                    lb, hb, step, sel = plan.q_pair_loads(tile, r)
                    qrow = q[g].astype(np.float16).view(np.uint16).astype(np.int64)
                    lo_w = int(qrow[lb + step * t] | (qrow[lb + step * t + 1] << 16))
                    hi_w = int(qrow[hb + step * t] | (qrow[hb + step * t + 1] << 16))
                    pair = _f16x2(prmt(lo_w, hi_w, sel))
                    for h in range(2):
                        kk, n = layouts.b_fragment_coord(lane, r, h)
                        b_q[kk, n] = pair[h]
                        assert pair[h] == q[g, plan.q_pair(tile, r, t)[h]]
            st += a_k @ b_q
        np.testing.assert_array_equal(st, k @ q.T)

    a_v = np.full((plan.ktiles, 16, 16), np.nan)
    regs_of = _pair_value_regs if plan.v_dequant == "pair" else _alu_value_regs
    for lane in range(32):
        g, t = divmod(lane, 4)
        for cc in range(plan.value_passes()):
            w = [word(vp[tok], plan.value_word(g, cc)) for tok in plan.value_tokens(t)]
            for i in range(4):
                e01, o01 = regs_of(w[0], w[1], i, C)
                e23, o23 = regs_of(w[2], w[3], i, C)
                for reg, pair in enumerate((e01, o01, e23, o23)):
                    for h in range(2):
                        a_v[4 * cc + i][a_coord(lane, reg, h)] = pair[h]
    for mt in range(plan.ktiles):
        for row in range(16):
            ch = plan.out_channel(mt, row // 8, row % 8)
            np.testing.assert_array_equal(a_v[mt, row], v[:, ch], err_msg=f"tile {mt} row {row}")


def test_pair_constants_decode_every_nibble():
    """(n & 15) ^ 8 under the f16 exponents of 1024 (bits 0-3) and 64 (bits 4-7), minus 1032 / 72, is n."""
    from decode.ptx import ALU_CONSTANTS as C

    for n in range(-8, 8):
        u = n & 15
        lo = (u | (u << 16)) ^ C["p_lo"]
        hi = ((u << 4) | (u << 20)) ^ C["p_hi"]
        assert _sub_f16x2(lo, C["p_lo"]).tolist() == [n, n]
        assert _sub_f16x2(hi, C["p_hi"]).tolist() == [n, n]


@pytest.mark.parametrize("d,block", [(128, 128), (64, 64), (128, 32)])
def test_warp_butterfly_is_bitwise_the_library_rotation(d, block):
    """The kernel's rotation (decode.hadamard_warp: lane l holds channels [n l, n l + n), register stages
    then shuffle stages, one multiply by float32(1/sqrt(block))) run on 32 emulated lanes in float32
    equals futx.quant.hadamard.rotate bit for bit: the cache rows the kernel writes can match the
    library's packer exactly."""
    hw = pytest.importorskip("decode.hadamard_warp")  # imports the DSL
    from futx.quant import hadamard

    x = torch.randn(64, d, generator=torch.Generator().manual_seed(d + block)).bfloat16().float()
    x[0, :4] = torch.tensor([3.0, -3.0, 1e-3, 7.5])  # a few exact values among the random ones
    want = hadamard.rotate(x, block).numpy()
    lanes, n = np.arange(32), d // 32
    for row in range(x.shape[0]):
        regs = [x[row].numpy().reshape(32, n)[:, i].astype(np.float32) for i in range(n)]
        out = hw.butterfly(regs, lanes, block, shuffle=lambda v, m: v[lanes ^ m], select=np.where)
        got = np.stack(out, axis=1).reshape(-1) * np.float32(hw.inv_sqrt(block))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32), want[row].view(np.uint32), err_msg=f"row {row}")
