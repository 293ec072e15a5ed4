"""Runtime on the CPU: registry completeness, `futx build` manifest, idempotence, staleness refusal."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from futx.runtime import fingerprint as fp_mod
from futx.runtime import all_specs, get_spec, select
from futx.runtime.registry import KernelSpec

ROOT = Path(__file__).resolve().parents[1]


def _kernel_files() -> list[Path]:
    """Every module that defines a compile factory is a kernel file."""
    files = []
    for folder in ("futx", "decode", "epilogues"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            if any(isinstance(n, ast.FunctionDef) and n.name == "compile_target" for n in tree.body):
                files.append(path)
    return files


def test_registry_is_complete_and_consistent():
    specs = all_specs()
    keys = [s.key for s in specs]
    assert len(keys) == len(set(keys))
    modules = {s.module for s in specs}
    for path in _kernel_files():
        module = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        assert module in modules, f"{path} defines compile_target but has no registry entry"
    for spec in specs:
        assert (ROOT / spec.module_file).is_file(), spec.module_file
        for src in spec.sources:
            assert (ROOT / src).exists(), f"{spec.key}: source {src} missing"
        for op in spec.expect_sass:
            assert op in ("QGMMA", "HGMMA", "HMMA"), op


def test_select_and_errors():
    assert [s.key for s in select("smoke.*")] == ["smoke.axpy.bf16"]
    with pytest.raises(KeyError, match="no kernel variant"):
        get_spec("smoke.nope")
    with pytest.raises(ValueError, match="lower-case"):
        KernelSpec(key="Bad Key", module="x")
    with pytest.raises(TypeError, match="hashable"):
        KernelSpec(key="x.y", module="x", params=(("a", [1]),))


def test_fingerprint_tracks_sources(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    src = tmp_path / "pkg" / "kern.py"
    src.write_text("A = 1\n")
    monkeypatch.setattr(fp_mod, "REPO_ROOT", tmp_path)
    spec = KernelSpec(key="t.k", module="pkg.kern")
    a = fp_mod.spec_fingerprint(spec, "sm_90a", "4.8.1")
    assert a == fp_mod.spec_fingerprint(spec, "sm_90a", "4.8.1")
    assert a != fp_mod.spec_fingerprint(spec, "sm_90a", "4.8.2")
    assert a != fp_mod.spec_fingerprint(spec, "sm_100a", "4.8.1")
    src.write_text("A = 2\n")
    assert a != fp_mod.spec_fingerprint(spec, "sm_90a", "4.8.1")


@pytest.mark.slow
def test_build_manifest_idempotent_and_stale_refused(tmp_path):
    pytest.importorskip("cutlass")
    from futx.runtime.build import build, read_manifest
    from futx.runtime.loader import StaleArtifactError, check_entry

    m1 = build(tmp_path, only="smoke.*", jobs=1, progress=False)
    entry = m1["entries"]["smoke.axpy.bf16"]
    assert (tmp_path / entry["object"]).stat().st_size > 0
    assert (tmp_path / entry["library"]).stat().st_size > 0
    assert (tmp_path / "lib" / "libcute_dsl_runtime.so").is_file()
    assert m1["arch"] == "sm_90a" and m1["format"] == "futx-aot/1"
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk["entries"]["smoke.axpy.bf16"]["fingerprint"] == entry["fingerprint"]

    m2 = build(tmp_path, only="smoke.*", jobs=1, progress=False)  # nothing to do
    assert m2["entries"]["smoke.axpy.bf16"]["built"] == entry["built"]

    spec = get_spec("smoke.axpy.bf16")
    assert check_entry(tmp_path, read_manifest(tmp_path), spec, "sm_90a").name == "libcute_dsl_runtime.so"
    stale = read_manifest(tmp_path)
    stale["entries"]["smoke.axpy.bf16"]["fingerprint"] = "0" * 32
    with pytest.raises(StaleArtifactError, match="different sources"):
        check_entry(tmp_path, stale, spec, "sm_90a")
    with pytest.raises(StaleArtifactError, match="built for"):
        check_entry(tmp_path, {**stale, "arch": "sm_100a"}, spec, "sm_90a")


@pytest.mark.slow
def test_export_refuses_an_object_built_for_another_arch(tmp_path):
    """The DSL reads CUTE_DSL_ARCH once, at import: a process that imported it before setting the target
    builds for its default arch. The export must refuse that object instead of shipping it."""
    import subprocess
    import sys
    import textwrap

    pytest.importorskip("cutlass")
    code = textwrap.dedent(f"""
        import os, cutlass                              # imported before the target is set
        os.environ["CUTE_DSL_ARCH"] = "sm_90a"
        from futx.runtime.compiler import export_spec
        from futx.runtime.registry import get_spec
        try:
            export_spec(get_spec("engine.rms_rows"), {str(tmp_path)!r}, sass=False)
        except RuntimeError as exc:
            assert "holds no sm_90a code" in str(exc), exc
        else:
            raise SystemExit("exported an object without sm_90a code")
    """)
    env = {k: v for k, v in __import__("os").environ.items() if k != "CUTE_DSL_ARCH"}
    res = subprocess.run([sys.executable, "-c", code], env=env, timeout=600, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-1000:]
