"""CPU compile check (CI): every shipped registry entry compiles for sm_90a, exports, links, and its SASS has the
matrix instructions it promises and no local-memory spills. One parallel `futx build` serves all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from futx.runtime.catalog import PACKAGE_SPECS

SPECS = sorted(PACKAGE_SPECS, key=lambda s: s.key)   # what ships (not entries other tests added at run time)


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    pytest.importorskip("cutlass")
    from futx.runtime.build import build, read_manifest

    out = Path(os.environ.get("FUTX_CI_BUILD_DIR") or tmp_path_factory.mktemp("aot"))
    errors = ""
    try:
        build(out, arch="sm_90a", only=[s.key for s in SPECS], jobs=os.cpu_count() or 1,
              bundle_runtime=False, progress=False)
    except RuntimeError as exc:  # per-variant failures are reported by each test below
        errors = str(exc)
    return read_manifest(out) or {"entries": {}}, errors


@pytest.mark.parametrize("spec", SPECS, ids=[s.key for s in SPECS])
def test_variant_compiles_for_sm90a(built, spec):
    manifest, errors = built
    entry = manifest["entries"].get(spec.key)
    assert entry is not None, f"{spec.key} failed to build:\n{errors}"
    assert entry["sass_found"], "no SASS was dumped (is nvdisasm installed? pip install nvidia-cuda-nvdisasm)"
    sass = entry["sass"]
    for op in spec.expect_sass:
        assert sass.get(op, 0) > 0, f"{spec.key}: expected {op} in SASS, got {sass}"
    assert sass["LDL"] == 0 and sass["STL"] == 0, f"{spec.key}: local-memory spills in SASS: {sass}"
    if spec.module == "decode.skinny_dispatch" and sass["HGMMA"]:
        # the warpgroup decode kernels keep a unit of wgmma in flight: a wait per MMA means ptxas serialized them
        assert sass["WARPGROUP.DEPBAR"] * 2 < sass["HGMMA"], f"{spec.key}: wgmma serialized in SASS: {sass}"


# the warp-specialized INT4 projection's tuning variants (decode/skinny_ws.py; the routed ones, P17, are checked with
# the registry above): every schedule and token bucket, the SwiGLU epilogue (the most registers)
WS_KEYS = [key for key in (f"decode.skinny.int4.m{m}.swiglu.{v}" for m in (16, 32, 64) for v in ("ws", "wsk", "wst", "wskt"))
           if key not in {s.key for s in SPECS}]
# and on E4M3 weights (decode/skinny_ws_e4m3.py), where not routed
WS_KEYS += [key for key in (f"decode.skinny.e4m3.m{m}.swiglu.{v}" for m in (16, 32, 64) for v in ("ws", "wsk"))
            if key not in {s.key for s in SPECS}]


@pytest.fixture(scope="module")
def ws_built(tmp_path_factory):
    pytest.importorskip("cutlass")
    from tuning import tuning_space

    out = tmp_path_factory.mktemp("aot-ws")
    return tuning_space().build(out, only=",".join(WS_KEYS), arch="sm_90a", jobs=os.cpu_count() or 1,
                                bundle_runtime=False, progress=False)


@pytest.mark.parametrize("key", WS_KEYS)
def test_warp_specialized_projection_compiles(ws_built, key):
    """Warpgroup MMA, no spills, and the wgmma kept in flight (ptxas serializes them, one wait each, when the
    in-flight partials and A operands do not fit its 168 registers)."""
    sass = ws_built["entries"][key]["sass"]
    assert sass["HGMMA"] > 0 and sass["LDL"] == 0 and sass["STL"] == 0, f"{key}: {sass}"
    assert sass["WARPGROUP.DEPBAR"] * 2 < sass["HGMMA"], f"{key}: wgmma serialized: {sass}"
