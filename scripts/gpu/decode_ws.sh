#!/usr/bin/env bash
# The warp-specialized INT4 projection (decode/skinny_ws.py) on the GPU, after `source scripts/gpu/remote.sh`:
#   bash scripts/gpu/decode_ws.sh tests proj ncu step        (any subset, in that order)
# tests: its GPU tests; proj: the 8B/70B projections at 16/32/64 rows against the shipped kernels and torch BF16;
# ncu: Nsight Compute counters (in the logs) of the 8B gate/up at M = 16/32/64: the shipped, "rwg" and "ws" kernels;
# step: the 8B decode step with the skinny projections on "ws" beside the shipped routing. Logs -> $OUT/logs.tgz.
# Stage first (here): scripts/gpu/stage.sh after building the registry and
#   python scripts/tuning_space.py build --out .gpu/aot --only 'decode.skinny.int4.*.ws,decode.skinny.int4.*.swiglu.rwg' --no-runtime
set -u
source scripts/gpu/steps.sh
source scripts/gpu/ncu_decode.sh
P="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
PROJ_M="${PROJ_M:-16,32,64}"
PROJ_CANDS="${PROJ_CANDS:-futx-int4,futx-int4-skinny-ws,futx-int4-skinny-wsk,torch-bf16}"
STEP_POINTS="${STEP_POINTS:-16x1024,32x4096,64x1024}"
STEP_VARIANTS="${STEP_VARIANTS:-\$ws,\$wsk}"   # the skinny variant routed in each extra step ($V)
for part in "$@"; do
  case "$part" in
    tests)
      TAILN=12 step ws_tests 150 $P tests/test_decode_linear_gpu.py -k "skinny_ws" ;;
    proj)
      TAILN=45 step ws_proj 170 python3 scripts/bench_decode_linear.py --layers layer-8b,layer-70b --m "$PROJ_M" \
        --cands "$PROJ_CANDS" --budget-s 110 ;;
    ncu)
      for mm in 16 32 64; do
        case "$mm" in 16) v="rw,rwg,ws,wsk" ;; 32) v="rw1,rwg,ws,wsk" ;; *) v="rww,ws,wsk" ;; esac   # shipped first
        timeout -k 5 90 ncu --clock-control none -k regex:Skinny --metrics "$M" --csv python3 scripts/profile_decode_linear.py \
          --n 28672 --k 4096 --m "$mm" --epilogue swiglu --kernel skinny --variants "$v" \
          > "$LOGS/ncu_gu$mm.csv" 2> "$LOGS/ncu_gu$mm.err"
        echo "== ncu gate/up M=$mm rc=$? $(wc -l < "$LOGS/ncu_gu$mm.csv") lines"
      done ;;
    step)
      TAILN=30 step ws_step 230 python3 -m futx bench decode --weights int4 --cache int4 --points "$STEP_POINTS" \
        --tile-variants "$STEP_VARIANTS" --breakdown '' --out "$OUT/step_ws.json" --md "$OUT/step_ws.md" ;;
    *) echo "unknown part $part" ;;
  esac
done
cp "$OUT"/*.md "$OUT"/*.json "$LOGS"/ 2>/dev/null
pack
