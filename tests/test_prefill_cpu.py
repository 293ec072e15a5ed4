"""Prefill GEMM on the CPU: policy protocol, catalog <-> policy consistency, the tile rule, op input
validation, the SwiGLU register permutation, and SASS facts of a representative variant.
(Every shipped variant is compiled for sm_90a by tests/test_kernel_compile.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from futx.runtime.catalog import prefill as cat

REPO = Path(__file__).resolve().parents[1]


# ---- catalog (DSL-free) ----------------------------------------------------------------------------
def test_registry_holds_the_shipped_chains_at_the_rule_variants():
    from epilogues import catalog as chains
    from futx.runtime import select

    specs = {s.key: s for s in cat.SPECS}   # (the registry also holds entries other tests added on demand)
    want = {cat.kernel_key(ab, name, v) for ab, names in cat.SHIPPED.items() for name in names for v in cat.VARIANTS}
    assert set(specs) == want
    assert set(specs) <= {s.key for s in select("prefill.gemm.*")}
    # CI budget: ~5 s per variant with two jobs (whole CI ~13 min at 60; the paged QKV chains, issue 28, add 12)
    assert len(specs) <= 72
    assert {n for names in cat.SHIPPED.values() for n in names} == set(chains.CHAINS)
    # every registered variant is one the rule can pick, and the rule picks only registered variants
    picked = {cat.choose_variant(m, n, 132) for m in (1, 64, 128, 512, 2048, 8192) for n in (512, 2048, 4096, 28672)}
    assert picked == set(cat.VARIANTS)
    assert not set(cat.TUNING) & set(cat.VARIANTS)


def test_tuning_variants_join_on_demand():
    spec = cat.spec_for("e4m3", "scale_bf16", "n256.pp.g16")
    assert spec.key == "prefill.gemm.e4m3.scale_bf16.n256.pp.g16" and dict(spec.params)["group_m"] == 16
    assert cat.spec_for("e4m3", "scale_bf16", "n256.pp.g16") is spec
    assert {s.key for s in cat.tuning_specs()} >= {spec.key, "prefill.gemm.bf16.bf16.n256.st"}
    with pytest.raises(ValueError, match="unknown prefill epilogue"):
        cat.spec_for("e4m3", "gelu_bf16", "n256.pp")
    with pytest.raises(ValueError, match="bad prefill variant"):
        cat.spec_for("e4m3", "scale_bf16", "n64")


def test_variant_names():
    assert cat.Variant.parse("n256") == cat.Variant(256, "coop", 2)
    assert cat.Variant.parse("n128.pp") == cat.Variant(128, "pingpong", 2)
    assert cat.Variant.parse("n256.c1") == cat.Variant(256, "coop", 1)
    assert cat.kernel_key("e4m3", "scale_bf16", "n256") == "prefill.gemm.e4m3.scale_bf16"
    assert cat.Variant.parse("n256.pp.g16") == cat.Variant(256, "pingpong", 2, 16)
    assert cat.Variant.parse("n256.pp.c1").name == "n256.pp.c1"
    assert cat.kernel_key("e4m3", "scale_bf16", "n256.pp") == "prefill.gemm.e4m3.scale_bf16.n256.pp"
    assert "group_m" not in dict(cat._spec("e4m3", "scale_bf16", "n256.pp").params)  # default: key unchanged
    v = cat.Variant.parse("n256.pp.c2x2")
    assert (v.cluster_m, v.cluster_n, v.cluster_size, v.name) == (2, 2, 4, "n256.pp.c2x2")
    assert dict(cat._spec("e4m3", "scale_bf16", "n256.pp.c2x2").params)["cluster_n"] == 2
    assert "cluster_n" not in dict(cat._spec("e4m3", "scale_bf16", "n256.pp").params)
    for bad in ("256", "n64", "n256.xx", "n256.c4", "n256.pp.pp2", "n256.g8", "n256.g3", "n256.g16.pp",
                "n256.c2x1", "n256.c2x4", "n256.cx2"):
        with pytest.raises(ValueError, match="bad prefill variant"):
            cat.Variant.parse(bad)


def test_tile_rule():
    # pingpong 64x256 wherever the launch has waves of tiles: the coop tile's rate, its fixed costs hidden
    assert cat.choose_variant(8192, 8192, 132) == "n256.pp"
    assert cat.choose_variant(4096, 28672, 132) == "n256.pp"
    assert cat.choose_plan(512, 28672, 4096, "bf16", 132) == ("n256.pp", 1)
    assert cat.choose_plan(2048, 4096, 4096, "bf16", 132) == ("n256.pp", 1)
    pp, coop, n128, pp128 = (cat.Variant.parse(v) for v in ("n256.pp", "n256", "n128", "n128.pp"))
    assert cat._waves(pp, 8192, 8192, 132, 64) < cat._waves(coop, 8192, 8192, 132, 64)
    # few tiles: 64x128 pingpong tiles halve each CTA's share (measured 1B O at M = 512, E4M3: 6.3 us vs
    # 8.9 coop 128x128 and 9.0 pingpong 64x256; at M = 128 1.5-1.8x cuBLAS on 1B/8B QKV, O and down)
    assert cat.choose_plan(512, 2048, 2048, "e4m3", 132) == ("n128.pp", 1)
    assert cat.choose_plan(128, 6144, 4096, "bf16", 132) == ("n128.pp", 1)
    assert cat.choose_plan(128, 8192, 28672, "e4m3", 132) == ("n128.pp", 1)
    assert cat._waves(pp128, 512, 2048, 132, 16) < min(cat._waves(pp, 512, 2048, 132, 16),
                                                       cat._waves(n128, 512, 2048, 132, 16))
    # two or more 64x128 tiles per CTA cost more than the 128x128 coop tiles (8B O at M = 512: 14.3 us vs 16.0)
    assert cat.choose_plan(512, 4096, 4096, "e4m3", 132) == ("n128", 1)
    # coop 128x256 never beats pingpong 64x256 (so it is tuning space, not shipped)
    assert all(cat.choose_variant(m, n, 132, ("n256.pp", "n256")) == "n256.pp"
               for m in range(64, 9000, 192) for n in range(256, 30000, 1792))


def test_split_k_rule():
    # split-K only where a coop launch leaves SMs idle over a long K: 1B down BF16 at M = 512 (32 clusters of
    # 128x128 on 66 slots, 128 k-tiles) runs 2 splits; launches of a wave or more, and pingpong, never split
    assert cat.choose_plan(512, 2048, 8192, "bf16", 132) == ("n128", 2)
    assert cat.choose_plan(8192, 8192, 8192, "e4m3", 132) == ("n256.pp", 1)
    assert list(cat.split_options("n256.pp", 8192, "e4m3")) == [1]
    assert list(cat.split_options("n128.pp", 8192, "e4m3")) == [1]
    # at least MIN_SPLIT_K_TILES k-tiles per split, at most MAX_SPLITS
    assert list(cat.split_options("n128", 1024, "e4m3")) == [1, 2]          # 8 k-tiles
    assert max(cat.split_options("n128", 65536, "bf16")) == cat.MAX_SPLITS
    assert cat.choose_splits("n128", 64, 256, 256, "bf16", 132) == 1       # 4 k-tiles: nothing to split
    # a partial last wave: 8B QKV BF16 at M = 512 is 96 clusters of 128x128 on 66 slots: one whole wave, the
    # other 30 tiles in two splits (measured 40.4 us vs 46.2 for 64x128 pingpong and 47.3 for 64x256)
    assert cat.choose_plan(512, 6144, 4096, "bf16", 132) == ("n128", 2)
    n128 = cat.Variant.parse("n128")
    assert cat._waves(n128, 512, 6144, 132, 64, 2) < cat._waves(n128, 512, 6144, 132, 64, 1)
    # M = 0 launches nothing; choosing for it must not fail (a split of zero tiles)
    assert cat.choose_plan(0, 4096, 4096, "bf16", 132)[0] in cat.VARIANTS
    assert cat.whole_tiles(0, 2, 66) == 0 and cat.whole_tiles(96, 2, 66) == 66 and cat.whole_tiles(32, 2, 66) == 0
    # without K the rule is the one without split-K at UNKNOWN_K
    kt = cat.k_tiles(cat.UNKNOWN_K, "e4m3")
    for m in (1, 512, 4096):
        for n in (256, 2048, 28672):
            t = {v: cat._waves(cat.Variant.parse(v), m, n, 132, kt) for v in cat.VARIANTS}
            assert t[cat.choose_variant(m, n, 132)] == min(t.values())


def test_rule_matches_the_measured_sweeps():
    """Over the saved sweeps (docs/prefill/), the rule's pick is on average within 1% of the fastest measured
    variant, and never more than 12% slower (scripts/fit_prefill_rule.py prints the table)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import fit_prefill_rule as fit

    for losses in fit.pick_losses(fit.load_sweeps(fit.SWEEPS)).values():
        assert sum(losses.values()) / len(losses) < 0.01 and max(losses.values()) < 0.12


def test_chains_are_the_single_declaration():
    """What the op validates and the kernel key come from the chain: no table restates a policy."""
    from epilogues import catalog as chains

    scale = chains.chain("scale_rho_swiglu_fp8")
    assert [a.name for a in scale.args()] == ["a_scale", "b_scale", "rho", "scale", "amax", "saturated"]
    assert scale.out == "e4m3" and scale.n_ratio == 2 and scale.writes() == ("amax", "saturated")
    qkv = chains.chain("scale_rho_qkv128_bf16")
    assert qkv.writes() == ("k_cache", "v_cache")
    assert qkv.out_width(8 * 128, {"k_cache": _t(1, 2, 4, 128)}) == 4 * 128     # D = Q: N minus K and V heads
    assert chains.chain("swiglu_bf16").out_width(512, {}) == 256


def test_declarations_import_without_the_dsl():
    """An AOT-only machine (no DSL) validates, keys and loads kernels of shipped and composed chains."""
    code = textwrap.dedent(f"""
        import sys; sys.modules["cutlass"] = None; sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
        from futx.ops import prefill
        from futx.runtime.catalog.prefill import chain_name, spec_for
        import prefill_user_policy as user
        chain = user.scale_bias_bf16()
        assert chain_name(chain).startswith("chain-") and [a.name for a in chain.args()][-1] == "bias"
        assert spec_for("e4m3", chain, "n256.pp").extra is chain
    """)
    res = subprocess.run([sys.executable, "-c", code], timeout=300, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]


def test_composed_chain_keys_follow_source_and_parameters(tmp_path, monkeypatch):
    """Editing a policy, or composing it with other parameters, names a different kernel (never a stale
    one); a composition equal to a shipped chain uses the shipped kernels."""
    from epilogues.base import Chain
    from epilogues.scale import ScaleRestore
    from epilogues.store import StoreBF16

    assert cat.chain_name(Chain(ScaleRestore(), StoreBF16())) == "scale_bf16"
    assert cat.chain_name(Chain(ScaleRestore(rho=True), StoreBF16())) == "scale_rho_bf16"
    src = (REPO / "tests" / "prefill_user_policy.py").read_text()
    mod = tmp_path / "my_policy.py"
    mod.write_text(src)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    first = importlib.import_module("my_policy")
    key1 = cat.chain_name(first.scale_bias_bf16())
    edited = src.replace("frag.vals[i] + state.bias", "frag.vals[i] - state.bias")
    assert edited != src
    mod.write_text(edited)                                                     # an edited policy
    os.utime(mod, ns=(1, 10**18))
    second = importlib.reload(first)
    key2 = cat.chain_name(second.scale_bias_bf16())
    assert key1.startswith("chain-") and key2.startswith("chain-") and key1 != key2
    other = Chain(ScaleRestore(rho=True), second.BiasAdd(), StoreBF16())        # other static parameters
    assert cat.chain_name(other) not in (key1, key2)
    spec = cat.spec_for("e4m3", other, "n256.pp")
    assert spec.key == f"prefill.gemm.e4m3.{cat.chain_name(other)}.n256.pp" and spec.extra is other
    assert cat.chain_of(cat.chain_name(other)) is other


def test_chain_rules():
    pytest.importorskip("cutlass")
    sys.path.insert(0, str(REPO))
    from epilogues.base import Chain
    from epilogues.fp8_store import StoreFP8
    from epilogues.scale import ScaleRestore
    from epilogues.store import StoreBF16
    from epilogues.swiglu import SwiGLU

    with pytest.raises(ValueError, match="must end with a store"):
        Chain(ScaleRestore())
    with pytest.raises(ValueError, match="only the last step"):
        Chain(StoreBF16(), StoreFP8())
    with pytest.raises(ValueError, match="at most one pair"):
        Chain(SwiGLU(), SwiGLU(), StoreBF16())
    with pytest.raises(ValueError, match="layout"):
        SwiGLU("diagonal")
    from epilogues.residual import ResidualAdd
    with pytest.raises(ValueError, match="after the pair step"):
        Chain(ResidualAdd(), SwiGLU(), StoreBF16())
    c = Chain(ScaleRestore(rho=True), SwiGLU("split"), StoreFP8())
    assert c.n_ratio == 2 and c.pre[0].rho and c.post == () and c.key() == "scale_abrho+swiglu_split+fp8"
    assert repr(c) == "Chain(ScaleRestore, SwiGLU, StoreFP8)"


# ---- op validation (no GPU: the device check is bypassed, CPU tensors stand in) --------------------
@pytest.fixture
def check(monkeypatch):
    """prefill._check by (chain name, variant) instead of kernel key."""
    from futx.ops import checks, prefill

    monkeypatch.setattr(checks, "cuda", lambda name, t, device=None: None)

    def run(a, w, out, name, variant, args):
        key = cat.spec_for(prefill._AB[a.dtype], name, variant).key
        prefill._check(a, w, out, key, args)
        return key
    return run


def _t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


def test_validation_accepts_good_input(check):
    a, w = _t(70, 256, dtype=torch.float8_e4m3fn), _t(512, 256, dtype=torch.float8_e4m3fn)
    out = _t(70, 256, dtype=torch.float8_e4m3fn)
    args = [_t(70), _t(512), _t(70), _t(1), _t(1), _t(1, dtype=torch.int32)]
    assert check(a, w, out, "scale_rho_swiglu_fp8", "n256", args) == "prefill.gemm.e4m3.scale_rho_swiglu_fp8"
    assert check(a, w, out, "scale_rho_swiglu_fp8", "n256.pp", args) == "prefill.gemm.e4m3.scale_rho_swiglu_fp8.n256.pp"
    assert check(a, w, out, "scale_rho_swiglu_fp8", "n256.pp.g16", args) == \
        "prefill.gemm.e4m3.scale_rho_swiglu_fp8.n256.pp.g16"


@pytest.mark.parametrize("case,err,match", [
    ("k_align", ValueError, "K .* multiple of 16"),
    ("k_zero", ValueError, "K = 0"),
    ("n_align", ValueError, "N .* multiple of 32"),
    ("dtype", TypeError, "w must have dtype"),
    ("out_shape", ValueError, "out must have shape"),
    ("count", ValueError, "takes 1 tensors"),
    ("rho_dtype", TypeError, "rho must have dtype float32"),
    ("noncontig", ValueError, "contiguous"),
    ("split", ValueError, "split SwiGLU needs I"),
    ("policy", ValueError, "unknown prefill epilogue"),
])
def test_validation_rejects(check, case, err, match):
    m, n, k = 64, 512, 256
    a, w = _t(m, k, dtype=torch.bfloat16), _t(n, k, dtype=torch.bfloat16)
    out = _t(m, n // 2, dtype=torch.bfloat16)
    pol, tile, args = "rho_swiglu_bf16", "n256", [_t(m)]
    if case == "k_align":
        a, w = _t(m, 200, dtype=torch.bfloat16), _t(n, 200, dtype=torch.bfloat16)
    elif case == "k_zero":
        a, w = _t(m, 0, dtype=torch.bfloat16), _t(n, 0, dtype=torch.bfloat16)
    elif case == "n_align":
        w, out = _t(n - 16, k, dtype=torch.bfloat16), _t(m, (n - 16) // 2, dtype=torch.bfloat16)
    elif case == "dtype":
        w = w.to(torch.float8_e4m3fn)
    elif case == "out_shape":
        out = _t(m, n, dtype=torch.bfloat16)
    elif case == "count":
        args = [_t(m), _t(m)]
    elif case == "rho_dtype":
        args = [_t(m, dtype=torch.bfloat16)]
    elif case == "noncontig":
        a = _t(k, m, dtype=torch.bfloat16).T
    elif case == "split":
        pol, w, out, args = "swiglu_split_bf16", _t(320, k, dtype=torch.bfloat16), _t(m, 160, dtype=torch.bfloat16), []
    elif case == "policy":
        pol = "gelu_bf16"
    with pytest.raises(err, match=match):
        check(a, w, out, pol, tile, args)


def _qkv_args(m, slots=3, hkv=2, cap=64, hd=128, pos=None):
    pos = torch.arange(m, dtype=torch.int32) if pos is None else pos
    return [_t(m), _t(128 * (4 + 2 * hkv)), _t(m), _t(hd // 2), torch.zeros(m, dtype=torch.int32), pos,
            _t(slots, hkv, cap, hd, dtype=torch.bfloat16), _t(slots, hkv, cap, hd, dtype=torch.bfloat16)]


def test_qkv_validation(check):
    m, k, hkv, hd = 40, 256, 2, 128
    n = (4 + 2 * hkv) * hd                             # 4 Q heads + 2 K + 2 V
    a, w = _t(m, k, dtype=torch.float8_e4m3fn), _t(n, k, dtype=torch.float8_e4m3fn)
    q = _t(m, 4 * hd, dtype=torch.bfloat16)
    pol = "scale_rho_qkv128_bf16"
    assert check(a, w, q, pol, "n256", _qkv_args(m)) == "prefill.gemm.e4m3.scale_rho_qkv128_bf16"
    with pytest.raises(ValueError, match="KV cache overflow"):
        check(a, w, q, pol, "n256", _qkv_args(m, pos=torch.arange(m, dtype=torch.int32) + 30))
    with pytest.raises(ValueError, match="out must have shape"):      # Q one head too narrow
        check(a, w, _t(m, 3 * hd, dtype=torch.bfloat16), pol, "n256", _qkv_args(m))
    with pytest.raises(ValueError, match="need N = Hq"):               # no room for a Q head
        check(a, w[: 4 * hd], _t(m, 0, dtype=torch.bfloat16), pol, "n256", _qkv_args(m)[:1] + [_t(4 * hd)] + _qkv_args(m)[2:])
    bad = _qkv_args(m)
    bad[-1] = _t(3, hkv, 32, hd, dtype=torch.bfloat16)                  # V cache shaped unlike K
    with pytest.raises(ValueError, match="v_cache must have shape"):
        check(a, w, q, pol, "n256", bad)
    bad = _qkv_args(m)
    bad[-2] = _t(3, hkv, 64, 64, dtype=torch.bfloat16)                  # head_dim 64 cache, qkv128 policy
    with pytest.raises(ValueError, match="k_cache must have shape"):
        check(a, w, q, pol, "n256", bad)


def test_rope_partner_registers():
    """QKVPlacement's register facts (epilogues/qkv.py): in the WGMMA accumulator layout register i of
    lane q holds row slot (i // 2) % 2 and column 8 (i // 4) + 2 q + i % 2, so channel c < hd/2 of a
    head and its rotate-half partner c + hd/2 are registers i and i + hd/4 of the same thread."""
    for hd in (64, 128, 256):
        for q in range(4):
            col = lambda i: 8 * (i // 4) + 2 * q + i % 2
            for i in range(256 // 2):                  # tile_n = 256: 128 registers per thread
                if col(i) % hd < hd // 2:
                    j = i + hd // 4
                    assert col(j) == col(i) + hd // 2 and (j // 2) % 2 == (i // 2) % 2


def test_whole_tile_chain_rules():
    pytest.importorskip("cutlass")
    sys.path.insert(0, str(REPO))
    from epilogues.base import Chain
    from epilogues.qkv import QKVPlacement
    from epilogues.scale import ScaleRestore
    from epilogues.store import StoreBF16
    from epilogues.swiglu import SwiGLU

    c = Chain(ScaleRestore(rho=True), QKVPlacement(128), StoreBF16())
    assert c.n_tile == 2 and c.pre == () and c.key() == "scale_abrho+qkv128+bf16"
    with pytest.raises(ValueError, match="whole-tile"):
        Chain(QKVPlacement(128), SwiGLU(), StoreBF16())
    with pytest.raises(ValueError, match="head_dim"):
        QKVPlacement(96)


def test_gemm_names_the_policy_tensors():
    from futx.ops import prefill

    a, w = _t(8, 64, dtype=torch.bfloat16), _t(64, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="does not take \\['bias'\\]; it takes: a_scale, b_scale"):
        prefill.gemm(a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn), "scale_bf16", bias=_t(64))
    with pytest.raises(ValueError, match="needs 'b_scale'"):
        prefill.gemm(a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn), "scale_bf16", a_scale=_t(8))


# ---- the interleaved-SwiGLU register permutation (pure index math, mirrors _quad_permute_pairs) ------
def test_quad_permutation_restores_accumulator_layout():
    """Pair order: lane q holds output columns (q, q+4) of each 8; accumulator order wants (2q, 2q+1)."""
    for r in range(2):
        # value held by (lane q, slot lo/hi) = its output column
        held = {(q, s): q + 4 * s for q in range(4) for s in range(2)}
        for q in range(4):
            straight = q in (0, 3)
            src1 = q // 2 if q % 2 == 0 else 3 - q // 2
            # shuffle k: every lane p sends slot (lo if p straight else hi) for k=1, the other for k=2
            send1 = lambda p: held[(p, 0 if p in (0, 3) else 1)]
            send2 = lambda p: held[(p, 1 if p in (0, 3) else 0)]
            x1, x2 = send1(src1), send2(src1 ^ 1)
            got = (x1, x2) if straight else (x2, x1)
            assert got == (2 * q, 2 * q + 1), (q, got)


# ---- SASS of a representative variant (the generic compile test checks every variant for spills) -----
@pytest.mark.slow
def test_sass_of_fused_fp8_swiglu(tmp_path):
    pytest.importorskip("cutlass")
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(REPO)!r})
        import cutlass.cute as cute
        from futx.prefill import mainloop
        fn, args = mainloop.compile_target(ab="e4m3", policy="scale_rho_swiglu_fp8")
        cute.compile(fn, *args, options="--enable-tvm-ffi")
    """)
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin,sass", CUTE_DSL_DUMP_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=900, capture_output=True)
    sass = "\n".join(p.read_text() for p in tmp_path.glob("*.sass"))
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", sass)
    count = lambda prefix: sum(op.startswith(prefix) for op in ops)
    assert count("QGMMA.64x256x32.F32.E4M3.E4M3") == 8          # 4 k-blocks: first k-tile + steady state
    assert count("LDL") == 0 and count("STL") == 0               # no spills with 128 accumulators/thread
    assert count("F2FP.SATFINITE.E4M3") > 0                      # saturating FP8 output conversion
    assert count("SHFL") >= 64                                   # SwiGLU pair permutation (2 per value pair)
    assert count("MUFU.EX2") >= 64 and count("MUFU.RCP") >= 64   # SiLU via ex2 + rcp
    assert count("UTMALDG.2D.MULTICAST") == 1 and count("UTMASTG") == 4
    assert count("USETMAXREG") == 2                              # producer down, consumers up


@pytest.mark.slow
def test_sass_of_2x2_cluster(tmp_path):
    """The 2x2-cluster pingpong kernel multicasts both operands (one TMA load each of A and B per k-tile)."""
    pytest.importorskip("cutlass")
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(REPO)!r})
        import cutlass.cute as cute
        from futx.prefill import mainloop
        fn, args = mainloop.compile_target(ab="e4m3", policy="scale_bf16", schedule="pingpong", cluster_n=2)
        cute.compile(fn, *args, options="--enable-tvm-ffi")
    """)
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin,sass", CUTE_DSL_DUMP_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=900, capture_output=True)
    sass = "\n".join(p.read_text() for p in tmp_path.glob("*.sass"))
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", sass)
    assert sum(op == "UTMALDG.2D.MULTICAST" for op in ops) == 2 and "UTMALDG.2D" not in ops
    assert not any(op.startswith(("LDL", "STL")) for op in ops)


@pytest.mark.slow
def test_user_chain_builds_ahead_of_time(tmp_path):
    """The README worked example: `futx build --chain module:factory` compiles the composed chain at the
    same variants as the shipped ones, under keys holding its fingerprint."""
    pytest.importorskip("cutlass")
    out = tmp_path / "aot"
    res = subprocess.run([sys.executable, "-m", "futx", "build", "--out", str(out), "--no-runtime",
                          "--chain", "prefill_user_policy:scale_bias_bf16", "--jobs", "2"],
                         cwd=REPO / "tests", timeout=900, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    keys = sorted(json.loads((out / "manifest.json").read_text())["entries"])
    sys.path.insert(0, str(REPO / "tests"))
    import prefill_user_policy as user

    name = cat.chain_name(user.scale_bias_bf16())
    assert keys == sorted(cat.kernel_key("e4m3", name, v) for v in cat.VARIANTS)
