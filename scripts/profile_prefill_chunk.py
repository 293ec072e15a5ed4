"""Where a serving prefill chunk's time goes: one packed 512-token chunk of the kernel prefill (8B shape, random
weights, as scripts/bench_serving.py builds the engine) timed and profiled with torch.profiler.

    python scripts/profile_prefill_chunk.py [--tokens 512] [--cache int4|bf16] [--layers 32]

Prints the wall time per chunk (synchronized, median of 5), the top operators by CUDA and by CPU time, and the
number of host synchronizations (cudaStreamSynchronize / device-to-host copies) per chunk.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_serving import build_engine, config_of  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--cache", default="int4")
    p.add_argument("--layers", type=int, default=32)
    a = p.parse_args(argv)
    ns = argparse.Namespace(backend="kernels", device="cuda", weights="int4", cache=a.cache, prefill_format="e4m3",
                            seed=0, max_batch=32, capacity=2048, no_graphs=True)
    cfg = config_of("llama-3.1-8b", a.layers)
    engine = build_engine(cfg, ns)
    from futx.engine.prefill import prefill_tokens

    model = engine.prefill_model
    prompt = [list(torch.randint(0, cfg.vocab_size, (a.tokens,)).tolist())]

    def chunk():
        prefill_tokens(model, prompt, starts=[0], slots=[0])
        torch.cuda.synchronize()

    for _ in range(3):
        chunk()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        chunk()
        times.append(time.perf_counter() - t0)
    print(f"{a.tokens}-token chunk, {a.layers} layers, cache {a.cache}: {1e3 * statistics.median(times):.1f} ms "
          f"(median of 5)", flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        chunk()
    ev = prof.key_averages()
    print(ev.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    print(ev.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    syncs = sum(e.count for e in ev if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
    d2h = sum(e.count for e in ev if "DtoH" in e.key or e.key == "aten::item" or e.key == "aten::_local_scalar_dense")
    print(f"host synchronizations per chunk: {syncs} stream/device syncs, {d2h} item/DtoH copies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
