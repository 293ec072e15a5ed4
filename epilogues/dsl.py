"""The CuTe DSL names the policies trace with, importable without the DSL.

Policy classes are declarations first (their tensors, output dtype, column ratio: what op validation,
kernel keys and `futx build` read) and device code second (hooks traced when a kernel compiles). A
machine that only loads ahead-of-time kernels has no DSL, so policy modules import the DSL from here:
without it `cute.jit` leaves a hook undecorated and every other DSL name says what is missing.
"""

from __future__ import annotations

try:
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    AVAILABLE = True
except ImportError:  # an AOT-only machine: declarations only, nothing compiles here
    AVAILABLE = False

    class _Missing:
        def __init__(self, name: str):
            self._name = name

        def jit(self, fn=None, **_):
            return fn if fn is not None else (lambda f: f)

        def __getattr__(self, attr):
            raise RuntimeError(f"{self._name}.{attr} needs the CUTLASS DSL (pip install 'nvidia-cutlass-dsl[cu13]')")

        def __call__(self, *a, **k):
            raise RuntimeError(f"{self._name} needs the CUTLASS DSL (pip install 'nvidia-cutlass-dsl[cu13]')")

    cutlass, cute = _Missing("cutlass"), _Missing("cute")
    Float32, Int32, Int64 = _Missing("Float32"), _Missing("Int32"), _Missing("Int64")
