"""Source fingerprints: an artifact is valid only for the exact sources and toolchain that built it."""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

from futx.runtime.registry import KernelSpec

REPO_ROOT = Path(__file__).resolve().parents[2]

# What every variant's binary depends on besides its own sources: the DSL compile options.
COMPILE_OPTIONS = "--enable-tvm-ffi"


def _expand(rel: str) -> list[Path]:
    path = REPO_ROOT / rel
    if path.is_dir():
        return sorted(p for p in path.rglob("*.py") if "__pycache__" not in p.parts)
    if path.is_file():
        return [path]
    raise FileNotFoundError(f"fingerprint source {rel!r} does not exist under {REPO_ROOT}")


@lru_cache(maxsize=None)
def _file_digest(path: Path, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def spec_fingerprint(spec: KernelSpec, arch: str, dsl_version: str) -> str:
    h = hashlib.sha256()
    h.update(f"{spec.key}|{spec.module}|{spec.factory}|{spec.params!r}|{arch}|{dsl_version}|{COMPILE_OPTIONS}"
             .encode())
    files: set[Path] = set()
    for rel in (spec.module_file, *spec.sources):
        files.update(_expand(rel))
    for path in sorted(files):
        st = path.stat()
        h.update(path.relative_to(REPO_ROOT).as_posix().encode())
        h.update(_file_digest(path, st.st_mtime_ns, st.st_size).encode())
    return h.hexdigest()[:32]
