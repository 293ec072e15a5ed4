"""Tokenizer from a checkpoint: tokenizer.json of an HF directory, or the BPE embedded in a GGUF.

The GGUF path rebuilds a `tokenizers` byte-level BPE from the stored vocabulary and merges, with the
pre-tokenizer llama.cpp names in `tokenizer.ggml.pre`, and registers the control tokens as special
tokens (so "<|im_start|>" in text encodes to its single id, as in Hugging Face).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional, Sequence

# Known end-of-turn / end-of-text tokens, used as extra stop tokens when present in the vocabulary.
_STOP_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>")
# llama.cpp pre-tokenizer names whose split is "each digit alone, then GPT-2's regex".
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact")
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer` with the model's BOS/EOS conventions."""

    def __init__(self, backend, *, bos_id: Optional[int], eos_ids: Iterable[int], add_bos: bool, source: str):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.add_bos = add_bos
        self.source = source

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings in the text map to their ids; BOS if the model adds one."""
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_id(self, token: str) -> Optional[int]:
        return self.backend.token_to_id(token)

    def chat_prompt(self, user_text: str) -> str:
        """A one-turn chat prompt in the model family's template (ChatML for SmolLM2, Llama-3 headers)."""
        if self.token_id("<|im_start|>") is not None:
            return (f"<|im_start|>system\n{SMOLLM_SYSTEM}<|im_end|>\n"
                    f"<|im_start|>user\n{user_text}<|im_end|>\n<|im_start|>assistant\n")
        if self.token_id("<|start_header_id|>") is not None:
            return (f"<|start_header_id|>user<|end_header_id|>\n\n{user_text}<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
        raise ValueError(f"no known chat template for the tokenizer from {self.source}")

    # ---- constructors ---------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"{path} has no tokenizer.json")
        try:
            backend = Backend.from_file(str(file))
        except Exception as e:
            raise ValueError(f"cannot read {file}: {e}") from None
        meta: dict = {}
        for name in ("config.json", "generation_config.json"):  # later files win
            f = path / name
            if f.is_file():
                meta.update({k: v for k, v in json.loads(f.read_text()).items()
                             if k in ("bos_token_id", "eos_token_id") and v is not None})
        tc = path / "tokenizer_config.json"
        add_bos = False
        if tc.is_file():
            add_bos = bool(json.loads(tc.read_text()).get("add_bos_token", False))
        # tokenizer.json's post-processor (e.g. Llama-3's) may add BOS itself; do what it does.
        probe = backend.encode("a", add_special_tokens=True).ids
        bos = meta.get("bos_token_id")
        add_bos = add_bos or (bos is not None and len(probe) > 1 and probe[0] == bos)
        eos = meta.get("eos_token_id", [])
        eos = [eos] if isinstance(eos, int) else list(eos)
        return cls(backend, bos_id=bos, eos_ids=eos + _known_stops(backend), add_bos=add_bos, source=str(path))

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as Backend
        from tokenizers import decoders, models, pre_tokenizers

        from futx.checkpoint.gguf import field, open_reader

        reader = open_reader(path)
        kind = field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} in {path} (only byte-level BPE 'gpt2')")
        pre = field(reader, "tokenizer.ggml.pre", "default")
        tokens = field(reader, "tokenizer.ggml.tokens")
        merges = field(reader, "tokenizer.ggml.merges")
        types = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
        pairs = []
        for m in merges:
            parts = m.split(" ")
            if len(parts) != 2:
                raise ValueError(f"malformed BPE merge {m!r} in {path}")
            pairs.append((parts[0], parts[1]))
        backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs,
                                     fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in _DIGITS_THEN_GPT2:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif pre in ("gpt2", "gpt-2", "default"):
            backend.pre_tokenizer = byte_level
        else:
            raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} in {path}")
        backend.decoder = decoders.ByteLevel()
        # Token types 3 (control) and 4 (user-defined) are atomic special tokens.
        special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
        backend.add_special_tokens(special)
        bos = field(reader, "tokenizer.ggml.bos_token_id", None)
        eos = field(reader, "tokenizer.ggml.eos_token_id", None)
        return cls(backend, bos_id=None if bos is None else int(bos),
                   eos_ids=([] if eos is None else [int(eos)]) + _known_stops(backend),
                   add_bos=bool(field(reader, "tokenizer.ggml.add_bos_token", False)), source=str(path))


def _known_stops(backend) -> list[int]:
    return [i for i in (backend.token_to_id(t) for t in _STOP_TOKENS) if i is not None]


def load_tokenizer(spec: str | Path | None = None) -> Tokenizer:
    """Tokenizer for a model spec (as futx.checkpoint.load: directory, .gguf file, default name)."""
    from futx.checkpoint import resolve

    path = resolve(spec)
    return Tokenizer.from_hf_dir(path) if path.is_dir() else Tokenizer.from_gguf(path)
