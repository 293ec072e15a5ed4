"""Package names imported on first use (PEP 562), so importing a package's light modules (constants, format
checks) does not pull in torch through its __init__."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module-level __getattr__ for `package`: `exports` maps each name to the submodule defining it."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f".{exports[name]}", package), name)

    return __getattr__
