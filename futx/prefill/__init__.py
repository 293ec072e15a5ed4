"""Prefill-time kernels (CuTe DSL): the persistent TMA + WGMMA GEMM mainloop whose epilogues live in
`epilogues/` (`mainloop`), causal GQA attention of a packed batch over the KV cache (`attention`) and the per-row
E4M3 activation quantization (`row_quant`). The decode-time kernels live in `decode/`. Every module here imports
cutlass; the torch ops (`futx.ops.*`) reach them only through the kernel registry, so a machine that loads
ahead-of-time artifacts never imports them."""
