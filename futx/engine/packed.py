"""The packed model: a checkpoint quantized and laid out for the decode kernels, saved once, loaded fast.

Per block four projections, each one GEMM of the decode step:
    qkv    [(Hq + 2 Hkv) D, H]  rows wq | wk | wv, attention-norm gain folded in
    o      [H, Hq D]
    gateup [2 I, H]             rows interleaved (2j = gate j, 2j + 1 = up j: the SwiGLU epilogue's order),
                                MLP-norm gain folded in
    down   [H, I]
stored in one decode weight format ("int4": `futx.quant.int4.Int4Weight`, round-to-nearest or a GPTQ grid;
"e4m3": `E4M3Weight`; "bf16": a tensor). Quantization is per output row (INT4 groups run along K), so
concatenating or interleaving rows before or after quantizing gives the same grid. The embedding, the
final norm gain and the LM head stay BF16 (the head is the embedding when tied).

On disk: a directory with `model.safetensors` and `futx-model.json` (format version, config, formats,
fragment-layout version, where the weights came from).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch

from futx import atomic
from futx.config import LlamaConfig
from futx.quant import layouts
from futx.quant.fold import fold_layer
from futx.quant.fp8 import E4M3Weight, quantize_e4m3_weight
from futx.quant.int4 import Int4Weight, group_scales, quantize_to_grid
from futx.reference.weights import ModelWeights

from .support import WEIGHT_FORMATS, check_model

PROJECTIONS = ("qkv", "o", "gateup", "down")
FILE_FORMAT = "futx-packed-model"
FILE_VERSION = 1
META_FILE = "futx-model.json"
TENSOR_FILE = "model.safetensors"

Weight = Union[Int4Weight, E4M3Weight, torch.Tensor]


@dataclass
class PackedLayer:
    qkv: Weight
    o: Weight
    gateup: Weight
    down: Weight


@dataclass
class PackedModel:
    config: LlamaConfig
    weights: str                      # decode weight format: int4 | e4m3 | bf16
    group_size: int                   # INT4 group (ignored otherwise)
    embed: torch.Tensor               # bf16 [V, H]
    final_norm: torch.Tensor          # float32 [H]
    lm_head: torch.Tensor             # bf16 [V, H] (the embedding itself when tied)
    layers: list[PackedLayer]
    source: dict = field(default_factory=dict)  # how it was made (checkpoint, quantizer, seconds)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def projection_bytes(self) -> int:
        """Bytes of every block projection (what one decode step streams from memory)."""
        return sum(_nbytes(getattr(layer, p)) for layer in self.layers for p in PROJECTIONS)

    def to(self, device) -> "PackedModel":
        def mv(w):
            if isinstance(w, Int4Weight):
                return Int4Weight(w.packed.to(device), w.scales.to(device), w.shape, w.group_size)
            if isinstance(w, E4M3Weight):
                return E4M3Weight(w.data.to(device), w.scale.to(device))
            return w.to(device)
        tied = self.lm_head is self.embed
        embed = self.embed.to(device)
        return PackedModel(self.config, self.weights, self.group_size, embed, self.final_norm.to(device),
                           embed if tied else self.lm_head.to(device),
                           [PackedLayer(*(mv(getattr(l, p)) for p in PROJECTIONS)) for l in self.layers],
                           dict(self.source))

    # ---- files ---------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {"embed": self.embed, "final_norm": self.final_norm}
        tied = self.lm_head is self.embed
        if not tied:
            tensors["lm_head"] = self.lm_head
        for i, layer in enumerate(self.layers):
            for p in PROJECTIONS:
                for suffix, t in _weight_tensors(getattr(layer, p)).items():
                    tensors[f"layers.{i}.{p}.{suffix}"] = t
        # The metadata goes first and comes back last: a directory left by an interrupted save (or re-save) is
        # not taken for a packed model, and neither file is ever half written.
        (path / META_FILE).unlink(missing_ok=True)
        with atomic.replacing(path / TENSOR_FILE) as tmp:
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
        meta = {"format": FILE_FORMAT, "version": FILE_VERSION, "layout_version": layouts.LAYOUT_VERSION,
                "config": self.config.to_hf_dict(), "config_name": self.config.name, "weights": self.weights,
                "group_size": self.group_size, "tied_lm_head": tied, "source": self.source}
        atomic.write_text(path / META_FILE, json.dumps(meta, indent=1))
        return path

    @staticmethod
    def load_meta(path: str | Path) -> dict:
        """The JSON side of a packed directory, checked against this futx's formats."""
        path = Path(path)
        meta_path = path / META_FILE
        if not meta_path.is_file():
            raise ValueError(f"{path} is not a futx packed model (no {META_FILE}); make one with `futx pack`")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FILE_FORMAT or meta.get("version") != FILE_VERSION:
            raise ValueError(f"{path}: packed-model format {meta.get('format')!r} v{meta.get('version')} is not "
                             f"{FILE_FORMAT!r} v{FILE_VERSION}; re-pack it with this futx")
        if meta.get("layout_version") != layouts.LAYOUT_VERSION:
            raise ValueError(f"{path}: fragment layout v{meta.get('layout_version')} != v{layouts.LAYOUT_VERSION} "
                             "of this futx; re-pack it")
        return meta

    @classmethod
    def load(cls, path: str | Path, device="cpu") -> "PackedModel":
        from safetensors.torch import load_file

        path = Path(path)
        meta = cls.load_meta(path)
        config = LlamaConfig.from_hf_dict(meta["config"], name=meta.get("config_name", "custom"))
        t = load_file(str(path / TENSOR_FILE), device=str(device))
        fmt, g = meta["weights"], int(meta["group_size"])
        layers = [PackedLayer(*(_weight_from(fmt, g, t, f"layers.{i}.{p}") for p in PROJECTIONS))
                  for i in range(config.num_hidden_layers)]
        embed = t["embed"]
        return cls(config, fmt, g, embed, t["final_norm"], embed if meta["tied_lm_head"] else t["lm_head"], layers,
                   meta.get("source", {}))


def is_packed_dir(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


# ---- packing -----------------------------------------------------------------------------------
def default_group_size(config: LlamaConfig) -> int:
    """128 where every projection's K allows it (the paper's group), else 64 (e.g. SmolLM2's 576)."""
    ks = {k for _, k in config.projection_shapes().values()}
    return 128 if all(k % 128 == 0 for k in ks) else 64


def pack_model(weights: ModelWeights, fmt: str = "int4", *, group_size: Optional[int] = None, gptq=None,
               device=None, progress: bool = True) -> PackedModel:
    """Fold the norm gains, quantize every projection to `fmt` and lay it out for the decode kernels.

    `gptq`: a `futx.quant.gptq.Int4Model` (e.g. `futx.quant.gptq.load(path)`) whose grids replace
    round-to-nearest for fmt="int4". Work runs on `device` (default: the weights' device); a CUDA device
    packs an 8B model in seconds.
    """
    from tqdm.auto import tqdm

    config = weights.config
    group_size = group_size or (gptq.group_size if gptq is not None else default_group_size(config))
    check_model(config, fmt, group_size)
    if gptq is not None and fmt != "int4":
        raise ValueError(f"a GPTQ result gives INT4 grids; it cannot be used with weight format {fmt!r}")
    if gptq is not None and gptq.group_size != group_size:
        raise ValueError(f"the GPTQ result has group size {gptq.group_size}, not {group_size}")
    dev = torch.device(device) if device is not None else weights.device
    t0 = time.perf_counter()
    params = 0
    layers = []
    bar = tqdm(weights.layers, desc=f"pack {fmt}", unit="layer", disable=not progress)
    for i, layer in enumerate(bar):
        f = fold_layer(layer.to(device=dev))
        if gptq is not None:
            grids = {p: _gptq_rows(gptq, i, p) for p in PROJECTIONS}
            packed = [_pack_int4_grid(*(x.to(dev) for x in grids[p]), group_size) for p in PROJECTIONS]
        else:
            rows = {"qkv": torch.cat([f.wq, f.wk, f.wv]), "o": f.wo,
                    "gateup": _interleave(f.w_gate, f.w_up), "down": f.w_down}
            packed = [quantize_weight(rows[p], fmt, group_size) for p in PROJECTIONS]
        layers.append(PackedLayer(*packed))
        params += sum(n * k for n, k in config.projection_shapes().values())
        dt = time.perf_counter() - t0
        bar.set_postfix_str(f"{params / 1e6 / max(dt, 1e-9):.0f} M params/s")
    bar.close()
    embed = weights.embed.to(device=dev, dtype=torch.bfloat16)
    head = embed if weights.lm_head is None else weights.lm_head.to(device=dev, dtype=torch.bfloat16)
    seconds = time.perf_counter() - t0
    source = {"quantizer": "gptq" if gptq is not None else ("rtn" if fmt == "int4" else fmt),
              "gptq_info": getattr(gptq, "info", {}) if gptq is not None else {},
              "pack_seconds": round(seconds, 3), "device": str(dev)}
    return PackedModel(config, fmt, group_size, embed, weights.final_norm.to(device=dev, dtype=torch.float32),
                       head, layers, source)


def quantize_weight(w: torch.Tensor, fmt: str, group_size: int) -> Weight:
    """One gain-folded float weight [N, K] in the decode format `fmt`, on w's device."""
    if fmt == "int4":
        scales = group_scales(w, group_size)
        return _pack_int4_grid(quantize_to_grid(w, scales, group_size), scales, group_size)
    if fmt == "e4m3":
        return quantize_e4m3_weight(w)
    if fmt == "bf16":
        return w.to(torch.bfloat16).contiguous()
    raise ValueError(f"unknown decode weight format {fmt!r}; known: {', '.join(WEIGHT_FORMATS)}")


def dequantize_weight(w: Weight) -> torch.Tensor:
    """The float32 values a kernel multiplies by (exact for every format)."""
    if isinstance(w, (Int4Weight, E4M3Weight)):
        return w.dequantize(torch.float32)
    return w.float()


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], gate.shape[1])


def _pack_int4_grid(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Weight:
    """`futx.quant.int4.pack_int4` on any device (the layouts packer is plain torch indexing)."""
    n, k = q.shape
    packed = layouts.pack_int4_weight(q.to(torch.int16) + layouts.INT4_WEIGHT.offset)
    return Int4Weight(packed=packed, scales=layouts.pack_weight_scales(scales), shape=(n, k), group_size=group_size)


def _gptq_rows(gptq, layer: int, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(signed grid, fp16 scales) of a packed projection from a GPTQ result's per-matrix grids."""
    def get(name):
        key = f"layers.{layer}.{name}"
        if key not in gptq.weights:
            raise ValueError(f"the GPTQ result has no {key}; was it made for this model?")
        w = gptq.weights[key]
        return w.q(), w.natural_scales()
    if proj == "qkv":
        parts = [get(n) for n in ("wq", "wk", "wv")]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    if proj == "gateup":
        (qg, sg), (qu, su) = get("w_gate"), get("w_up")
        return _interleave(qg, qu), _interleave(sg, su)
    return get({"o": "wo", "down": "w_down"}[proj])


def _weight_tensors(w: Weight) -> dict[str, torch.Tensor]:
    if isinstance(w, Int4Weight):
        return {"packed": w.packed, "scales": w.scales}
    if isinstance(w, E4M3Weight):
        return {"data": w.data, "scale": w.scale}
    return {"weight": w}


def _weight_from(fmt: str, group_size: int, t: dict, name: str) -> Weight:
    if fmt == "int4":
        packed, scales = t[f"{name}.packed"], t[f"{name}.scales"]
        shape = (packed.shape[0] * layouts.INT4_WEIGHT.block_n, packed.shape[1] * layouts.INT4_WEIGHT.block_k)
        return Int4Weight(packed, scales, shape, group_size)
    if fmt == "e4m3":
        return E4M3Weight(t[f"{name}.data"], t[f"{name}.scale"])
    return t[f"{name}.weight"]


def _nbytes(w: Weight) -> int:
    return sum(t.numel() * t.element_size() for t in _weight_tensors(w).values())


# ---- synthetic packed weights (benchmarks) -------------------------------------------------------
def random_packed(config: LlamaConfig, fmt: str = "int4", *, group_size: Optional[int] = None, device="cuda",
                  seed: int = 0, layers: Optional[int] = None) -> PackedModel:
    """Random packed weights drawn directly in the kernel format (no float model, no quantizer): for speed
    measurements at 8B/70B shapes. Scales keep activations bounded (about unit RMS per projection)."""
    group_size = group_size or default_group_size(config)
    check_model(config, fmt, group_size)
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = config.projection_shapes()
    n_layers = config.num_hidden_layers if layers is None else layers

    def one(n, k):
        if fmt == "int4":
            packed = torch.randint(-2**31, 2**31 - 1, (n // 16, k // 64, 32, 4), generator=gen, device=device,
                                   dtype=torch.int32)
            scales = torch.full((n // 16, k // group_size, 16), 0.25 / k ** 0.5, dtype=torch.float16, device=device)
            return Int4Weight(packed, scales, (n, k), group_size)
        w = torch.randn(n, k, generator=gen, device=device) / k ** 0.5
        return quantize_weight(w, fmt, group_size)

    layer_list = [PackedLayer(*(one(*shapes[p if p != "gateup" else "gate_up"]) for p in PROJECTIONS))
                  for _ in range(n_layers)]
    embed = (torch.randn(config.vocab_size, config.hidden_size, generator=gen, device=device)).to(torch.bfloat16)
    head = embed if config.tie_word_embeddings else (
        torch.randn(config.vocab_size, config.hidden_size, generator=gen, device=device) * 0.02).to(torch.bfloat16)
    cfg = config if n_layers == config.num_hidden_layers else config.replace(num_hidden_layers=n_layers)
    return PackedModel(cfg, fmt, group_size, embed, torch.ones(config.hidden_size, device=device), head, layer_list,
                       {"quantizer": "random", "seed": seed})
