"""Host cost of one futx kernel call (goal: <= 10 us), measured on the runtime self-test kernel.

    python scripts/bench_runtime_overhead.py [--calls 20000]

Tiny inputs keep the GPU far ahead of the CPU, so calls/second measures the host path: the raw TVM-FFI
callable from `get_kernel`, the validated torch op, a real op (torch.ops.futx.decode_linear_int4 at M=1,
N=16, K=128, group 128), and a torch elementwise op for scale.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def per_call_us(fn, calls: int, rounds: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    import futx.ops  # noqa: F401
    from futx.runtime import get_kernel, kernel_origin

    x = torch.randn(256, device="cuda").bfloat16()
    y = torch.randn_like(x)
    raw = get_kernel("smoke.axpy.bf16")
    rows = [
        ("futx raw TVM-FFI callable", per_call_us(lambda: raw(x, y, 1.0), args.calls)),
        ("torch.ops.futx.axpy_ (validated)", per_call_us(lambda: torch.ops.futx.axpy_(x, y, 1.0), args.calls)),
        ("torch y.add_(x) (reference)", per_call_us(lambda: y.add_(x), args.calls)),
    ]
    # a real op: INT4 decode projection at a tiny shape (M=1, N=16, K=128, group 128): validation, plan
    # choice (cached), output allocation and the launch of the routed kernel
    try:
        from decode import plan

        xd = torch.randn(1, 128, device="cuda").bfloat16()
        packed = torch.zeros(1, 2, 32, 4, dtype=torch.int32, device="cuda")
        scales = torch.ones(1, 1, 16, dtype=torch.float16, device="cuda")
        key = plan.choose("int4", 128, "store", 1, 16, 128).key
        us = per_call_us(lambda: torch.ops.futx.decode_linear_int4(xd, packed, scales, 128), args.calls)
        rows.append((f"torch.ops.futx.decode_linear_int4 M=1 N=16 K=128 g128 ({key}, {kernel_origin(key)})", us))
    except Exception as exc:  # noqa: BLE001 - keep the other rows
        print(f"decode_linear_int4 row skipped: {type(exc).__name__}: {str(exc)[:160]}")
    print(f"kernel origin: {kernel_origin('smoke.axpy.bf16')}")
    print("| path | host us/call |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
