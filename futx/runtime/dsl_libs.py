"""Where the DSL's runtime pieces live, found without importing the DSL compiler.

An exported kernel object needs two shared libraries at load time: `libcute_dsl_runtime.so` (from the
`nvidia-cutlass-dsl-libs-cu13` wheel, or bundled into an AOT directory by `futx build`) and
`libtvm_ffi.so` (from `apache-tvm-ffi`). Neither needs the 190 MB MLIR compiler.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
from functools import lru_cache
from pathlib import Path

RUNTIME_LIB = "libcute_dsl_runtime.so"
RUNTIME_VERSION_FILE = "CUTE_DSL_RUNTIME_VERSION"


def installed_dsl_version() -> str | None:
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return None


def dsl_compiler_available() -> bool:
    return importlib.util.find_spec("cutlass") is not None or _dsl_package_dir() is not None and (
        _dsl_package_dir() / "dsl_packages" / "cutlass").is_dir()


def _dsl_package_dir() -> Path | None:
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def installed_runtime_lib() -> Path | None:
    """libcute_dsl_runtime.so of the installed wheel (cu13 build preferred)."""
    env = os.environ.get("FUTX_CUTE_DSL_RUNTIME")
    if env:
        return Path(env)
    pkg = _dsl_package_dir()
    if pkg is None:
        return None
    for flavour in ("cu13", "cu12"):
        lib = pkg / flavour / "lib" / RUNTIME_LIB
        if lib.is_file():
            return lib
    return None


def tvm_ffi_lib_dir() -> Path:
    import tvm_ffi

    return Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent


@lru_cache(maxsize=None)
def preload_runtime(lib_path: str) -> None:
    """Load libcute_dsl_runtime globally so kernel libraries resolve it by soname."""
    import tvm_ffi  # noqa: F401  (loads libtvm_ffi.so globally)

    ctypes.CDLL(lib_path, mode=ctypes.RTLD_GLOBAL)
