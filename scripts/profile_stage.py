"""What staging a cached prefix costs on the INT4-only cache (`--cache-main none`, futx.serve.engines.stage): its
mirror pages dequantized into the staging pages' main copy (futx.engine.paged_kv.dequantize_pages_into, the
stage; by the futx::main_rows_ kernel as the kernels engine runs it, and in torch), against the same through the slot's table (dequantize_slot) and one layer per call; and copying mirror
pages (EngineCache.copy_pages, what unstage does with a prefill's own rows). The 8B shape's 32 layers; CUDA events
around each (median of --reps) and the host time of a call.

  python scripts/profile_stage.py [--fmt int4,e4m3] [--tokens 1024,4096] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from futx.config import PRESETS  # noqa: E402
from futx.engine.cache import EngineCache  # noqa: E402
from futx.engine.paged_kv import dequantize_pages, dequantize_pages_into, dequantize_slot  # noqa: E402
from futx.paging import PageLayout, pages_for  # noqa: E402


def _time(fn, reps: int) -> tuple[float, float]:
    """(median device ms, median host ms) of fn()."""
    dev, host = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        dev.append(a.elapsed_time(b))
    return statistics.median(dev), statistics.median(host)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--fmt", default="int4,e4m3")
    p.add_argument("--tokens", default="1024,4096")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("profile_stage: needs a CUDA device")
        return 2
    cfg, size = PRESETS[a.shape], 128
    rows = []
    for fmt in a.fmt.split(","):
        for n in (int(x) for x in a.tokens.split(",")):
            k = pages_for(n, size)
            lay = PageLayout.for_capacity(size, pages=2 * k, slots=1, capacity=k * size, staging=k)
            cache = EngineCache(cfg, fmt, 1, k * size, "cuda", layout=lay)
            cache.randomize(0)   # never time on zeros; E4M3 without NaN codes
            own = [lay.first_page + i for i in range(k)]
            staging = list(range(k))
            cache.set_pages(0, staging)
            copy = _time(lambda: cache.copy_pages(own, staging), a.reps)
            stage = _time(lambda: dequantize_pages_into(cache, own, staging, n), a.reps)
            kernel = _time(lambda: dequantize_pages_into(cache, own, staging, n, kernel=True), a.reps)
            grouped = _time(lambda: dequantize_slot(cache, 0, n), a.reps)
            per_layer = _time(lambda: [dequantize_pages(layer, cache.table, size, 0, n) for layer in cache.layers],
                              a.reps)
            row = {"fmt": fmt, "tokens": n, "layers": cfg.num_hidden_layers, "copy_pages_ms": copy,
                   "stage_ms": stage, "stage_kernel_ms": kernel, "dequantize_grouped_ms": grouped, "dequantize_per_layer_ms": per_layer}
            rows.append(row)
            print(f"{fmt} {n:5d} tokens: stage by futx::main_rows_ {kernel[0]:.3f} ms (host {kernel[1]:.3f}), in torch "
                  f"{stage[0]:.2f} ms (host {stage[1]:.2f}); copy_pages {copy[0]:.2f} ms "
                  f"(host {copy[1]:.2f}); dequantize_slot "
                  f"{grouped[0]:.2f} ms (host {grouped[1]:.2f}); one layer per call {per_layer[0]:.2f} ms "
                  f"(host {per_layer[1]:.2f})", flush=True)
            del cache
            torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": a.shape,
                                            "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
