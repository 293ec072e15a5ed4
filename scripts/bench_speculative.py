"""Speculative decoding end to end: `futx bench speculative` (tokens/s and acceptance by context position).

One engine (the options of `futx generate`: model, backend, weight and cache formats, CUDA graphs) serves every
configuration in one process. Prompts come from WikiText-2 test windows and multi-turn chats built from the same
text (scripts/spec_prompts.py), placed so that the generated tokens fall in each --ranges bucket. For every
round, batch size B in --batches and group of B prompts, each draft in --drafts (none = plain decoding) generates
the group greedily through the serving scheduler, interleaved; reported per (corpus, batch, draft):
  * end-to-end generated tokens/s (wall time of the group, prefill included), and its ratio to `none`;
  * acceptance: mean accepted drafts and tokens per verification, overall and per context-position bucket;
  * whether the outputs equal plain decoding's, and where they first differ when not: on the kernels the verify
    step's projections run at another M than the plain step's and round differently, so greedy outputs agree up
    to the first near-tie of the target's logits (tests/test_speculative_gpu.py checks that it is a tie).
A plot of tokens per verification against context position (bins of --bin positions) per draft and corpus.

  futx bench speculative --backend kernels --drafts none,ngram,dlite --draft runs/dlite --batches 1,8 \
      --out spec.json --md spec.md --plot spec.png
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DRAFTS = ("none", "ngram", "dlite")


def build_parser(prog: str = "bench_speculative.py"):
    from futx.cli import options, validators as v
    from futx.cli.options import MAX_DRAFT
    from futx.cli.parser import Parser, RawDefaultsFormatter

    p = Parser(prog=prog, description=__doc__, formatter_class=RawDefaultsFormatter)
    options.add_model_arguments(p)
    options.add_engine_arguments(p, batch_default=8)
    p.add_argument("--drafts", type=v.choice_list(DRAFTS), default=["none", "ngram"],
                   help="configurations compared (none = plain decoding)")
    p.add_argument("--draft", default=None, type=v.input_path, help="the DLite head (for --drafts ...,dlite)")
    p.add_argument("--num-draft", type=v.int_in(1, MAX_DRAFT), default=4, help="drafts per verification")
    p.add_argument("--batches", default="1,8", help="concurrent requests per group, comma-separated")
    p.add_argument("--corpus", type=v.choice_list(("wiki", "chat")), default=["wiki", "chat"])
    p.add_argument("--text", default=None, type=v.text_file,
                   help="held-out text (default: ../shared/data/wikitext-2-raw/wiki.test.raw)")
    p.add_argument("--ranges", default="0-512,512-1024,1024-2048", help="context-position buckets")
    p.add_argument("--prompts", type=v.positive_int, default=8, help="prompts per corpus and range")
    p.add_argument("--gen-len", type=v.int_in(8), default=256, help="tokens generated per prompt")
    p.add_argument("--rounds", type=v.positive_int, default=2, help="timed rounds (after one warm-up group)")
    p.add_argument("--bin", type=v.positive_int, default=128, help="position bin of the plot")
    p.add_argument("--out", default=None, type=v.output_file, help="JSON results")
    p.add_argument("--md", default=None, type=v.output_file, help="Markdown table")
    p.add_argument("--plot", default=None, type=v.output_file, help="PNG: tokens per verification vs position")
    return p


def batches(value: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",")]
    except ValueError:
        raise ValueError(f"--batches {value!r} is not a comma-separated list of integers") from None
    if any(b < 1 for b in out):
        raise ValueError(f"--batches must be positive, got {value!r}")
    return out


def prepare(a):
    """Checks that need several options; fills defaults (mutates a)."""
    from futx.cli import options
    from futx.eval.data import default_text

    a.batch_list = batches(a.batches)
    if "dlite" in a.drafts and a.draft is None:
        raise ValueError("--drafts ...,dlite needs --draft (a head from futx train-draft)")
    options.check_model_options(a)
    options.check_engine_options(a)
    if a.backend == "reference":
        raise ValueError("futx bench speculative runs on the decode engine (--backend kernels or emulated)")
    a.max_batch = max(a.max_batch, max(a.batch_list))
    if a.max_batch * (a.num_draft + 1) > 64:
        raise ValueError(f"{a.max_batch} requests x ({a.num_draft} + 1) rows exceed the step's 64 rows")
    a.text = a.text or (str(default_text()) if default_text() else None)
    if a.text is None:
        raise ValueError("no --text and no ../shared/data/wikitext-2-raw/wiki.test.raw beside the repo")
    # the engine is built once with block steps (speculative args), the `none` scheduler runs plain steps on it
    a.speculative = next((d for d in a.drafts if d != "none"), "none")


def make_prompts(a, tok):
    from futx import files
    from futx.serve.chat import render_chat

    from scripts import spec_prompts as sp

    text = files.read_text(a.text)
    ranges = sp.parse_ranges(a.ranges)
    out = []
    if "wiki" in a.corpus:
        out += sp.wiki_prompts(tok.encode(text), ranges, a.prompts, a.gen_len)
    if "chat" in a.corpus:
        out += sp.chat_prompts(tok, render_chat, sp.articles(text), ranges, a.prompts, a.gen_len)
    return out


def groups(prompts, batch: int):
    """Per corpus, consecutive prompts in groups of `batch` (a group never mixes corpora)."""
    out = []
    for corpus in dict.fromkeys(p.corpus for p in prompts):
        mine = [p for p in prompts if p.corpus == corpus]
        out += [(corpus, mine[i:i + batch]) for i in range(0, len(mine), batch)]
    return out


def run_group(engine, tok, drafter, k, group, gen_len, stats):
    """Generate one group; returns (seconds, generated tokens, outputs). Acceptance goes into `stats`."""
    import torch

    from futx.serve.sampling import SamplingParams
    from futx.serve.scheduler import Scheduler

    s = Scheduler(engine, tok, max_queue=len(group), drafter=drafter, num_draft=k if drafter else 0)
    if drafter is not None:
        s.acceptance = stats
    params = SamplingParams(max_tokens=gen_len, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    hs = [s.submit(list(p.ids), params) for p in group]
    s.run_until_idle()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    for h in hs:
        if h.finish_reason == "error":
            raise RuntimeError(f"generation failed: {h.error}")
    return dt, sum(len(h.output) for h in hs), [list(h.output) for h in hs]


def measure(a, engine, tok, drafters, prompts) -> dict:
    from futx.speculative.stats import AcceptanceStats

    rows = []
    for b in a.batch_list:
        gs = groups(prompts, b)
        for corpus in dict.fromkeys(c for c, _ in gs):
            mine = [g for c, g in gs if c == corpus]
            for name, d in drafters.items():   # warm-up: graphs captured, drafts' first calls
                run_group(engine, tok, d, a.num_draft, mine[0][:b], 16, AcceptanceStats())
            acc = {name: AcceptanceStats() for name in drafters}
            secs = {name: [] for name in drafters}
            toks = {name: 0 for name in drafters}
            outs = {name: {} for name in drafters}
            for r in range(a.rounds):
                for gi, g in enumerate(mine):
                    for name, d in drafters.items():          # interleaved, group by group
                        stats = acc[name] if r == 0 else AcceptanceStats(keep_log=False)
                        dt, n, o = run_group(engine, tok, d, a.num_draft, g, a.gen_len, stats)
                        secs[name].append((r, gi, dt))
                        toks[name] += n if r == 0 else 0
                        if r == 0:
                            outs[name][gi] = o
            base = None
            for name in drafters:
                per_round = [sum(dt for rr, _, dt in secs[name] if rr == r) for r in range(a.rounds)]
                tps = toks[name] / statistics.median(per_round)
                same = sum(o == outs["none"][gi] for gi, o in outs[name].items()) if "none" in outs else None
                diverge = sorted(first_divergence(a_, b_) for gi, o in outs[name].items()
                                 for a_, b_ in zip(o, outs["none"][gi]) if a_ != b_) if "none" in outs else []
                row = {"corpus": corpus, "batch": b, "draft": name, "tokens": toks[name],
                       "seconds_per_round": per_round, "tokens_per_s": tps,
                       "groups": len(mine), "identical_groups": same, "first_divergence": diverge,
                       "acceptance": acc[name].summary() if drafters[name] is not None else None,
                       "log": acc[name].log if drafters[name] is not None else None}
                if name == "none":
                    base = tps
                row["speedup"] = tps / base if base else None
                rows.append(row)
                print(line(row, a.num_draft), flush=True)
    return {"rows": rows}


def first_divergence(a: list, b: list) -> int:
    """Index of the first token where two outputs differ (the shorter one's length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def line(r: dict, k: int) -> str:
    s = f"{r['corpus']:5s} B={r['batch']:<2d} {r['draft']:6s} {r['tokens_per_s']:9.1f} tok/s"
    if r["speedup"]:
        s += f"  x{r['speedup']:.2f}"
    if r["acceptance"]:
        acc = r["acceptance"]
        per = " ".join(f"{n}:{b['mean_tokens_per_verification']:.2f}" for n, b in acc["by_position"].items()
                       if b["verifications"])
        s += f"  {acc['mean_tokens_per_verification'] or 0:.2f} tok/verif (k={k}) [{per}]"
    if r["identical_groups"] is not None:
        s += f"  identical {r['identical_groups']}/{r['groups']}"
    return s


def render(res: dict) -> str:
    k = res["num_draft"]
    lines = [f"speculative decoding, {res['engine']}, {res['gpu']}, {res['date']}; k = {k}, {res['gen_len']} "
             f"tokens per prompt, greedy", "",
             "| corpus | B | draft | tokens/s | vs none | tokens / verification | 0-512 | 512-1024 | 1024-2048 | "
             "outputs = plain |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        acc = r["acceptance"]
        cells = ["–"] * 4
        if acc:
            cells[0] = f"{acc['mean_tokens_per_verification']:.2f}" if acc["verifications"] else "–"
            for i, name in enumerate(("0-512", "512-1024", "1024-2048")):
                b = acc["by_position"].get(name)
                if b and b["verifications"]:
                    cells[i + 1] = f"{b['mean_tokens_per_verification']:.2f}"
        same = "–" if r["identical_groups"] is None else f"{r['identical_groups']}/{r['groups']}"
        vs = f"{r['speedup']:.2f}x" if r["speedup"] else "–"
        lines.append(f"| {r['corpus']} | {r['batch']} | {r['draft']} | {r['tokens_per_s']:.0f} | {vs} | "
                     + " | ".join(cells) + f" | {same} |")
    return "\n".join(lines)


def plot(res: dict, path: str, bin_size: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    seen = set()
    for r in res["rows"]:
        key = (r["draft"], r["corpus"])
        if not r["log"] or key in seen:
            continue
        seen.add(key)
        logs = [x for rr in res["rows"] if (rr["draft"], rr["corpus"]) == key and rr["log"] for x in rr["log"]]
        bins: dict[int, list[int]] = {}
        for pos, _, accepted in logs:
            bins.setdefault(pos // bin_size, []).append(accepted + 1)
        xs = sorted(bins)
        ax.plot([(x + 0.5) * bin_size for x in xs], [statistics.mean(bins[x]) for x in xs], marker="o", ms=3,
                label=f"{key[0]} / {key[1]}")
    ax.set_xlabel("context position of the verification")
    ax.set_ylabel(f"tokens per verification (k = {res['num_draft']})")
    ax.set_ylim(bottom=1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(a) -> int:
    import datetime
    import json

    import torch

    from futx import atomic
    from futx.cli.models import build_serving_engine, tokenizer_for
    from futx.speculative.drafter import make_drafter

    prepare(a)
    tok = tokenizer_for(a.model)
    prompts = make_prompts(a, tok)
    capacity = max(len(p.ids) for p in prompts) + a.gen_len + a.num_draft + 1
    engine, tok = build_serving_engine(a, capacity, tok)
    model = engine.model
    drafters = {}
    for name in a.drafts:
        drafters[name] = None if name == "none" else make_drafter(name, a.draft, device=model.device,
                                                                 target=model.packed)
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "engine": engine.describe(), "num_draft": a.num_draft, "gen_len": a.gen_len, "command": sys.argv,
           "prompts": {c: sum(p.corpus == c for p in prompts) for c in a.corpus}}
    res.update(measure(a, engine, tok, drafters, prompts))
    if a.out:
        atomic.write_text(a.out, json.dumps(res, indent=1) + "\n")
    md = render(res)
    print(md)
    if a.md:
        atomic.write_text(a.md, md + "\n")
    if a.plot:
        plot(res, a.plot, a.bin)
    return 0


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
