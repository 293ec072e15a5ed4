#!/usr/bin/env bash
# One GPU run over the AOT-staged kernels (after `source scripts/gpu/remote.sh`):
#   bash scripts/gpu/kernels.sh runtime decode attention paged prefill     (any subset, in that order)
# Each part runs its GPU tests, then its benchmark; every step is time-boxed; logs -> $OUT/logs.tgz.
# The decode and attention tests and benchmarks also run the tuning space (design alternatives the routers
# never pick; they register it in-process from scripts/tuning_space.py). In AOT mode stage it with the
# registry: `python scripts/tuning_space.py build --out .gpu/aot --no-runtime && scripts/gpu/stage.sh`.
set -u
source scripts/gpu/steps.sh
P="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
tuning_staged() {  # name the tuning variants (pattern $1) an AOT stage lacks: their tests and rows will fail
  [ "${FUTX_KERNELS:-auto}" = aot ] || return 0
  local miss; miss=$(python3 scripts/tuning_space.py missing --aot "$FUTX_AOT_DIR" --only "$1" | wc -l)
  [ "$miss" -eq 0 ] || echo "== warning: $miss tuning-space variants ($1) not staged (see the header of this script)"
}
for part in "$@"; do
  case "$part" in
    runtime)
      step runtime 90 $P tests/test_runtime_gpu.py tests/test_ops_compile_gpu.py
      TAILN=30 step deploy 60 python3 scripts/aot_deploy_demo.py --aot "$FUTX_AOT_DIR"
      TAILN=5 step overhead 40 python3 scripts/bench_runtime_overhead.py --calls 5000 ;;
    decode)
      tuning_staged 'decode.gemv.*,decode.skinny.*'
      timeout -k 5 90 $P -x tests/test_decode_linear_gpu.py -k "public_ops or back_to_back or (gemv_geometry and int4)" \
        > "$LOGS/dlin_smoke.log" 2>&1; rc=$?; echo "== dlin_smoke rc=$rc"; tail -n 2 "$LOGS/dlin_smoke.log"
      if [ $rc -ne 124 ] && [ $rc -ne 137 ]; then
        TAILN=8 step dlin 150 $P tests/test_decode_linear_gpu.py
        TAILN=20 step bench_dlin 120 python3 scripts/bench_decode_linear.py --budget-s 75
      fi ;;
    attention)
      tuning_staged 'decode.attn.*'
      TAILN=12 step attn_tests 150 $P --maxfail=30 tests/test_decode_attention_gpu.py
      TAILN=30 step bench_attn 110 python3 scripts/bench_decode_attention.py --budget-s 75 ;;
    paged)  # the paged cache's decode attention (stage 'decode.attn.*,engine.mirror_rows.*')
      TAILN=12 step paged_tests 300 $P --maxfail=20 tests/test_decode_attention_paged_gpu.py
      TAILN=12 step bench_paged 240 python3 scripts/bench_paged_attention.py ;;
    prefill)
      TAILN=8 step prefill_tests 120 $P tests/test_prefill_gpu.py
      TAILN=12 step bench_gemm 60 python3 scripts/bench_prefill.py --quick --rounds 9
      TAILN=14 step bench_swiglu 90 python3 scripts/bench_swiglu.py --only futx --rounds 9 ;;
    *) echo "unknown part $part" ;;
  esac
done
cp "$OUT"/*.md "$OUT"/*.json "$LOGS"/ 2>/dev/null
pack
