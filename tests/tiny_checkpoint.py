"""A tiny model written as a Hugging Face directory with a byte-level BPE tokenizer (no merges), for tests that
drive the CLI or the server end to end."""

from pathlib import Path


def save_tiny_hf(path: Path, weights, specials=("<|endoftext|>",)) -> Path:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    from futx.checkpoint.hf import save_hf

    save_hf(path, weights)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Backend(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(specials))
    backend.save(str(path / "tokenizer.json"))
    return path
