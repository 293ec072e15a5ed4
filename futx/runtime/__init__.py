"""futx kernel runtime: one registry of variants, ahead-of-time build, JIT fallback, loading via TVM-FFI.

    get_kernel(key)      -> callable(torch tensors..., scalars...)   (AOT artifact or JIT, cached)
    build(out, ...)      -> manifest                                 (`futx build`)
    all_specs()/select() -> registry entries
"""

from futx.runtime.registry import KernelSpec, all_specs, get_spec, register, select
from futx.runtime.loader import STATS, StaleArtifactError, get_kernel, kernel_origin


def build(*args, **kwargs):
    from futx.runtime.build import build as _build

    return _build(*args, **kwargs)


def compile_spec(spec, arch: str = "sm_90a"):
    from futx.runtime.compiler import compile_spec as _compile

    return _compile(spec, arch)


__all__ = ["KernelSpec", "all_specs", "get_spec", "register", "select", "get_kernel", "kernel_origin",
           "build", "compile_spec", "STATS", "StaleArtifactError"]
