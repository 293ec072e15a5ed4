"""Perplexity over a text file under three protocols (windows of `window` tokens, default 2048).

Text: the file's non-empty lines ("rows", line endings removed) joined with "\\n\\n" and tokenized
once; the token stream is cut into non-overlapping windows (a short tail is dropped). Each window
starts from an empty cache. Perplexity = exp(mean NLL over the scored tokens of all windows).

    gptq        the whole window in one prefill; every token with context is scored (window-1 per window).
    serving     the first window/2 tokens prefilled (phase "prefill", not scored), the rest decoded one
                token at a time (phase "decode"); only decoded positions are scored (window/2 - 1).
    all-decode  every token through phase "decode" from position 0; window-1 scored.

Decode phases run token by token (`stepwise=True`) or in chunks of `decode_chunk` new tokens per
request (default): a chunk is causal within itself and reads the same cache values, so it is an exact
re-grouping of token-by-token decoding (tests: equal to 1e-12 in float64), only far cheaper on a CPU.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from futx import files
from futx.eval.protocols import PROTOCOLS, WINDOW
from futx.eval.runner import Runner
from futx.reference import PackedBatch
from futx.reference.model import tokens_checked


def read_rows(path: str | Path) -> list[str]:
    """Non-empty lines of a UTF-8 text file, line endings (LF or CRLF) removed."""
    return [line for line in files.read_text(path).splitlines() if line.strip()]


def join_rows(rows: list[str]) -> str:
    return "\n\n".join(rows)


def make_windows(ids, window: int = WINDOW, max_windows: Optional[int] = None) -> torch.Tensor:
    """Non-overlapping windows [n, window] (int64) of a token stream; the tail shorter than a window is dropped."""
    ids = torch.as_tensor(ids, dtype=torch.int64)
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    n = ids.numel() // window
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than one window of {window}")
    return ids[:n * window].view(n, window)


def scored_per_window(protocol: str, window: int) -> int:
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose from {PROTOCOLS}")
    return window // 2 - 1 if protocol == "serving" else window - 1


@dataclass(frozen=True)
class PerplexityResult:
    protocol: str
    windows: int
    window: int
    tokens: int          # scored tokens
    nll_sum: float
    seconds: float
    decode: str          # "chunked(N)" or "stepwise" or "-" (gptq)

    def merge(self, later: "PerplexityResult") -> "PerplexityResult":
        """This result followed by one over the next windows (same protocol and window)."""
        if (later.protocol, later.window, later.decode) != (self.protocol, self.window, self.decode):
            raise ValueError("can only merge results of the same protocol, window and decode mode")
        return PerplexityResult(self.protocol, self.windows + later.windows, self.window, self.tokens + later.tokens,
                                self.nll_sum + later.nll_sum, self.seconds + later.seconds, self.decode)

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.tokens

    @property
    def ppl(self) -> float:
        return math.exp(self.mean_nll)


def _decode_span(runner: Runner, cache, tokens: torch.Tensor, start: int, stop: int, chunk: int,
                 bar) -> torch.Tensor:
    """Decode input positions [start, stop) of every window, scoring each prediction of the next token.

    Returns the summed NLL as a float64 tensor on the runner's device (no host sync per step).
    """
    b = tokens.shape[0]
    total = torch.zeros((), dtype=torch.float64, device=tokens.device)
    for s in range(start, stop, chunk):
        e = min(s + chunk, stop)
        batch = PackedBatch.from_lengths([e - s] * b, [s] * b, device=tokens.device)
        hidden = runner.decode(tokens[:, s:e].reshape(-1), batch, cache)
        total += runner.nll(hidden, tokens[:, s + 1:e + 1].reshape(-1), "decode").sum()
        bar.update(b * (e - s))
    return total


def window_nll(runner: Runner, tokens: torch.Tensor, protocol: str, decode_chunk: int, bar) -> torch.Tensor:
    """Summed NLL (float64 tensor on the runner's device) of the scored tokens of windows tokens [B, W]."""
    b, w = tokens.shape
    cache = runner.new_cache(b, w)
    if protocol == "gptq":
        hidden = runner.prefill(tokens.reshape(-1), PackedBatch.from_lengths([w] * b, device=tokens.device), cache)
        hidden = hidden.view(b, w, -1)[:, :-1].reshape(b * (w - 1), -1)
        total = runner.nll(hidden, tokens[:, 1:].reshape(-1), "prefill").sum()
        bar.update(b * (w - 1))
        return total
    start = 0
    if protocol == "serving":
        start = w // 2
        runner.prefill(tokens[:, :start].reshape(-1), PackedBatch.from_lengths([start] * b, device=tokens.device),
                       cache)
    return _decode_span(runner, cache, tokens, start, w - 1, decode_chunk, bar)


def check_token_range(windows: torch.Tensor, vocab_size: int) -> None:
    """ValueError unless every token id lies in [0, vocab_size) (checked once, before the forwards)."""
    if windows.numel():
        lo, hi = int(windows.min()), int(windows.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"token ids must lie in [0, {vocab_size}), got {lo}..{hi}")


def evaluate(runner: Runner, windows: torch.Tensor, protocol: str = "gptq", *, batch_size: int = 8,
             decode_chunk: int = 128, stepwise: bool = False, progress: bool = True,
             on_batch: Optional[Callable[[PerplexityResult], None]] = None, bar=None) -> PerplexityResult:
    """Perplexity of `runner` over windows [n, W] (from make_windows) under `protocol`.

    `on_batch` receives the running result after every batch of windows (the first k windows so far),
    so a long CPU run leaves exact partial results behind. `bar`: an open tqdm bar to advance instead
    of opening one.
    """
    if windows.dim() != 2 or windows.dtype != torch.int64 or windows.shape[0] == 0:
        raise ValueError(f"windows must be a non-empty int64 tensor [n, W], got {windows.dtype} "
                         f"{tuple(windows.shape)}")
    per_window = scored_per_window(protocol, windows.shape[1])
    if batch_size < 1 or decode_chunk < 1:
        raise ValueError(f"batch_size and decode_chunk must be positive, got {batch_size}, {decode_chunk}")
    chunk = 1 if stepwise else decode_chunk
    from tqdm.auto import tqdm

    n = windows.shape[0]
    mode = "-" if protocol == "gptq" else ("stepwise" if stepwise else f"chunked({decode_chunk})")
    check_token_range(windows, runner.config.vocab_size)
    windows = windows.to(runner.device)
    t0 = time.perf_counter()
    nll = 0.0
    own_bar = bar is None
    if own_bar:
        bar = tqdm(total=n * per_window, unit="tok", desc=f"ppl {protocol}", disable=not progress, smoothing=0.1)
    try:
        for i in range(0, n, batch_size):
            with tokens_checked():  # checked above: no per-call device sync for the token range
                nll += float(window_nll(runner, windows[i:i + batch_size], protocol, chunk, bar))
            k = min(i + batch_size, n)
            result = PerplexityResult(protocol, k, windows.shape[1], k * per_window, nll, time.perf_counter() - t0,
                                      mode)
            if own_bar:
                bar.set_postfix(ppl=f"{result.ppl:.4f}")
            if on_batch is not None:
                on_batch(result)
    finally:
        if own_bar:
            bar.close()
    return result


def format_table(results: list[PerplexityResult], model: str = "", text: str = "") -> str:
    """A small Markdown table of results (what `futx ppl` prints)."""
    lines = []
    if model or text:
        lines.append(f"model: {model}   text: {text}")
    lines += ["| protocol | windows | window | scored tokens | decode | mean NLL | perplexity | seconds |",
              "|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.protocol} | {r.windows} | {r.window} | {r.tokens} | {r.decode} | {r.mean_nll:.6f} | "
                     f"{r.ppl:.4f} | {r.seconds:.0f} |")
    return "\n".join(lines)
