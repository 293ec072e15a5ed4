#!/usr/bin/env bash
# One GPU run in JIT mode (DSL bundle carried): AOT == JIT bit for bit, JIT compile vs cache-load times,
# and the CuTe-DSL peers timed in the same process as the futx kernels (loaded AOT): quack's W4A16 GEMM
# against the INT4 decode projections, FlashAttention-4 against decode attention.
#   CPU:  scripts/gpu/jit.sh --stage        (after scripts/gpu/stage.sh: .gpu/aot-jit = smoke + decode libs)
#         .dsl-quack/ holds the peers' wheels (quack-kernels, flash-attn-4, einops, torch-c-dlpack-ext)
#   GPU:  carry [".dsl", ".dsl-quack", ".gpu/aot-jit"];  source .dsl/prelude.sh; bash scripts/gpu/jit.sh [PARTS]
#         PARTS: any of aot timing quack fa4 (default: aot timing quack); the quack part's points from
#         QUACK_LAYERS / QUACK_M (default layer-8b / 1,8,16,32), QUACK_BUDGET, QUACK_LIMIT; the staged kernels from
#         JIT_KERNELS (registry patterns) at --stage
set -u
if [ "${1:-}" = "--stage" ]; then
  cd "$(git rev-parse --show-toplevel)"
  rm -rf .gpu/aot-jit && mkdir -p .gpu/aot-jit/lib
  python - <<'PY'
import json, shutil
from futx.runtime import select
m = json.load(open(".gpu/aot/manifest.json"))
keep = {s.key for s in select(__import__("os").environ.get("JIT_KERNELS", "smoke.*,decode.gemv.int4.*,decode.skinny.int4.*,decode.attn.*"))}
m["entries"] = {k: e for k, e in m["entries"].items() if k in keep}
for e in m["entries"].values():
    shutil.copy(".gpu/aot/" + e["library"], ".gpu/aot-jit/" + e["library"])
json.dump(m, open(".gpu/aot-jit/manifest.json", "w"), indent=1)
print(len(m["entries"]), "kernels in .gpu/aot-jit")
PY
  du -sh .gpu/aot-jit
  exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile .dsl-quack/*.whl
export OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source scripts/gpu/steps.sh
export FUTX_AOT_DIR="$PWD/.gpu/aot-jit" FUTX_CACHE_DIR=/tmp/futx-jit-cache
for part in ${@:-aot timing quack}; do
  case "$part" in
    aot) step aot_vs_jit 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_runtime_gpu.py \
           -k aot_and_jit ;;
    timing) TAILN=30 step jit_timing 200 python3 scripts/jit_timing.py ;;
    quack) TAILN=${QUACK_TAIL:-14} step quack ${QUACK_LIMIT:-300} python3 scripts/bench_decode_linear.py --quack \
             --layers ${QUACK_LAYERS:-layer-8b} --m ${QUACK_M:-1,8,16,32} \
             --cands futx-int4,torch-bf16,torch-int4,quack-w4a16 --budget-s ${QUACK_BUDGET:-120} ;;
    fa4) TAILN=16 step fa4 400 python3 scripts/bench_decode_attention.py --quick --no-ablation --budget-s 240 \
           --watchdog-s 300 ;;
    *) echo "unknown part $part" ;;
  esac
done
cp "$OUT"/*.md "$OUT"/*.json "$LOGS"/ 2>/dev/null
pack
