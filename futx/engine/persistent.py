"""The persistent decode layer's host side (issue 29): the task table of a model's whole step at one row, its
counters and scratch, and the layer launches (decode/persistent_layer.py, registry `decode.persistent.layer.*`).

The table is built once per model (decode.persistent_schedule, kernel form: fused row factors, every split-KV
partial in the table, the split count chosen for the cache's capacity as the attention op chooses it), so one
table serves every context: which splits hold tiles and which one writes the new token is the kernel's choice at
run time, from the row's position. A step zeroes the counters (targets are cumulative over the layers) and launches
the layer kernel once per layer; the residual stream is updated in place.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from futx.runtime.catalog.persistent import CACHES as FORMATS, HEAD_DIM, layer_key  # the kernels built

MAX_ROWS = 1


def unsupported(model) -> Optional[str]:
    """Why the persistent layer cannot run this DecodeModel's one-row step (None: it can)."""
    from decode.attn_plan import MAX_GROUP

    c, p = model.config, model.packed
    if model.backend != "kernels":
        return "it runs on the kernel backend only"
    if p.weights != "int4" or p.group_size != 128:
        return f"it needs INT4 g128 weights, the model has {p.weights} g{p.group_size}"
    if model.cache.fmt not in FORMATS:
        return f"it reads an INT4 or E4M3 cache mirror, the cache is {model.cache.fmt}"
    if getattr(model.cache, "layout", None) is not None:
        return "it reads a contiguous cache, not a paged one"
    if c.head_dim != HEAD_DIM or c.num_attention_heads // c.num_key_value_heads > MAX_GROUP:
        return f"it is built for head dim {HEAD_DIM} and GQA groups <= {MAX_GROUP}"
    return None


def layer_starts(table: torch.Tensor, layers: int) -> torch.Tensor:
    """int32 [ctas, layers + 1]: CTA c runs its table rows starts[c, l] .. starts[c, l + 1] - 1 in layer l's launch
    (a CTA's list runs in task order, hence layer by layer; END rows are past every layer)."""
    from decode.persistent_host import END, F

    kind, layer = table[..., F["kind"]], table[..., F["layer"]]
    live = kind != END
    counts = torch.stack([(live & (layer == lay)).sum(dim=1) for lay in range(layers)], dim=1)
    starts = torch.zeros(table.shape[0], layers + 1, dtype=torch.int32)
    starts[:, 1:] = torch.cumsum(counts, dim=1)
    return starts


class PersistentStep:
    """The one-row step's layers on the persistent layer kernel, for one DecodeModel (its cache and weights)."""

    def __init__(self, model, ctas: Optional[int] = None, splits: Optional[int] = None):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"the persistent decode layer does not fit this model: {why}")
        from decode.attn_plan import MAX_GROUP, choose_splits
        from decode.persistent_host import layer_plan
        from decode.persistent_schedule import make_schedule, task_table
        from futx.hardware import sm_count
        from futx.runtime import get_kernel

        self.model = model
        c, dev = model.config, model.device
        fmt = model.cache.fmt
        sms = sm_count(dev)
        self.ctas = ctas or sms   # one CTA per SM (the layer kernel's registers), all co-resident
        if not 1 <= self.ctas <= sms:
            raise ValueError(f"ctas must be 1..{sms} (co-resident, one per SM), got {self.ctas}")
        if splits is None:
            splits = choose_splits(layer_plan(fmt, c.head_dim), MAX_ROWS, c.num_key_value_heads, model.capacity, sms)
        layers = len(model.packed.layers)
        sched = make_schedule(c, MAX_ROWS, model.capacity, layers=layers, ctas=self.ctas, cache=fmt,
                              splits=splits, fused_norm=True, every_split=True)
        table = task_table(sched)
        self.splits, self.counter_count = splits, len(sched.graph.counters)
        self.table = table.to(dev)
        self.starts = layer_starts(table, layers).to(dev)
        self.counters = torch.zeros(self.counter_count, dtype=torch.int32, device=dev)
        bf = dict(dtype=torch.bfloat16, device=dev)
        self.qkv = torch.empty(1, c.qkv_size, **bf)
        self.attn = torch.empty(1, c.num_attention_heads, c.head_dim, **bf)
        self.hmid = torch.empty(1, c.hidden_size, **bf)
        self.act = torch.empty(1, c.intermediate_size, **bf)
        f32 = dict(dtype=torch.float32, device=dev)
        self.ws_o = torch.empty(1, c.num_key_value_heads, splits, MAX_GROUP, c.head_dim, **f32)
        self.ws_ml = torch.empty(1, c.num_key_value_heads, splits, MAX_GROUP, 2, **f32)
        self.kernel = get_kernel(layer_key(fmt, c.head_dim))
        self.scale = 1.0 / math.sqrt(c.head_dim)

    def run(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Every layer on the one-row residual stream x [1, H] bf16 (updated in place; returned)."""
        m = self.model
        c = m.config
        if x.shape != (1, c.hidden_size) or x.dtype != torch.bfloat16 or not x.is_contiguous():
            raise ValueError(f"the persistent step takes one contiguous bf16 row [1, {c.hidden_size}], got "
                             f"{tuple(x.shape)} {x.dtype}")
        heads = self.qkv.view(1, -1, c.head_dim)
        attn2 = self.attn.view(1, c.q_size)
        self.counters.zero_()
        for i, w in enumerate(m.packed.layers):
            kc, vc, km, ks, vm, vs = m.cache.layers[i].tensors()
            self.kernel(self.table, self.starts, i, self.counters, x, w.qkv.packed, w.qkv.scales, self.qkv, attn2,
                        w.o.packed, w.o.scales, self.hmid, w.gateup.packed, w.gateup.scales, self.act, w.down.packed,
                        w.down.scales, heads, positions, slots, kc, vc, km.view(torch.uint8), ks,
                        vm.view(torch.uint8), vs, m.rope, self.attn, self.ws_o, self.ws_ml, c.rms_norm_eps,
                        self.scale)
        return x

