"""Find a kernel at first use: a valid AOT artifact, else a JIT compile (cached on disk), never a stale one.

Search order for `get_kernel(key)`:
  1. directories in $FUTX_AOT_DIR (os.pathsep-separated), then the JIT cache ($FUTX_CACHE_DIR,
     default ~/.cache/futx/<arch>): an entry is used only if its arch matches this GPU, its fingerprint
     matches the current sources, and a runtime library of its DSL version is available;
  2. otherwise JIT: compile with the installed DSL (TVM-FFI convention) and export into the cache, so
     the next process loads it without compiling.
An artifact that exists but does not match is refused with a warning that says why; if no DSL compiler is
installed either, the error says what to rebuild.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

from futx.runtime.build import FORMAT, MANIFEST, _write_manifest, read_manifest
from futx.runtime.dsl_libs import (RUNTIME_LIB, RUNTIME_VERSION_FILE, dsl_compiler_available,
                                   installed_dsl_version, installed_runtime_lib, preload_runtime)
from futx.runtime.fingerprint import spec_fingerprint
from futx.runtime.registry import KernelSpec, get_spec

_LOCK = threading.Lock()
_LOADED: dict[str, Callable] = {}
_ORIGIN: dict[str, str] = {}  # key -> "aot:<dir>" | "jit-cache:<dir>" | "jit"
STATS = {"jit_compiles": 0, "aot_loads": 0}


class StaleArtifactError(RuntimeError):
    pass


def device_arch() -> str:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("futx kernels need a CUDA GPU; none is visible to torch")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        raise RuntimeError(f"futx kernels are built for Hopper (sm_90a); this GPU is sm_{major}{minor}")
    return "sm_90a"


def cache_dir(arch: str) -> Path:
    base = os.environ.get("FUTX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "futx")
    return Path(base) / arch


def aot_dirs() -> list[Path]:
    return [Path(p) for p in os.environ.get("FUTX_AOT_DIR", "").split(os.pathsep) if p]


def _runtime_for(directory: Path, version: str) -> Path | None:
    bundled = directory / "lib" / RUNTIME_LIB
    vfile = directory / "lib" / RUNTIME_VERSION_FILE
    if bundled.is_file() and vfile.is_file() and vfile.read_text().strip() == version:
        return bundled
    if installed_dsl_version() == version:
        return installed_runtime_lib()
    return None


def check_entry(directory: Path, manifest: dict[str, Any], spec: KernelSpec, arch: str) -> Path:
    """Return the runtime library to preload if the entry is valid here; raise StaleArtifactError if not."""
    where = directory / MANIFEST
    if manifest.get("arch") != arch:
        raise StaleArtifactError(f"{where}: built for {manifest.get('arch')}, this GPU needs {arch}")
    entry = manifest["entries"][spec.key]
    version = manifest.get("dsl_version", "?")
    want = spec_fingerprint(spec, arch, version)
    if entry.get("fingerprint") != want:
        raise StaleArtifactError(
            f"{where}: {spec.key} was built from different sources (fingerprint {entry.get('fingerprint')} "
            f"!= {want}); rebuild with `futx build --out {directory} --only '{spec.key}'`")
    lib = directory / entry["library"]
    if not lib.is_file():
        raise StaleArtifactError(f"{where}: {spec.key} lists {entry['library']}, which is missing")
    runtime = _runtime_for(directory, version)
    if runtime is None:
        raise StaleArtifactError(f"{where}: needs libcute_dsl_runtime {version}; neither bundled in "
                                 f"{directory / 'lib'} nor installed (installed DSL: {installed_dsl_version()})")
    return runtime


def _load_library(directory: Path, manifest: dict[str, Any], spec: KernelSpec, runtime: Path) -> Callable:
    import tvm_ffi

    preload_runtime(str(runtime))
    entry = manifest["entries"][spec.key]
    module = tvm_ffi.load_module(str(directory / entry["library"]))
    return module[entry["symbol"]]


def _try_artifacts(spec: KernelSpec, arch: str) -> Callable | None:
    for directory in [*aot_dirs(), cache_dir(arch)]:
        try:
            manifest = read_manifest(directory)
        except ValueError as exc:
            warnings.warn(f"futx: ignoring AOT directory: {exc}", stacklevel=3)
            continue
        if not manifest or spec.key not in manifest.get("entries", {}):
            continue
        try:
            runtime = check_entry(directory, manifest, spec, arch)
        except StaleArtifactError as exc:
            warnings.warn(f"futx: refusing artifact: {exc}", stacklevel=3)
            continue
        fn = _load_library(directory, manifest, spec, runtime)
        _ORIGIN[spec.key] = f"aot:{directory}"
        STATS["aot_loads"] += 1
        return fn
    return None


def _require_compiler(spec: KernelSpec, arch: str) -> None:
    if not dsl_compiler_available():
        raise RuntimeError(
            f"futx: no valid ahead-of-time artifact for {spec.key!r} and the CUTLASS DSL compiler is not "
            f"installed. Build one with `futx build --arch {arch} --only '{spec.key}' --out DIR` and set "
            "FUTX_AOT_DIR=DIR, or pip install 'nvidia-cutlass-dsl[cu13]'.")


def _jit_in_process(spec: KernelSpec, arch: str) -> Callable:
    _require_compiler(spec, arch)
    from futx.runtime.compiler import compile_spec

    STATS["jit_compiles"] += 1
    _ORIGIN[spec.key] = "jit"
    return compile_spec(spec, arch)


def _jit(spec: KernelSpec, arch: str) -> Callable:
    _require_compiler(spec, arch)
    STATS["jit_compiles"] += 1
    target = cache_dir(arch)
    try:  # compile once, export to the disk cache, load that (the next process skips the compile)
        from futx.runtime.compiler import export_spec

        entry = export_spec(spec, target, arch, sass=False)
        version = installed_dsl_version() or "?"
        entry.update(fingerprint=spec_fingerprint(spec, arch, version), module=spec.module)
        manifest = read_manifest(target) or {"format": FORMAT, "arch": arch, "dsl_version": version,
                                             "entries": {}}
        if manifest.get("dsl_version") != version:
            manifest = {"format": FORMAT, "arch": arch, "dsl_version": version, "entries": {}}
        manifest["entries"][spec.key] = entry
        _write_manifest(target, manifest)
        fn = _load_library(target, manifest, spec, installed_runtime_lib())
        _ORIGIN[spec.key] = f"jit-cache:{target}"
        return fn
    except (OSError, RuntimeError) as exc:  # no linker / read-only cache: fall back to in-process
        warnings.warn(f"futx: disk cache unavailable for {spec.key} ({exc}); compiling in-process", stacklevel=3)
        STATS["jit_compiles"] -= 1
        return _jit_in_process(spec, arch)


def get_kernel(key: str) -> Callable:
    """The callable for registry entry `key` (tensors and scalars in the jit function's order)."""
    fn = _LOADED.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _LOADED.get(key)
        if fn is None:
            spec = get_spec(key)
            arch = device_arch()
            # auto: artifact else compile+cache | aot: never compile | jit: always compile in-process
            mode = os.environ.get("FUTX_KERNELS", "auto")
            if mode not in ("auto", "aot", "jit"):
                raise ValueError(f"FUTX_KERNELS must be auto, aot or jit, got {mode!r}")
            if mode == "jit":
                fn = _jit_in_process(spec, arch)
            else:
                fn = _try_artifacts(spec, arch)
            if fn is None:
                if mode == "aot":
                    raise RuntimeError(f"futx: FUTX_KERNELS=aot but no valid artifact for {key!r} in "
                                       f"{[str(d) for d in aot_dirs()] or 'FUTX_AOT_DIR (unset)'}")
                fn = _jit(spec, arch)
            _LOADED[key] = fn
    return fn


def kernel_origin(key: str) -> str | None:
    """Where a loaded kernel came from (for tests and the deployment demo)."""
    return _ORIGIN.get(key)
