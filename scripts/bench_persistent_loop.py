"""The handoff of the persistent kernel's task loop (issue 29) on the GPU: the time from a counter's last increment
to its waiters running, against a kernel boundary.

decode/persistent_loop.py's chain kernel runs R rounds of one tiny task per CTA (each reads three tiles of the round
before, written by other CTAs), ordered by one counter. Per round: (time of R rounds - time of 1 round) / (R - 1),
each launch with its counter memset in one CUDA graph, interleaved (bench_engine's Timer), median of --reps. Against it: the same rounds as R launches
of one round each in one CUDA graph (a kernel boundary per round, no programmatic dependent launch). The model of
docs/persistent.md spans handoffs of 0 to 1 us (the 8B layer 27 to 33 us); this measures it.

  python scripts/bench_persistent_loop.py [--ctas 132,264] [--rounds 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ctas", default="132,264")
    p.add_argument("--rounds", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench_persistent_loop: needs a CUDA GPU")
        return 2
    import tuning_space

    from decode import persistent_host as pl
    from futx.runtime import get_kernel
    from scripts.bench_engine import Timer, graph_of

    tuning_space.register()
    chain = get_kernel("decode.persistent.chain")

    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    timer = Timer(1, a.reps)

    rows = []
    for ctas in (int(c) for c in a.ctas.split(",")):
        x = torch.randn(a.rounds + 1, ctas * pl.THREADS, device="cuda") * 1e-3
        runs = {}
        for rounds in (1, a.rounds):
            table, counters = pl.chain_table(rounds, ctas, ctas)
            table, counters = table.cuda(), counters.cuda()

            def one(table=table, counters=counters):
                counters.zero_()
                chain(table, counters, x)
            runs[rounds] = graph_of(one, stream)
        singles = []
        for r in range(a.rounds):   # round r alone: reads row r, writes row r + 1, waits on nothing
            table, counters = pl.chain_table(1, ctas, ctas)
            a0 = table[:, :, pl.F["a0"]]
            a0.copy_(torch.where(table[:, :, pl.F["kind"]] != pl.END, r + 1, a0))
            singles.append((table.cuda(), counters.cuda()))
        boundary = graph_of(lambda: [chain(t, c, x) for t, c in singles], stream)
        ms = timer.run({"one": runs[1].replay, "all": runs[a.rounds].replay, "boundary": boundary.replay})
        t1, tr, tb = (ms[k]["ms"] for k in ("one", "all", "boundary"))
        row = {"ctas": ctas, "rounds": a.rounds, "one_round_ms": t1, "persistent_ms": tr,
               "handoff_us": (tr - t1) / (a.rounds - 1) * 1e3, "launches_ms": tb,
               "boundary_us": tb / a.rounds * 1e3}
        rows.append(row)
        print(f"{ctas} CTAs: {row['handoff_us']:.2f} us per round in one persistent launch "
              f"({tr:.3f} ms for {a.rounds}); {row['boundary_us']:.2f} us per round as {a.rounds} launches", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
