#!/usr/bin/env bash
# One GPU run for the prefill engine: correctness tests, then the GEMM and gate/up+SwiGLU benchmarks.
# On the GPU machine, after `source scripts/gpu/remote.sh` (AOT kernels staged with
# `scripts/gpu/stage.sh 'prefill.*'`) or `source .dsl/prelude.sh` (JIT):
#     bash scripts/prefill_gpu.sh [quick|full|tests|bench]   (quick: tests + 8192^3 + 8B shapes + SwiGLU)
# Every step runs under `timeout` (a hung kernel is also caught by an in-process watchdog); logs and
# JSON/markdown results go to $OUT; a short summary is printed last.
# quick, AOT (47 kernels staged): run 2 took 20 + 7 + 15 s with 119 tests and 36 kernels; with 169 tests
# and 47 kernels expect ~30 + 8 + 18 s (the limits below are for a hang, not the expected time).
set -u
mode="${1:-quick}"
OUT="${OUT:-/tmp/out}"; export OUT; mkdir -p "$OUT"
declare -a SUMMARY
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  SUMMARY+=("$(printf '%-14s rc=%-3s %4ss' "$name" "$rc" "$(( $(date +%s) - t0 ))")")
  echo "== $name (rc=$rc) =="; tail -n 6 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader 2>/dev/null

if [ "$mode" != "bench" ]; then
  step tests 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_prefill_gpu.py
fi
if [ "$mode" != "tests" ]; then
  if [ "$mode" = "full" ]; then   # every preset's projections at M = 512 ... 8192
    step bench_gemm 900 python3 scripts/bench_prefill.py --m 512,1024,2048,4096,8192
  else                            # 8192^3 and the 8B projections at M = 2048
    step bench_gemm 60 python3 scripts/bench_prefill.py --quick --rounds 9
  fi
  step bench_swiglu 90 python3 scripts/bench_swiglu.py --only futx --rounds 9
fi

echo; echo "================ prefill summary ================"
printf '%s\n' "${SUMMARY[@]}"
if [ -f "$OUT/tests.log" ]; then
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 15
  grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 1
fi
[ -f "$OUT/bench_gemm.log" ] && sed -n '/^prefill GEMM TFLOP/,$p' "$OUT/bench_gemm.log" | cut -c1-140 | head -n 60
[ -f "$OUT/swiglu_table2.md" ] || { [ -f "$OUT/bench_swiglu.log" ] && grep -E "^\||^Also|^  (8B|405B)" "$OUT/bench_swiglu.log"; }
