"""A DLite-style draft head: k draft tokens from the target's last hidden state, no history of its own.

Design (issue 27, item 2b). The drafters this follows read the target's own features rather than tokens:
Medusa puts k independent heads on the last hidden state (each guesses position +i blind of the guesses before
it, so acceptance falls off fast); Hydra makes head i see the draft tokens 1..i-1 (sequential dependence is
what keeps later guesses consistent with earlier ones); EAGLE runs one decoder layer autoregressively on the
target's features (feature + next token -> next feature), but keeps a KV history of its own across
verifications. DLite ("history-free speculative decoding") drops that history: the draft depends only on the
target's hidden state of the last accepted position, so nothing has to be rolled back or kept per request, and
its cost does not grow with the context. This head is that design at its smallest:

    f0 = h_p                                  target's final residual (before the final RMSNorm) at position p
    f_j = cell(f_{j-1}, E[tok_{j-1}])         tok_0 = history[-1] (the target's own token from h_p); tok_j the
                                              j-th draft token (its own argmax at inference)
    logits_j = lm_head(final_norm(f_j))       the target's final norm and LM head, tied and frozen
    cell(f, e) = std^-1(std(f) + out(a + sum MLP_i(a))),  a = fc_in([std(f); rms(e)])
                                              (depth SwiGLU MLPs of width `width`; std: RMS-normalized, then
                                              standardized per channel; `out` starts at zero)

so f_j is trained to be the target's next hidden state (an EAGLE-style feature regression on top of cross
entropy) and the chain is run end to end (the state is always the head's own). The embedding E, the final norm
gain and the LM head are the target's (not saved with the head); the head owns only fc_in, the MLPs, their
norm gains and out (plus the per-channel statistics that standardize the target's hidden state on input):
5.0M parameters for SmolLM2-135M (hidden 576). The draft's cost per token is one
small MLP stack and one LM-head product.

Files (`DLiteHead.save(dir)`): draft.safetensors (the head's own trainable tensors) and draft.json (DLiteConfig:
shapes, k_max, the target's name and a fingerprint of its embedding / LM head, so a head is never used with
another model). `load_head(path, target)` refuses a missing file, another target, or tensors of other shapes.
Training: futx.speculative.dlite_train (`futx train-draft`).

The hidden-state contract with the engine (futx.speculative.drafter): `hidden[i]` is the target's final residual
stream (after the last block, before the final RMSNorm) at the position whose logits produced histories[i][-1];
the drafts continue histories[i].
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

CONFIG_FILE = "draft.json"
WEIGHTS_FILE = "draft.safetensors"
FORMAT = "futx-dlite"
FORMAT_VERSION = 1
K_MAX_LIMIT = 7
FINGERPRINT_ROWS = 257   # rows of the embedding / LM head hashed (evenly spread), bf16-rounded


# ---- the target's frozen tensors -------------------------------------------------------------------

@dataclass
class TargetTensors:
    """What the head borrows from the target, frozen: embedding [V, H], final norm gain [H], LM head [V, H]
    (the embedding when tied), RMSNorm eps, and the target's name."""
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    eps: float
    name: str = "target"

    @classmethod
    def of(cls, target) -> "TargetTensors":
        """From futx ModelWeights (reference) or a PackedModel (engine): both have embed / final_norm / config."""
        if isinstance(target, TargetTensors):
            return target
        head = getattr(target, "output_weight", None)
        if head is None:
            head = target.lm_head
        return cls(target.embed, target.final_norm, head, float(target.config.rms_norm_eps),
                   str(target.config.name))

    @property
    def hidden_size(self) -> int:
        return int(self.embed.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.embed.shape[0])

    def to(self, device=None, dtype: Optional[torch.dtype] = None) -> "TargetTensors":
        def mv(t):
            return t.to(device=device if device is not None else t.device, dtype=dtype or t.dtype)
        tied = self.lm_head is self.embed
        embed = mv(self.embed)
        return TargetTensors(embed, mv(self.final_norm), embed if tied else mv(self.lm_head), self.eps, self.name)


def fingerprint(target) -> str:
    """A short hash of the target's embedding and LM head (a fixed spread of rows, rounded to bf16 so the same
    checkpoint in float32, bf16 or packed for the engine gives the same fingerprint), with their shapes."""
    t = TargetTensors.of(target)
    h = hashlib.sha256()
    for name, w in (("embed", t.embed), ("lm_head", t.lm_head)):
        v = w.shape[0]
        rows = torch.linspace(0, v - 1, min(FINGERPRINT_ROWS, v)).round().long().to(w.device)
        sample = w.detach().index_select(0, rows).to(torch.bfloat16).to(torch.float32).cpu().contiguous()
        h.update(f"{name}:{tuple(w.shape)}:".encode())
        h.update(sample.view(torch.int32).numpy().tobytes())
    return h.hexdigest()[:16]


# ---- configuration -------------------------------------------------------------------------------

@dataclass
class DLiteConfig:
    hidden_size: int
    vocab_size: int
    k_max: int = 4
    width: int = 0          # the cell's width (0: the target's hidden size)
    depth: int = 2          # SwiGLU MLPs in the cell
    mlp_ratio: float = 2.0  # MLP hidden width / width
    residual: bool = True   # the cell predicts the change of the (standardized) feature from the previous one
    eps: float = 1e-5
    target: str = "target"            # the target's config name
    target_fingerprint: str = ""
    target_model: str = ""            # the model spec it was trained on (what `load` opens when not given one)
    training: dict = field(default_factory=dict)   # how it was trained (recorded, not used)

    def __post_init__(self) -> None:
        if self.width == 0:
            self.width = self.hidden_size
        for name in ("hidden_size", "vocab_size", "width", "depth"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"DLiteConfig.{name} must be a positive integer, got {v!r}")
        if not isinstance(self.k_max, int) or not 1 <= self.k_max <= K_MAX_LIMIT:
            raise ValueError(f"DLiteConfig.k_max must be in 1..{K_MAX_LIMIT}, got {self.k_max!r}")
        if not self.mlp_ratio > 0:
            raise ValueError(f"DLiteConfig.mlp_ratio must be positive, got {self.mlp_ratio!r}")

    @property
    def mlp_width(self) -> int:
        return max(1, int(round(self.width * self.mlp_ratio)))

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": FORMAT_VERSION, **asdict(self)}, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "draft.json") -> "DLiteConfig":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source} is not JSON: {e}") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"{source} is not a futx DLite draft config (no \"format\": \"{FORMAT}\")")
        if d.get("version") != FORMAT_VERSION:
            raise ValueError(f"{source} has format version {d.get('version')}, this futx reads {FORMAT_VERSION}")
        d = {k: v for k, v in d.items() if k not in ("format", "version")}
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{source}: unknown fields {', '.join(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def for_target(cls, target, k_max: int = 4, **kw) -> "DLiteConfig":
        t = TargetTensors.of(target)
        return cls(hidden_size=t.hidden_size, vocab_size=t.vocab_size, k_max=k_max, eps=t.eps, target=t.name,
                   target_fingerprint=fingerprint(t), **kw)


# ---- the head ------------------------------------------------------------------------------------

def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) (statistics in float32), in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return unit_rms(x, self.eps) * self.weight.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, width: int, hidden: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(width, eps)
        self.gate_up = nn.Linear(width, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)
        nn.init.zeros_(self.down.weight)   # each MLP starts as the identity on the residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(g) * u)


class DLiteHead(nn.Module):
    """The sequential draft head over the target's frozen embedding, final norm and LM head (see the module
    docstring). Trainable tensors: `state_dict()`; the target's tensors are plain attributes, never saved."""

    def __init__(self, config: DLiteConfig, target):
        super().__init__()
        t = TargetTensors.of(target)
        if (t.hidden_size, t.vocab_size) != (config.hidden_size, config.vocab_size):
            raise ValueError(f"the draft head is for hidden {config.hidden_size} / vocab {config.vocab_size}, the "
                             f"target has hidden {t.hidden_size} / vocab {t.vocab_size}")
        self.config = config
        c = config
        self.in_norm_h = RMSNorm(c.hidden_size, c.eps)
        self.in_norm_e = RMSNorm(c.hidden_size, c.eps)
        self.fc_in = nn.Linear(2 * c.hidden_size, c.width, bias=False)
        self.mlps = nn.ModuleList(SwiGLU(c.width, c.mlp_width, c.eps) for _ in range(c.depth))
        self.out_norm = RMSNorm(c.width, c.eps)
        self.fc_out = nn.Linear(c.width, c.hidden_size, bias=False)
        if c.residual:
            nn.init.zeros_(self.fc_out.weight)   # the cell starts as "the next feature is this one"
        # per-channel mean / std of the target's RMS-normalized hidden states (a few channels of a trained model's
        # residual stream carry most of its energy): set from the training data once, saved with the head
        self.register_buffer("feat_mean", torch.zeros(c.hidden_size))
        self.register_buffer("feat_std", torch.ones(c.hidden_size))
        self.target = t
        for p in (self.target.embed, self.target.final_norm, self.target.lm_head):
            p.requires_grad_(False)
        self.to(t.embed.device)   # the head lives where the target's tensors are (move both with .to())

    # the target's tensors follow the head to its device (their dtype stays the target's)
    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        dev = self.fc_in.weight.device
        if self.target.embed.device != dev:
            self.target = self.target.to(device=dev)
        return out

    @property
    def device(self) -> torch.device:
        return self.fc_in.weight.device

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def set_feature_stats(self, hidden: torch.Tensor) -> None:
        """feat_mean / feat_std from a sample of the target's hidden states [..., H]."""
        u = unit_rms(hidden.reshape(-1, hidden.shape[-1]).float(), self.config.eps)
        self.feat_mean.copy_(u.mean(0))
        self.feat_std.copy_(u.std(0).clamp_min(1e-3))

    def standardize(self, f: torch.Tensor) -> torch.Tensor:
        """A hidden state or draft feature [..., H] RMS-normalized, then standardized per channel (float32)."""
        return (unit_rms(f.float(), self.config.eps) - self.feat_mean) / self.feat_std

    def cell(self, f: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One step: the feature of the next position from the feature f [n, H] and the token ids [n] there."""
        dtype = self.fc_in.weight.dtype
        e = self.target.embed[tokens].to(dtype)
        z = self.standardize(f)
        a = self.fc_in(torch.cat([self.in_norm_h(z.to(dtype)), self.in_norm_e(e)], dim=-1))
        for mlp in self.mlps:
            a = mlp(a)
        out = self.fc_out(self.out_norm(a)).float()
        if self.config.residual:
            out = out + z
        # back in the target's hidden-state space (its RMS scale is free: logits and the next step normalize it)
        return out * self.feat_std + self.feat_mean

    def logits(self, f: torch.Tensor) -> torch.Tensor:
        """The target's final RMSNorm and LM head on draft features f [..., H] -> [..., V] (float32 stats)."""
        w = self.target.lm_head
        x = unit_rms(f, self.target.eps).to(w.dtype) * self.target.final_norm.to(w.dtype)
        return x @ w.T

    def rollout(self, hidden: torch.Tensor, last: torch.Tensor, k: int, tokens: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k draft steps from hidden [n, H] and the last token ids [n].

        tokens [n, k-1] (optional): the tokens fed at steps 2..k (teacher forcing); without them the head is fed
        its own argmax. Returns (logits [n, k, V], features [n, k, H], drafted token ids [n, k])."""
        if not 1 <= k <= self.config.k_max:
            raise ValueError(f"k must be in 1..{self.config.k_max} (the head's k_max), got {k}")
        if tokens is not None and tuple(tokens.shape) != (hidden.shape[0], k - 1):
            raise ValueError(f"teacher tokens must be [n, k-1] = [{hidden.shape[0]}, {k - 1}], "
                             f"got {tuple(tokens.shape)}")
        f, tok = hidden, last
        all_logits, feats, drafts = [], [], []
        for j in range(k):
            f = self.cell(f, tok)
            lg = self.logits(f)
            d = lg.argmax(-1)
            all_logits.append(lg)
            feats.append(f)
            drafts.append(d)
            if j + 1 < k:
                tok = tokens[:, j] if tokens is not None else d
        return torch.stack(all_logits, 1), torch.stack(feats, 1), torch.stack(drafts, 1)

    @torch.no_grad()
    def draft(self, hidden: torch.Tensor, last: torch.Tensor, k: int) -> torch.Tensor:
        """Greedy drafts [n, k] (int64) for hidden [n, H] and last tokens [n]."""
        hidden = hidden.to(self.device)
        last = last.to(self.device)
        from futx.engine.backends import greedy_tokens

        f, tok, out = hidden, last, []
        for _ in range(k):
            f = self.cell(f, tok)
            tok = greedy_tokens(self.logits(f))
            out.append(tok)
        return torch.stack(out, 1)

    # ---- files ---------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """draft.safetensors (the head's own tensors, float32: trainable ones and feat_mean / feat_std) + draft.json in `directory` (created), each
        written atomically."""
        from safetensors.torch import save_file

        from futx.atomic import replacing, write_text

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in self.state_dict().items()}
        with replacing(d / WEIGHTS_FILE) as tmp:
            save_file(tensors, str(tmp), metadata={"format": FORMAT, "fingerprint": self.config.target_fingerprint})
        write_text(d / CONFIG_FILE, self.config.to_json() + "\n")
        return d


def load_head(path: str | Path, target, device=None, check_target: bool = True) -> DLiteHead:
    """A saved head (a directory holding draft.json + draft.safetensors, or either file) for `target`
    (ModelWeights, PackedModel or TargetTensors), on `device` (default: the target's); ValueError for a missing file, another target's head
    (fingerprint), or tensors of the wrong shapes."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    d = p if p.is_dir() else p.parent
    if not p.exists():
        raise ValueError(f"draft head {p} does not exist")
    cfg_path, w_path = d / CONFIG_FILE, d / WEIGHTS_FILE
    for f in (cfg_path, w_path):
        if not f.is_file():
            raise ValueError(f"draft head {d}: {f.name} is missing (a head is {CONFIG_FILE} + {WEIGHTS_FILE}, "
                             f"written by futx train-draft)")
    config = DLiteConfig.from_json(cfg_path.read_text(encoding="utf-8"), str(cfg_path))
    t = TargetTensors.of(target)
    if check_target:
        have = fingerprint(t)
        if config.target_fingerprint != have:
            raise ValueError(f"draft head {d} was trained for target {config.target!r} (fingerprint "
                             f"{config.target_fingerprint}), not this model {t.name!r} (fingerprint {have}): "
                             f"train one for it with futx train-draft")
    head = DLiteHead(config, t)
    try:
        tensors = load_file(str(w_path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{w_path} is not a readable safetensors file: {e}") from None
    want = head.state_dict()
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        raise ValueError(f"{w_path} does not match {cfg_path.name}: missing {missing[:3]}, unexpected {extra[:3]}")
    for k, v in want.items():
        if tuple(tensors[k].shape) != tuple(v.shape):
            raise ValueError(f"{w_path}: tensor {k} has shape {tuple(tensors[k].shape)}, {cfg_path.name} implies "
                             f"{tuple(v.shape)}")
    head.load_state_dict(tensors)
    head.to(device if device is not None else t.embed.device)   # default: where the target is
    head.eval()
    return head


# ---- the drafter -----------------------------------------------------------------------------------

class DLiteDrafter:
    """The Drafter protocol (futx.speculative.drafter) over a DLite head: greedy drafts of k tokens for each
    request from the target's hidden state of its last accepted position, batched over requests."""

    name = "dlite"
    needs_hidden = True

    def __init__(self, head: DLiteHead, graphs: bool = True):
        """graphs: on a CUDA device, replay the k-step draft as one CUDA graph per (requests, k) (captured on
        first use) instead of launching its ~20 small kernels per step eagerly."""
        self.head = head.eval()
        self.graphs = graphs and self.head.device.type == "cuda"
        self._graphs: dict = {}

    @classmethod
    def load(cls, path: str | Path, target, device=None) -> "DLiteDrafter":
        return cls(load_head(path, target, device=device))

    @property
    def k_max(self) -> int:
        return self.head.config.k_max

    def propose(self, histories: Sequence[Sequence[int]], hidden: Optional[torch.Tensor], k: int
                ) -> list[list[int]]:
        n = len(histories)
        if k <= 0 or n == 0:
            return [[] for _ in range(n)]
        if hidden is None:
            raise ValueError("the DLite drafter needs the target's hidden states (needs_hidden = True)")
        if hidden.dim() != 2 or hidden.shape[0] != n or hidden.shape[1] != self.head.config.hidden_size:
            raise ValueError(f"hidden must be [{n}, {self.head.config.hidden_size}] (one row per request), "
                             f"got {tuple(hidden.shape)}")
        if any(len(h) == 0 for h in histories):
            raise ValueError("every request needs at least one token of history")
        k_run = min(k, self.k_max)
        last = torch.tensor([int(h[-1]) for h in histories], dtype=torch.long, device=self.head.device)
        if not self.graphs:
            return self.head.draft(hidden, last, k_run).tolist()
        graph, h_in, last_in, out = self._graph(n, k_run, hidden.dtype)
        h_in.copy_(hidden)
        last_in.copy_(last)
        graph.replay()
        return out.tolist()

    def _graph(self, n: int, k: int, dtype: torch.dtype):
        key = (n, k, dtype)
        if key not in self._graphs:
            dev = self.head.device
            h_in = torch.zeros(n, self.head.config.hidden_size, dtype=dtype, device=dev)
            last_in = torch.zeros(n, dtype=torch.long, device=dev)
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):   # warm-up off the capture (lazy inits, cuBLAS workspaces)
                for _ in range(2):
                    self.head.draft(h_in, last_in, k)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):   # the warm-up's stream: kernels' per-stream workspaces
                out = self.head.draft(h_in, last_in, k)
            self._graphs[key] = (graph, h_in, last_in, out)
        return self._graphs[key]


def load(path: str | Path, target=None, device=None, **options) -> DLiteDrafter:
    """The drafter of `--speculative dlite --draft PATH` (futx.speculative.drafter.make_drafter). `target`: the
    target's ModelWeights or PackedModel (its embedding / final norm / LM head are borrowed, and its fingerprint
    checked); without one, the model recorded in draft.json (`target_model`) is loaded for those tensors."""
    if options:
        raise ValueError(f"the DLite drafter takes no options {', '.join(sorted(options))}")
    if target is None:
        p = Path(path)
        cfg_path = (p if p.is_dir() else p.parent) / CONFIG_FILE
        if not cfg_path.is_file():
            raise ValueError(f"draft head {p}: {CONFIG_FILE} is missing")
        config = DLiteConfig.from_json(cfg_path.read_text(encoding="utf-8"), str(cfg_path))
        if not config.target_model:
            raise ValueError(f"{cfg_path} names no target model; pass the target's weights")
        from futx.checkpoint import load as load_checkpoint

        target = load_checkpoint(config.target_model, dtype=torch.bfloat16, device=device or "cpu")
    return DLiteDrafter.load(path, target, device=device)


def expected_acceptance(accuracies: Sequence[float]) -> float:
    """sum_i prod_{j<=i} a_j: the expected number of accepted draft tokens per verification when position i is
    right with probability a_i given the positions before it were (1 + this = tokens per verification)."""
    total, run = 0.0, 1.0
    for a in accuracies:
        run *= float(a)
        total += run
    return total


__all__ = ["CONFIG_FILE", "DLiteConfig", "DLiteDrafter", "DLiteHead", "K_MAX_LIMIT", "TargetTensors",
           "WEIGHTS_FILE", "expected_acceptance", "fingerprint", "load", "load_head", "unit_rms"]
