"""Prefill then teacher-forced decode on the engine: what the prefill tests compare between prefill paths."""

import torch

from futx.engine import DecodeModel, pack_model
from futx.engine.prefill import PrefillModel, pack_prefill, prefill_tokens
from futx.quant.simulated import quantized_weights


def forced_decode_logits(weights, prefill, prompts, cont, *, wf="e4m3", cf="int4", capacity=64,
                         backend="emulated", device="cpu"):
    """Prefill prompt[:-1] (the prefill block in format `prefill` on `backend`, or "reference": the BF16
    reference path through DecodeEngine), then decode steps fed the last prompt token and then `cont` (teacher
    forcing: every run sees the same inputs); returns the logits of every step [B, steps, V]."""
    from futx.serve.engines import Chunk, DecodeEngine

    model = DecodeModel(pack_model(weights, wf, progress=False), cf, max_batch=len(prompts), capacity=capacity,
                        backend=backend, device=device)
    heads = [p[:-1] for p in prompts]
    if prefill == "reference":
        DecodeEngine(model, None, quantized_weights(weights, "bf16")).prefill(
            [Chunk(b, h, 0, len(h)) for b, h in enumerate(heads)])
    else:
        prefill_tokens(PrefillModel(pack_prefill(weights, prefill), model.cache, backend), heads)
    out = []
    toks, pos = [p[-1] for p in prompts], [len(p) - 1 for p in prompts]
    for s in range(cont.shape[1]):
        model.run(toks, pos, list(range(len(prompts))))
        out.append(model.logits(model.buffers.hidden[:len(prompts)]).float())
        toks, pos = cont[:, s].tolist(), [q + 1 for q in pos]
    return torch.stack(out, 1)
