"""The greedy-argmax kernel's geometry (decode/argmax_rows.py), pure Python: the op (futx/ops/argmax_rows.py) sizes
its workspace and checks its inputs with the same numbers the kernel is built with."""

THREADS = 256
VEC = 8                     # bf16 per 16-byte load: the vocabulary and the row stride must be multiples of it
CHUNK = THREADS * VEC       # elements of a row per CTA
MAX_VOCAB = 1 << 24         # a partial's index travels as float32: exact below 2^24
NO_INDEX = 1 << 30          # the index of a padding pair (above any vocabulary): it never wins a tie


def blocks_per_row(vocab: int) -> int:
    """CTAs per row, and partial pairs (2 float32 each) per row in the workspace."""
    return -(-vocab // CHUNK)
