"""Launch decode projections for Nsight Compute: each named variant of one shape `--launches` times, an L2 flush
before each launch (weights come from HBM, as in the decode step). Profile with, e.g.:

  ncu --clock-control none -k regex:Gemv --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \\
      python3 scripts/profile_decode_linear.py --n 28672 --k 4096 --epilogue swiglu --variants ,ring4,p1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--k", type=int, required=True)
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--epilogue", default="store", choices=("store", "residual", "swiglu"))
    p.add_argument("--kernel", default="auto", help="auto, tile, gemv or skinny")
    p.add_argument("--variants", default="", help="comma-separated variants of that kernel ('' = the shipped one)")
    p.add_argument("--warps", type=int, default=None, help="tile GEMV warps (default: the rule's)")
    p.add_argument("--nblocks", type=int, default=None, help="tile GEMV n-blocks per CTA (default: 1)")
    p.add_argument("--launches", type=int, default=3)
    a = p.parse_args(argv)

    import tuning_space
    from futx.ops.decode_linear import run_variant

    tuning_space.register()
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, k, m = a.n, a.k, a.m
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    r = torch.randn(m, n, device="cuda", generator=gen).bfloat16() if a.epilogue == "residual" else None
    packed = torch.randint(-2**31, 2**31 - 1, (n // 16, k // 64, 32, 4), dtype=torch.int32, device="cuda",
                           generator=gen)
    scales = (torch.rand(n // 16, k // 128, 16, device="cuda", generator=gen) * 0.01).half()
    flush = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    for v in a.variants.split(","):
        for _ in range(a.launches):
            flush.add_(1)
            run_variant("int4", x, packed, scales, 128, a.epilogue, r, a.kernel, v, warps=a.warps, nblocks=a.nblocks)
        torch.cuda.synchronize()
        print(f"variant {v or 'shipped'}: {a.launches} launches", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
