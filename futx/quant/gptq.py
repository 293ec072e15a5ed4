"""INT4 quantization of a whole model: GPTQ layer by layer (or RTN), saved in the kernel format.

GPTQ runs on the gain-folded weights (what the kernels multiply by) and on the partially quantized
model's own activations: calibration windows pass through the already quantized earlier layers, and
inside a block the projections are solved in execution order (QKV, O, gate/up, down), each stage
seeing the inputs produced by the stages quantized before it. Projections named in `rtn` keep
round-to-nearest. The result packs through `int4.pack_int4`, the same packer RTN uses.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from futx.kvcache import KVCache
from futx.reference import PackedBatch, block
from futx.rope import cos_sin

from . import layouts
from .capture import probe
from .fold import fold_model
from .gptq_solver import DAMPING, HessianAccumulator, gptq_quantize
from .int4 import DEFAULT_GROUP_SIZE, Int4Weight, fake_quantize_int4, group_scales, pack_int4, quantize_to_grid

PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
STAGES = (("wq", "wk", "wv"), ("wo",), ("w_gate", "w_up"), ("w_down",))  # execution order in a block
SHORT = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}
FILE_FORMAT = "futx-int4-weights"
FILE_VERSION = 1


def projection_name(spec: str) -> str:
    """'layers.1.down' or 'layers.1.w_down' -> 'layers.1.w_down'."""
    m = re.fullmatch(r"layers\.(\d+)\.(\w+)", spec.strip())
    proj = m and SHORT.get(m.group(2), m.group(2))
    if not m or proj not in PROJECTIONS:
        raise ValueError(f"bad projection name {spec!r}: expected layers.<i>.<{'|'.join(SHORT)}>")
    return f"layers.{int(m.group(1))}.{proj}"


@dataclass
class Int4Model:
    """Packed INT4 projections of every block, keyed 'layers.<i>.<field>' (gains already folded)."""

    config_name: str
    group_size: int
    weights: dict[str, Int4Weight]
    methods: dict[str, str]                      # 'gptq' or 'rtn' per projection
    stats: dict[str, float] = field(default_factory=dict)  # GPTQ proxy loss relative to RTN
    info: dict = field(default_factory=dict)     # how it was made (calibration, device, seconds)

    def dequantized(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weights[name].dequantize(dtype)


def _rtn(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = group_scales(w, group_size)
    return quantize_to_grid(w, s, group_size), s


def _proxy_loss(w: torch.Tensor, wq: torch.Tensor, h: torch.Tensor) -> float:
    d = (wq - w).to(h)
    return float(torch.einsum("nk,kl,nl->", d, h, d))


def quantize_model(weights, calibration: Optional[torch.Tensor] = None, group_size: int = DEFAULT_GROUP_SIZE,
                   method: str = "gptq", rtn: Iterable[str] = (), damping: float = DAMPING,
                   device: Optional[str] = None, progress: bool = True) -> Int4Model:
    """Quantize every projection of `weights` (ModelWeights, unfolded) to INT4.

    calibration: token windows [W, S] (int64) for GPTQ; unused for method='rtn'.
    """
    if method not in ("gptq", "rtn"):
        raise ValueError(f"method must be 'gptq' or 'rtn', got {method!r}")
    config = weights.config
    keep_rtn = {projection_name(s) for s in rtn}
    for name in keep_rtn:
        if int(name.split(".")[1]) >= config.num_hidden_layers:
            raise ValueError(f"override {name} names a layer the model does not have")
    for f in PROJECTIONS:  # shape errors before any work
        n, k = getattr(weights.layers[0], f).shape
        layouts.INT4_WEIGHT.check_shape(n, k, group_size)
    if method == "gptq" and (calibration is None or calibration.dim() != 2):
        raise ValueError("GPTQ needs calibration token windows [W, S]")

    folded = fold_model(weights)
    out = Int4Model(config.name, group_size, {}, {})
    if method == "rtn":
        for i, layer in enumerate(folded.layers):
            for f in PROJECTIONS:
                name = f"layers.{i}.{f}"
                out.weights[name] = pack_int4(*_rtn(getattr(layer, f).float(), group_size), group_size)
                out.methods[name] = "rtn"
        return out

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    w_count, s_len = calibration.shape
    one_layer = config.replace(num_hidden_layers=1)
    batch = PackedBatch.from_lengths([s_len] * w_count, device=dev)
    cache = KVCache(one_layer, w_count, s_len, dtype=torch.float32, device=dev)
    rope = cos_sin(config, batch.row_position, torch.float32)
    x = folded.embed.to(dev, torch.float32)[calibration.reshape(-1).to(dev)]

    bar = tqdm(total=config.num_hidden_layers * len(STAGES), desc="gptq", disable=not progress)
    for i, layer in enumerate(folded.layers):
        cur = layer.to(torch.float32, dev)
        for stage in STAGES:
            acc = HessianAccumulator(getattr(cur, stage[0]).shape[1], dev)
            sink = lambda _name, inp: acc.add(inp)  # noqa: E731  (the stage's projections share one input)
            block(one_layer, cur.replace(**{stage[0]: probe(getattr(cur, stage[0]), stage[0], sink)}),
                  0, x, batch, cache, "prefill", rope)
            if acc.n == 0:
                raise RuntimeError(f"GPTQ saw no input to {stage[0]}: the reference block no longer computes "
                                   "projections as h @ W.T (see futx.quant.capture)")
            updates = {}
            # The stage's projections share the input, hence the Hessian, and GPTQ treats rows
            # independently: solve them as one stacked matrix (fewer, wider column steps).
            solve = [f for f in stage if f"layers.{i}.{f}" not in keep_rtn]
            solved = {}
            if solve:
                rows = [getattr(cur, f).shape[0] for f in solve]
                q_all, s_all = gptq_quantize(torch.cat([getattr(cur, f) for f in solve]), acc.h, group_size, damping)
                solved = dict(zip(solve, zip(q_all.split(rows), s_all.split(rows))))
            for f in stage:
                name, w = f"layers.{i}.{f}", getattr(cur, f)
                q, s = _rtn(w.cpu(), group_size) if name in keep_rtn else solved[f]
                out.weights[name] = pack_int4(q.contiguous(), s.contiguous(), group_size)
                out.methods[name] = "rtn" if name in keep_rtn else "gptq"
                wq = out.weights[name].dequantize().to(dev)
                loss_rtn = _proxy_loss(w, fake_quantize_int4(w.cpu(), group_size).to(dev), acc.h)
                out.stats[name] = _proxy_loss(w, wq, acc.h) / max(loss_rtn, 1e-30)  # < 1: GPTQ helps
                updates[f] = wq
            cur = cur.replace(**updates)
            bar.set_postfix(layer=i, stage=stage[0])
            bar.update()
        x = block(one_layer, cur, 0, x, batch, cache, "prefill", rope)  # the quantized layer feeds the next
    bar.close()
    return out


# ---- save / load -------------------------------------------------------------------------------
def save(model: Int4Model, path: str | Path) -> None:
    """safetensors: '<name>.packed' int32 [N/16, K/64, 32, 4], '<name>.scales' fp16 [N/16, K/G, 16]."""
    tensors = {}
    for name, w in model.weights.items():
        tensors[f"{name}.packed"] = w.packed.contiguous()
        tensors[f"{name}.scales"] = w.scales.contiguous()
    meta = {"format": FILE_FORMAT, "version": str(FILE_VERSION), "layout_version": str(layouts.LAYOUT_VERSION),
            "config": model.config_name, "group_size": str(model.group_size), "gains_folded": "true",
            "methods": json.dumps(model.methods), "shapes": json.dumps({n: w.shape for n, w in model.weights.items()}),
            "stats": json.dumps(model.stats), "info": json.dumps(model.info)}
    save_file(tensors, str(path), metadata=meta)


def load(path: str | Path) -> Int4Model:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FILE_FORMAT:
        raise ValueError(f"{path}: not a futx INT4 weight file (format={meta.get('format')!r})")
    if int(meta["layout_version"]) != layouts.LAYOUT_VERSION or int(meta["version"]) != FILE_VERSION:
        raise ValueError(f"{path}: layout/file version {meta['layout_version']}/{meta['version']} != "
                         f"{layouts.LAYOUT_VERSION}/{FILE_VERSION} of this futx")
    tensors, shapes, g = load_file(str(path)), json.loads(meta["shapes"]), int(meta["group_size"])
    weights = {n: Int4Weight(tensors[f"{n}.packed"], tensors[f"{n}.scales"], tuple(s), g) for n, s in shapes.items()}
    return Int4Model(meta["config"], g, weights, json.loads(meta["methods"]), json.loads(meta.get("stats", "{}")),
                     json.loads(meta.get("info", "{}")))


# ---- calibration data and command line -------------------------------------------------------------
CALIBRATION_TEXT = Path(__file__).resolve().parents[2].parent / "shared/data/enwiki-sample/enwiki-sample.txt"


def calibration_windows(tokens: torch.Tensor, windows: int, length: int, seed: int = 0) -> torch.Tensor:
    """`windows` random windows [W, S] of a token stream (reproducible from `seed`)."""
    if tokens.numel() <= length:
        raise ValueError(f"calibration text has {tokens.numel()} tokens, fewer than one window of {length}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - length, (windows,), generator=gen)
    return torch.stack([tokens[s:s + length] for s in starts.tolist()])


def main(argv: Optional[list[str]] = None) -> None:
    import argparse
    import hashlib
    import time

    from futx.checkpoint import load as load_checkpoint
    from futx.eval.device import describe, setup_device
    from futx.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(description="INT4 (GPTQ or RTN) quantization of a model's block projections")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", required=True, help="output .safetensors")
    p.add_argument("--method", choices=("gptq", "rtn"), default="gptq")
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE)
    p.add_argument("--calib", default=str(CALIBRATION_TEXT), help="calibration text (never the test split)")
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtn", action="append", default=[], help="keep RTN for a projection, e.g. layers.1.down")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--json", default=None, help="write a summary (calibration, timing, proxy-loss stats) here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is faster on a busy machine)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if "wikitext" in a.calib.lower() and "test" in a.calib.lower():
        raise ValueError("refusing to calibrate on the WikiText-2 test split")
    dev = setup_device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    weights = load_checkpoint(a.model)
    calib = None
    info = {"method": a.method, "group_size": a.group_size, "damping": DAMPING, **describe(dev)}
    if a.method == "gptq":
        raw = Path(a.calib).read_bytes()
        tokens = torch.tensor(load_tokenizer(a.model).encode(raw.decode("utf-8")), dtype=torch.int64)
        calib = calibration_windows(tokens, a.windows, a.seq_len, a.seed)
        info.update(calibration={"text": Path(a.calib).name, "sha256": hashlib.sha256(raw).hexdigest(),
                                 "text_tokens": int(tokens.numel()), "windows": a.windows, "seq_len": a.seq_len,
                                 "seed": a.seed, "sampling": "uniform random window starts (torch.Generator)"})
    t1 = time.perf_counter()
    with torch.no_grad():
        model = quantize_model(weights, calib, a.group_size, a.method, a.rtn, device=str(dev),
                               progress=not a.no_progress)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    info.update(rtn_overrides=sorted(projection_name(x) for x in a.rtn), load_seconds=round(t1 - t0, 1),
                quantize_seconds=round(t2 - t1, 1))
    model.info = info
    save(model, a.out)
    worst = max(model.stats.items(), key=lambda kv: kv[1]) if model.stats else None
    print(f"saved {len(model.weights)} projections to {a.out} in {t2 - t1:.1f} s; worst GPTQ/RTN proxy loss: {worst}")
    if a.json:
        by_kind: dict[str, list[float]] = {}
        for name, r in model.stats.items():
            by_kind.setdefault(name.rsplit(".", 1)[1], []).append(r)
        summary = {**info, "out": str(a.out), "projections": len(model.weights),
                   "proxy_loss_vs_rtn": {k: {"mean": sum(v) / len(v), "min": min(v), "max": max(v)}
                                         for k, v in sorted(by_kind.items())}}
        Path(a.json).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
