"""The operations a decode step is made of, in two interchangeable backends.

* `KernelOps`: futx's own kernels (`torch.ops.futx.*`), for Hopper GPUs.
* `EmulatedOps`: the same functions in PyTorch with float32 arithmetic and BF16 storage at exactly the
  points where the kernel path stores BF16 (any device, CPU included). It is the kernel path's
  specification: the decode step built on it runs in CI, and GPU tests compare the two step by step.

Both take and return the same tensors (BF16 activations [M, ...], the engine cache's layer tensors), so
`futx.engine.model` is written once.
"""

from __future__ import annotations

import math

import torch

from futx.config import LlamaConfig
from futx.quant.fold import rms_row_factor
from futx.reference import rms_norm
from futx.rope import apply_rope, cos_sin
from futx.runtime.catalog.decode_attention import PDL_HEAD_DIMS

from .cache import EngineCache
from .packed import Weight, dequantize_weight
from .support import BLOCK_N


def rope_table(config: LlamaConfig, capacity: int, device) -> torch.Tensor:
    """float32 [capacity, D]: cos of the D/2 angles of each position, then their sin (futx.rope's tables,
    which repeat the D/2 angles twice, kept once each): what the attention kernel reads."""
    cos, sin = cos_sin(config, torch.arange(capacity), torch.float32)
    half = config.head_dim // 2
    return torch.cat([cos[:, :half], sin[:, :half]], dim=1).to(device)


def apply_rope_f32(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """futx.rope.apply_rope of x [M, heads, D] in float32 with rows of `rope_table` at `positions`."""
    cs = table[positions.long()]                      # [M, D]: cos | sin of the D/2 angles
    cos, sin = cs.chunk(2, dim=1)
    return apply_rope(x.float(), torch.cat([cos, cos], 1), torch.cat([sin, sin], 1))


def split_rope(qkv: torch.Tensor, config: LlamaConfig, table: torch.Tensor, positions: torch.Tensor) -> tuple:
    """q, k (RoPE applied, rounded to bf16) and v [M, heads, D] from the QKV projection's output [M, (Hq+2Hkv) D]."""
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    x = qkv.view(qkv.shape[0], hq + 2 * hkv, d)
    q = apply_rope_f32(x[:, :hq], table, positions).to(torch.bfloat16)
    k = apply_rope_f32(x[:, hq:hq + hkv], table, positions).to(torch.bfloat16)
    return q, k, x[:, hq + hkv:]


def rms_rows(x: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16(x * rsqrt(mean(x^2) + eps)) per row: RMSNorm with its gain folded into the next projection."""
    return (x.float() * rms_row_factor(x, eps)[..., None]).to(torch.bfloat16)


def row_products(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ wt [K, N], each row its own M = 1 product (one batched GEMM, wt shared by stride 0, not copied):
    a row's result does not depend on how many rows share the call. A 2-D GEMM need not round M = 1 as it rounds
    M > 1 (CPU GEMMs do not), which would make a verify step's rows differ from the plain step's."""
    return torch.bmm(x[:, None, :], wt.expand(x.shape[0], *wt.shape)).squeeze(1)


GLUES = ("fused", "norm-kernel", "torch")


def fused_norm(x: torch.Tensor, w: Weight, epilogue: str) -> bool:
    """Whether the kernel path runs this norm + projection as one fused kernel (decode.plan.fuses_norm, asked with
    the SM count the ops use on a GPU)."""
    from decode import plan
    from futx.hardware import sm_count
    from futx.quant.int4 import Int4Weight

    if not isinstance(w, Int4Weight):
        return False
    n, k = w.shape
    sms = sm_count(x.device) if x.is_cuda else 132
    return plan.fuses_norm("int4", w.group_size, epilogue, x.shape[0], n, k, sms)


class EmulatedOps:
    """glue "fused" (default): the row factor scales the outputs where the kernel path fuses it (as KernelOps
    does); "norm-kernel" / "torch": a normalized bf16 row first, everywhere."""

    name = "emulated"

    def __init__(self, glue: str = "fused"):
        if glue not in GLUES:
            raise ValueError(f"glue must be one of {GLUES}, got {glue!r}")
        self.glue = glue
        self._dequant: dict[int, torch.Tensor] = {}

    def _w(self, w: Weight) -> torch.Tensor:
        key = id(w)
        if key not in self._dequant:
            self._dequant[key] = dequantize_weight(w)
        return self._dequant[key]

    def rms_rows(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_rows(x, eps)

    def norm_linear(self, x: torch.Tensor, w: Weight, epilogue: str, eps: float) -> torch.Tensor:
        """The projection of x's RMSNorm row (gain folded into w): QKV and gate/up. Where the kernel path fuses
        the row factor into the projection (decode.plan.fuses_norm) it scales the float32 outputs, so no
        normalized bf16 row is stored; elsewhere the row-factor kernel stores one."""
        if self.glue == "fused" and fused_norm(x, w, epilogue):
            y = row_products(x.float(), self._w(w).T) * rms_row_factor(x, eps)[:, None]
            return self._finish(y, epilogue)
        return self.linear(self.rms_rows(x, eps), w, epilogue)

    def final_norm(self, x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
        """The final RMSNorm before the LM head, with its bf16 gain (futx.reference.rms_norm)."""
        return rms_norm(x, gain, eps)

    def head(self, h: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """BF16 logits [M, V]."""
        return h @ lm_head.T

    def argmax(self, logits: torch.Tensor, out: torch.Tensor) -> None:
        """out [M] int64: the greedy next token of each row of logits [M, V]."""
        torch.argmax(logits, dim=-1, out=out)

    def linear(self, x: torch.Tensor, w: Weight, epilogue: str = "store", residual=None) -> torch.Tensor:
        return self._finish(row_products(x.float(), self._w(w).T), epilogue, residual)

    @staticmethod
    def _finish(y: torch.Tensor, epilogue: str, residual=None) -> torch.Tensor:
        if epilogue == "swiglu":
            y = torch.nn.functional.silu(y[:, 0::2]) * y[:, 1::2]
        elif epilogue == "residual":
            y = y + residual.float()
        return y.to(torch.bfloat16)

    def attention(self, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: EngineCache,
                  layer: int, table: torch.Tensor, out: torch.Tensor, step: bool = True) -> torch.Tensor:
        """RoPE on q and k, new K/V row into the cache, GQA attention over positions [0, pos] -> out [M, Hq, D]
        (step: KernelOps.attention's launch choice; the same arithmetic either way)."""
        c = cache.config
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        m = qkv.shape[0]
        q, k, v = split_rope(qkv, c, table, positions)
        cache.write_rows(layer, slots, positions, k, v)
        g = hq // hkv
        if cache.values is None:
            raise ValueError("the emulated backend needs an EngineCache made with keep_values=True")
        ctx = int(positions.max()) + 1  # rows attend over their own [0, pos]; later positions are masked
        kk, vv = cache.attended_values(layer, slots, ctx)                   # [M, Hkv, ctx, D] float32
        s = (q.float().view(m, hkv, g, d) @ kk.transpose(-1, -2)) / math.sqrt(d)  # [M, Hkv, g, ctx]
        late = torch.arange(ctx, device=q.device)[None, :] > positions.long()[:, None]
        p = torch.softmax(s.masked_fill(late[:, None, None, :], float("-inf")), dim=-1)
        out.copy_((p @ vv).reshape(m, hq, d).to(torch.bfloat16))
        return out

    def attention_block(self, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: EngineCache,
                        layer: int, table: torch.Tensor, out: torch.Tensor, width: int) -> torch.Tensor:
        """A block step's attention (`width` rows per request in one slot, causal inside the block): `attention`
        already is one, since it writes every row's K/V before any row attends over its own [0, pos]."""
        return self.attention(qkv, positions, slots, cache, layer, table, out)


GEMV_HEAD_ROWS = 16
# whether the decode attention kernel (and the block step's prewrite) address a paged cache through its block
# table: on since the paged kernels (issue 28, branch paged-decode) merged; False refuses a paged cache on the
# kernels again (the CLI's model builder then keeps --backend kernels contiguous)
KERNELS_PAGED = True


def check_kernel_cache(cache: EngineCache) -> None:
    if cache.layout is not None and not KERNELS_PAGED:
        raise ValueError("the paged KV cache is not built into the decode kernels yet (the emulated backend runs "
                         "it); use the contiguous cache on --backend kernels")


BLOCK_ATTENTION = ("prewrite", "kernel", "columns")   # KernelOps.attention_block's ways

# Routing rule E5 (docs/routing.md): the decode step's attention as a programmatic dependent launch of its QKV
# projection (decode.attn_plan.AttnPlan.pdl: its first cache tiles requested while the projection finishes, the O
# projection released at its start) for steps of at most this many rows, at the head dims its kernels are built for
# (futx.runtime.catalog.decode_attention.PDL_HEAD_DIMS), on models up to PDL_ATTENTION_MAX_HIDDEN wide. Measured
# (`futx bench decode --pdl-attention`, both in one process; docs/routing.md E5): the 8B faster at 1, 4 and 8 rows,
# even at (1, 8192), slower at (32, 4096); the 70B slower at (4, 1024) and (1, 8192).
PDL_ATTENTION_MAX_ROWS = 8
PDL_ATTENTION_MAX_HIDDEN = 4096


def pdl_attention_limit(config) -> int:
    """Rule E5's row limit for a model of this config (0: never)."""
    return PDL_ATTENTION_MAX_ROWS if config.hidden_size <= PDL_ATTENTION_MAX_HIDDEN else 0

# Routing rule E6 (docs/routing.md): the final RMSNorm as one kernel (`engine.rms_rows.gain`) instead of the
# reference's ~8 elementwise torch kernels a step. Off: measured even with the torch chain at every point (`futx
# bench decode --final-norm-kernel`; docs/routing.md E6).
FINAL_NORM_KERNEL = False

# Routing rule E7 (docs/routing.md): the step's greedy argmax on futx's kernel (`engine.argmax_rows`: many CTAs per
# row, PDL) instead of torch.argmax (a few CTAs for a 128k-wide row: ~28 µs a step on the H100 and H200 timelines).
# Measured (`futx bench decode --argmax-kernel`, H100): 20-33 µs a step faster at every point of the 8B and 70B.
ARGMAX_KERNEL = True


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """int64 [M]: the argmax of each row of logits [M, V] outside the step (the DLite drafter's tokens), by rule E7
    as the step takes it."""
    if ARGMAX_KERNEL and logits.is_cuda and logits.dim() == 2:
        from futx.ops.argmax_rows import greedy

        return greedy(logits)
    return logits.argmax(-1)


def cache_paging(cache: EngineCache) -> tuple:
    """(block table, page size) of a paged engine cache (`cache.layout` a futx.paging.PageLayout, `cache.table` its
    device int32 block table [slots + 1, max_pages]); (None, 0) for a contiguous one (layout None or absent)."""
    layout = getattr(cache, "layout", None)
    if layout is None:
        return None, 0
    return cache.table, layout.page_size


class KernelOps:
    """futx kernels. glue="fused" (default): the RMSNorm row factor runs inside the tile-GEMV projections that read
    it (decode.plan.fuses_norm; elsewhere it is one kernel) and RoPE inside the attention kernel, which reads
    q/k/v straight from the QKV output; glue="norm-kernel": the row factor always its own kernel; glue="torch":
    both as PyTorch ops between the kernels (the naive chain, kept to measure what fusing saves)."""

    name = "kernels"

    def __init__(self, glue: str = "fused"):
        import futx.ops  # noqa: F401  (registers torch.ops.futx.*)
        from futx.ops import decode_linear as dl

        if glue not in GLUES:
            raise ValueError(f"glue must be one of {GLUES}, got {glue!r}")
        self.glue = glue
        self._dl = dl
        self._padded_heads: dict = {}
        self.block_attention = "kernel"   # or "prewrite", "columns": see attention_block (BLOCK_ATTENTION)
        self.pdl_attention_rows = None   # rule E5: None routes it (pdl_attention_limit), n: up to n rows; set
        # before capturing the step's graphs
        self.attention_splits = 0   # 0: the op's split rule (decode.attn_plan.step_splits, A8); n: n splits
        self.final_norm_kernel = FINAL_NORM_KERNEL   # rule E6
        self.argmax_kernel = ARGMAX_KERNEL   # rule E7

    def rms_rows(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        if self.glue == "torch":
            return rms_rows(x, eps)
        y = torch.empty_like(x)
        torch.ops.futx.rms_rows_(x, y, eps)
        return y

    def linear(self, x: torch.Tensor, w: Weight, epilogue: str = "store", residual=None) -> torch.Tensor:
        return self._dl.decode_linear(x, w, epilogue, residual)

    def norm_linear(self, x: torch.Tensor, w: Weight, epilogue: str, eps: float) -> torch.Tensor:
        if self.glue != "fused":
            return self.linear(self.rms_rows(x, eps), w, epilogue)
        return self._dl.decode_norm_linear(x, w, epilogue, eps)

    def final_norm(self, x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
        """The final RMSNorm with its bf16 gain: with rule E6 one kernel (`engine.rms_rows.gain`, PDL: the LM head's
        weights start streaming while it runs), else futx.reference.rms_norm's chain of torch kernels. The same
        rounding; the row's sum of squares in the kernel's order."""
        if self.final_norm_kernel and self.glue != "torch":
            y = torch.empty_like(x)
            torch.ops.futx.rms_rows_(x, y, eps, gain)
            return y
        return rms_norm(x, gain, eps)

    def head(self, h: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """BF16 logits [M, V]: up to GEMV_HEAD_ROWS rows on futx's BF16 decode GEMV (as fast as cuBLAS there, and
        no cuBLAS workspace in the step's graph: see graphs.fresh_cublas_workspace), above on cuBLAS (the skinny
        BF16 kernel is slower at 32 rows: 8B step 5.75 vs 5.44 ms at B = 32, H200)."""
        if h.shape[0] > GEMV_HEAD_ROWS:
            return h @ lm_head.T
        n = lm_head.shape[0]
        if n % BLOCK_N == 0:
            return self._dl.decode_linear_bf16(h, lm_head)
        padded = self._padded_heads.get(id(lm_head))   # a vocabulary the GEMV's column blocks do not divide
        if padded is None:
            padded = torch.zeros(-(-n // BLOCK_N) * BLOCK_N, lm_head.shape[1], dtype=lm_head.dtype,
                                 device=lm_head.device)
            padded[:n] = lm_head
            self._padded_heads[id(lm_head)] = padded
        return self._dl.decode_linear_bf16(h, padded)[:, :n]

    def argmax(self, logits: torch.Tensor, out: torch.Tensor) -> None:
        """out [M] int64: the greedy next token of each row (rule E7: futx's kernel where it takes the logits, the
        same answer as torch.argmax, ties and NaNs included)."""
        if self.argmax_kernel and self.glue != "torch":
            from futx.ops.argmax_rows import greedy

            greedy(logits, out)
        else:
            torch.argmax(logits, dim=-1, out=out)

    def attention(self, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: EngineCache,
                  layer: int, table: torch.Tensor, out: torch.Tensor, step: bool = True) -> torch.Tensor:
        """step: the decode step's attention, right after its QKV projection (rule E5 may launch it as a dependent);
        False where the rows' K/V were just written by the kernels before it (attention_block)."""
        check_kernel_cache(cache)
        c = cache.config
        lc = cache.layers[layer]
        block_table, page_size = cache_paging(cache)   # a paged cache: the kernel reads through its table
        if self.glue != "torch":
            x = qkv.view(qkv.shape[0], c.num_attention_heads + 2 * c.num_key_value_heads, c.head_dim)
            limit = pdl_attention_limit(c) if self.pdl_attention_rows is None else self.pdl_attention_rows
            pdl = step and qkv.shape[0] <= limit and c.head_dim in PDL_HEAD_DIMS
            torch.ops.futx.decode_attention_qkv_(x, positions, slots, *lc.tensors(), table, out, cache.fmt,
                                                 cache.rotate, 0.0, self.attention_splits, 0, False, block_table,
                                                 page_size, pdl)
            return out
        q, k, v = split_rope(qkv, c, table, positions)
        torch.ops.futx.decode_attention_(q, k, v.contiguous(), positions, slots, *lc.tensors(), out, cache.fmt,
                                         cache.rotate, 0.0, 0, 0, False, "", block_table, page_size)
        return out

    def attention_block(self, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: EngineCache,
                        layer: int, table: torch.Tensor, out: torch.Tensor, width: int) -> torch.Tensor:
        """A block step's attention: rows i * width + j (j < width) of request i share its slot at consecutive
        positions, row j attending over [0, its pos], the block's earlier rows included.

        The attention kernel writes each row's own new K/V row (main copy and mirror) and reads [0, pos]; with
        several rows of one slot in one launch, a row's CTA could read a sibling row's K/V before the sibling's
        CTA wrote it (a race). "prewrite" therefore writes every row first, as a prefill does
        (futx.engine.prefill: main copy, then EngineCache.mirror_rows with the mirror kernel, the decode kernel's
        own quantization code): the main copy gets k with RoPE applied exactly as the kernel applies it (float32
        rotate-half with the same rope table, rounded to bf16: split_rope, the kernel's specification), v as is.
        The attention kernel's own rewrite of each row then stores the same bytes, so whichever CTA writes
        last, every read sees the final values: one launch, the cache read once per layer. "kernel": the same
        prewrite as one launch of futx's block-rows kernel (futx.ops.qkv_rows: RoPE, main copy and mirror with the
        attention kernel's own code) instead of ~10 torch and mirror launches per layer (mirror formats; BF16 caches
        take the torch prewrite): the default, the verify step 18-27% faster on the H200 (routing rule A7,
        docs/results-speculative.md). "columns": one
        launch per block column j over the requests' row j (distinct slots, as a decode step), race-free by
        construction but reading the cache `width` times (kept as the reference the GPU tests compare to)."""
        c = cache.config
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        if self.block_attention == "columns":
            m = qkv.shape[0]
            x3 = qkv.view(m // width, width, -1)
            o3 = out.view(m // width, width, hq, d)
            for j in range(width):
                o = torch.empty_like(o3[:, j])
                self.attention(x3[:, j].contiguous(), positions.view(-1, width)[:, j].contiguous(),
                               slots.view(-1, width)[:, j].contiguous(), cache, layer, table, o, step=False)
                o3[:, j].copy_(o)
            return out
        if self.block_attention not in BLOCK_ATTENTION:
            raise ValueError(f"block_attention must be one of {BLOCK_ATTENTION}, got {self.block_attention!r}")
        self.prewrite_rows(qkv, positions, slots, cache, layer, table, kernel=self.block_attention == "kernel")
        return self.attention(qkv, positions, slots, cache, layer, table, out, step=False)

    @staticmethod
    def prewrite_rows(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: EngineCache, layer: int,
                      table: torch.Tensor, kernel: bool = False) -> None:
        """The new K/V rows of qkv (RoPE on k) into the main copy and, by the mirror kernel, the mirror: the bytes
        the attention kernel itself stores for these rows (tests/test_speculative_gpu.py checks they are equal).
        kernel: all of it by one launch of the block-rows kernel (futx.ops.qkv_rows; mirror formats, a BF16 cache
        takes the torch path), always so on the INT4-only cache (mirror rows only). A paged cache's rows go to
        their (page, in-page row) of its block table (futx.paging.locate), located once. Capturable: no host
        synchronization (load_blocks checked the indices)."""
        check_kernel_cache(cache)
        c = cache.config
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        x = qkv.view(qkv.shape[0], hq + 2 * hkv, d)
        lc = cache.layers[layer]
        at_s, at_p = cache.locate(slots, positions)   # the rows located once, for the main copy and the mirror
        # an INT4-only cache (staging pages) has no main copy of the block's pages: its rows go to the mirror by the
        # kernel's mirror-only twin, which the attention kernel's `.mo` twin then rewrites the same
        if (kernel or getattr(cache, "staged", False)) and cache.fmt != "bf16":
            i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
            torch.ops.futx.qkv_rows_(cache.fmt, x, table, i32(positions), i32(at_s), i32(at_p), *lc.tensors())
            return
        k = apply_rope_f32(x[:, hq:hq + hkv], table, positions).to(torch.bfloat16)   # RoPE at the true positions
        lc.k_cache[at_s, :, at_p] = k
        lc.v_cache[at_s, :, at_p] = x[:, hq + hkv:]
        cache.mirror_stored_rows(layer, at_s, at_p)

    @staticmethod
    def mirror_rows(cache: EngineCache, layer: int, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """The mirror of rows (slots[m], positions[m]) already in the main copy (a prefill wrote them), by futx's
        mirror kernel: EngineCache.mirror_rows, which translates a paged cache's rows itself. Capturable."""
        cache.mirror_rows(layer, slots, positions, kernel=True)


def make_ops(backend: str, glue: str = "fused"):
    if backend == "kernels":
        return KernelOps(glue)
    if backend == "emulated":
        return EmulatedOps(glue)
    raise ValueError(f"unknown engine backend {backend!r}: 'kernels' or 'emulated'")
