from futx.runtime.registry import KernelSpec

SPECS = [
    KernelSpec(key="smoke.axpy.bf16", module="futx.runtime.smoke", params=(("dtype", "bf16"),),
               doc="y = alpha*x + y (runtime self-test)"),
]
