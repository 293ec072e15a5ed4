"""The packed prefill block on futx's prefill kernels, chained through the epilogue policies (paper 3.2).

Per layer, for a packed batch of R requests (M rows; request r owns rows [cu[r], cu[r+1]) at positions
start[r], start[r] + 1, ... of cache slot slot[r]; x = the BF16 residual stream [M, H]; rho = RMSNorm
row factors [M], layer 0's from a torch reduction, later ones from the previous block's RMS partials):

  e4m3 ("FP8"):
    x8, a  = quantize_rows(x)                                     torch glue: per-row dynamic E4M3
    q      = gemm(x8, Wqkv, "scale_rho_qkv{hd}_bf16", a, b, rho)  RoPE; K/V -> cache main copy (BF16)
             cache.mirror_rows(...)                               the INT4 / E4M3 mirror rows (futx's mirror kernel)
    o      = attention(q, k_cache, v_cache, cu, start, slot)      causal GQA over the cache
    o8, a  = quantize_rows(o)                                     torch glue
    x, s   = gemm(o8, Wo, "scale_res_rms_bf16", a, b, residual=x) residual add + RMS partials s [t, M]
    rho    = rms_rho(s)                                           [M]
    x8, a  = quantize_rows(x)                                     torch glue
    z8     = gemm(x8, Wgu, "scale_rho_swiglu_fp8", a, b, rho, scale, amax, saturated)
                                                                  SwiGLU, E4M3 out, delayed per-tensor scale
    x, s   = gemm(z8, Wdown, "scalet_res_rms_bf16", scale, b, residual=x)
    rho    = rms_rho(s);   scale <- amax * margin / 448 (device-side, no sync)
  bf16: the same with BF16 operands and no activation quantization: "rho_qkv{hd}_bf16", "res_rms_bf16",
    "rho_swiglu_bf16", "res_rms_bf16".
Then the final RMSNorm and the BF16 LM head on each request's last row.

Weights: `pack_prefill` folds the RMSNorm gains (futx.quant.fold) into Wqkv (rows [Q | K | V]) and Wgu
(rows interleaved, 2j = gate j, 2j + 1 = up j), E4M3 with one float32 scale per output channel
(`futx.quant.fp8.quantize_e4m3_weight`) or BF16.

FP8 scale conventions (value ~ e4m3 * scale everywhere, as futx.quant.fp8):
  * activations into QKV, O and gate/up: per row, a[m] = amax_m / 448 (1 for an all-zero row),
    x8 = e4m3(clamp(x / a)) (IEEE division). One torch pass over the BF16 tensor per GEMM (`quantize_rows`);
    `glue="kernel"` (the default on the kernels backend) runs it as futx's row-quantization kernel
    (futx/prefill/row_quant.py: one launch, bit for bit the torch code); `glue="compiled"` fuses it with torch.compile
    (fewer launches, but not bit for bit: futx.engine.compiled says where Triton rounds differently).
  * the SwiGLU output: delayed per-tensor scaling, one state per layer and per request group
    (`ScaleState`). Call t quantizes with the scale from call t-1's amax: scale = amax * margin / 448
    (margin 2 by default: one binade of headroom for a later batch whose values run larger; all-zero keeps
    the previous scale). The first call of a state calibrates: the gate/up GEMM runs once to measure
    amax (its output is discarded), so the first real call uses that batch's own amax. A conservative
    fixed initial scale is no good here: E4M3's normal range is only 2^15 wide, so a scale sized for
    Llama's rare outliers (~1e3-1e4) pushes the typical ~1e-2 values into the subnormals.
    `ScaleState(initial_amax=...)` skips the calibration (e.g. a saved state, or CUDA-graph capture).
    The kernels count saturated elements (`saturations`).

Paged cache (an EngineCache made with a `layout` (futx.paging.PageLayout), its block table `table`;
futx.engine.paged_kv): each path translates (slot, position) once, on the device (inside a captured graph too):
the QKV epilogue gets each row's page from futx.paging.locate (`_paged`; its "p" chain: RoPE from the true
position, the row at in-page row pos % P), the mirror rows stay (slot, position) and EngineCache.mirror_rows
locates them, and prefill attention gets the block table (its paged variant reads the pages itself); request
slots and start positions stay the scheduler's.

Backends: "kernels" (futx.ops.prefill / prefill_attention on a Hopper GPU) and "emulated" (the same
dataflow in PyTorch: float32 GEMM of the exact E4M3/BF16 operand values, the epilogue math in float32,
E4M3 via torch.float8_e4m3fn, BF16 wherever the kernels store BF16; any device). The padded path
(`forward_padded`) runs the same kernels on every request padded to the longest one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence, Union

import torch

from futx import paging
from futx.config import LlamaConfig
from futx.quant.fold import fold_layer, rms_row_factor
from futx.quant.fp8 import E4M3_MAX, E4M3Weight, ieee_div, quantize_e4m3_weight
from futx.reference import rms_norm
from futx.reference.batch import PackedBatch
from futx.reference.weights import ModelWeights
from futx.hardware import sm_count
from futx.ops.prefill import rms_rho
from futx.ops.prefill_attention import MAX_GROUP as ATTN_MAX_GROUP
from futx.rope import apply_rope
from futx.rope import inv_freq as rope_inv_freq
from futx.runtime.catalog.prefill import Variant, choose_plan
from futx.runtime.catalog.prefill_attention import HEAD_DIMS as ATTN_HEAD_DIMS

from .cache import EngineCache
from .paged_kv import cache_layout, gather

FORMATS = ("e4m3", "bf16")
BACKENDS = ("kernels", "emulated")
# whether the prefill attention kernel and the QKV epilogue address a paged cache through its block table: their
# own piece of work (issue 28, branch paged-prefill), which flips this
KERNELS_PAGED = True
GLUE = ("auto", "eager", "kernel", "compiled")
Weight = Union[E4M3Weight, torch.Tensor]


# ---- weights ------------------------------------------------------------------------------------------------
@dataclass
class PrefillLayer:
    qkv: Weight      # [(Hq + 2 Hkv) D, H]  rows wq | wk | wv, attention-norm gain folded
    o: Weight        # [H, Hq D]
    gateup: Weight   # [2 I, H]  rows interleaved gate/up, MLP-norm gain folded
    down: Weight     # [H, I]


@dataclass
class PrefillWeights:
    config: LlamaConfig
    fmt: str                     # e4m3 | bf16
    embed: torch.Tensor          # bf16 [V, H]
    final_norm: torch.Tensor     # float32 [H]
    lm_head: torch.Tensor        # bf16 [V, H]
    layers: list[PrefillLayer]

    @property
    def device(self) -> torch.device:
        return self.embed.device


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], gate.shape[1])


def _quantize(w: torch.Tensor, fmt: str) -> Weight:
    if fmt == "e4m3":
        q = quantize_e4m3_weight(w)
        return E4M3Weight(q.data.contiguous(), q.scale.contiguous())
    return w.to(torch.bfloat16).contiguous()


def check_prefill_model(config: LlamaConfig, fmt: str) -> None:
    """Raise ValueError naming the first dimension the prefill GEMMs cannot take (TMA: K, N multiples of 16)."""
    if fmt not in FORMATS:
        raise ValueError(f"prefill weight format must be one of {FORMATS}, got {fmt!r}")
    c = config
    for name, n, k in (("qkv", c.qkv_size, c.hidden_size), ("o", c.hidden_size, c.q_size),
                       ("gate/up", 2 * c.intermediate_size, c.hidden_size), ("down", c.hidden_size,
                                                                              c.intermediate_size)):
        if k % 16 or n % (32 if name == "gate/up" else 16):
            raise ValueError(f"prefill: the {name} projection ([N, K] = [{n}, {k}]) needs K and N multiples of 16 "
                             "(N = 2 I a multiple of 32)")
    if c.head_dim not in (64, 128):
        raise ValueError(f"prefill: head_dim {c.head_dim} has no QKV placement chain (64 or 128)")


def pack_prefill(weights: ModelWeights, fmt: str = "e4m3", *, device=None, embed: Optional[torch.Tensor] = None,
                 lm_head: Optional[torch.Tensor] = None) -> PrefillWeights:
    """Prefill weights from the float checkpoint: gains folded, QKV rows [Q|K|V], gate/up interleaved, each
    projection E4M3 (per-output-channel scales) or BF16. `embed` / `lm_head`: BF16 tensors to share (e.g. a
    decode PackedModel's), else converted from `weights`."""
    config = weights.config
    check_prefill_model(config, fmt)
    dev = torch.device(device) if device is not None else weights.device
    layers = []
    for layer in weights.layers:
        f = fold_layer(layer.to(device=dev))
        layers.append(PrefillLayer(_quantize(torch.cat([f.wq, f.wk, f.wv]), fmt), _quantize(f.wo, fmt),
                                   _quantize(_interleave(f.w_gate, f.w_up), fmt), _quantize(f.w_down, fmt)))
    if embed is None:
        embed = weights.embed.to(device=dev, dtype=torch.bfloat16)
    if lm_head is None:
        lm_head = embed if weights.lm_head is None else weights.lm_head.to(device=dev, dtype=torch.bfloat16)
    return PrefillWeights(config, fmt, embed, weights.final_norm.to(device=dev, dtype=torch.float32), lm_head, layers)


def prefill_from_packed(packed) -> PrefillWeights:
    """The decode PackedModel's own projections when they are E4M3 or BF16 (same layout and quantizer):
    a packed directory serves the kernel prefill without its checkpoint."""
    if packed.weights not in FORMATS:
        raise ValueError(f"a {packed.weights} packed model has no prefill weights (prefill takes {FORMATS})")
    check_prefill_model(packed.config, packed.weights)
    layers = [PrefillLayer(l.qkv, l.o, l.gateup, l.down) for l in packed.layers]
    return PrefillWeights(packed.config, packed.weights, packed.embed, packed.final_norm.float(), packed.lm_head,
                          layers)


# ---- glue: per-row dynamic FP8 quantization of BF16 activations ----------------------------------------------
def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (BF16) -> (e4m3 [M, K], float32 scale [M]) with scale = amax / 448 per row (1 for zero rows).

    The torch definition; futx's kernel (glue="kernel") stores the same bytes in one launch, eager PyTorch
    makes ~6 passes."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    scale = torch.where(amax > 0, ieee_div(amax, E4M3_MAX), torch.ones_like(amax))
    data = ieee_div(xf, scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return data, scale


_COMPILED: dict = {}


def _quantizer(glue: str):
    if glue == "eager":
        return quantize_rows
    if glue == "kernel":
        from futx.ops.row_quant import quantize_rows_e4m3

        return quantize_rows_e4m3
    if "q" not in _COMPILED:
        from .compiled import compile_glue

        _COMPILED["q"] = compile_glue(quantize_rows)
    return _COMPILED["q"]


# ---- delayed per-tensor scaling of the SwiGLU output --------------------------------------------------------
class ScaleState:
    """One request group's delayed scales of the SwiGLU E4M3 output: per layer scale [1], amax [1] (reset per
    call), saturated [1] (running count), all on the device; `calibrated[i]` is a host flag."""

    def __init__(self, layers: int, device, margin: float = 2.0, initial_amax: Optional[float] = None):
        if not margin >= 1.0:
            raise ValueError(f"margin must be >= 1, got {margin}")
        if initial_amax is not None and not (0 < initial_amax < float("inf")):
            raise ValueError(f"initial_amax must be positive and finite, got {initial_amax}")
        self.margin = margin
        first = 1.0 if initial_amax is None else initial_amax * margin / E4M3_MAX
        self.scale = [torch.full((1,), first, dtype=torch.float32, device=device) for _ in range(layers)]
        self.amax = [torch.zeros(1, dtype=torch.float32, device=device) for _ in range(layers)]
        self.saturated = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(layers)]
        self.calibrated = [initial_amax is not None] * layers

    def next_scale(self, i: int) -> None:
        """scale <- amax * margin / 448 where amax > 0 (device-side)."""
        a = self.amax[i]
        self.scale[i].copy_(torch.where(a > 0, ieee_div(a * self.margin, E4M3_MAX), self.scale[i]))

    def tensors(self) -> list[torch.Tensor]:
        """Every device tensor of the state (scales, amaxes, saturation counts), e.g. to save and restore it."""
        return [*self.scale, *self.amax, *self.saturated]

    def saturations(self) -> int:
        return int(torch.stack(self.saturated).sum())


# ---- the torch pieces shared by the emulation and the fallbacks ----------------------------------------------
def _rope_cos_sin(row_pos: torch.Tensor, inv_freq32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [M, D/2] of pos * inv_freq (the FP32 frequencies the kernel reads, exact product)."""
    angle = row_pos.double()[:, None] * inv_freq32.double()[None, :]
    return angle.cos().float(), angle.sin().float()


def place_qkv(y: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row_slot: torch.Tensor,
              row_pos: torch.Tensor, inv_freq32: torch.Tensor, paged: bool = False) -> torch.Tensor:
    """QKVPlacement in torch: y float32 [M, (Hq + 2 Hkv) D] (scales and rho applied) -> Q bf16 [M, Hq, D]; RoPE'd
    K and V (BF16) written to cache[slot, head, pos]. paged: row_slot holds pages and the row goes to in-page
    row pos % P, as the "p" chains do (epilogues/qkv.py)."""
    m = y.shape[0]
    hkv, d = k_cache.shape[1], k_cache.shape[3]
    x = y.view(m, -1, d)
    hq = x.shape[1] - 2 * hkv
    cos, sin = _rope_cos_sin(row_pos, inv_freq32)
    qk = apply_rope(x[:, :hq + hkv], torch.cat([cos, cos], 1), torch.cat([sin, sin], 1))
    sl, ps = row_slot.long(), row_pos.long()
    if paged:
        ps = ps % k_cache.shape[2]
    k_cache[sl, :, ps] = qk[:, hq:].to(torch.bfloat16)
    v_cache[sl, :, ps] = x[:, hq + hkv:].to(torch.bfloat16)
    return qk[:, :hq].to(torch.bfloat16)


def attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, host: tuple,
                    out: Optional[torch.Tensor] = None, block: int = 512, table: Optional[torch.Tensor] = None,
                    page_size: int = 0) -> torch.Tensor:
    """Causal GQA of q [M, Hq, D] over the BF16 cache in float32 (scores, softmax, P V), BF16 out.
    host = (cu_seqlens, start_positions, slots) as host int tuples (PackedBatch.host_lists()).
    table / page_size: a paged cache's block table (each request's K/V gathered through it)."""
    cu, starts, slots = host
    m, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    out = torch.empty_like(q) if out is None else out
    scale = 1.0 / math.sqrt(d)
    for b in range(len(slots)):
        r0, r1, st = cu[b], cu[b + 1], starts[b]
        if table is None:
            k = k_cache[slots[b], :, :st + r1 - r0].float()          # [Hkv, L, D]
            v = v_cache[slots[b], :, :st + r1 - r0].float()
        else:
            k = gather(k_cache, table, slots[b], st + r1 - r0, page_size).float()
            v = gather(v_cache, table, slots[b], st + r1 - r0, page_size).float()
        for s in range(r0, r1, block):
            e = min(s + block, r1)
            n, first, stop = e - s, st + s - r0, st + e - r0
            qb = q[s:e].float().reshape(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
            sc = (qb @ k[:, :stop].transpose(1, 2)) * scale
            qpos = torch.arange(first, stop, device=q.device).repeat(g)
            late = torch.arange(stop, device=q.device)[None, :] > qpos[:, None]
            p = sc.masked_fill_(late, float("-inf")).softmax(dim=-1)
            o = (p @ v[:, :stop]).reshape(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)
            out[s:e] = o.to(out.dtype)
    return out


# ---- the ops, in two backends ---------------------------------------------------------------------------------
class EmulatedPrefillOps:
    """futx.ops.prefill.gemm / qkv and prefill_attention in PyTorch, for the shipped chain names.

    GEMM: float32 product of the exact operand values (the kernels accumulate FP8 with fewer bits); then the
    chain steps in the kernels' order: row factor a[m] * rho[m], x row factor, x column scale; SwiGLU
    silu(gate) * up on column pairs (2j, 2j + 1); residual add; RMS partials of the BF16-rounded output per
    output tile; store BF16, or E4M3 as e4m3(v * (1 / scale)) with amax / saturation statistics."""

    name = "emulated"

    def gemm(self, a, w, policy: str, *, out=None, variant: Optional[str] = None, **t):
        steps = policy.split("_")
        v = a.float() @ w.float().T
        row = None
        if "scale" in steps:
            row = t["a_scale"].float()[:, None]
        elif "scalet" in steps:
            row = t["a_scale"].float().reshape(1, 1)
        if "rho" in steps:
            rho = t["rho"].float()[:, None]
            row = rho if row is None else row * rho
        if row is not None:
            v = v * row
        if "scale" in steps or "scalet" in steps:
            v = v * t["b_scale"].float()[None, :]
        if "swiglu" in steps:
            gate, up = v[:, 0::2], v[:, 1::2]
            v = gate * torch.sigmoid(gate) * up
        if "res" in steps:
            v = v + t["residual"].float()
        if steps[-1] == "fp8":
            finite = v.masked_fill(torch.isnan(v), 0.0).abs()
            if v.numel():
                t["amax"].copy_(torch.maximum(t["amax"], finite.amax().reshape(1)))
            inv = torch.ones(1, device=v.device) / t["scale"].float()
            y = v * inv
            t["saturated"].add_((y.abs() > E4M3_MAX).sum().to(torch.int32).reshape(1))
            res = y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        else:
            res = v.to(torch.bfloat16)
        if "rms" in steps:
            sumsq = t["sumsq"]
            tiles = sumsq.shape[0]
            width = Variant.parse(variant).tile_n if variant else -(-res.shape[1] // tiles)
            sq = res.float().pow(2)
            for i in range(tiles):
                sumsq[i] = sq[:, i * width:(i + 1) * width].sum(dim=1)
        if out is not None:
            out.copy_(res)
            return out
        return res

    def qkv(self, a, w, k_cache, v_cache, row_slot, row_pos, inv_freq, *, rho, a_scale=None, b_scale=None,
            out=None, variant=None, paged=False):
        y = a.float() @ w.float().T
        row = rho.float() if a_scale is None else a_scale.float() * rho.float()
        y = y * row[:, None]
        if b_scale is not None:
            y = y * b_scale.float()[None, :]
        q = place_qkv(y, k_cache, v_cache, row_slot, row_pos, inv_freq, paged)
        if out is not None:
            out.view_as(q).copy_(q)
            return out.view_as(q)
        return q

    def attention(self, q, k_cache, v_cache, cu32, start32, slot32, host, out=None, table=None, page_size=0):
        return attention_torch(q, k_cache, v_cache, host, out, table=table, page_size=page_size)


class KernelPrefillOps:
    """futx's prefill GEMM (epilogue chains) and prefill attention (Hopper GPU)."""

    name = "kernels"

    def __init__(self):
        from futx.ops import prefill, prefill_attention

        self._gemm, self._attn = prefill, prefill_attention

    def gemm(self, a, w, policy: str, *, out=None, variant: Optional[str] = None, **t):
        return self._gemm.gemm(a, w, policy, out=out, variant=variant, **t)

    def qkv(self, a, w, k_cache, v_cache, row_slot, row_pos, inv_freq, *, rho, a_scale=None, b_scale=None,
            out=None, variant=None, paged=False):
        return self._gemm.qkv(a, w, k_cache, v_cache, row_slot, row_pos, inv_freq, rho=rho, a_scale=a_scale,
                              b_scale=b_scale, out=out, variant=variant, paged=paged)

    def attention(self, q, k_cache, v_cache, cu32, start32, slot32, host, out=None, table=None, page_size=0):
        # the ranges were checked on the host from the batch's host lists (PrefillModel.check_rows)
        return self._attn.attention(q, k_cache, v_cache, cu32, start32, slot32, out=out, check_ranges_on_host=False,
                                    table=table, page_size=page_size)


def make_prefill_ops(backend: str):
    if backend == "kernels":
        return KernelPrefillOps()
    if backend == "emulated":
        return EmulatedPrefillOps()
    raise ValueError(f"unknown prefill backend {backend!r}: 'kernels' or 'emulated'")


def _rms_partials(m: int, h: int, k: int, ab: str, device: torch.device) -> tuple:
    """(variant, sumsq [output tiles, M]) of a residual projection writing RMS partials: the variant the op
    would choose, named explicitly because the tile count follows it."""
    var = choose_plan(m, h, k, ab, sm_count(device) if device.type == "cuda" else 132)[0]
    return var, torch.empty(-(-h // Variant.parse(var).tile_n), m, dtype=torch.float32, device=device)


# ---- the model ------------------------------------------------------------------------------------------------
@dataclass
class _Rows:
    """Per-call batch metadata on the device (int32 for the kernels) and on the host."""
    row_slot: torch.Tensor
    row_pos: torch.Tensor
    cu: torch.Tensor
    start: torch.Tensor
    slot: torch.Tensor
    host: Optional[tuple]                 # (cu, starts, slots) host tuples (None inside a CUDA graph)
    mirror_slot: torch.Tensor             # the rows whose decode mirror is written (padded path: the real rows)
    mirror_pos: torch.Tensor
    # a paged cache (`PrefillModel._paged`): each row's page (the QKV epilogue's row_slot), the block table and
    # its page size (mirror_slot / mirror_pos stay slots and positions: the cache's mirror writer locates them)
    row_page: Optional[torch.Tensor] = None
    table: Optional[torch.Tensor] = None
    page_size: int = 0


@dataclass
class PrefillOutput:
    hidden: torch.Tensor                  # bf16 [R, H]: the residual stream at each request's last row
    normed: torch.Tensor                  # bf16 [R, H]: after the final RMSNorm
    logits: Optional[torch.Tensor] = None  # bf16 [R, V] (want_logits)


@dataclass
class _Stats:
    calls: int = 0
    rows: int = 0
    padded_rows: int = 0
    notes: list = field(default_factory=list)


class PrefillModel:
    """Prefill weights + the engine's cache + one backend: packed (or padded) prefill of a batch of requests.

    K/V of every layer land in `cache` (an EngineCache, contiguous or paged: main copy by the QKV epilogue, mirror
    rows through `EngineCache.mirror_rows`), so decode continues from the cache at once."""

    def __init__(self, weights: PrefillWeights, cache: EngineCache, backend: str = "kernels", *,
                 margin: float = 2.0, initial_amax: Optional[float] = None, glue: str = "auto",
                 attention: str = "auto"):
        cfg = weights.config
        check_prefill_model(cfg, weights.fmt)
        c = cache.config
        if (c.num_hidden_layers, c.num_key_value_heads, c.head_dim) != (
                cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim):
            raise ValueError("the engine cache was made for another model shape")
        if backend == "kernels" and cache.device.type != "cuda":
            raise ValueError("the kernel prefill needs a CUDA (Hopper) device; use backend='emulated' elsewhere")
        if backend == "kernels" and cache.layout is not None and not KERNELS_PAGED:
            raise ValueError("the paged KV cache is not built into the prefill kernels yet (the emulated prefill "
                             "runs it); use the contiguous cache on the kernels")
        if glue not in GLUE:
            raise ValueError(f"glue must be one of {GLUE}, got {glue!r}")
        if glue == "kernel" and backend != "kernels":
            raise ValueError("glue='kernel' runs futx's row-quantization kernel: it needs backend='kernels'")
        if glue == "auto":   # the kernel is bit for bit the torch definition, in one launch
            glue = "kernel" if backend == "kernels" else "eager"
        self.weights, self.config, self.cache, self.fmt = weights, cfg, cache, weights.fmt
        self.device = cache.device
        if _device_key(weights.device) != _device_key(self.device):
            raise ValueError(f"prefill weights on {weights.device}, the cache on {self.device}")
        self.backend = backend
        self.ops = make_prefill_ops(backend)
        self.margin, self.initial_amax = margin, initial_amax
        self.quantize = _quantizer(glue)
        self.inv_freq = rope_inv_freq(cfg).float().to(self.device)
        self.states: dict[object, ScaleState] = {}
        fits = cfg.head_dim in ATTN_HEAD_DIMS and 1 <= cfg.group_size <= ATTN_MAX_GROUP
        if attention not in ("auto", "kernel", "torch"):
            raise ValueError(f"attention must be 'auto', 'kernel' or 'torch', got {attention!r}")
        if attention == "kernel" and not fits:
            raise ValueError(f"the prefill attention kernel needs head_dim in {ATTN_HEAD_DIMS} and a GQA group "
                             f"of 1..{ATTN_MAX_GROUP}; this model has {cfg.head_dim} and {cfg.group_size}")
        self.attention_impl = "torch" if attention == "torch" or not fits else "kernel"
        self.stats = _Stats()

    def describe(self) -> str:
        what = "kernel" if self.backend == "kernels" else "emulated kernel"
        parts = [f"{what} prefill ({self.fmt}, packed)"]
        if self.attention_impl == "torch":
            parts.append(f"attention in torch (GQA group {self.config.group_size} / head_dim {self.config.head_dim}"
                         " has no prefill attention kernel)")
        return "; ".join(parts)

    def state(self, group: object = 0) -> ScaleState:
        if group not in self.states:
            self.states[group] = ScaleState(self.config.num_hidden_layers, self.device, self.margin,
                                            self.initial_amax)
        return self.states[group]

    # ---- entry points ------------------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, batch: PackedBatch, *, group: object = 0,
                want_logits: bool = False) -> PrefillOutput:
        """Packed prefill of `batch` (tokens [M] int). Returns each request's last row (hidden, normed, logits)."""
        rows = self._rows(tokens, batch)
        last = torch.tensor([e - 1 for e in batch.host_lists()[0][1:]], device=self.device)
        x = self._run(tokens.to(self.device), rows, group)
        self.stats.calls += 1
        self.stats.rows += batch.num_rows
        return self._out(x[last], want_logits)

    def forward_padded(self, prompts: Sequence[Sequence[int]], starts: Optional[Sequence[int]] = None,
                       slots: Optional[Sequence[int]] = None, *, group: object = 0,
                       want_logits: bool = False) -> PrefillOutput:
        """The same prefill with every request padded to the longest (pad token 0, same slot, later positions:
        causal attention keeps the real rows exact; the padded rows cost GEMM and attention time, their K/V
        land past the prompt in the main copy only, and they enter the SwiGLU scale's amax)."""
        n = len(prompts)
        lengths = [len(p) for p in prompts]
        if n == 0 or min(lengths) < 1:
            raise ValueError("every request needs at least one token")
        s_max = max(lengths)
        starts = [0] * n if starts is None else list(starts)
        slots = list(range(n)) if slots is None else list(slots)
        batch = PackedBatch.from_lengths([s_max] * n, starts, slots, device=self.device)
        toks = torch.tensor([t for p in prompts for t in list(p) + [0] * (s_max - len(p))], dtype=torch.int64)
        real = torch.tensor([b * s_max + i for b in range(n) for i in range(lengths[b])], device=self.device)
        rows = self._rows(toks, batch, real)
        x = self._run(toks.to(self.device), rows, group)
        last = torch.tensor([b * s_max + lengths[b] - 1 for b in range(n)], device=self.device)
        self.stats.calls += 1
        self.stats.rows += sum(lengths)
        self.stats.padded_rows += n * s_max - sum(lengths)
        return self._out(x[last], want_logits)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return normed @ self.weights.lm_head.T

    # ---- internals ----------------------------------------------------------------------------------------------
    def _out(self, x: torch.Tensor, want_logits: bool) -> PrefillOutput:
        h = rms_norm(x, self.weights.final_norm.to(torch.bfloat16), self.config.rms_norm_eps)
        return PrefillOutput(x, h, self.logits(h) if want_logits else None)

    def check_rows(self, tokens: torch.Tensor, cu: Sequence[int], starts: Sequence[int],
                   slots: Sequence[int]) -> None:
        """Host-side checks of a batch (tokens: a 1-D integer CPU tensor; the rest host ints) before any launch:
        token ids, cache slots and capacity. Nothing is read back from the device."""
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype.is_floating_point \
                or tokens.dtype == torch.bool:
            raise ValueError("tokens must be a 1-D integer tensor")
        if tokens.numel() != cu[-1]:
            raise ValueError(f"{tokens.numel()} tokens but the batch describes {cu[-1]} rows")
        if tokens.numel():
            lo, hi = (int(v) for v in torch.aminmax(tokens))
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), got {lo}..{hi}")
        n_slots, capacity = self.slots, self.capacity
        for b, (st, sl) in enumerate(zip(starts, slots)):
            if not 0 <= sl < n_slots:
                raise ValueError(f"request {b}: cache slot {sl} out of range [0, {n_slots})")
            if st < 0 or st + cu[b + 1] - cu[b] > capacity:
                raise ValueError(f"request {b}: KV cache overflow: positions {st}..{st + cu[b + 1] - cu[b] - 1} but "
                                 f"the capacity is {capacity}")

    # ---- the cache's request geometry (slots and positions per request; a paged EngineCache keeps them too:
    # its PageLayout's table span may exceed `capacity`, which is what the engine's requests reach) ----
    @property
    def slots(self) -> int:
        return self.cache.slots

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    @property
    def scratch_slot(self) -> int:
        return self.cache.scratch_slot

    def _paged(self, rows: _Rows) -> _Rows:
        """A paged cache: the rows translated through the block table (futx.paging.locate; device ops, no host
        sync, so a CUDA graph captures it). The scheduler's slots and positions were range-checked on the host;
        pages a request does not own map to the scratch page, so a bad table entry never leaves the cache."""
        layout = cache_layout(self.cache)
        if layout is None:
            return rows
        table, size = self.cache.table, layout.page_size
        row_page, _ = paging.locate(table, rows.row_slot, rows.row_pos, size)
        # the mirror rows stay (slot, position): EngineCache.mirror_rows translates them itself
        return replace(rows, row_page=row_page, table=table, page_size=size)

    def _rows(self, tokens: torch.Tensor, batch: PackedBatch, real: Optional[torch.Tensor] = None) -> _Rows:
        host = batch.host_lists()
        self.check_rows(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens, *host)
        i32 = lambda t: t.to(device=self.device, dtype=torch.int32).contiguous()  # noqa: E731
        row_slot, row_pos = i32(batch.row_slot), i32(batch.row_position)
        ms, mp = row_slot, row_pos
        if real is not None:
            ms, mp = ms[real].contiguous(), mp[real].contiguous()
        layout = cache_layout(self.cache)
        if layout is not None:   # every real row on a page its request owns (reads the table back)
            paging.check_rows(self.cache.table, ms, mp, layout.page_size, layout.scratch_page)
        return _Rows(row_slot, row_pos, i32(batch.cu_seqlens), i32(batch.start_positions), i32(batch.slots), host,
                     ms, mp)

    def _run(self, tokens: torch.Tensor, rows: _Rows, group: object,
             pad: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows = self._paged(rows)
        x = self.weights.embed[tokens]
        if pad is not None:  # padding rows (bool [M]) start at zero and stay exactly zero through every block
            x = x.masked_fill(pad[:, None], 0)
        rho = rms_row_factor(x, self.config.rms_norm_eps)   # layer 0: a plain torch reduction
        st = self.state(group) if self.fmt == "e4m3" else None
        for i in range(self.config.num_hidden_layers):
            x, rho = self.layer(i, x, rho, rows, st)
        return x

    def layer(self, i: int, x: torch.Tensor, rho: torch.Tensor, rows: _Rows, st: Optional[ScaleState]):
        """Block i on the residual stream x [M, H] with its RMSNorm row factors rho [M] -> (x, next rho)."""
        cfg, w, ops = self.config, self.weights.layers[i], self.ops
        m, h, eps = x.shape[0], cfg.hidden_size, cfg.rms_norm_eps
        lc = self.cache.layers[i]
        fp8 = self.fmt == "e4m3"
        dev = x.device
        # ---- QKV: RoPE, K/V into the main copy, then the mirror rows ----
        paged = rows.row_page is not None
        row_slot = rows.row_page if paged else rows.row_slot
        if fp8:
            x8, a_s = self.quantize(x)
            q = ops.qkv(x8, w.qkv.data, lc.k_cache, lc.v_cache, row_slot, rows.row_pos, self.inv_freq,
                        rho=rho, a_scale=a_s, b_scale=w.qkv.scale, paged=paged)
        else:
            q = ops.qkv(x, w.qkv, lc.k_cache, lc.v_cache, row_slot, rows.row_pos, self.inv_freq, rho=rho,
                        paged=paged)
        self._mirror(i, rows)
        # ---- attention ----
        if self.attention_impl == "kernel":
            attn = ops.attention(q, lc.k_cache, lc.v_cache, rows.cu, rows.start, rows.slot, rows.host,
                                 table=rows.table, page_size=rows.page_size)
        else:
            attn = attention_torch(q, lc.k_cache, lc.v_cache, rows.host, table=rows.table, page_size=rows.page_size)
        attn = attn.reshape(m, cfg.q_size)
        # ---- O projection: residual add (+ RMS partials) ----
        if fp8:
            a8, a_s = self.quantize(attn)
            var, sumsq = _rms_partials(m, h, a8.shape[1], "e4m3", dev)
            x = ops.gemm(a8, w.o.data, "scale_res_rms_bf16", variant=var, a_scale=a_s, b_scale=w.o.scale,
                         residual=x, sumsq=sumsq)
            rho = rms_rho(sumsq, h, eps)
        else:
            var, sumsq = _rms_partials(m, h, attn.shape[1], "bf16", dev)
            x = ops.gemm(attn, w.o, "res_rms_bf16", variant=var, residual=x, sumsq=sumsq)
            rho = rms_rho(sumsq, h, eps)
        # ---- gate/up + SwiGLU ----
        if fp8:
            x8, a_s = self.quantize(x)
            gu = dict(a_scale=a_s, b_scale=w.gateup.scale, rho=rho)
            if not st.calibrated[i]:  # first call of this state: measure the output's amax, then scale from it
                st.amax[i].zero_()
                ops.gemm(x8, w.gateup.data, "scale_rho_swiglu_fp8", scale=torch.ones_like(st.scale[i]),
                         amax=st.amax[i], saturated=torch.zeros_like(st.saturated[i]), **gu)
                st.next_scale(i)
                st.calibrated[i] = True
            st.amax[i].zero_()
            z = ops.gemm(x8, w.gateup.data, "scale_rho_swiglu_fp8", scale=st.scale[i], amax=st.amax[i],
                         saturated=st.saturated[i], **gu)
        else:
            z = ops.gemm(x, w.gateup, "rho_swiglu_bf16", rho=rho)
        # ---- down projection: residual add (+ RMS partials for the next block) ----
        if fp8:
            var, sumsq = _rms_partials(m, h, z.shape[1], "e4m3", dev)
            x = ops.gemm(z, w.down.data, "scalet_res_rms_bf16", variant=var, a_scale=st.scale[i],
                         b_scale=w.down.scale, residual=x, sumsq=sumsq)
            st.next_scale(i)
            rho = rms_rho(sumsq, h, eps)
        else:
            var, sumsq = _rms_partials(m, h, z.shape[1], "bf16", dev)
            x = ops.gemm(z, w.down, "res_rms_bf16", variant=var, residual=x, sumsq=sumsq)
            rho = rms_rho(sumsq, h, eps)
        return x, rho

    def _mirror(self, i: int, rows: _Rows) -> None:
        """The decode mirror (and kept values) of this layer's new rows, as the decode kernels store them (no
        host sync: the rows were checked on the host); on the kernels by futx's mirror kernel."""
        self.cache.mirror_rows(i, rows.mirror_slot, rows.mirror_pos, kernel=self.backend == "kernels")


def _device_key(device) -> tuple:
    """(type, index) with the current CUDA device for a bare "cuda" ("cuda" and "cuda:0" are one device)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return d.type, torch.cuda.current_device()
    return d.type, d.index


# ---- convenience ------------------------------------------------------------------------------------------------
def prefill_tokens(model: PrefillModel, prompts: Sequence[Sequence[int]], starts: Optional[Sequence[int]] = None,
                   slots: Optional[Sequence[int]] = None, *, group: object = 0,
                   want_logits: bool = False) -> PrefillOutput:
    """Packed prefill of token lists (request b at starts[b] in slots[b])."""
    batch = PackedBatch.from_lengths([len(p) for p in prompts], starts, slots, device=model.device)
    toks = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
    return model.forward(toks, batch, group=group, want_logits=want_logits)


__all__ = ["FORMATS", "EmulatedPrefillOps", "KernelPrefillOps", "PrefillLayer", "PrefillModel", "PrefillOutput",
           "PrefillWeights", "ScaleState", "attention_torch", "check_prefill_model", "pack_prefill", "place_qkv",
           "prefill_from_packed", "prefill_tokens", "quantize_rows"]
