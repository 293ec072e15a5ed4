"""Quantization: the formats the decode kernels read, and the simulated-quantization model.

layouts      fragment-order packing (the single definition of every packed order)
int4         INT4 weights: RTN, grouped symmetric, fp16 scales, packing via layouts
gptq_solver  GPTQ error-feedback solve of one matrix;  gptq: whole model, save/load, CLI
fp8          E4M3 weights and the delayed per-tensor FP8 scaling state
hadamard     normalized block-diagonal Walsh-Hadamard rotation
kv_mirror    INT4 / E4M3 cache rows and the mirror callables of the reference KV cache
regtrick     bit-exact emulation of the register dequantization (BF16 128.0 mantissa trick)
fold         RMSNorm gain folding;  formats: registry of weight/cache formats
simulated    the reference model with exactly the values the kernels use
"""
