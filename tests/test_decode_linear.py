"""CPU checks of the decode projections: variant choice, op validation and fake kernels, and the SASS of
representative variants (every registry variant is also compiled by test_kernel_compile.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from decode import plan
from futx.config import preset
from futx.runtime import get_spec
from futx.runtime.catalog import decode_linear

SHAPES = [preset(p).projection_shapes()[proj] + (64 if p.startswith("smollm2") else 128,)
          for p in ("layer-1b", "layer-8b", "layer-70b", "smollm2-135m") for proj in ("qkv", "o", "gate_up", "down")]


@pytest.mark.parametrize("fmt", plan.FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 16, 17, 31, 32])
def test_every_shape_picks_a_registered_variant_and_a_valid_shape(fmt, m):
    for n, k, group in SHAPES:
        for epilogue in plan.EPILOGUES:
            choice = plan.choose(fmt, group, epilogue, m, n, k)
            assert get_spec(choice.key) in decode_linear.SPECS, f"{choice.key} is routed to but not shipped"
            if choice.kind == "tile":
                assert fmt == "int4" and group == 128
                assert m == 1 or plan.tile_serves_rows(fmt, group, epilogue, m, n, k), "multi-token tile off its rule"
            elif choice.kind == "gemv":
                assert m <= plan.GEMV_MAX_M and 1 <= choice.tiles <= n // 16
                assert -(-(n // 16) // choice.tiles) <= 132, "one CTA per SM at most"
            else:
                units = k // plan.unit_k(fmt, group)
                if plan.is_stream_k(choice.variant):   # persistent: one CTA per SM at most, a few pairs each
                    pairs = -(-n // plan.TILE_N) * units
                    assert 1 <= choice.split <= min(132, max(1, pairs // plan.MIN_UNITS))
                    continue
                assert 1 <= choice.split <= max(1, units // plan.MIN_UNITS)  # every CTA keeps a few units
                if choice.split > 1:
                    assert -(-n // plan.TILE_N) * choice.split <= plan.CTAS_PER_SM * 132, "no partial second wave"


def test_m1_gemv_has_balanced_tiles():
    for fmt in plan.FORMATS:
        for n, k, group in SHAPES:
            choice = plan.choose(fmt, group, "store", 1, n, k, kernel="gemv")
            ctas = -(-(n // 16) // choice.tiles)
            assert ctas * choice.tiles - n // 16 < choice.tiles, "only the last CTA may be short"


def test_routing_rule_follows_the_measurements():
    """decode.plan's rules (docs/routing.md P1-P7): INT4 g128 M = 1 -> tile GEMV (8 warps for K > 8192 and for
    grids of at most 3 CTAs per SM: the 8B QKV and O, not the 70B ones), INT4 2..8 -> persistent GEMV (the
    multi-token tile GEMV for store/SwiGLU projections whose grid fits one wave, P12/P13), INT4 9..64 -> skinny (g128:
    its register-weights form up to 16 rows, P15; the warp-specialized kernel beyond, P17);
    BF16/E4M3 up to 16 -> persistent GEMV where the rows fit; E4M3 from 17 rows -> its warp-specialized kernel (P18)."""
    # the down projections (K > 8192): 8 warps; beyond K = 16384 (70B) batches of 3 units (P2, P3)
    for layer, want in (("layer-70b", {"qkv": "", "o": "", "gate_up": "", "down": ".w8.p3"}),):
        for proj, (n, k) in preset(layer).projection_shapes().items():
            key = plan.choose("int4", 128, "residual", 1, n, k).key
            assert key == "decode.gemv.int4.m1.residual" + want[proj], (layer, proj, key)
    shapes = preset("layer-8b").projection_shapes()
    want_suffix = {"qkv": ".w8", "o": ".w8", "gate_up": "", "down": ".w8"}
    for proj, (n, k) in shapes.items():
        c = plan.choose("int4", 128, "store", 1, n, k)
        assert c.kind == "tile" and c.key == "decode.gemv.int4.m1.store" + want_suffix[proj], c
        if proj == "down":   # the fused-norm kernels keep batches of 2
            assert plan.choose("int4", 128, "store", 1, n, k, norm=True).key == "decode.gemv.int4.m1.store.w8.norm"
        assert plan.choose("int4", 64, "store", 1, n, k).kind == "gemv"  # no tile variant for group 64
        # P15: the register-weights skinny kernel up to 16 rows; P17: the warp-specialized kernel beyond, stream-K
        # where the grid schedule fills less than 90% of its waves (8B QKV 96 / 132 CTAs, gate/up 224 / 264)
        for m in (9, 16, 17, 32, 33, 64):
            c = plan.choose("int4", 128, "store", m, n, k)
            bucket = 16 if m <= 16 else 32 if m <= 32 else 64
            want = "rw" if m <= 16 else ("wsk" if proj in ("qkv", "gate_up") else "ws")
            assert c.kind == "skinny" and c.key == f"decode.skinny.int4.m{bucket}.store.{want}", c
            if m > 32:
                continue
            assert plan.choose("int4", 64, "store", m, n, k).key == \
                f"decode.skinny.int4g64.m{16 if m <= 16 else 32}.store"
            assert plan.choose("int4", 128, "store", m, n, k, kernel="skinny").key == c.key.rsplit(".", 1)[0]
        for fmt in ("bf16", "e4m3"):
            assert plan.choose(fmt, 128, "store", 1, n, k).kind == "gemv"
            assert plan.choose(fmt, 128, "store", 32, n, k).kind == "skinny"
        # P18: E4M3 from 17 rows on -> its warp-specialized kernel, P17's schedule rule in 64-k units (stream-K for the
        # 8B QKV, 96 of 132 CTAs, and gate/up, 224 of 264); BF16 keeps the ring kernel / rww
        for m in (17, 32, 33, 64):
            bucket = 32 if m <= 32 else 64
            want = "wsk" if proj in ("qkv", "gate_up") else "ws"
            assert plan.choose("e4m3", 128, "store", m, n, k).key == f"decode.skinny.e4m3.m{bucket}.store.{want}"
            assert plan.choose("bf16", 128, "store", m, n, k).key == \
                f"decode.skinny.bf16.m{bucket}.store" + (".rww" if bucket == 64 else "")
        assert plan.choose("e4m3", 128, "store", 16, n, k).key == (   # P6 / P7 up to 16 rows
            "decode.skinny.e4m3.m16.store" if proj == "down" else "decode.gemv.e4m3.m16.store")
    n, k = shapes["qkv"]
    # P12/P13: 2..8 rows of the store/SwiGLU projections -> the multi-token tile GEMV, 8 warps, its fused norm too:
    # the 8B QKV (one wave as it is), the 8B gate/up (1792 CTAs) and the 70B QKV (640) with n-blocks per CTA; the 8B
    # O (residual) and the 70B gate/up (3584 CTAs: no count fits one wave) keep the GEMV
    big = preset("layer-70b").projection_shapes()
    assert [plan.choose("int4", 128, "swiglu", m, *big["gate_up"], norm=True).key for m in (2, 3)] == \
        ["decode.tile.int4.m8.swiglu.w8.norm.nb10", "decode.tile.int4.m8.swiglu.w8.norm.nb16"]
    for m in (2, 5, 8):
        assert plan.choose("int4", 128, "store", m, n, k).key == "decode.tile.int4.m8.store.w8"
        assert plan.choose("int4", 128, "store", m, n, k, norm=True).key == "decode.tile.int4.m8.store.w8.norm"
        assert plan.choose("int4", 128, "residual", m, *shapes["o"]).kind == "gemv"
        assert plan.choose("int4", 128, "swiglu", m, *shapes["gate_up"], norm=True).key == \
            f"decode.tile.int4.m8.swiglu.w8.norm.nb{8 if m == 8 else 5}"
        assert plan.choose("int4", 128, "store", m, *big["qkv"]).key == \
            f"decode.tile.int4.m8.store.w8.nb{ {2: 2, 5: 3, 8: 5}[m] }"   # the rows leave 3 / 2 / 2 CTAs per SM
        if m > 3:   # its 3584 CTAs: 10 n-blocks at M = 2, 16 at M = 3, no count beyond (one CTA per SM)
            assert plan.choose("int4", 128, "swiglu", m, *big["gate_up"]).kind == "gemv"
    plan.route_tile_variant("", rows_nblocks=False)   # P12 alone: small grids only
    try:
        assert plan.choose("int4", 128, "swiglu", 2, *shapes["gate_up"]).kind == "gemv"
        assert plan.choose("int4", 128, "store", 2, *big["qkv"]).kind == "gemv"
        assert plan.choose("int4", 128, "store", 2, n, k).key == "decode.tile.int4.m8.store.w8"
    finally:
        plan.route_tile_variant("")
    # the cluster split-K variants: at most CLUSTER_MAX CTAs per tile (a portable cluster)
    assert plan.choose("int4", 128, "store", 16, 2048, 14336, kernel="skinny", variant="rw").split == 16
    assert plan.choose("int4", 128, "store", 16, 2048, 14336, kernel="skinny", variant="rwc").split == plan.CLUSTER_MAX
    with pytest.raises(ValueError, match="cluster split-K"):
        plan.choose("int4", 128, "store", 16, 2048, 4096, kernel="skinny", variant="rw1c", split=9)
    plan.route_tile_variant("", skinny="")   # the ring kernel where the router picks the skinny kernel
    try:
        assert plan.choose("int4", 128, "store", 16, n, k).key == "decode.skinny.int4.m16.store"
    finally:
        plan.route_tile_variant("")
    plan.route_tile_variant("", max_m=1)
    try:
        assert plan.choose("int4", 128, "store", 8, n, k).kind == "gemv"
        # the benchmark's ^8r-rnb: P12 (small grids) for the residual projections too: the 8B O
        plan.route_tile_variant("", multi_epilogues=plan.EPILOGUES, rows_nblocks=False)
        assert plan.choose("int4", 128, "residual", 2, *shapes["o"]).key == "decode.tile.int4.m8.residual.w8"
        # the 8B down (K = 14336): its rows leave 2 CTAs per SM up to M = 3, one at M = 4
        assert plan.choose("int4", 128, "residual", 3, *shapes["down"]).key == "decode.tile.int4.m8.residual.w8"
        assert plan.choose("int4", 128, "residual", 4, *shapes["down"]).kind == "gemv"
    finally:
        plan.route_tile_variant("")
    assert plan.choose("int4", 128, "residual", 2, *shapes["o"]).kind == "gemv"
    assert plan.choose("bf16", 128, "store", 16, n, k).kind == "gemv"
    # forced designs (tests, benchmarks) and their errors
    assert plan.choose("int4", 128, "swiglu", 1, n, k, kernel="tile", warps=8, variant="rolling").key == \
        "decode.gemv.int4.m1.swiglu.w8.rolling"
    assert plan.choose("int4", 128, "store", 1, n, k, kernel="gemv", variant="r2").key == "decode.gemv.int4.m8.store.r2"
    assert plan.choose("int4", 128, "store", 2, n, k, kernel="tile").key == "decode.tile.int4.m8.store.w8"
    assert plan.choose("int4", 128, "residual", 2, n, k, kernel="tile", warps=4).key == "decode.tile.int4.m8.residual"
    with pytest.raises(ValueError, match="M <= 8"):
        plan.choose("int4", 128, "store", 9, n, k, kernel="tile")
    for bad in (dict(max_m=9), dict(multi_epilogues=("gelu",)), dict(fill=3), dict(rows_w8=1), dict(skinny="rw9")):
        with pytest.raises(ValueError):
            plan.route_tile_variant("p3", **bad)
        assert plan.tile_route() == ("", plan.TILE_SMALL_GRID_CTAS, None, plan.TILE_LONG_K_VARIANT, plan.TILE_MAX_M,
                                     plan.TILE_MULTI_EPILOGUES, 0, False, 0, True, plan.TILE_ROWS_W8, None), \
            "a rejected route left state behind"
    with pytest.raises(ValueError, match="exceed shared memory"):
        plan.choose("int4", 128, "store", 8, n, 14336, kernel="tile")
    with pytest.raises(ValueError, match="no variant or split"):
        plan.choose("int4", 128, "store", 3, n, k, kernel="tile", variant="p3")
    with pytest.raises(ValueError, match="no tile GEMV"):
        plan.choose("bf16", 128, "store", 1, n, k, kernel="tile")
    with pytest.raises(ValueError, match="kernel must be"):
        plan.choose("int4", 128, "store", 1, n, k, kernel="fast")


def _tuning_space():
    from tuning import tuning_space

    return tuning_space()


# shapes of the grid below: the model presets plus K values around the tile GEMV's 4/8-warp threshold, the
# shared-memory limits of the GEMV's activation rows, and N from one skinny tile to 2 * 28672
GRID_N = (128, 512, 2048, 4096, 6144, 14336, 28672, 32768, 57344, 65536)
GRID_K = (256, 1024, 2048, 4096, 8192, 8320, 14336, 28672, 57344, 131072)


# + the E4M3 ws / wsk of the 16-row bucket (6) and the E4M3 kernels P18 replaced (the ring kernel at 32 rows, rww at 64)
TUNING_COUNT = 357


def _router_keys() -> set[str]:
    """Every key decode.plan.choose(kernel="auto") returns over M = 1..64, the formats, group sizes,
    epilogues and the (N, K) grid."""
    keys = set()
    for fmt, group in (("int4", 128), ("int4", 64), ("e4m3", 128), ("bf16", 128)):
        for epilogue in plan.EPILOGUES:
            for m in range(1, plan.MAX_M + 1):
                for n in GRID_N:
                    for k in GRID_K:
                        keys.add(plan.choose(fmt, group, epilogue, m, n, k).key)
                        if plan.fuses_norm(fmt, group, epilogue, m, n, k):
                            keys.add(plan.choose(fmt, group, epilogue, m, n, k, norm=True).key)
    return keys


def test_registry_is_exactly_what_the_router_picks():
    """Every decode-projection registry entry is reachable from the router, every router choice is in the
    registry (and CI-compiled), and the tuning space (scripts/tuning_space.py) holds only keys the router
    never picks (docs/routing.md)."""
    registry = {s.key: s for s in decode_linear.SPECS}
    routed = _router_keys()
    assert routed == set(registry), (f"registry entries never routed: {sorted(set(registry) - routed)}; "
                                     f"routed keys missing from the registry: {sorted(routed - set(registry))}")
    tuning = {s.key: s for s in _tuning_space().linear_specs()}
    assert not set(tuning) & routed
    assert len(registry) == 119 and len(tuning) == TUNING_COUNT   # 113 + 12 E4M3 ws / wsk - the 6 they replaced


def test_fused_norm_routes_only_the_tile_gemv():
    """The RMSNorm row factor folds into the M = 1 tile GEMV of QKV and gate/up (INT4 g128) and into the
    multi-token one where it is routed (2..8 rows of the grids some n-block count fits in one wave, P13); every other
    projection keeps the row-factor kernel, and forcing the fused variant there is an error."""
    for n, k, epilogue in ((6144, 4096, "store"), (28672, 4096, "swiglu"), (10240, 8192, "store"),
                           (57344, 8192, "swiglu")):
        assert plan.fuses_norm("int4", 128, epilogue, 1, n, k)
        launch = plan.choose("int4", 128, epilogue, 1, n, k, norm=True)
        assert launch.kind == "tile" and launch.key.endswith(".norm"), launch
        assert plan.fuses_norm("int4", 128, epilogue, 2, n, k)   # the 70B gate/up: 10 n-blocks per CTA
        assert not plan.fuses_norm("int4", 128, epilogue, 9, n, k)
    assert not plan.fuses_norm("int4", 128, "swiglu", 4, 57344, 8192)   # its rows leave one CTA per SM
    with pytest.raises(ValueError, match="fused-norm"):
        plan.choose("int4", 128, "swiglu", 4, 57344, 8192, norm=True)
    assert not plan.fuses_norm("int4", 128, "residual", 1, 4096, 4096)
    assert not plan.fuses_norm("int4", 64, "store", 1, 576, 576)       # group 64 has no tile GEMV
    assert not plan.fuses_norm("e4m3", 128, "store", 1, 4096, 4096)
    assert not plan.fuses_norm("int4", 128, "store", 1, 4096, 131072)  # the row does not fit
    with pytest.raises(ValueError, match="epilogue"):
        plan.choose("int4", 128, "residual", 1, 4096, 4096, kernel="tile", norm=True)
    assert plan.tile_key("int4", 128, "swiglu", 8, norm=True) == "decode.gemv.int4.m1.swiglu.w8.norm"


def test_tuning_space_keys_are_what_the_forced_router_names():
    """Each tuning variant is reachable with the router's overrides (kernel=, variant=, warps=, split=), so benchmarks
    and GPU tests name them through plan.choose."""
    n, k = 4096, 4096
    forced = set()
    for e in plan.EPILOGUES:
        for w in (4, 8):
            for v in plan.TILE_VARIANTS:
                forced.add(plan.choose("int4", 128, e, 1, n, k, kernel="tile", warps=w, variant=v).key)
                if e in plan.NORM_EPILOGUES:
                    forced.add(plan.choose("int4", 128, e, 1, n, k, kernel="tile", warps=w, variant=v,
                                           norm=True).key)
            if e in plan.TILE_SPLIT_EPILOGUES:
                forced.add(plan.choose("int4", 128, e, 1, n, k, kernel="tile", warps=w, split=2).key)
            forced.add(plan.choose("int4", 128, e, 5, n, k, kernel="tile", warps=w).key)
            if e in plan.NORM_EPILOGUES:
                forced.add(plan.choose("int4", 128, e, 5, n, k, kernel="tile", warps=w, norm=True).key)
        for w in plan.TILE_FILL_WARPS:   # the fill rule's warp counts: batches of 2 and 3, the fused norm
            for v in ("", plan.TILE_LONG_K_VARIANT):
                forced.add(plan.choose("int4", 128, e, 1, n, k, kernel="tile", warps=w, variant=v).key)
            if e in plan.NORM_EPILOGUES:
                forced.add(plan.choose("int4", 128, e, 1, n, k, kernel="tile", warps=w, norm=True).key)
        for nb in plan.TILE_NBLOCKS:      # n-blocks per CTA
            for w in (4, 8):
                for v in ("", plan.TILE_LONG_K_VARIANT):
                    forced.add(plan.choose("int4", 128, e, 1, n, k, kernel="tile", warps=w, variant=v,
                                           nblocks=nb).key)
                if e in plan.NORM_EPILOGUES:
                    forced.add(plan.choose("int4", 128, e, 1, n, k, kernel="tile", warps=w, norm=True,
                                           nblocks=nb).key)
        for nb in plan.TILE_ROWS_NBLOCKS:  # the multi-token kernel with n-blocks per CTA
            for w in (4, 8):
                forced.add(plan.choose("int4", 128, e, 5, n, k, kernel="tile", warps=w, nblocks=nb).key)
                if e in plan.NORM_EPILOGUES:
                    forced.add(plan.choose("int4", 128, e, 5, n, k, kernel="tile", warps=w, norm=True,
                                           nblocks=nb).key)
        for v in plan.GEMV_VARIANTS:
            forced.add(plan.choose("int4", 128, e, 1, n, k, kernel="gemv", variant=v).key)
        for group in plan.GROUP_SIZES:
            forced.add(plan.choose("int4", group, e, 16, n, k, kernel="gemv").key)
        for m in (16, 32, 64):
            for v in plan.SKINNY_VARIANTS:
                for group in plan.GROUP_SIZES:
                    forced.add(plan.choose("int4", group, e, m, n, k, kernel="skinny", variant=v).key)
            for v in plan.E4M3_WS_VARIANTS + plan.skinny_replaced_variants("e4m3", 128, m):
                forced.add(plan.choose("e4m3", 128, e, m, n, k, kernel="skinny", variant=v).key)
    assert {s.key for s in _tuning_space().linear_specs()} <= forced


def test_gemv_smem_layout_is_aligned_and_bounded():
    from decode.gemv_layout import SMEM_LIMIT

    for fmt, group in (("int4", 128), ("int4", 64), ("e4m3", 128), ("bf16", 128)):
        for epilogue in plan.EPILOGUES:
            for m in (1, 5, 8, 9, 16):
                params = plan.gemv_params(fmt, group, epilogue, m)
                offs = plan.gemv_smem(params).offsets(m, 4096 // plan.unit_k(fmt, group), 14)
                assert all(v % 16 == 0 for v in offs.values()), offs
                assert offs["total"] <= SMEM_LIMIT


def test_plan_rejects_what_no_kernel_serves():
    with pytest.raises(ValueError, match="1 <= M <= 64"):
        plan.m_bucket(65)
    with pytest.raises(ValueError, match="1 <= M <= 64"):
        plan.m_bucket(0)
    with pytest.raises(ValueError, match="group size 256"):
        plan.fmt_tag("int4", 256)
    with pytest.raises(ValueError, match="unknown decode weight format"):
        plan.fmt_tag("int8")
    with pytest.raises(ValueError, match="shared memory"):
        plan.choose("int4", 128, "store", 16, 8192, 28672, kernel="gemv")


def test_ops_reject_cpu_tensors_before_launch():
    import futx.ops  # noqa: F401

    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        torch.ops.futx.decode_linear_bf16(x, torch.zeros(16, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="CUDA"):
        torch.ops.futx.decode_linear_int4(x, torch.zeros(1, 2, 32, 4, dtype=torch.int32),
                                          torch.zeros(1, 1, 16, dtype=torch.float16), 128)


def test_fake_kernels_give_output_shapes():
    import futx.ops  # noqa: F401

    with torch._subclasses.fake_tensor.FakeTensorMode():
        x = torch.empty(5, 4096, dtype=torch.bfloat16, device="cuda")
        packed = torch.empty(6144 // 16, 64, 32, 4, dtype=torch.int32, device="cuda")
        scales = torch.empty(6144 // 16, 32, 16, dtype=torch.float16, device="cuda")
        assert torch.ops.futx.decode_linear_int4(x, packed, scales, 128).shape == (5, 6144)
        assert torch.ops.futx.decode_linear_int4(x, packed, scales, 128, "swiglu").shape == (5, 3072)
        data = torch.empty(512, 4096, dtype=torch.float8_e4m3fn, device="cuda")
        scale = torch.empty(512, dtype=torch.float32, device="cuda")
        assert torch.ops.futx.decode_linear_e4m3(x, data, scale).shape == (5, 512)


# ---- SASS of representative variants ----------------------------------------------------------
def _sass(key: str, tmp_path: Path) -> str:
    pytest.importorskip("cutlass")
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, 'scripts'); import tuning_space; tuning_space.register(); "
            "from futx.runtime import compile_spec, get_spec; compile_spec(get_spec(sys.argv[1]))")  # tuning keys too
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="sass", CUTE_DSL_DUMP_DIR=str(tmp_path))
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.run([sys.executable, "-c", code, key], check=True, env=env, cwd=root, timeout=600)
    return "\n".join(p.read_text() for p in tmp_path.glob("*.sass"))


def _ops(sass: str) -> list[str]:
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)


def _count(ops, prefix):
    return sum(1 for op in ops if op.startswith(prefix))


@pytest.mark.slow
@pytest.mark.parametrize("fold", [True, False])
def test_int4_gemv_sass(tmp_path, fold):
    from decode.gemv import Gemv

    key = "decode.gemv.int4.m8.store" + ("" if fold else ".nofold")
    ops = _ops(_sass(key, tmp_path))
    depth = Gemv("int4", 128, "store", 1, fold).depth
    step_mmas = 8  # two 64-k blocks x four k16 steps per 128-k group
    assert _count(ops, "HMMA.16816.F32.BF16") == depth * step_mmas + (step_mmas if fold else 0)  # + the sums
    # the register trick: one LOP3 per register; the nibble bias is one packed FMA per register, or folded away
    assert _count(ops, "HFMA2.BF16") == (0 if fold else 4 * depth * step_mmas)
    assert _count(ops, "LDG.E") and _count(ops, "LDSM") and _count(ops, "BAR.SYNC")
    assert not any(op.startswith(("LDL", "STL")) for op in ops), "local-memory spills"


_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?);")


def prefetch_waits(sass: str) -> list[tuple[str, str, str]]:
    """Global loads (LDG, not cp.async) whose destination registers are read again in the basic block that
    issues them: (load pc, reader pc, reader opcode). Such a read makes the warp wait for the load there, so
    a register prefetch that has one is not in flight across the work that should hide it."""
    out, pending = [], {}
    for line in sass.splitlines():
        if re.match(r"^\s*\.L\w*:", line):
            pending = {}
            continue
        m = _INS.search(line)
        if not m:
            continue
        pc, op, operands = m.groups()
        ops = [o.strip() for o in operands.split(",")]
        writes = not op.startswith(("ST", "BAR", "BRA", "LDGSTS", "RED", "ATOM", "EXIT"))
        for o in (ops[1:] if writes else ops):
            for r in re.findall(r"\bR(\d+)", o):
                if int(r) in pending:
                    out.append((pending.pop(int(r)), pc, op))
        dst = re.match(r"R(\d+)", ops[0]) if writes and ops else None
        if dst:
            width = 4 if ".128" in op else 2 if ".64" in op else 1
            for i in range(width):
                pending.pop(int(dst.group(1)) + i, None)
                if op.startswith("LDG") and not op.startswith("LDGSTS"):
                    pending[int(dst.group(1)) + i] = pc
        if "BRA" in op or op.startswith("EXIT"):
            pending = {}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("key,waits", [("decode.gemv.int4.m8.swiglu", False),        # fixed: scales converted at use
                                       ("decode.gemv.int4.m8.swiglu.r2", True),      # run 2: every step waits
                                       ("decode.gemv.int4.m16.store", False),
                                       ("decode.gemv.int4.m1.store.rolling", False),
                                       ("decode.gemv.int4.m1.store", True)])         # run 1: waits per batch
def test_prefetch_is_not_waited_for_where_it_is_issued(tmp_path, key, waits):
    """The INT4 run-2 regression: converting a group scale inside its load's asm made ptxas wait for the
    load in the step that requested it (one memory latency per unit and warp)."""
    found = prefetch_waits(_sass(key, tmp_path))
    assert bool(found) == waits, f"{key}: loads waited for in their own block: {found[:8]}"


# the register-weights skinny kernel: weights by streamed 16-byte global loads, activations by cp.async + ldmatrix
RW_SASS = ("HMMA", "LDGSTS", "LDSM", "LDG.E.NA.LTC256B.128")


@pytest.mark.slow
@pytest.mark.parametrize("key,expect", [("decode.gemv.int4.m1.store", ("HMMA", "HFMA2.BF16", "LDSM", "BAR.SYNC")),
                                        ("decode.gemv.int4.m1.residual.w8", ("HMMA", "HFMA2.BF16", "LDSM")),
                                        ("decode.gemv.e4m3.m8.residual", ("HMMA", "HMUL2.BF16", "LDGSTS")),
                                        ("decode.gemv.int4.m16.swiglu", ("HMMA", "LDSM", "BAR.SYNC")),
                                        ("decode.skinny.int4.m32.swiglu", ("HMMA", "LDGSTS", "LDSM", "SHFL")),
                                        ("decode.skinny.int4.m16.swiglu.rw", RW_SASS),
                                        ("decode.skinny.int4.m32.residual.rw1", RW_SASS),
                                        ("decode.skinny.bf16.m16.store", ("HMMA", "LDGSTS", "LDS.128"))])
def test_variant_sass(tmp_path, key, expect):
    ops = _ops(_sass(key, tmp_path))
    for want in expect:
        assert any(op.startswith(want) for op in ops), f"{key}: no {want} in SASS"
    assert not any(op.startswith(("LDL", "STL")) for op in ops), f"{key}: local-memory spills"


def test_tile_smem_regions_are_aligned_and_the_ring_is_budgeted():
    """The tile GEMV's shared-memory map (one formula for the host's planner and the kernel): every region
    16-byte aligned, the ring's units 1 KB apart, and the planner refuses a ring that does not fit."""
    from decode.gemv_layout import SMEM_LIMIT, UNIT_BYTES, tile_share_units, tile_smem

    for k in (128, 2176, 4096, 8192, 14336, 28672):
        for warps in (4, 8):
            for norm in (False, True):
                for ring in (0, 4, 8):
                    r = tile_smem(k, warps, norm, ring)
                    assert all(v % 16 == 0 for v in r.values()), (k, warps, norm, ring, r)
                    assert r["total"] - r["ring"] == warps * ring * UNIT_BYTES
                    assert r["ring"] - r["scales"] == (warps * tile_share_units(k, warps) * 32 if ring else 0)
                    assert tile_share_units(k, warps) * warps >= k // 128
    assert plan.tile_fits(28672, 8, False, "ring8") == (tile_smem(28672, 8, False, 8)["total"] <= SMEM_LIMIT)
    assert not plan.tile_fits(96 * 1024, 4, False, "ring8")


def test_routing_the_tile_gemv_to_a_tuning_variant_and_back():
    """route_tile_variant steers choose(kernel="auto") at M = 1 only (the engine benchmark's hook), forced
    choices keep their variant, small_grid moves the 8-warp threshold, and "" restores the shipped rule."""
    n, k = 6144, 4096
    shipped = plan.choose("int4", 128, "store", 1, n, k, norm=True).key
    try:
        plan.route_tile_variant("ring8")
        assert plan.choose("int4", 128, "store", 1, n, k, norm=True).key == shipped + ".ring8"
        assert plan.choose("int4", 128, "residual", 1, 4096, 14336).key == "decode.gemv.int4.m1.residual.w8.ring8"
        assert plan.choose("int4", 128, "store", 1, 28672, k, kernel="tile").key == "decode.gemv.int4.m1.store"
        plan.route_tile_variant("", small_grid=0, rows_nblocks=False)
        assert plan.choose("int4", 128, "store", 1, n, k, norm=True).key == "decode.gemv.int4.m1.store.norm"
        assert plan.choose("int4", 128, "store", 8, n, k).kind == "gemv"
        with pytest.raises(ValueError, match="unknown tile GEMV variant"):
            plan.route_tile_variant("ring3")
    finally:
        plan.route_tile_variant("")
    assert plan.choose("int4", 128, "store", 1, n, k, norm=True).key == shipped


def test_fill_rule_warps():
    """route_tile_variant(fill=S) gives each M = 1 tile GEMV the most warps (of TILE_FILL_WARPS) whose CTAs per SM
    fit in S warps: the 8B O and down 12, the 70B O and down 6, the 1B O and down 16; grids needing more CTAs per
    SM than S / 4 keep the shipped rule, and M > 1 is untouched. The GPU tests run the same warp counts."""
    from test_decode_linear_gpu import FILL_WARPS

    assert FILL_WARPS == tuple(w for w in plan.TILE_FILL_WARPS if w not in (plan.TILE_WARPS_SMALL_K,
                                                                           plan.TILE_WARPS_LARGE_K))
    shapes = {name: preset(name).projection_shapes() for name in ("layer-1b", "layer-8b", "layer-70b")}
    want = {("layer-8b", "o"): 12, ("layer-8b", "down"): 12, ("layer-70b", "o"): 6, ("layer-70b", "down"): 6,
            ("layer-1b", "o"): 16, ("layer-1b", "down"): 16, ("layer-1b", "qkv"): 12}
    shipped = {(m, p): plan.tile_warps(k, n) for m, sh in shapes.items() for p, (n, k) in sh.items()}
    route = plan.tile_route()
    plan.route_tile_variant("", fill=24)
    try:
        for (model, proj), (n, k) in ((key, shapes[key[0]][key[1]]) for key in shipped):
            assert plan.tile_warps(k, n) == want.get((model, proj), shipped[(model, proj)]), (model, proj)
        n, k = shapes["layer-8b"]["down"]
        assert plan.choose("int4", 128, "residual", 1, n, k).key == "decode.gemv.int4.m1.residual.w12"
        assert plan.choose("int4", 128, "residual", 2, n, k).kind == "gemv"
        n, k = shapes["layer-70b"]["down"]
        assert plan.choose("int4", 128, "residual", 1, n, k).key == "decode.gemv.int4.m1.residual.w6.p3"
    finally:
        plan.route_tile_variant("")
    assert plan.tile_route() == route


def test_nblocks_rule():
    """route_tile_variant(nblocks=True) gives grids of more than one wave of resident CTAs several n-blocks per CTA
    (8B gate/up 2, 70B gate/up 4; the 8B QKV, O and down fit in one wave and keep one), never for the tuning
    pipelines without batches, K shorter than a unit per warp, or M > 1; bad counts are rejected."""
    shapes = {name: preset(name).projection_shapes() for name in ("layer-8b", "layer-70b")}
    plan.route_tile_variant("", nblocks=True)
    try:
        assert plan.choose("int4", 128, "swiglu", 1, *shapes["layer-8b"]["gate_up"], norm=True).key == \
            "decode.gemv.int4.m1.swiglu.norm.nb2"
        assert plan.choose("int4", 128, "swiglu", 1, *shapes["layer-70b"]["gate_up"], norm=True).key == \
            "decode.gemv.int4.m1.swiglu.norm.nb4"
        for proj, epilogue in (("qkv", "store"), ("o", "residual"), ("down", "residual")):
            assert ".nb" not in plan.choose("int4", 128, epilogue, 1, *shapes["layer-8b"][proj]).key
        assert plan.tile_nblocks(28672, 4096, 4, variant="ring4") == 1
        assert plan.tile_nblocks(28672 * 4, 256, 4) == 1
        assert ".m8." in plan.choose("int4", 128, "swiglu", 2, *shapes["layer-8b"]["gate_up"]).key  # M = 2: P13
    finally:
        plan.route_tile_variant("")
    assert ".nb" not in plan.choose("int4", 128, "swiglu", 1, *shapes["layer-8b"]["gate_up"], norm=True).key
    with pytest.raises(ValueError, match="n-blocks per CTA"):
        plan.choose("int4", 128, "store", 1, 4096, 4096, kernel="tile", nblocks=5)
    with pytest.raises(ValueError, match="n-blocks per CTA"):
        plan.choose("int4", 128, "store", 1, 4096, 4096, kernel="tile", variant="ring4", nblocks=2)


def test_rows_nblocks_rule():
    """P13: 2..8 rows of every store/SwiGLU grid go to the multi-token tile GEMV (8 warps from TILE_ROWS_W8 = 2
    rows) with the fewest n-blocks per CTA that fit its grid in one wave of 3 CTAs per SM (8B gate/up: 5, and 8 at
    M = 8 where the staged rows leave 2 CTAs per SM); grids no count fits (70B gate/up from M = 4) keep the
    persistent GEMV, the residual ones are unchanged. rows_nblocks=8 (at most 8 n-blocks), rows_w8=3 (4 warps at
    M = 2, 7 CTAs per SM) and rows_nblocks=False (P12) are the benchmark's alternatives."""
    shapes = {name: preset(name).projection_shapes() for name in ("layer-8b", "layer-70b")}
    gate_up = shapes["layer-8b"]["gate_up"]
    want = {2: "decode.tile.int4.m8.swiglu.w8.norm.nb5", 3: "decode.tile.int4.m8.swiglu.w8.norm.nb5",
            4: "decode.tile.int4.m8.swiglu.w8.norm.nb5", 8: "decode.tile.int4.m8.swiglu.w8.norm.nb8"}
    for m, key in want.items():
        assert plan.fuses_norm("int4", 128, "swiglu", m, *gate_up)
        assert plan.choose("int4", 128, "swiglu", m, *gate_up, norm=True).key == key
    assert plan.tile_rows_nblocks(2, *gate_up, 8, True) == 5
    assert plan.tile_rows_nblocks(3, *shapes["layer-70b"]["gate_up"], 8, True) == 16
    assert plan.tile_rows_nblocks(4, *shapes["layer-70b"]["gate_up"], 8, True) == 0   # one CTA per SM: 27 needed
    assert plan.choose("int4", 128, "swiglu", 4, *shapes["layer-70b"]["gate_up"]).kind == "gemv"
    assert plan.choose("int4", 128, "residual", 2, *shapes["layer-8b"]["down"]).kind == "gemv"
    plan.route_tile_variant("", rows_nblocks=8)   # at most 8 n-blocks per CTA: the 70B gate/up keeps the GEMV
    try:
        assert plan.choose("int4", 128, "swiglu", 2, *shapes["layer-70b"]["gate_up"]).kind == "gemv"
        assert plan.choose("int4", 128, "swiglu", 8, *gate_up).key == "decode.tile.int4.m8.swiglu.w8.nb8"
        with pytest.raises(ValueError, match="rows_nblocks"):
            plan.route_tile_variant("", rows_nblocks=7)
        assert plan.tile_route()[-3] == 8, "a rejected route left state behind"
    finally:
        plan.route_tile_variant("")
    plan.route_tile_variant("", rows_w8=3)
    try:
        assert plan.choose("int4", 128, "swiglu", 2, *gate_up, norm=True).key == "decode.tile.int4.m8.swiglu.norm.nb2"
        assert plan.choose("int4", 128, "swiglu", 2, *shapes["layer-70b"]["gate_up"]).key == \
            "decode.tile.int4.m8.swiglu.nb6"
        assert plan.choose("int4", 128, "store", 2, *shapes["layer-8b"]["qkv"]).key == "decode.tile.int4.m8.store.w8"
    finally:
        plan.route_tile_variant("")
    with pytest.raises(ValueError, match="n-blocks per CTA"):
        plan.choose("int4", 128, "store", 3, 4096, 4096, kernel="tile", nblocks=7)


def test_tile_split_is_tuning_space():
    """Split-K of the M = 1 tile GEMV (docs/routing.md P11: measured slower in the decode step) is never routed;
    it can be forced (tests, `route_tile_variant(split=)` for the step benchmark) on the residual projections."""
    from decode.gemv_layout import tile_slice_k

    down70 = plan.choose("int4", 128, "residual", 1, 8192, 28672)
    assert (down70.split, down70.key) == (1, "decode.gemv.int4.m1.residual.w8.p3")
    forced = plan.choose("int4", 128, "residual", 1, 8192, 28672, kernel="tile", split=3)
    assert (forced.split, forced.key) == (3, "decode.gemv.int4.m1.residual.w8.split")
    assert plan.choose("int4", 128, "residual", 1, 2096, 2176, kernel="tile", split=4).split == 4
    for epilogue, n, k in (("swiglu", 28672, 4096), ("store", 6144, 4096)):
        with pytest.raises(ValueError, match="split-K"):
            plan.choose("int4", 128, epilogue, 1, n, k, kernel="tile", split=2)
    with pytest.raises(ValueError, match="tile GEMV split"):
        plan.choose("int4", 128, "residual", 1, 16, 128, kernel="tile", split=2)   # one unit
    assert tile_slice_k(28672, 3) == 75 * 128
    try:
        plan.route_tile_variant("", split=2)
        assert plan.choose("int4", 128, "residual", 1, 8192, 28672).split == 2
        assert plan.choose("int4", 128, "swiglu", 1, 28672, 4096).split == 1
        plan.route_tile_variant("ring8", split=2)   # a tuning pipeline has no split kernel
        assert plan.choose("int4", 128, "residual", 1, 8192, 28672).split == 1
        plan.route_tile_variant("", long_k="")     # batches of 2 for the down projections too (the rule before P2's)
        assert plan.choose("int4", 128, "residual", 1, 8192, 28672).key == "decode.gemv.int4.m1.residual.w8"
        with pytest.raises(ValueError, match="unknown tile GEMV variant"):
            plan.route_tile_variant("", long_k="p9")
        with pytest.raises(ValueError, match="split"):
            plan.route_tile_variant("", split=9)
    finally:
        plan.route_tile_variant("")
    assert plan.choose("int4", 128, "residual", 1, 8192, 28672) == down70


@pytest.mark.parametrize("tiles,units,ctas", [(16, 32, 1), (16, 32, 5), (16, 32, 37), (16, 32, 132), (16, 32, 512),
                                              (224, 32, 132), (48, 32, 132), (1, 2, 2), (80, 64, 132)])
def test_stream_k_shares(tiles, units, ctas):
    """decode/stream_k.py (the persistent ws kernel's work split): the shares cover every (tile, unit) pair once, each
    tile's CTAs are exactly those whose shares meet it, and a tile is partial only as the first or last of a share,
    so two workspace slots per CTA hold every partial without collision."""
    from decode import stream_k

    pairs = tiles * units
    covered = []
    slots = set()
    for c in range(ctas):
        a, b = stream_k.start(c, ctas, pairs), stream_k.start(c + 1, ctas, pairs)
        assert b > a, "every CTA gets work (the plan caps ctas at the pair count)"
        covered += list(range(a, b))
        assert all(stream_k.owner(p, ctas, pairs) == c for p in range(a, b))
        for t in range(a // units, (b - 1) // units + 1):
            lo, hi = max(a, t * units), min(b, (t + 1) * units)
            first, last = stream_k.tile_ctas(t, units, ctas, pairs)
            assert first <= c <= last
            if hi - lo < units:   # partial: the share's first or last tile
                assert t in (a // units, (b - 1) // units)
                slot = 0 if t == stream_k.first_tile(c, units, ctas, pairs) else 1
                assert (c, slot) not in slots
                slots.add((c, slot))
            else:
                assert first == last == c
    assert covered == list(range(pairs))


def test_stream_k_launch_shape_and_workspace():
    """The persistent ws kernel ("wsk") launches one CTA per SM (fewer for fewer pairs); its split is the CTA count,
    its workspace two 128-channel partial tiles per CTA."""
    c = plan.choose("int4", 128, "swiglu", 24, 28672, 4096, 132, kernel="skinny", variant="wsk")
    assert (c.key, c.split, c.variant) == ("decode.skinny.int4.m32.swiglu.wsk", 132, "wsk")
    assert plan.skinny_workspace("wsk", c.split, 28672, 24) == 132 * 2 * plan.TILE_N * 32
    small = plan.choose("int4", 128, "store", 9, 128, 2048, 132, kernel="skinny", variant="wsk")
    assert small.split == 4   # one 128-channel tile x 16 units, at least 4 per CTA
    assert plan.skinny_max_split("int4", 128, 2048, 4096, "wsk") == 16 * 32
    assert plan.skinny_max_split("int4", 128, 2048, 4096, "ws") == 32
    assert plan.skinny_workspace("ws", 1, 2048, 20) == 4 and plan.skinny_workspace("ws", 3, 2048, 20) == 3 * 2048 * 32
