"""PyTorch reference Llama: weights, packed-batch metadata and the forward (see model.py)."""

from futx.reference.batch import PackedBatch
from futx.reference.model import PHASES, attention, block, forward, forward_hidden, logits, rms_norm, stat_dtype
from futx.reference.weights import LAYER_FIELDS, LayerWeights, ModelWeights, layer_shapes

__all__ = ["LAYER_FIELDS", "LayerWeights", "ModelWeights", "PHASES", "PackedBatch", "attention", "block",
           "forward", "forward_hidden", "layer_shapes", "logits", "rms_norm", "stat_dtype"]
