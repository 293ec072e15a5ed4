"""Acceptance length of a DLite draft head (futx train-draft) by context position, on the reference path.

The target continues held-out enwiki prompts greedily (the part of the text the head was not trained on: the last
`holdout` of its paragraphs, as draft.json records), and greedy speculative decoding is replayed on those
continuations (futx.speculative.dlite_train.walk_acceptance): a verification drafts k tokens from the target's
hidden state and keeps the longest prefix the target's greedy tokens agree with, plus the target's own token.
The engine's speculative generation measures the same thing on the kernel path (INT4 weights: slightly other
numbers).

    python scripts/dlite_acceptance.py --draft runs/dlite-smollm2 --device cuda --json runs/dlite-smollm2/acceptance.json

Reports mean accepted drafts and tokens per verification overall and for the buckets 0-512, 512-1024,
1024-2048, and the drop from 0-512 to 1024-2048 (issue 27's goals: tokens per verification >= 2.5 at k = 4, and
at most 15% lower at 1024-2048 than at 0-512).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="the head's directory (draft.json + draft.safetensors)")
    p.add_argument("--model", default=None, help="the target (default: the model draft.json names)")
    p.add_argument("--data", default=None, help="text (default: ../shared/data/enwiki-sample); its held-out part")
    p.add_argument("--k", type=int, default=None, help="drafts per verification (default: the head's k_max)")
    p.add_argument("--ranges", default="0-512,512-1024,1024-2048", help="context ranges the prompts are placed in")
    p.add_argument("--prompts", type=int, default=32, help="continuations per range")
    p.add_argument("--gen-len", type=int, default=256, help="greedy tokens per continuation")
    p.add_argument("--batch", type=int, default=16, help="continuations generated together (one prompt length)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)

    import torch

    from futx.atomic import write_text
    from futx.checkpoint import load
    from futx.eval.device import setup_device
    from futx.speculative.dlite import CONFIG_FILE, DLiteConfig, load_head
    from futx.speculative.dlite_data import default_data
    from futx.speculative.dlite_train import concat_states, greedy_continuations, make_prompts, read_corpus, \
        walk_acceptance
    from futx.tokenizer import load_tokenizer

    dev = setup_device(args.device)
    config = DLiteConfig.from_json((Path(args.draft) / CONFIG_FILE).read_text())
    model = args.model or config.target_model or None
    k = args.k or config.k_max
    data = args.data or default_data()
    if data is None:
        print("no --data and no ../shared/data/enwiki-sample beside the repo", file=sys.stderr)
        return 2
    weights = load(model, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, device=dev)
    head = load_head(args.draft, weights, device=dev)
    _, held = read_corpus(data, load_tokenizer(model), float(config.training.get("holdout", 0.05)))
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    parts = []
    for r in args.ranges.split(","):
        lo, hi = (int(x) for x in r.split("-"))
        top = max(lo + 1, hi - args.gen_len)          # the continuation's positions stay mostly inside the range
        groups = max(1, math.ceil(args.prompts / args.batch))
        for g in range(groups):
            length = max(2, int(round(max(lo, 16) + (top - max(lo, 16)) * g / max(1, groups - 1))))
            b = min(args.batch, args.prompts - g * args.batch)
            parts.append(greedy_continuations(weights, make_prompts(held, length, b, gen), args.gen_len))
    states = {key: v.to(dev) for key, v in concat_states(parts).items()}
    res = walk_acceptance(head, states, k, autocast=dev.type == "cuda")
    by = res["by_position"]
    lo_b, hi_b = by.get("0-512"), by.get("1024-2048")
    if lo_b and hi_b and lo_b["mean_tokens_per_verification"]:
        res["drop_1024_2048_vs_0_512"] = round(1 - hi_b["mean_tokens_per_verification"]
                                               / lo_b["mean_tokens_per_verification"], 4)
    res.update(model=weights.config.name, draft=str(args.draft), data=str(data), seconds=round(time.perf_counter() - t0, 1),
               device=str(dev))
    print(json.dumps(res, indent=2))
    if args.json:
        write_text(args.json, json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
