"""The OpenAI request bodies this server accepts (validated before any work) and the bodies it answers.

Unknown fields are refused rather than ignored, so a client never gets an answer that silently
disregarded what it asked for (top_k, logprobs, n > 1, ...). `ignore_eos` is accepted as vLLM does.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from .chat import ROLES, render_chat
from .sampling import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as the OpenAI API
# a prompt text longer than this many characters per cache position is refused before it is tokenized (no
# tokenizer's tokens are that long on average), so a huge prompt costs no tokenizer time
MAX_CHARS_PER_TOKEN = 64
SEED_RANGE = (-(1 << 63), 1 << 64)   # what torch.Generator.manual_seed takes


class ApiError(Exception):
    """An error answered as OpenAI's {"error": {message, type, param, code}} with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class Parsed:
    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str


# ---- field checks -------------------------------------------------------------------------------------------
def _int(body, name, default=None, lo=None):
    x = body.get(name)
    if x is None:
        return default
    if type(x) is not int:
        raise bad(f"'{name}' must be an integer, got {type(x).__name__}", name)
    if lo is not None and x < lo:
        raise bad(f"'{name}' must be at least {lo}, got {x}", name)
    return x


def _num(body, name, default, lo, hi, open_lo=False):
    x = body.get(name)
    if x is None:
        return default
    if type(x) not in (int, float):
        raise bad(f"'{name}' must be a number, got {type(x).__name__}", name)
    if x < lo or x > hi or (open_lo and x == lo):
        raise bad(f"'{name}' must be in {'(' if open_lo else '['}{lo}, {hi}], got {x}", name)
    return float(x)


def _bool(body, name, default=False):
    x = body.get(name)
    if x is None:
        return default
    if type(x) is not bool:
        raise bad(f"'{name}' must be a boolean, got {type(x).__name__}", name)
    return x


def _only(body, name, allowed, what):
    """A field accepted only at its neutral value(s) (features not implemented)."""
    if name in body and body[name] not in allowed:
        raise bad(f"'{name}' is not supported by this server ({what})", name)


def _unicode(text: str, param: str, what: str) -> str:
    """JSON lets a string hold a lone surrogate (an escaped half of a UTF-16 pair), which is no text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"{what} is not valid Unicode (it holds a lone surrogate)", param) from None
    return text


def _too_long(n: int, capacity: int, param: str, unit: str = "tokens") -> ApiError:
    return ApiError(400, f"the prompt is {n} {unit} long; this server holds at most {capacity} tokens per request "
                    f"(prompt + max_tokens)", param=param, code="context_length_exceeded")


def _check_text_length(text: str, capacity: int, param: str) -> None:
    if len(text) > capacity * MAX_CHARS_PER_TOKEN:
        raise _too_long(len(text), capacity, param, "characters")


def _check_prompt_length(ids: list[int], capacity: int, param: str) -> None:
    if len(ids) > capacity:
        raise _too_long(len(ids), capacity, param)


def _stop(body) -> tuple[str, ...]:
    x = body.get("stop")
    if x is None:
        return ()
    stops = [x] if isinstance(x, str) else x
    if not isinstance(stops, list) or len(stops) > 4 or any(not isinstance(s, str) or not s for s in stops):
        raise bad("'stop' must be a non-empty string or a list of up to 4 non-empty strings", "stop")
    return tuple(_unicode(x, "stop", "a stop string") for x in stops)


# ---- requests ---------------------------------------------------------------------------------------------
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
          "presence_penalty", "frequency_penalty", "logit_bias", "user", "ignore_eos"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "logprobs", "best_of", "suffix"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}


def _common(body: dict, fields: set, models: tuple[str, ...]) -> str:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad(f"unknown or unsupported field '{unknown[0]}'", unknown[0])
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("'model' (a string) is required", "model")
    if model not in models:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves {', '.join(models)}",
                       param="model", code="model_not_found")
    _only(body, "n", (1, None), "one choice per request")
    _only(body, "presence_penalty", (0, 0.0, None), "no penalties")
    _only(body, "frequency_penalty", (0, 0.0, None), "no penalties")
    _only(body, "logit_bias", ({}, None), "no logit bias")
    if "user" in body and not isinstance(body["user"], (str, type(None))):
        raise bad("'user' must be a string", "user")
    return model


def _seed(body: dict) -> Optional[int]:
    seed = _int(body, "seed")
    if seed is not None and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise bad(f"'seed' must be in [-2**63, 2**64), got {seed}", "seed")
    return seed


def _params(body: dict, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
                              top_p=_num(body, "top_p", 1.0, 0.0, 1.0, open_lo=True), seed=_seed(body),
                              stop=_stop(body), ignore_eos=_bool(body, "ignore_eos"))
    except ValueError as e:
        raise bad(str(e)) from None


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise bad("'stream_options' may hold only 'include_usage'", "stream_options")
    return stream, _bool(opts, "include_usage")


def _token_ids(x, vocab: int, capacity: int) -> Optional[list[int]]:
    if isinstance(x, list) and x and all(type(t) is int for t in x):
        _check_prompt_length(x, capacity, "prompt")
        if any(not 0 <= t < vocab for t in x):
            raise bad(f"prompt token ids must lie in [0, {vocab})", "prompt")
        return x
    return None


def parse_completion(body: Any, tokenizer, models, capacity: int, vocab: int) -> Parsed:
    model = _common(body, COMPLETION_FIELDS, models)
    _only(body, "echo", (False, None), "no echo")
    _only(body, "logprobs", (None,), "no logprobs")
    _only(body, "best_of", (1, None), "one candidate per request")
    _only(body, "suffix", (None,), "no suffix")
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    ids = _token_ids(p, vocab, capacity)
    if ids is None:
        if not isinstance(p, str):
            raise bad("'prompt' must be a string, a list of token ids, or a list of one of those (one prompt "
                      "per request)", "prompt")
        _check_text_length(_unicode(p, "prompt", "the prompt"), capacity, "prompt")
        ids = tokenizer.encode(p)
    if not ids:
        raise bad("the prompt is empty", "prompt")
    _check_prompt_length(ids, capacity, "prompt")
    max_tokens = _int(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS, lo=1)
    stream, usage = _stream(body)
    return Parsed(ids, _params(body, max_tokens), stream, usage, model)


def _messages(body) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or set(m) - {"role", "content", "name"}:
            raise bad(f"messages[{i}] must be {{'role': one of {', '.join(ROLES)}, 'content': ...}}", "messages")
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            if any(not isinstance(x, dict) or x.get("type") != "text" or not isinstance(x.get("text"), str)
                   for x in c):
                raise bad(f"messages[{i}]: only text content parts are supported", "messages")
            c = "".join(x["text"] for x in c)
        if not isinstance(c, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        _unicode(c, "messages", f"messages[{i}].content")
        out.append({"role": m["role"], "content": c})
    return out


def parse_chat(body: Any, tokenizer, models, capacity: int, vocab: int) -> Parsed:
    model = _common(body, CHAT_FIELDS, models)
    _only(body, "logprobs", (False, None), "no logprobs")
    _only(body, "top_logprobs", (None,), "no logprobs")
    try:
        text = render_chat(tokenizer, _messages(body))
    except ValueError as e:
        raise bad(str(e), "messages") from None
    _check_text_length(text, capacity, "messages")
    ids = tokenizer.encode(text)
    _check_prompt_length(ids, capacity, "messages")
    limit = _int(body, "max_completion_tokens", lo=1)
    max_tokens = _int(body, "max_tokens", limit, lo=1)
    if max_tokens is None:  # as the OpenAI API: up to the context length
        max_tokens = max(1, capacity - len(ids) + 1)
    stream, usage = _stream(body)
    return Parsed(ids, _params(body, max_tokens), stream, usage, model)


# ---- responses --------------------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(chat: bool, rid: str, model: str, text: str, finish: str, prompt_tokens: int,
             completion_tokens: int) -> dict:
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
               "finish_reason": finish} if chat else
              {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def chunk(chat: bool, rid: str, model: str, text: Optional[str], finish: Optional[str] = None,
          role: bool = False) -> dict:
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}
