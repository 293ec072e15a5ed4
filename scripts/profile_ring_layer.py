"""Drive the 8B step on the ring layer for a profiler (issue 29 diagnostic, GPU): a few CUDA graph replays at one
point, nothing timed; Nsight Compute picks one layer launch (`persistent.sh ncusrc`: per-instruction warp stall
samples of the ring kernel, to say where its consumers' time goes).

    python scripts/profile_ring_layer.py [--batch 1] [--context 1024] [--variant g2] [--replays 3]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--variant", default="", help="a ring tuning variant (catalog persistent.RING_TUNING)")
    p.add_argument("--replays", type=int, default=3)
    a = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("profile_ring_layer: needs a CUDA GPU")
        return 2
    from scripts.bench_engine import replaying_model, ring_step

    _, m, g = replaying_model(a.shape, "int4", "int4", a.batch, a.context, persistent=ring_step(a.variant))
    for _ in range(a.replays):
        g.replay(a.batch)
    torch.cuda.synchronize()
    print("replayed", a.replays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
