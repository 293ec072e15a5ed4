"""How many cache tokens and 4096-token requests fit, with the BF16 main copy on every page and with the INT4-only
cache (`futx serve --cache-main none`), for a model shape on this GPU (issue 28, item 2).

Per mode: bytes of one cached token over all layers (EngineCache.page_bytes / page size), tokens per GB, and on a
GPU the pages that fit in the memory left after the decode weights (random INT4 weights of the shape, as
scripts/bench_engine.py), a reserve for the step buffers, CUDA graphs and the prefill's workspaces, and (INT4-only)
the staging pages: those pages are then allocated for real (EngineCache), so the count is one that fits, and the
4096-token requests they hold are pages // pages_for(4096 + the output).

  python scripts/cache_capacity.py                          8B shape, INT4 cache, on this GPU (or computed only)
  python scripts/cache_capacity.py --shape llama-3.1-70b --json cap.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--cache", default="int4", choices=("int4", "e4m3"))
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--request", type=int, default=4096, help="tokens of one request (prompt + output)")
    p.add_argument("--capacity", type=int, default=4352, help="--capacity of the server (staging pages: twice it)")
    p.add_argument("--reserve-gb", type=float, default=8.0, help="memory kept for buffers, graphs and prefill")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    import torch

    from futx.config import PRESETS
    from futx.engine.cache import EngineCache
    from futx.paging import PageLayout, pages_for

    cfg = PRESETS[a.shape]
    P = a.page_size
    full = EngineCache.page_bytes(cfg, a.cache, P)
    mirror = EngineCache.page_bytes(cfg, a.cache, P, main=False)
    staging = 2 * pages_for(a.capacity, P)
    per_request = pages_for(a.request, P)
    res = {"shape": a.shape, "cache": a.cache, "page_size": P, "request_tokens": a.request,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": " ".join(["scripts/cache_capacity.py", *(sys.argv[1:] if argv is None else argv)]),
           "modes": {"main+mirror": {"bytes_per_token": full / P, "tokens_per_gb": 1e9 * P / full},
                     "int4-only": {"bytes_per_token": mirror / P, "tokens_per_gb": 1e9 * P / mirror,
                                   "staging_pages": staging, "staging_gb": staging * full / 1e9}}}
    if torch.cuda.is_available():
        from futx.engine import random_packed

        dev = torch.device("cuda")
        before, total = torch.cuda.mem_get_info(dev)
        packed = random_packed(cfg, "int4", device=dev)   # noqa: F841 -- held while the caches are allocated
        torch.cuda.synchronize()
        free, _ = torch.cuda.mem_get_info(dev)
        res.update(gpu=torch.cuda.get_device_name(dev), total_gb=total / 1e9, weights_gb=(before - free) / 1e9,
                   free_after_weights_gb=free / 1e9, reserve_gb=a.reserve_gb)
        budget = free - a.reserve_gb * 1e9
        for mode, per_page, extra in (("main+mirror", full, 0), ("int4-only", mirror, staging * full)):
            pages = int((budget - extra) // per_page)
            lay = PageLayout.for_capacity(P, pages, 64, a.capacity, staging if extra else 0)
            cache = EngineCache(cfg, a.cache, 64, a.capacity, dev, layout=lay)   # allocated: the count fits
            r = res["modes"][mode]
            r.update(pages=pages, cache_gb=cache.nbytes() / 1e9, tokens=pages * P,
                     requests=pages // per_request)
            del cache
            torch.cuda.empty_cache()
        res["gain"] = res["modes"]["int4-only"]["requests"] / max(1, res["modes"]["main+mirror"]["requests"])
    for mode, r in res["modes"].items():
        print(f"{mode:12s} {r['bytes_per_token']:9.0f} B/token {r['tokens_per_gb']:9.0f} tokens/GB"
              + (f"  {r['pages']} pages = {r['tokens']} tokens = {r['requests']} requests of {a.request} "
                 f"({r['cache_gb']:.1f} GB)" if "pages" in r else ""))
    if "gain" in res:
        print(f"INT4-only holds {res['gain']:.2f}x the {a.request}-token requests on {res['gpu']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
