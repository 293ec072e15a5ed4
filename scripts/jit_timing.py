"""Time the JIT path against the disk cache it fills (run on a GPU machine with the DSL installed).

    python scripts/jit_timing.py [--only 'prefill.gemm.e4m3.scale_bf16*'] [--cache DIR]

Process 1 starts with an empty cache: `get_kernel` compiles, exports, links and loads. Process 2 finds the
artifact in the cache and only loads it. Prints both times per kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
import torch
torch.cuda.init()
from futx.runtime import STATS, get_kernel, kernel_origin, select
rows = []
for spec in select(sys.argv[1])[:int(sys.argv[2])]:
    t0 = time.perf_counter(); get_kernel(spec.key); dt = time.perf_counter() - t0
    rows.append({"key": spec.key, "seconds": round(dt, 3), "origin": kernel_origin(spec.key)})
print(json.dumps({"rows": rows, "jit_compiles": STATS["jit_compiles"]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="prefill.gemm.e4m3.scale_bf16*,decode.gemv.int4*")
    ap.add_argument("--count", type=int, default=2, help="kernels per process")
    ap.add_argument("--cache", default=None)
    args = ap.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="futx-jit-")
    env = dict(os.environ, FUTX_CACHE_DIR=cache, FUTX_KERNELS="auto", FUTX_AOT_DIR="")
    for attempt in ("empty cache (compile)", "warm cache (load)"):
        out = subprocess.run([sys.executable, "-c", CHILD, args.only, str(args.count)], env=env,
                             capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"child failed:\n{out.stderr[-3000:]}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
        print(attempt, json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
