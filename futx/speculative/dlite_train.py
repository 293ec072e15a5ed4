"""Training a DLite draft head (futx.speculative.dlite) in two stages, as `futx train-draft` runs it.

Stage 1, offline on the target's hidden states: the target reads windows of enwiki text once; for each position
t the cache keeps the final residual h_t (bf16), the token x_t and the target's greedy prediction g_t = argmax
logits(h_t), in safetensors chunks (so more steps or a second run never rerun the target). A sample is a position
t: the head starts from h_t and the token x_{t+1}, is fed x_{t+2..t+k} (teacher forcing), and at step j is scored
by cross entropy against the target's distribution at t+j (softmax of its logits from the cached h_{t+j}; its
argmax g_{t+j} is what verification checks, not the text's token) plus an EAGLE-style regression of its feature f_j onto h_{t+j} (both RMS-normalized, smooth L1).
Step j is weighted decay^(j-1): an early miss costs every later draft.

Stage 2, end to end on the target's own greedy outputs: the target continues enwiki prompts greedily (prompt
lengths spread over 0..seq_len, so long contexts are trained too), and the head runs exactly as at inference:
from (h_p, the target's token) it is fed its own drafts. Step j is scored only while drafts 1..j-1 match the
target's continuation (a later step's loss would train for tokens verification never reaches), so the loss is
an expected-acceptance objective.

Evaluation (every `eval_every` steps and at the end of each stage): per-position top-1 accuracy on held-out
enwiki windows (the last `holdout` of the text; teacher-forced) with sum_i prod_{j<=i} acc_j, and on held-out
greedy continuations the exact mean accepted drafts per verification (free-running), overall and by context
position bucket (0-512, 512-1024, 1024-2048, 2048+; the engine's AcceptanceStats buckets).

Never trained or tuned on the WikiText-2 test split: the data is ../shared/data/enwiki-sample.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from futx.speculative.dlite import DLiteConfig, DLiteHead, TargetTensors, expected_acceptance, fingerprint
from futx.speculative.dlite_data import default_data
BUCKETS = (0, 512, 1024, 2048)
CACHE_FORMAT = "futx-dlite-stage1-v1"
CHUNK_WINDOWS = 32


@dataclass
class TrainOptions:
    k: int = 4                   # k_max of the head (drafts per verification)
    seq_len: int = 2048          # tokens per stage-1 window; stage-2 prompt + continuation length at most
    windows: int = 256           # stage-1 training windows (fewer if the text is shorter)
    eval_windows: int = 16       # held-out stage-1 windows
    holdout: float = 0.05        # the last fraction of the text's paragraphs, held out for evaluation
    stage1_steps: int = 6000
    stage2_steps: int = 3000
    batch_size: int = 512        # positions per step
    lr: float = 1e-3             # stage 1 peak (AdamW, warmup then cosine to 10%); stage 2 uses half
    weight_decay: float = 0.01
    reg_weight: float = 1.0      # feature regression weight (cross entropy has weight 1)
    soft_labels: bool = True     # cross entropy against the target's whole distribution at t+j (from the cached
                                 # h_{t+j}), not only its argmax
    decay: float = 0.8           # weight of step j: decay^(j-1)
    stage2_prompts: int = 1024   # greedy continuations for stage 2 training
    eval_prompts: int = 64       # held-out greedy continuations for evaluation
    gen_len: int = 128           # greedy tokens per continuation
    gen_batch: int = 128         # continuations generated together
    target_batch: int = 8        # stage-1 windows per target forward
    eval_every: int = 1000       # steps between evaluations (0: only at the end of each stage)
    eval_samples: int = 4096     # held-out stage-1 positions evaluated
    width: int = 0               # head width (0: the target's hidden size)
    depth: int = 2               # SwiGLU MLPs in the head's cell
    device: str = "cpu"
    seed: int = 0

    def check(self) -> None:
        if not 1 <= self.k <= 7:
            raise ValueError(f"k must be in 1..7, got {self.k}")
        if self.seq_len < 2 * (self.k + 2):
            raise ValueError(f"seq_len {self.seq_len} is too short for k = {self.k} (at least {2 * (self.k + 2)})")
        if not 0 < self.holdout < 1:
            raise ValueError(f"holdout must be in (0, 1), got {self.holdout}")


# ---- the target's hidden states ------------------------------------------------------------------------------

def final_residual(weights, tokens: torch.Tensor, batch, cache) -> torch.Tensor:
    """The residual stream after the last block (before the final RMSNorm) of the reference model: [M, H]."""
    from futx.reference import block
    from futx.rope import cos_sin

    config = weights.config
    x = weights.embed[tokens]
    rope = cos_sin(config, batch.row_position, x.dtype)
    for i, layer in enumerate(weights.layers):
        x = block(config, layer, i, x, batch, cache, "prefill", rope)
    return x


def greedy_tokens(weights, hidden: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    """argmax of the target's logits for residuals [M, H] (chunked: the logits of M rows are not all held)."""
    from futx.reference import rms_norm

    out = []
    for s in range(0, hidden.shape[0], rows):
        x = rms_norm(hidden[s:s + rows], weights.final_norm, weights.config.rms_norm_eps)
        out.append((x @ weights.output_weight.T).argmax(-1))
    return torch.cat(out)


@torch.no_grad()
def window_states(weights, windows: torch.Tensor, batch_windows: int = 8, bar=None) -> dict:
    """For windows [n, T] (int64): hidden [n, T, H] (bf16), tokens [n, T], greedy [n, T] (int32), start [n]."""
    from futx.kvcache import KVCache
    from futx.reference import PackedBatch

    n, t = windows.shape
    dev = weights.device
    hidden, greedy = [], []
    cache = None
    for s in range(0, n, batch_windows):
        w = windows[s:s + batch_windows].to(dev)
        b = w.shape[0]
        if cache is None or cache.slots != b:
            cache = KVCache(weights.config, b, t, dtype=weights.dtype, device=dev)
        batch = PackedBatch.from_lengths([t] * b, device=dev)
        x = final_residual(weights, w.reshape(-1), batch, cache)
        greedy.append(greedy_tokens(weights, x).view(b, t).to(torch.int32).cpu())
        hidden.append(x.view(b, t, -1).to(torch.bfloat16).cpu())
        if bar is not None:
            bar.update(b * t)
    return {"hidden": torch.cat(hidden), "tokens": windows.to(torch.int32).cpu(), "greedy": torch.cat(greedy),
            "start": torch.zeros(n, dtype=torch.int32)}


@torch.no_grad()
def greedy_continuations(weights, prompts: torch.Tensor, gen_len: int, bar=None) -> dict:
    """The target's greedy continuations of prompts [B, L] (one length), gen_len tokens each, in the layout of
    `window_states`: row i is position L-1+i, tokens[i] its input, hidden[i] its residual, greedy[i] its argmax
    (= tokens[i+1], the continuation)."""
    from futx.kvcache import KVCache
    from futx.reference import PackedBatch

    b, length = prompts.shape
    dev = weights.device
    cache = KVCache(weights.config, b, length + gen_len, dtype=weights.dtype, device=dev)
    p = prompts.to(dev)
    x = final_residual(weights, p.reshape(-1), PackedBatch.from_lengths([length] * b, device=dev), cache)
    h, tok = x.view(b, length, -1)[:, -1], p[:, -1]
    hs, ins, outs = [], [], []
    for i in range(gen_len):
        nxt = greedy_tokens(weights, h)
        hs.append(h.to(torch.bfloat16))
        ins.append(tok)
        outs.append(nxt)
        if bar is not None:
            bar.update(b)
        if i + 1 == gen_len:
            break
        h = final_residual(weights, nxt, PackedBatch.decode([length + i] * b, device=dev), cache)
        tok = nxt
    return {"hidden": torch.stack(hs, 1).cpu(), "tokens": torch.stack(ins, 1).to(torch.int32).cpu(),
            "greedy": torch.stack(outs, 1).to(torch.int32).cpu(),
            "start": torch.full((b,), length - 1, dtype=torch.int32)}


def concat_states(parts: list[dict]) -> dict:
    """States of equal row counts concatenated over sequences."""
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


# ---- data ----------------------------------------------------------------------------------------------------

def read_corpus(path, tokenizer, holdout: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train ids, held-out ids): the text's paragraphs, the last `holdout` of them held out."""
    from futx.eval.perplexity import join_rows, read_rows

    rows = read_rows(path)
    if len(rows) < 2:
        raise ValueError(f"{path} holds {len(rows)} paragraph(s); the draft head needs a training and a held-out "
                         f"part")
    cut = min(len(rows) - 1, max(1, int(round(len(rows) * (1 - holdout)))))
    train = torch.tensor(tokenizer.encode(join_rows(rows[:cut])), dtype=torch.int64)
    held = torch.tensor(tokenizer.encode(join_rows(rows[cut:])), dtype=torch.int64)
    return train, held


def take_windows(ids: torch.Tensor, seq_len: int, n: int, what: str) -> torch.Tensor:
    """Up to n non-overlapping windows [n', seq_len] spread evenly over the token stream."""
    avail = ids.numel() // seq_len
    if avail == 0:
        raise ValueError(f"the {what} text has {ids.numel()} tokens, fewer than one window of {seq_len}")
    n = min(n, avail)
    starts = torch.linspace(0, avail - 1, n).round().long() * seq_len
    return torch.stack([ids[s:s + seq_len] for s in starts.tolist()])


def prompt_lengths(seq_len: int, gen_len: int, groups: int) -> list[int]:
    """Prompt lengths spread over [16, seq_len - gen_len] (fewer below 16 tokens of room)."""
    hi = seq_len - gen_len
    lo = max(1, min(16, hi))
    if groups <= 1:
        return [hi]
    return [int(round(lo + (hi - lo) * i / (groups - 1))) for i in range(groups)]


def make_prompts(ids: torch.Tensor, length: int, n: int, gen: torch.Generator) -> torch.Tensor:
    if ids.numel() < length:
        raise ValueError(f"a prompt of {length} tokens does not fit the {ids.numel()}-token text")
    starts = torch.randint(0, ids.numel() - length + 1, (n,), generator=gen)
    return torch.stack([ids[s:s + length] for s in starts.tolist()])


@torch.no_grad()
def continuation_set(weights, ids: torch.Tensor, n: int, seq_len: int, gen_len: int, batch: int,
                     gen: torch.Generator, bar=None) -> dict:
    """n greedy continuations of prompts from `ids`, in groups of `batch` whose prompt lengths spread over the
    context (each group one length)."""
    groups = max(1, math.ceil(n / batch))
    parts, left = [], n
    for length in prompt_lengths(seq_len, gen_len, groups):
        b = min(batch, left)
        if b <= 0:
            break
        parts.append(greedy_continuations(weights, make_prompts(ids, length, b, gen), gen_len, bar))
        left -= b
    return concat_states(parts)


# ---- the stage-1 cache -----------------------------------------------------------------------------------------

def cache_key(target_fp: str, data_path, opts: TrainOptions, dtype: torch.dtype) -> str:
    h = hashlib.sha256(Path(data_path).read_bytes()).hexdigest()
    spec = {"format": CACHE_FORMAT, "target": target_fp, "data": h, "seq_len": opts.seq_len,
            "windows": opts.windows, "eval_windows": opts.eval_windows, "holdout": opts.holdout, "dtype": str(dtype)}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def save_states(directory: Path, name: str, states: dict) -> list[str]:
    """States in safetensors chunks of CHUNK_WINDOWS sequences: name-00000.safetensors, ..."""
    from safetensors.torch import save_file

    from futx.atomic import replacing

    files = []
    n = states["tokens"].shape[0]
    for i, s in enumerate(range(0, n, CHUNK_WINDOWS)):
        f = directory / f"{name}-{i:05d}.safetensors"
        with replacing(f) as tmp:
            save_file({k: v[s:s + CHUNK_WINDOWS].contiguous() for k, v in states.items()}, str(tmp))
        files.append(f.name)
    return files


def load_states(directory: Path, files: list[str]) -> dict:
    from safetensors.torch import load_file

    return concat_states([load_file(str(directory / f)) for f in files])


def stage1_states(weights, tokenizer, data_path, opts: TrainOptions, cache_dir: Optional[Path],
                  progress: bool = True, log: Callable[[str], None] = print) -> tuple[dict, dict, dict]:
    """(train states, held-out states, info) of stage 1: read from `cache_dir` when a matching cache is there,
    else computed (the target over the windows) and written there."""
    from tqdm.auto import tqdm

    from futx.atomic import write_text

    fp = fingerprint(weights)
    key = cache_key(fp, data_path, opts, weights.dtype)
    where = None if cache_dir is None else Path(cache_dir) / f"stage1-{key}"
    manifest = None if where is None else where / "manifest.json"
    if manifest is not None and manifest.is_file():
        m = json.loads(manifest.read_text())
        log(f"stage 1: the target's hidden states from the cache {where}")
        return load_states(where, m["train"]), load_states(where, m["eval"]), {"cache": str(where), "cached": True}
    train_ids, held_ids = read_corpus(data_path, tokenizer, opts.holdout)
    train_w = take_windows(train_ids, opts.seq_len, opts.windows, "training")
    eval_w = take_windows(held_ids, opts.seq_len, opts.eval_windows, "held-out")
    total = (train_w.shape[0] + eval_w.shape[0]) * opts.seq_len
    with tqdm(total=total, unit="tok", desc="stage 1: target hidden states", disable=not progress) as bar:
        train = window_states(weights, train_w, opts.target_batch, bar)
        held = window_states(weights, eval_w, opts.target_batch, bar)
    info = {"cache": None if where is None else str(where), "cached": False, "train_windows": train_w.shape[0],
            "eval_windows": eval_w.shape[0], "train_text_tokens": train_ids.numel(),
            "eval_text_tokens": held_ids.numel()}
    if where is not None:
        where.mkdir(parents=True, exist_ok=True)
        m = {"format": CACHE_FORMAT, "key": key, "target_fingerprint": fp, "data": str(data_path),
             "seq_len": opts.seq_len, "train": save_states(where, "train", train), "eval": save_states(where, "eval", held)}
        write_text(manifest, json.dumps(m, indent=2) + "\n")   # last: a cache without it is not used
    return train, held, info


# ---- sampling, loss, evaluation --------------------------------------------------------------------------------

def to_device(states: dict, device) -> dict:
    return {k: v.to(device) for k, v in states.items()}


def gather(states: dict, seq: torch.Tensor, t: torch.Tensor, k: int) -> dict:
    """The samples at (sequence, row) pairs: h0 [B, H], last [B], teacher [B, k-1], labels [B, k],
    targets [B, k, H], position [B] (of the last token, as the engine buckets a verification)."""
    dev = states["hidden"].device
    seq, t = seq.to(dev), t.to(dev)
    rows = t[:, None] + torch.arange(k + 1, device=dev)
    s = seq[:, None]
    hid = states["hidden"][s, rows]
    tok = states["tokens"][s, rows].long()
    gre = states["greedy"][s, rows].long()
    return {"h0": hid[:, 0], "last": tok[:, 1], "teacher": tok[:, 2:], "labels": gre[:, 1:], "targets": hid[:, 1:],
            "position": states["start"][seq].long() + t + 1}


def random_batch(states: dict, k: int, n: int, gen: torch.Generator) -> dict:
    seqs, rows = states["tokens"].shape
    return gather(states, torch.randint(0, seqs, (n,), generator=gen), torch.randint(0, rows - k, (n,), generator=gen), k)


def all_samples(states: dict, k: int, limit: Optional[int] = None, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (sequence, row) sample, or `limit` of them drawn with a fixed seed."""
    seqs, rows = states["tokens"].shape
    total = seqs * (rows - k)
    idx = torch.arange(total)
    if limit is not None and limit < total:
        idx = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:limit].sort().values
    return idx // (rows - k), idx % (rows - k)


def step_weights(k: int, decay: float, device) -> torch.Tensor:
    w = decay ** torch.arange(k, dtype=torch.float32, device=device)
    return w / w.sum()


def draft_loss(head: DLiteHead, b: dict, k: int, own: bool, opts: TrainOptions) -> tuple[torch.Tensor, dict]:
    logits, feats, drafts = head.rollout(b["h0"], b["last"], k, tokens=None if own else b["teacher"])
    n = logits.shape[0]
    if opts.soft_labels:   # the target's distribution there, from its cached hidden state (free: no target run)
        with torch.no_grad():
            p = head.logits(b["targets"]).float().softmax(-1)
        ce = -(p * logits.float().log_softmax(-1)).sum(-1)
        del p
    else:
        ce = F.cross_entropy(logits.float().flatten(0, 1), b["labels"].flatten(), reduction="none").view(n, k)
    reg = F.smooth_l1_loss(head.standardize(feats), head.standardize(b["targets"]), reduction="none").mean(-1)
    correct = drafts == b["labels"]
    if own:   # step j counts while drafts 1..j-1 were accepted
        mask = torch.cat([torch.ones_like(correct[:, :1]), correct[:, :-1]], 1).cumprod(1).float()
    else:
        mask = torch.ones_like(ce)
    per_step = ((ce + opts.reg_weight * reg) * mask).mean(0)
    loss = (per_step * step_weights(k, opts.decay, per_step.device)).sum()
    return loss, {"ce": ce.mean().item(), "acc1": correct[:, 0].float().mean().item()}


@torch.no_grad()
def evaluate(head: DLiteHead, states: dict, k: int, own: bool, limit: Optional[int] = None, batch: int = 1024,
             autocast: bool = False) -> dict:
    """Per-position top-1 accuracy against the target's greedy tokens, sum_i prod_{j<=i} acc_j, and the exact
    mean accepted drafts (the longest matching prefix) overall and per context bucket."""
    head.eval()
    seq, t = all_samples(states, k, limit)
    correct, positions = [], []
    for s in range(0, seq.numel(), batch):
        b = gather(states, seq[s:s + batch], t[s:s + batch], k)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            _, _, drafts = head.rollout(b["h0"], b["last"], k, tokens=None if own else b["teacher"])
        correct.append((drafts == b["labels"]).cpu())
        positions.append(b["position"].cpu())
    head.train()
    c = torch.cat(correct).float()
    pos = torch.cat(positions)
    accepted = c.cumprod(1).sum(1)
    acc = c.mean(0).tolist()
    out = {"samples": c.shape[0], "accuracy": [round(a, 4) for a in acc],
           "expected_accepted": round(expected_acceptance(acc), 4),
           "accepted_mean": round(accepted.mean().item(), 4),
           "tokens_per_verification": round(1 + accepted.mean().item(), 4), "by_position": {}}
    edges = list(BUCKETS) + [None]
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (pos >= lo) & (pos < hi) if hi is not None else pos >= lo
        if m.any():
            name = f"{lo}-{hi}" if hi is not None else f"{lo}+"
            out["by_position"][name] = {"samples": int(m.sum()), "accepted_mean": round(accepted[m].mean().item(), 4)}
    return out


@torch.no_grad()
def walk_acceptance(head: DLiteHead, states: dict, k: int, autocast: bool = False) -> dict:
    """Greedy speculative decoding replayed on the target's greedy continuations `states`: each sequence starts at
    its first row; a verification at row i drafts k tokens from (hidden[i], greedy[i]), accepts the longest prefix
    equal to greedy[i+1..], and the next verification is at row i + accepted + 1 (the target's own token there
    is the bonus). Exactly what the engine's greedy acceptance does with the same target numbers. Returns the
    mean accepted drafts and tokens per verification, overall and by the position of the last accepted token
    (the engine's AcceptanceStats buckets)."""
    head.eval()
    hid, gre, start = states["hidden"], states["greedy"].long(), states["start"].long()
    n, rows = gre.shape
    dev = hid.device
    i = torch.zeros(n, dtype=torch.long, device=dev)
    ar = torch.arange(k, device=dev)
    pos_log, acc_log = [], []
    while True:
        live = (i + k < rows).nonzero().flatten()
        if live.numel() == 0:
            break
        r = i[live]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            d = head.draft(hid[live, r], gre[live, r], k)
        truth = gre[live[:, None], r[:, None] + 1 + ar]
        a = (d == truth).long().cumprod(1).sum(1)
        pos_log.append((start[live] + r + 1).cpu())
        acc_log.append(a.cpu())
        i[live] = r + a + 1
    i_done = torch.cat(acc_log) if acc_log else torch.zeros(0, dtype=torch.long)
    pos = torch.cat(pos_log) if pos_log else torch.zeros(0, dtype=torch.long)
    head.train()

    def summary(m) -> dict:
        v = int(m.sum())
        acc = i_done[m].float()
        return {"verifications": v, "mean_accepted": round(acc.mean().item(), 4) if v else None,
                "mean_tokens_per_verification": round(1 + acc.mean().item(), 4) if v else None}

    out = {"k": k, **summary(torch.ones_like(pos, dtype=torch.bool)), "by_position": {}}
    edges = list(BUCKETS) + [None]
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (pos >= lo) & (pos < hi) if hi is not None else pos >= lo
        if m.any():
            out["by_position"][f"{lo}-{hi}" if hi is not None else f"{lo}+"] = summary(m)
    return out


# ---- the two stages ----------------------------------------------------------------------------------------------

def lr_at(step: int, steps: int, peak: float) -> float:
    warm = max(1, min(100, steps // 10))
    if step < warm:
        return peak * (step + 1) / warm
    p = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


class Trainer:
    """Both stages over one head; `head` and `metrics` are current at every moment (Ctrl-C keeps them)."""

    def __init__(self, weights, tokenizer, data_path, opts: TrainOptions, cache_dir: Optional[Path] = None,
                 progress: bool = True, log: Callable[[str], None] = print, target_model: str = ""):
        opts.check()
        self.weights, self.tokenizer, self.data_path, self.opts = weights, tokenizer, Path(data_path), opts
        self.cache_dir, self.progress, self.log = cache_dir, progress, log
        self.device = torch.device(opts.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.autocast = self.device.type == "cuda"
        torch.manual_seed(opts.seed)
        config = DLiteConfig.for_target(weights, k_max=opts.k, width=opts.width, depth=opts.depth,
                                        target_model=target_model,
                                        training={k: v for k, v in asdict(opts).items() if k != "device"})
        self.head = DLiteHead(config, TargetTensors.of(weights)).to(self.device)
        self.gen = torch.Generator().manual_seed(opts.seed)
        self.metrics: dict = {"head_parameters": self.head.num_parameters(), "options": asdict(opts),
                              "stage1": {"history": []}, "stage2": {"history": []}, "partial": True}
        self._optimizer(opts.lr)   # its first construction imports torch._dynamo (seconds): before any work
        self.t0 = time.perf_counter()

    def _optimizer(self, lr: float) -> torch.optim.Optimizer:
        params = [p for p in self.head.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": self.opts.weight_decay},
                                  {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))

    def _stage(self, name: str, train: dict, held: dict, steps: int, own: bool, lr: float, eval_own: bool) -> None:
        from tqdm.auto import tqdm

        o = self.opts
        rec = self.metrics[name]
        if steps == 0:
            return
        params = [p for p in self.head.parameters() if p.requires_grad]
        opt = self._optimizer(lr)
        limit = o.eval_samples if not eval_own else None
        self.head.train()
        with tqdm(total=steps, desc=f"{name.replace('stage', 'stage ')}: {'own drafts' if own else 'teacher forced'}",
                  unit="step", disable=not self.progress) as bar:
            for step in range(steps):
                for g in opt.param_groups:
                    g["lr"] = lr_at(step, steps, lr)
                b = random_batch(train, o.k, o.batch_size, self.gen)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
                    loss, info = draft_loss(self.head, b, o.k, own, o)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                rec["steps_done"] = step + 1
                rec["last_loss"] = round(loss.item(), 5) if step % 10 == 0 or step + 1 == steps else rec.get("last_loss")
                if step % 10 == 0:
                    bar.set_postfix(loss=f"{loss.item():.3f}", acc1=f"{info['acc1']:.3f}")
                bar.update(1)
                last = step + 1 == steps
                if last or (o.eval_every and (step + 1) % o.eval_every == 0):
                    ev = evaluate(self.head, held, o.k, eval_own, limit, autocast=self.autocast)
                    ev.update(step=step + 1, loss=round(loss.item(), 5),
                              seconds=round(time.perf_counter() - self.t0, 1))
                    rec["history"].append(ev)
                    bar.write(f"{name} step {step + 1}: accuracy {ev['accuracy']} expected accepted "
                              f"{ev['expected_accepted']:.3f} (exact {ev['accepted_mean']:.3f})")

    def run(self) -> dict:
        o = self.opts
        train, held, info = stage1_states(self.weights, self.tokenizer, self.data_path, o, self.cache_dir,
                                          self.progress, self.log)
        self.metrics["stage1"]["data"] = info
        train, held = to_device(train, self.device), to_device(held, self.device)
        seq, t = all_samples(train, 0, limit=65536, seed=o.seed)
        self.head.set_feature_stats(train["hidden"][seq, t])
        self._stage("stage1", train, held, o.stage1_steps, own=False, lr=o.lr, eval_own=False)
        del train
        s1_held = held
        # stage 2: the target's greedy continuations (training prompts from the training text, evaluation
        # prompts from the held-out text)
        from tqdm.auto import tqdm

        train_ids, held_ids = read_corpus(self.data_path, self.tokenizer, o.holdout)
        gen_len = min(o.gen_len, o.seq_len // 2)
        n2 = o.stage2_prompts if o.stage2_steps > 0 else 0
        t1 = time.perf_counter()
        with tqdm(total=(n2 + o.eval_prompts) * gen_len, unit="tok", desc="stage 2: greedy continuations",
                  disable=not self.progress) as bar:
            eval_batch = max(1, math.ceil(o.eval_prompts / 8))
            held2 = continuation_set(self.weights, held_ids, o.eval_prompts, o.seq_len, gen_len, eval_batch,
                                     self.gen, bar)
            train2 = (continuation_set(self.weights, train_ids, n2, o.seq_len, gen_len, o.gen_batch, self.gen, bar)
                      if n2 else None)
        self.metrics["stage2"]["data"] = {"train_continuations": n2, "eval_continuations": o.eval_prompts,
                                          "gen_len": gen_len, "seconds": round(time.perf_counter() - t1, 1)}
        held2 = to_device(held2, self.device)
        if o.stage1_steps > 0:   # the stage-1 head on the greedy evaluation set: what stage 2 starts from
            self.metrics["stage1"]["greedy_eval"] = evaluate(self.head, held2, o.k, True, autocast=self.autocast)
        if train2 is not None:
            self._stage("stage2", to_device(train2, self.device), held2, o.stage2_steps, own=True, lr=o.lr / 2,
                        eval_own=True)
        self.metrics["final"] = {"greedy_eval": evaluate(self.head, held2, o.k, True, autocast=self.autocast),
                                 "speculative_walk": walk_acceptance(self.head, held2, o.k, autocast=self.autocast),
                                 "enwiki_eval": evaluate(self.head, s1_held, o.k, False, o.eval_samples,
                                                         autocast=self.autocast)}
        self.metrics["partial"] = False
        self.metrics["seconds"] = round(time.perf_counter() - self.t0, 1)
        return self.metrics


__all__ = ["TrainOptions", "Trainer", "continuation_set", "default_data", "draft_loss", "evaluate",
           "final_residual", "greedy_continuations", "read_corpus", "stage1_states", "walk_acceptance",
           "window_states"]
