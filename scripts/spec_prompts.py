"""Prompts for the speculative-decoding benchmark (scripts/bench_speculative.py), placed at context positions.

Two corpora, both from a held-out text (the WikiText-2 *test* split is right here: nothing is trained on it;
the DLite head trains on the enwiki sample):
  * wiki: token windows of the text, each ending where the generated tokens land inside the range asked for;
  * chat: multi-turn conversations in the model's chat template: each earlier turn asks about an article
    ("Tell me about <title>.") and the assistant turn holds that article's opening paragraph; turns are added
    until the conversation reaches the range, then a last question opens the assistant turn the model answers.
A range (lo, hi) gets prompts of about max(lo, floor) tokens so that `gen_len` generated tokens stay below hi.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HEADING = re.compile(r"^ = ([^=].*?) = $")


@dataclass(frozen=True)
class Prompt:
    corpus: str
    range: str
    ids: list


def parse_ranges(value: str) -> list[tuple[int, int]]:
    out = []
    for part in value.split(","):
        lo, _, hi = part.partition("-")
        try:
            lo_i, hi_i = int(lo), int(hi)
        except ValueError:
            raise ValueError(f"range {part!r} is not LO-HI") from None
        if not 0 <= lo_i < hi_i:
            raise ValueError(f"range {part!r}: need 0 <= LO < HI")
        out.append((lo_i, hi_i))
    return out


def prompt_length(lo: int, hi: int, gen_len: int, floor: int = 64) -> int:
    n = max(lo, floor)
    if n + gen_len > hi:
        raise ValueError(f"range {lo}-{hi}: a {n}-token prompt and {gen_len} generated tokens do not fit below {hi}")
    return n


def articles(text: str) -> list[tuple[str, str]]:
    """(title, first paragraph) of each top-level article of a WikiText file."""
    out, title, para = [], None, None
    for line in text.splitlines():
        m = HEADING.match(line)
        if m:
            if title and para:
                out.append((title, para))
            title, para = m.group(1).strip(), None
        elif title and para is None and len(line.strip()) > 200:
            para = line.strip()
    if title and para:
        out.append((title, para))
    return out


def wiki_prompts(ids: list[int], ranges, per_range: int, gen_len: int, stride: int = 997) -> list[Prompt]:
    """per_range windows per range, start offsets spread over the text (deterministic)."""
    out = []
    for lo, hi in ranges:
        n = prompt_length(lo, hi, gen_len)
        if n > len(ids):
            raise ValueError(f"the text holds {len(ids)} tokens, fewer than a {n}-token prompt")
        span = len(ids) - n
        for i in range(per_range):
            s = (i * stride * 7919) % (span + 1)
            out.append(Prompt("wiki", f"{lo}-{hi}", ids[s:s + n]))
    return out


def chat_prompts(tokenizer, render_chat, arts: list[tuple[str, str]], ranges, per_range: int,
                 gen_len: int, max_answer_chars: int = 900) -> list[Prompt]:
    """per_range conversations per range; conversation i starts at article 5 i (wrapping)."""
    if len(arts) < 4:
        raise ValueError(f"the text holds {len(arts)} articles; chat prompts need at least 4")
    out = []
    for lo, hi in ranges:
        n = prompt_length(lo, hi, gen_len)
        for i in range(per_range):
            msgs, j = [], 5 * i
            while True:
                title, para = arts[j % len(arts)]
                ask = {"role": "user", "content": f"Tell me about {title}."}
                ids = tokenizer.encode(render_chat(tokenizer, msgs + [ask]))
                if len(ids) >= n or j - 5 * i > 4 * len(arts):
                    break
                msgs += [ask, {"role": "assistant", "content": para[:max_answer_chars]}]
                j += 1
            if len(ids) + gen_len > hi:   # the last turn overshot: drop turns until it fits
                while msgs and len(ids) + gen_len > hi:
                    msgs = msgs[2:]
                    ids = tokenizer.encode(render_chat(tokenizer, msgs + [ask]))
            out.append(Prompt("chat", f"{lo}-{hi}", ids))
    return out
