"""The one registry of kernel variants.

A `KernelSpec` names a kernel family's compile-time configuration. Specs live in
`futx/runtime/catalog/<family>.py` files that import no CUDA/DSL code, so listing, fingerprinting and
validating artifacts works on any machine. See docs/kernel-contract.md.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

_KEY_RE = re.compile(r"^[a-z0-9][a-z0-9_.\-]*$")


@dataclass(frozen=True)
class KernelSpec:
    key: str                                  # unique, stable; names the exported symbol
    module: str                               # python module holding the factory (imported only to compile)
    factory: str = "compile_target"           # factory(**params) -> (jit_callable, fake_args)
    params: tuple[tuple[str, Any], ...] = ()  # compile-time configuration, hashable
    sources: tuple[str, ...] = ()             # repo-relative files/folders that fingerprint the variant
    expect_sass: tuple[str, ...] = ()         # instructions the compile check must find (QGMMA, HGMMA, HMMA)
    doc: str = ""
    tags: tuple[str, ...] = field(default=())
    # Objects the factory receives as `extra=` (a caller-composed epilogue chain). Not part of equality or
    # the fingerprint: the key and params must already identify them (a chain's key holds its fingerprint).
    extra: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not _KEY_RE.match(self.key):
            raise ValueError(f"kernel key {self.key!r} must be lower-case [a-z0-9_.-]")
        try:
            hash(self.params)
        except TypeError:
            raise TypeError(f"{self.key}: params must be hashable (tuples, not lists/dicts)") from None

    @property
    def param_dict(self) -> dict[str, Any]:
        return dict(self.params)

    @property
    def symbol(self) -> str:
        """C symbol of the exported function."""
        return "futx_" + re.sub(r"[^a-zA-Z0-9_]", "_", self.key)

    @property
    def module_file(self) -> str:
        return self.module.replace(".", "/") + ".py"


_REGISTRY: dict[str, KernelSpec] = {}
_LOADED = False


def register(*specs: KernelSpec) -> None:
    for spec in specs:
        old = _REGISTRY.get(spec.key)
        if old is not None and old != spec:
            raise ValueError(f"kernel key {spec.key!r} registered twice with different specs")
        _REGISTRY[spec.key] = spec


def _ensure_loaded() -> None:
    global _LOADED
    if not _LOADED:
        from futx.runtime import catalog  # noqa: F401  (registers every family)
        _LOADED = True


def all_specs() -> list[KernelSpec]:
    _ensure_loaded()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def get_spec(key: str) -> KernelSpec:
    _ensure_loaded()
    try:
        return _REGISTRY[key]
    except KeyError:
        close = [k for k in _REGISTRY if k.split(".")[0] == key.split(".")[0]][:8]
        raise KeyError(f"no kernel variant {key!r} in the futx registry"
                       + (f"; same family: {', '.join(close)}" if close else "")) from None


def select(patterns: Iterable[str] | str | None = None) -> list[KernelSpec]:
    """Specs whose key matches any of the glob patterns (all when None)."""
    specs = all_specs()
    if patterns is None:
        return specs
    if isinstance(patterns, str):
        patterns = [p for p in patterns.split(",") if p]
    patterns = list(patterns)
    return [s for s in specs if any(fnmatch.fnmatchcase(s.key, p) for p in patterns)]
