"""`futx --version`: futx's, torch's and the CUTLASS DSL's versions, and whether a Hopper GPU is present.

Versions come from the installed packages' metadata and the GPU from the driver (futx.gpus), so nothing is
imported or initialized: no torch, no CUDA context.
"""

from __future__ import annotations

import argparse
from importlib import metadata

from futx import gpus

PACKAGES = (("futx", "futx"), ("torch", "torch"), ("CUTLASS DSL", "nvidia-cutlass-dsl"))


def package_version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def gpu_line() -> str:
    if gpus.hopper_visible():
        return f"Hopper GPU present: {gpus.describe()}"
    return f"no Hopper GPU ({gpus.describe()})"


def version_text() -> str:
    lines = [f"{label} {package_version(dist)}" for label, dist in PACKAGES]
    return "\n".join(lines + [gpu_line()])


class VersionAction(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()
