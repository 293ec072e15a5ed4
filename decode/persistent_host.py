"""The host side of the persistent kernels' task loop (decode/persistent_loop.py), without the DSL, so that the
GPU machine (no DSL there: kernels are staged ahead of time) can build tables and references: the table's field
indices and end marker, and the chain kernel's table and its torch reference, the layer kernel's block size."""

from __future__ import annotations

from decode.persistent_schedule import END, END_ROW, F  # noqa: F401  (END and F: the kernels' names for them)

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
