#!/usr/bin/env bash
# One GPU run in JIT mode (DSL bundle carried): AOT == JIT bit for bit, JIT compile vs cache-load times,
# and quack's W4A16 peer timed in the same process as the futx INT4 decode kernels (loaded AOT).
#   CPU:  scripts/gpu/jit.sh --stage        (after scripts/gpu/stage.sh: .gpu/aot-jit = smoke + INT4 decode libs)
#   GPU:  carry [".dsl", ".dsl-quack", ".gpu/aot-jit"];  source .dsl/prelude.sh; bash scripts/gpu/jit.sh
set -u
if [ "${1:-}" = "--stage" ]; then
  cd "$(git rev-parse --show-toplevel)"
  rm -rf .gpu/aot-jit && mkdir -p .gpu/aot-jit/lib
  python - <<'PY'
import fnmatch, json, shutil
m = json.load(open(".gpu/aot/manifest.json"))
keep = ("smoke.*", "decode.gemv.int4.*", "decode.skinny.int4.*")
m["entries"] = {k: e for k, e in m["entries"].items() if any(fnmatch.fnmatch(k, p) for p in keep)}
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
step aot_vs_jit 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_runtime_gpu.py -k aot_and_jit
TAILN=30 step jit_timing 200 python3 scripts/jit_timing.py
TAILN=14 step quack 300 python3 scripts/bench_decode_linear.py --quack --layers layer-8b --m 1,8,16,32 \
  --cands futx-int4,torch-bf16,torch-int4,quack-w4a16 --budget-s 120
cp "$OUT"/*.md "$OUT"/*.json "$LOGS"/ 2>/dev/null
pack
