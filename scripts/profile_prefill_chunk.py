"""Where a serving prefill chunk's time goes: one packed 512-token chunk of the kernel prefill (8B shape, random
weights, as scripts/bench_serving.py builds the engine) timed and profiled with torch.profiler.

    python scripts/profile_prefill_chunk.py [--tokens 512] [--cache int4|bf16] [--layers 32] [--glue eager|kernel|compiled]

Runs the chunk eagerly (PrefillModel.forward) and replayed as a CUDA graph (PrefillGraphs), interleaved in one
process. Prints the wall time per chunk of each (synchronized, median of 9), the GPU time of the graph (CUDA
events), and for the eager chunk the top operators by CUDA and by CPU time and the number of host
synchronizations (cudaStreamSynchronize / device-to-host copies) per chunk.
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
    p.add_argument("--glue", default="kernel", choices=("eager", "kernel", "compiled"))
    a = p.parse_args(argv)
    ns = argparse.Namespace(backend="kernels", device="cuda", weights="int4", cache=a.cache, prefill_format="e4m3",
                            seed=0, max_batch=32, capacity=2048, no_graphs=True, prefill_glue=a.glue)
    cfg = config_of("llama-3.1-8b", a.layers)
    torch.inference_mode().__enter__()
    engine = build_engine(cfg, ns)
    from futx.engine.prefill import prefill_tokens
    from futx.engine.prefill_graphs import PrefillGraphs

    model = engine.prefill_model
    graphs = PrefillGraphs(model, max_rows=a.tokens, max_requests=ns.max_batch)
    prompt = [list(torch.randint(0, cfg.vocab_size, (a.tokens,)).tolist())]
    toks = torch.tensor(prompt[0])

    def eager():
        prefill_tokens(model, prompt, starts=[0], slots=[0])
        torch.cuda.synchronize()

    def graph():
        graphs.run(toks, [a.tokens], [0], [0])
        torch.cuda.synchronize()

    for _ in range(3):
        eager()
        graph()
    times = {"eager": [], "graph": []}
    gpu = []
    for _ in range(9):
        for name, fn in (("eager", eager), ("graph", graph)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graphs.graphs[a.tokens].replay()
        e1.record()
        torch.cuda.synchronize()
        gpu.append(e0.elapsed_time(e1))
    for name, ts in times.items():
        print(f"{a.tokens}-token chunk, {a.layers} layers, cache {a.cache}, glue {a.glue}, {name}: "
              f"{1e3 * statistics.median(ts):.1f} ms wall (median of 9)", flush=True)
    print(f"graph replay GPU time: {statistics.median(gpu):.1f} ms (CUDA events, median of 9)", flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eager()
    ev = prof.key_averages()
    print(ev.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    print(ev.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    syncs = sum(e.count for e in ev if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
    d2h = sum(e.count for e in ev if "DtoH" in e.key or e.key == "aten::item" or e.key == "aten::_local_scalar_dense")
    print(f"host synchronizations per chunk: {syncs} stream/device syncs, {d2h} item/DtoH copies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
