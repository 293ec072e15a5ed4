"""The host side of the persistent kernels' task loop (decode/persistent_loop.py), without the DSL, so that the
GPU machine (no DSL there: kernels are staged ahead of time) can build tables and references: the table's field
indices and end marker, and the chain kernel's table and its torch reference, the layer kernel's block size."""

from __future__ import annotations

from decode.gemv_layout import TOKENS, UNIT_BYTES, UNIT_SCALE_BYTES, X_ROW_PAD
from decode.persistent_schedule import END, END_ROW, FIELDS, F  # noqa: F401  (END and F: the kernels' names)

THREADS = 128                  # the chain kernel's block: one tile of columns per thread
LAYER_WARPS = 8                # the layer kernel's block (decode/persistent_layer.py): every task body runs on it


def chain_table(layers: int, tiles: int, ctas: int):
    """The chain's task table: round l's tile t on CTA (l * tiles + t) % ctas, in round order (each list increases
    in a topological order: no deadlock), waiting on one counter for all of round l - 1 (cumulative target
    l * tiles) and signalling it. Returns (int32 table, counters)."""
    import torch

    if layers < 1 or tiles < 1 or ctas < 1:
        raise ValueError(f"chain_table needs positive layers, tiles and ctas, got {layers}, {tiles}, {ctas}")
    lists = [[] for _ in range(ctas)]
    for lay in range(layers):
        for t in range(tiles):
            wait = [0, lay * tiles] if lay else [-1, 0]
            lists[(lay * tiles + t) % ctas].append([0, 0, lay + 1, t, 0, 0, *wait, -1, 0, 0, -1])
    width = max(len(lst) for lst in lists) + 1
    table = [lst + [list(END_ROW)] * (width - len(lst)) for lst in lists]
    return torch.tensor(table, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)


def chain_reference(x0, layers: int):
    """What ChainKernel computes, in torch and in its order of float32 additions (so bit for bit): x
    [layers + 1, tiles * THREADS] from round 0's row x0."""
    import torch

    tiles = x0.numel() // THREADS
    rows = [x0.float().view(tiles, THREADS)]
    for _ in range(layers):
        p = rows[-1]
        z = torch.zeros_like(p[:1])
        rows.append(((p + 1.0) + torch.cat([z, p[:-1]])) + torch.cat([p[1:], z]))
    return torch.stack([r.reshape(-1) for r in rows])


def layer_plan(cache: str = "int4", head_dim: int = 128):
    """The layer kernel's attention plan: decode attention's fused-QKV plan for the cache format (the INT4 mirror
    rotated, as the engine cache keeps it) on the layer's block of LAYER_WARPS warps."""
    from decode.attn_plan import default_plan

    return default_plan(cache, head_dim, rotate=cache == "int4", warps=LAYER_WARPS, fused_qkv=True)


# ---- the ring layer (decode/persistent_ring.py): a producer warp streams every projection task's weights --------
RING_CONSUMER_WARPS = LAYER_WARPS   # they run every task body; the producer warp is one more
RING_RED_BUFS = 4                   # the epilogue-warp variant's partial buffers (tasks handed on, not yet finished)
RING_STAGE_UNITS = RING_CONSUMER_WARPS   # a stage holds one unit per consumer warp, consecutive in K
RING_STAGE_K = RING_STAGE_UNITS * 128    # every projection's K must be a multiple of it (whole stages)
RING_MAX_STAGES = 16
RING_HEADER = 1024                  # the stages' full and empty mbarriers and the consumers' two task rows
RING_ROW_BYTES = 4 * len(FIELDS)    # one task row of the table (48 bytes: three 16-byte copies)
ALIGN = 1024


def ring_threads(epilogue_warp: bool = False) -> int:
    """The ring layer's block: the consumer warps, the producer warp and (the tuning space's `epilogue_warp`) a warp
    that finishes the projection tasks from their partials."""
    return 32 * (RING_CONSUMER_WARPS + 1 + int(epilogue_warp))


def ring_per_warp(tokens: int) -> int:
    """Token columns a warp's partials and sums of squares hold: TOKENS for the multi-token kernel, else 1."""
    return TOKENS if tokens > 1 else 1


def ring_regions(stages: int, tokens: int = 1, red_bufs: int = 1) -> dict:
    """Byte offsets of the ring layer's shared memory: `bars` (full[stages], empty[stages], 8 bytes each), `rows`
    (two task rows of the table, 16-byte aligned: the consumers' double buffer), `weights` [stages][8 units of 1 KB],
    `scales` [stages][8 x 32 B], `red` [warps][16] f32 (the warps' partials; multi-token [warps][16][TOKENS]),
    `ss` [warps] f32 (sums of squares; multi-token [warps][TOKENS]),
    `body` (1024-aligned, the attention bodies' scratch: a projection task stages its input rows there, in chunks of
    `ring_chunk_stages`). `red_bufs` > 1 (the epilogue-warp variant): that many partial buffers `red`, each with its
    task's sums of squares in `red_ss` [red_bufs][warps][per], and their full and empty mbarriers at `red_bars`."""
    red_bars = 16 * stages + 2 * RING_ROW_BYTES
    if not 2 <= stages <= RING_MAX_STAGES or red_bars + 16 * red_bufs > RING_HEADER:
        raise ValueError(f"the ring takes 2..{RING_MAX_STAGES} stages, got {stages}")
    w = RING_HEADER
    s = w + stages * RING_STAGE_UNITS * UNIT_BYTES
    red = s + stages * RING_STAGE_UNITS * UNIT_SCALE_BYTES
    ss = red + red_bufs * ring_red_bytes(tokens)
    red_ss = ss + ring_ss_bytes(tokens)
    body = -(-(red_ss + (red_bufs * ring_ss_bytes(tokens) if red_bufs > 1 else 0)) // ALIGN) * ALIGN
    return {"bars": 0, "rows": 16 * stages, "red_bars": red_bars, "weights": w, "scales": s, "red": red, "ss": ss,
            "red_ss": red_ss, "body": body}


def ring_red_bytes(tokens: int = 1) -> int:
    """One task's partials: [warps][16 channels][token columns] float32."""
    return RING_CONSUMER_WARPS * 16 * ring_per_warp(tokens) * 4


def ring_ss_bytes(tokens: int = 1) -> int:
    """One task's sums of squares of its staged rows: [warps][token columns] float32."""
    return RING_CONSUMER_WARPS * ring_per_warp(tokens) * 4


def ring_chunk_stages(body_bytes, rows, tokens: int = 1):
    """The stages of K (RING_STAGE_K each) of a projection's input whose `rows` rows fit `body_bytes` of shared memory
    at once: a task stages its input a chunk of this many stages at a time (one chunk where the whole K fits; the 8B's
    down input at 8 rows takes two). One row is contiguous, multi-token rows sit X_ROW_PAD apart (the tile GEMV's
    staging). +, * and // only: the kernel evaluates it on its runtime row count."""
    if tokens == 1:
        return body_bytes // (RING_STAGE_K * 2)
    return (body_bytes - rows * X_ROW_PAD) // (rows * (RING_STAGE_K * 2))


RING_STAGE_BYTES = RING_STAGE_UNITS * UNIT_BYTES               # a stage's packed weights (8 KB)
RING_STAGE_SCALE_BYTES = RING_STAGE_UNITS * UNIT_SCALE_BYTES   # their group scales (256 B)
RING_WORD_BYTES = 16                                           # a lane's word of one block: one 16-byte load


def ring_weights_at(nb, k, st):
    """Byte offset of n-block nb's stage st in a projection's packed INT4 weights ([N/16, K/64, 32, 4] int32: an
    n-block is its K/64 blocks in K order, 16 channels x K nibbles = 8 K bytes; a stage is 16 blocks, 8 units)."""
    return nb * (k * 8) + st * RING_STAGE_BYTES


def ring_scales_at(nb, k, st):
    """Byte offset of n-block nb's stage st in its float16 group scales ([N/16, K/128, 16]: K / 4 bytes per
    n-block, a stage's 8 groups 256 bytes)."""
    return nb * (k // 4) + st * RING_STAGE_SCALE_BYTES


def ring_lane_at(warp, lane):
    """Byte offset, in a stage's weights, of the lane's word of the first block of the warp's unit (the stage's unit
    `warp`; the unit's second block is 32 words on: the tile GEMV's `_ring_read`)."""
    return warp * UNIT_BYTES + lane * RING_WORD_BYTES


def ring_unit_scales_at(warp):
    """Byte offset, in a stage's scales, of the warp's unit's 16 channel scales."""
    return warp * UNIT_SCALE_BYTES


def ring_row_stride(chunk, n_st, mn=min):
    """Bytes between staged rows of a projection's input in the body: a chunk's stages of one row (all of them where
    the input is one chunk), then X_ROW_PAD so that the multi-token MMAs' 8 ldmatrix rows hit different banks; `mn`
    is min on the values given (the kernel passes the DSL's)."""
    return mn(chunk, n_st) * (RING_STAGE_K * 2) + X_ROW_PAD


RING_PIECE = 16                          # bytes a lane copies at once
RING_UNIT_X_BYTES = 128 * 2              # one unit's activations of one row (128 bf16)
RING_PIECES = RING_UNIT_X_BYTES // RING_PIECE


def ring_piece_offset(c, warp):
    """Where a warp's c-th 16-byte piece of a chunk's activations sits, in bytes from the chunk's start (in the row
    as in shared memory): piece c % RING_PIECES of the warp's unit c // RING_PIECES of the chunk, which is unit
    (c // RING_PIECES) * RING_STAGE_UNITS + warp, the unit the warp multiplies at the chunk's stage c // RING_PIECES.
    +, * , // and % only: the kernel evaluates it on its values."""
    return ((c // RING_PIECES) * RING_STAGE_UNITS + warp) * RING_UNIT_X_BYTES + (c % RING_PIECES) * RING_PIECE


def ring_stages(body_bytes: int, smem: int, tokens: int = 1, red_bufs: int = 1) -> int:
    """The most stages (<= RING_MAX_STAGES) that fit `smem` bytes beside a body of `body_bytes` (0: not even 2)."""
    best = 0
    for stages in range(2, RING_MAX_STAGES + 1):
        if ring_regions(stages, tokens, red_bufs)["body"] + body_bytes <= smem:
            best = stages
    return best


def ring_kernel_stages(attention_bytes: int, tokens: int = 1, red_bufs: int = 1) -> int:
    """The stages a ring kernel is compiled with (decode/persistent_ring.py; the host's checks use the same): as many
    as fit beside the attention scratch, which is the body."""
    from futx.hardware import SMEM_PER_CTA

    return ring_stages(attention_bytes, SMEM_PER_CTA, tokens, red_bufs)


def ring_k_misfit(ks) -> "str | None":
    """Why projections of these input widths K cannot run on the ring (None: they can): a stage is one unit per
    consumer warp, so K must be whole stages."""
    bad = sorted({k for k in ks if k % RING_STAGE_K})
    return f"the ring layer needs every projection's K a multiple of {RING_STAGE_K}, got {bad}" if bad else None


# the ring layer's task trace (its `.trace` registry entries): int64 [CTAs, table rows, fields] of global-timer ns,
# written by the task's CTA (-1 where it did not run): when its consumers reached it, when its wait had passed, when
# its last write was done, and (projections) when the producer had issued its first stage's copies
TRACE_FIELDS = ("start", "ready", "end", "issued")

