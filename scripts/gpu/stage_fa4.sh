#!/usr/bin/env bash
# FlashAttention-4 (the CuTe-DSL flash_attn.cute, PyPI flash-attn-4) as a peer of scripts/bench_prefill_attention.py
# on the GPU machine, which has no DSL and no internet. JIT: the DSL bundle travels too.
#   ../shared/device/make-bundle             builds .dsl/ (the DSL, ~55 MB)
#   bash scripts/gpu/stage_fa4.sh            downloads .dsl-fa4/ (flash-attn-4, quack-kernels, einops, torch-c-dlpack-ext)
#   device run, carry [".dsl", ".dsl-fa4"]:
#     source .dsl/prelude.sh; python3 -m pip install -q --no-index --no-deps .dsl-fa4/*.whl;
#     python3 scripts/bench_prefill_attention.py --rounds 5
# (futx's kernel is JIT-compiled there too.) Measured this way: docs/results-prefill-engine.md.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .dsl-fa4
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64)
python -m pip download -q --no-deps --pre -d .dsl-fa4 "flash-attn-4==4.0.0b36" "quack-kernels==0.6.5" einops
python -m pip download -q --no-deps "${plat[@]}" -d .dsl-fa4 torch-c-dlpack-ext
du -sh .dsl-fa4
