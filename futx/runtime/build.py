"""`futx build`: compile registry entries ahead of time into a deployable directory.

Layout of the output directory:
    manifest.json                 format, arch, DSL version, one entry per variant (fingerprint, files, SASS stats)
    obj/<key>.o                   the exported object (TVM-FFI calling convention)
    lib/<key>.so                  the object linked against the two runtime libraries below
    lib/libcute_dsl_runtime.so    copied from the DSL wheel (unless --no-runtime), with its version file
The build is idempotent: entries whose fingerprint and files are current are skipped. It needs the DSL
and a C++ linker, but no GPU.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing
import os
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from futx.runtime.dsl_libs import RUNTIME_LIB, RUNTIME_VERSION_FILE, installed_dsl_version, installed_runtime_lib
from futx.runtime.fingerprint import spec_fingerprint
from futx.runtime.registry import KernelSpec, select

MANIFEST = "manifest.json"
FORMAT = "futx-aot/1"


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown manifest format {data.get('format')!r} (expected {FORMAT})")
    return data


def _write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    tmp = out_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, out_dir / MANIFEST)


def _set_arch(arch: str) -> None:
    # Before the worker unpickles its task: a spec's `extra` (a composed chain) imports the DSL, which
    # reads its target at import.
    os.environ["CUTE_DSL_ARCH"] = arch


def _worker(spec: KernelSpec, out_dir: str, arch: str) -> dict[str, Any]:
    # A fresh process per variant (max_tasks_per_child=1): the DSL reads its dump switches at import.
    os.environ["CUTE_DSL_ARCH"] = arch
    from futx.runtime.compiler import export_spec

    return export_spec(spec, out_dir, arch)


def _is_current(entry: dict[str, Any] | None, fingerprint: str, out_dir: Path) -> bool:
    return bool(entry) and entry.get("fingerprint") == fingerprint and all(
        (out_dir / entry[f]).is_file() for f in ("object", "library"))


def build(out_dir: str | Path, arch: str = "sm_90a", only: str | None = None, jobs: int | None = None,
          force: bool = False, bundle_runtime: bool = True, progress: bool = True) -> dict[str, Any]:
    """Compile the selected registry entries into `out_dir`; return the manifest."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dsl_version = installed_dsl_version()
    if dsl_version is None:
        raise RuntimeError("futx build needs the CUTLASS DSL: pip install 'nvidia-cutlass-dsl[cu13]'")
    specs = select(only)
    if not specs:
        raise ValueError(f"no registry entry matches {only!r}")
    manifest = read_manifest(out_dir) or {}
    if manifest and (manifest.get("arch") != arch or manifest.get("dsl_version") != dsl_version):
        manifest = {}  # a different target or toolchain: rebuild everything
    entries: dict[str, Any] = dict(manifest.get("entries", {}))
    manifest.update(format=FORMAT, arch=arch, dsl_version=dsl_version)

    todo: list[tuple[KernelSpec, str]] = []
    for spec in specs:
        fp = spec_fingerprint(spec, arch, dsl_version)
        if force or not _is_current(entries.get(spec.key), fp, out_dir):
            todo.append((spec, fp))
    failures: dict[str, str] = {}
    if todo:
        jobs = jobs or max(1, min(len(todo), os.cpu_count() or 1))
        ctx = multiprocessing.get_context("spawn")
        # children inherit the target from their first instruction: a re-imported __main__ may import the DSL
        # (which reads CUTE_DSL_ARCH once) before the initializer runs
        os.environ["CUTE_DSL_ARCH"] = arch
        bar = _progress(len(todo), progress)
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, max_tasks_per_child=1,
                                    initializer=_set_arch, initargs=(arch,)) as pool:
            futures = {pool.submit(_worker, spec, str(out_dir), arch): (spec, fp) for spec, fp in todo}
            for fut in cf.as_completed(futures):
                spec, fp = futures[fut]
                try:
                    entry = fut.result()
                except Exception as exc:  # keep building the others; report all failures at the end
                    failures[spec.key] = f"{type(exc).__name__}: {exc}"
                    entries.pop(spec.key, None)
                else:
                    entry.update(fingerprint=fp, module=spec.module, built=_now())
                    entries[spec.key] = entry
                    manifest["entries"] = entries
                    _write_manifest(out_dir, manifest)  # progress survives an interrupted build
                bar(spec.key)
    manifest["entries"] = entries
    manifest["updated"] = _now()
    if bundle_runtime:
        _bundle_runtime(out_dir, dsl_version)
    _write_manifest(out_dir, manifest)
    if failures:
        details = "\n".join(f"  {k}: {v.splitlines()[0] if v else v}" for k, v in sorted(failures.items()))
        raise RuntimeError(f"{len(failures)} of {len(todo)} variants failed to build:\n{details}")
    return manifest


def _bundle_runtime(out_dir: Path, dsl_version: str) -> None:
    src = installed_runtime_lib()
    if src is None:
        raise RuntimeError("libcute_dsl_runtime.so not found in the DSL wheel")
    dst = out_dir / "lib" / RUNTIME_LIB
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not dst.is_file() or dst.stat().st_size != src.stat().st_size:
        shutil.copy2(src, dst)
    (out_dir / "lib" / RUNTIME_VERSION_FILE).write_text(dsl_version + "\n")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _progress(total: int, enabled: bool):
    if not enabled:
        return lambda key: None
    try:
        from tqdm import tqdm
    except ImportError:  # plain lines instead of a bar
        count = [0]
        t0 = time.time()

        def step(key: str) -> None:
            count[0] += 1
            print(f"[{count[0]}/{total}] {key} ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
        return step
    bar = tqdm(total=total, desc="futx build", unit="kernel")

    def step(key: str) -> None:
        bar.set_postfix_str(key, refresh=False)
        bar.update(1)
        if bar.n == total:
            bar.close()
    return step
