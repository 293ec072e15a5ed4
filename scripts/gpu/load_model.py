"""Write the small synthetic model the H200 load test serves (scripts/gpu/serving.sh, part `load`) into
DIR/model: a Hugging Face directory (random weights, a byte-level BPE tokenizer with the chat specials) of a shape
the kernels serve (head dim 64, K multiples of 64), a few MB so that it travels with the kernels.

  python scripts/gpu/load_model.py .gpu-data-load
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def main(out: str) -> int:
    import torch

    from tiny_checkpoint import save_tiny_hf

    from futx.checkpoint.synthetic import random_weights, tiny_config

    cfg = tiny_config(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, num_hidden_layers=4, vocab_size=320, max_position_embeddings=8192)
    path = Path(out, "model")
    path.mkdir(parents=True, exist_ok=True)
    save_tiny_hf(path, random_weights(cfg, seed=5, std=0.3, dtype=torch.bfloat16), specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    print(f"wrote {path}: {sum(f.stat().st_size for f in path.iterdir()) / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else ".gpu-data-load"))
