"""Decode-time kernels (CuTe DSL). Kernel modules import cutlass; `plan` does not, so the torch ops can
pick variants and launch shapes on a machine that only loads ahead-of-time artifacts."""
