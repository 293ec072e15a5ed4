"""Where a single prompt's answer moves between implementations of the same quantized model (GPU).

For the SmolLM2 chat prompt "What is the capital of France?": the top-4 logits after the prompt on the
kernels (fused glue, unfused glue, 4 identical rows) and on the emulated backend, and the relative gap of the
final hidden states per position, for INT4/INT4, INT4/BF16 and BF16/INT4 (weights/cache). Used in
docs/results-engine.md to show that the INT4 cache amplifies last-bit differences.

  python scripts/engine_first_token.py [MODEL]          (default: the SmolLM2 GGUF)
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from futx.checkpoint import load  # noqa: E402
from futx.engine import DecodeModel, pack_model  # noqa: E402
from futx.tokenizer import load_tokenizer  # noqa: E402


def main() -> None:
    spec = sys.argv[1] if len(sys.argv) > 1 else None
    w = load(spec, device="cuda")
    tok = load_tokenizer(spec)
    ids = tok.encode(tok.chat_prompt("What is the capital of France?"))
    packed = {f: pack_model(w, f, progress=False) for f in ("int4", "bf16")}
    stop = sorted(tok.eos_ids)

    def run(wf, cf, backend, glue="fused", batch=1):
        m = DecodeModel(packed[wf], cf, max_batch=batch, capacity=64, backend=backend, glue=glue)
        hs = []
        for p, t in enumerate(ids):
            m.run([t] * batch, [p] * batch, list(range(batch)))
            hs.append(m.buffers.hidden[:1].float().clone())
        lg = m.logits(m.buffers.hidden[:1]).float()[0]
        top = lg.topk(4)
        return (torch.cat(hs), [(tok.decode([i]), round(v, 2)) for v, i in zip(top.values.tolist(), top.indices.tolist())],
                [round(float(lg[e]), 2) for e in stop])

    for wf, cf in (("int4", "int4"), ("int4", "bf16"), ("bf16", "int4")):
        he, te, ee = run(wf, cf, "emulated")
        print(wf, cf, "emulated", te, "stop tokens", ee, flush=True)
        for label, kw in (("kernels", {}), ("kernels-unfused", {"glue": "torch"}), ("kernels-M4", {"batch": 4})):
            hk, tk, ek = run(wf, cf, "kernels", **kw)
            d = (hk - he).norm(dim=-1) / he.norm(dim=-1)
            print(wf, cf, label, tk, "stop tokens", ek, "hidden rel err per position max %.3g last %.3g"
                  % (d.max(), d[-1]), flush=True)


if __name__ == "__main__":
    main()
