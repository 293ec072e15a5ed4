#!/usr/bin/env bash
# One GPU run in JIT mode (DSL bundle carried): AOT == JIT bit for bit, JIT compile vs cache-load times,
# and quack's W4A16 peer for the decode projections. Carry: .dsl .dsl-quack .gpu/aot-smoke
#   source .dsl/prelude.sh; bash scripts/gpu/jit.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile .dsl-quack/*.whl
export OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source scripts/gpu/steps.sh
export FUTX_AOT_DIR="$PWD/.gpu/aot-smoke" FUTX_CACHE_DIR=/tmp/futx-jit-cache
step aot_vs_jit 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_runtime_gpu.py -k aot_and_jit
TAILN=30 step jit_timing 200 python3 scripts/jit_timing.py
TAILN=14 step quack 300 python3 scripts/bench_decode_linear.py --quack --cands torch-bf16,torch-int4,quack-w4a16 --layers layer-8b --m 1,8,16,32
cp "$OUT"/*.md "$OUT"/*.json "$LOGS"/ 2>/dev/null
pack
