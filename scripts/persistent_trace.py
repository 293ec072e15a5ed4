"""Where the time goes inside the persistent ring layer (issue 29 diagnostic, GPU): the 8B step (or --shape) at one
row on the ring layer's traced kernel, a few graph replays, then the last step's task trace summarized
(futx.engine.persistent_trace: per kind busy / wait / weight lead, each layer's phases) and a layer's achieved
bandwidth (its weight and cache bytes over its median span).

    python scripts/persistent_trace.py [--shape llama-3.1-8b] [--context 1024] [--cache int4] [--json FILE]
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--cache", default="int4", choices=("int4", "e4m3"))
    p.add_argument("--splits", type=int, default=None, help="split-KV count (default: the attention op's choice)")
    p.add_argument("--replays", type=int, default=5)
    p.add_argument("--variant", default="", help="a traced ring tuning variant (catalog persistent.RING_TRACED_TUNING; "
                                                  "the tuning space registered)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("persistent_trace: needs a CUDA GPU")
        return 2
    from futx.engine.persistent_trace import report, summarize
    from scripts.bench_engine import HBM_BYTES_PER_S, head_bytes, replaying_model, ring_step, step_bytes

    cfg, m, g = replaying_model(a.shape, "int4", a.cache, 1, a.context,
                                persistent=ring_step(a.variant, splits=a.splits, trace=True))
    for _ in range(a.replays):
        g.replay(1)
    torch.cuda.synchronize()
    t = m.persistent.tables(1)
    s = summarize(t["table"], t["trace"])
    print(f"{cfg.name} ring layer, 1 x {a.context}, {a.cache} cache, {t['splits']} splits "
          f"({torch.cuda.get_device_name()}):")
    print(report(s), flush=True)
    # a layer's bytes (its weights and cache rows) over its median span: the layer's achieved bandwidth
    layers = len(m.packed.layers)
    layer_bytes = (step_bytes(m, 1, a.context) - head_bytes(cfg)) / layers
    span = float(torch.tensor([lay["span_us"] for lay in s["layers"]]).median())
    s["layer_bytes"], s["layer_tb_s"] = layer_bytes, layer_bytes / span / 1e6
    print(f"a layer moves {layer_bytes / 1e6:.2f} MB: {s['layer_tb_s']:.2f} TB/s over the median span "
          f"({100 * s['layer_tb_s'] * 1e12 / HBM_BYTES_PER_S:.0f}% of {HBM_BYTES_PER_S / 1e12:.2f})", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"shape": cfg.name, "context": a.context, "cache": a.cache,
                                            "splits": t["splits"], "device": torch.cuda.get_device_name(),
                                            "summary": s}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
