"""The ring layer's task trace, summarized (issue 29's view of where the time goes inside a persistent launch, which
Nsight Systems shows as one kernel): what `PersistentStep(body="ring", trace=True)` records per task
(decode.persistent_host.TRACE_FIELDS, global-timer ns) turned into per-kind busy and wait times and each layer's
phases.

- *wait*: ready - start, the time a CTA's consumers spent at the task's counter (0 for a same-kind follower, which
  keeps its row and skips the wait).
- *busy*: end - ready, the task's own work (staging, the ring's stages, the epilogue; attention's partial or merge).
- *lead* (projections): ready - issued, how long before the task could start its first stage's weights had been
  requested (negative: the consumers waited for the producer's copies too).
- *phases*: per layer and kind, from the first task's ready to the last task's end, relative to the layer's first
  start: where the all-to-all barriers sit and how long attention takes inside the layer.
"""

from __future__ import annotations

import torch

from decode.persistent_host import END, F, TRACE_FIELDS
from decode.persistent_schedule import KINDS

T = {n: i for i, n in enumerate(TRACE_FIELDS)}


def _stats(v: torch.Tensor) -> dict:
    if v.numel() == 0:
        return {"n": 0}
    v = v.double() / 1e3
    return {"n": int(v.numel()), "median_us": float(v.median()), "mean_us": float(v.mean()),
            "max_us": float(v.max()), "sum_us": float(v.sum())}


def summarize(table: torch.Tensor, trace: torch.Tensor) -> dict:
    """table int32 [CTAs, rows, FIELDS] (the step's task table), trace int64 [CTAs, rows, len(TRACE_FIELDS)] as the
    traced kernel left it. Raises ValueError if a listed task has no timestamps (it did not run) or they go
    backwards."""
    table, trace = table.cpu(), trace.cpu()
    if trace.shape[:2] != table.shape[:2] or trace.shape[2] != len(TRACE_FIELDS):
        raise ValueError(f"trace {tuple(trace.shape)} does not match table {tuple(table.shape)}")
    live = table[..., F["kind"]] != END
    kind, layer = table[..., F["kind"]][live], table[..., F["layer"]][live]
    tr = trace[live]
    start, ready, end = tr[:, T["start"]], tr[:, T["ready"]], tr[:, T["end"]]
    if (tr[:, :3] < 0).any():
        raise ValueError(f"{int((tr[:, :3] < 0).any(dim=1).sum())} listed tasks have no timestamps: did the step run "
                         "on the traced ring kernel?")
    if ((ready < start) | (end < ready)).any():
        raise ValueError("timestamps go backwards within a task")
    t0 = int(start.min())
    out = {"span_us": (int(end.max()) - t0) / 1e3, "tasks": int(live.sum()), "kinds": {}, "layers": []}
    for k, name in enumerate(KINDS):
        sel = kind == k
        if not sel.any():
            continue
        row = {"busy": _stats(end[sel] - ready[sel]), "wait": _stats(ready[sel] - start[sel])}
        issued = tr[sel, T["issued"]]
        if (issued >= 0).any():
            row["lead"] = _stats(ready[sel][issued >= 0] - issued[issued >= 0])
        out["kinds"][name] = row
    for lay in range(int(layer.max()) + 1):
        sl = layer == lay
        base = int(start[sl].min())
        phases = {}
        for k, name in enumerate(KINDS):
            sel = sl & (kind == k)
            if sel.any():
                phases[name] = ((int(ready[sel].min()) - base) / 1e3, (int(end[sel].max()) - base) / 1e3)
        out["layers"].append({"layer": lay, "span_us": (int(end[sl].max()) - base) / 1e3, "phases_us": phases})
    return out


def report(summary: dict) -> str:
    """The summary as text: the kinds' medians, then the layers' median span and each kind's median phase."""
    lines = [f"{summary['tasks']} tasks, span {summary['span_us']:.1f} us",
             f"{'kind':14s} {'n':>6s} {'busy med':>9s} {'wait med':>9s} {'busy sum':>10s} {'lead med':>9s}"]
    for name, row in summary["kinds"].items():
        b, w, lead = row["busy"], row["wait"], row.get("lead", {})
        lines.append(f"{name:14s} {b['n']:6d} {b['median_us']:9.2f} {w['median_us']:9.2f} {b['sum_us']:10.1f} "
                     + (f"{lead['median_us']:9.2f}" if lead.get("n") else f"{'-':>9s}"))
    layers = summary["layers"]
    if layers:
        spans = torch.tensor([lay["span_us"] for lay in layers])
        lines.append(f"layer span: median {float(spans.median()):.1f} us over {len(layers)} layers; phases (median "
                     "first ready .. last end, us from the layer's first start):")
        for name in KINDS:
            ph = [lay["phases_us"][name] for lay in layers if name in lay["phases_us"]]
            if ph:
                a = float(torch.tensor([p[0] for p in ph]).median())
                z = float(torch.tensor([p[1] for p in ph]).median())
                lines.append(f"  {name:14s} {a:7.1f} .. {z:7.1f}")
    return "\n".join(lines)
