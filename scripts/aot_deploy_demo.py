"""Show that an AOT directory from `futx build` serves a fresh process with no DSL compile.

    python scripts/aot_deploy_demo.py --aot DIR [--keys smoke.axpy.bf16,...]

Runs a child process with FUTX_KERNELS=aot (compiling is an error there), calls each kernel's op once,
and prints time-to-first-result, whether the DSL compiler module was ever imported, and JIT count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
import futx.ops
from futx.runtime import STATS, kernel_origin
x = torch.randn(1 << 20, device="cuda").bfloat16(); y = torch.randn_like(x)
torch.cuda.synchronize()
t1 = time.perf_counter()
from futx.runtime import get_kernel
get_kernel("smoke.axpy.bf16")
t2 = time.perf_counter()
torch.ops.futx.axpy_(x, y, 2.0); torch.cuda.synchronize()
t3 = time.perf_counter()
print(json.dumps({"import_and_cuda_init_s": t1 - t0, "load_kernel_s": t2 - t1, "first_call_s": t3 - t2,
                  "jit_compiles": STATS["jit_compiles"],
                  "aot_loads": STATS["aot_loads"], "dsl_compiler_imported": "cutlass" in sys.modules,
                  "origin": kernel_origin("smoke.axpy.bf16")}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aot", required=True, help="directory written by `futx build`")
    args = ap.parse_args()
    env = dict(os.environ, FUTX_KERNELS="aot", FUTX_AOT_DIR=os.path.abspath(args.aot))
    for attempt in ("cold", "warm"):  # warm: OS page cache and tvm-ffi's own caches populated
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if out.returncode:
            sys.exit(f"child failed:\n{out.stderr}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
        res["process_wall_s"] = wall
        if out.stderr.strip():
            print(f"{attempt} child stderr (tail):", *out.stderr.strip().splitlines()[-4:], sep="\n  ")
        print(attempt, json.dumps(res, indent=1))
        assert res["jit_compiles"] == 0 and not res["dsl_compiler_imported"], "a JIT compile happened"


if __name__ == "__main__":
    main()
