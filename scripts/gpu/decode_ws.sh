#!/usr/bin/env bash
# The warp-specialized INT4 projection (decode/skinny_ws.py, routing rule P17) on the GPU, after
# `source scripts/gpu/remote.sh`:
#   bash scripts/gpu/decode_ws.sh tests engine proj ncu step        (any subset, in that order)
#   bash scripts/gpu/decode_ws.sh e4m3 e4m3proj     the E4M3 kernel (decode/skinny_ws_e4m3.py): its GPU tests; the
#     8B/70B projections at M = 16/32/64 (routed E4M3, its ws / wsk, torch BF16). Stage: the registry's decode.gemv.*,
#     decode.tile.*, decode.skinny.* and the tuning space's 'decode.skinny.e4m3.*,decode.skinny.int4.*.ws*'.
# tests: its GPU tests and the decode-projection tests of every routed kernel; engine: the decode engine's GPU tests
# (the step on the kernels against the emulated path at every row count); proj: every 8B/70B projection at M = 1 and 8
# (routed, torch BF16, torch INT4) and at 16/32/64 (routed, the ws/wsk/wst/wskt variants, torch); ncu: Nsight Compute
# counters (in the logs) of the 8B gate/up at M = 16/32/64 for the register-weights, "rwg" and ws kernels; step: the
# 8B decode step at STEP_POINTS beside the same step with STEP_VARIANTS routed. Logs -> $OUT/logs.tgz.
# Stage first (here): `python -m futx build --out .gpu/aot --no-runtime`,
#   `python scripts/tuning_space.py build --out .gpu/aot --only 'decode.skinny.int4.*.ws*' --no-runtime`
#   and '*.m32.*.rw1,*.m64.*.rww' (the replaced kernels, for tests/test_engine_gpu.py; for ncu also '*.swiglu.rwg'),
#   then scripts/gpu/stage.sh.
set -u
source scripts/gpu/steps.sh
source scripts/gpu/ncu_decode.sh
P="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
WS_CANDS="futx-int4,futx-int4-skinny-ws,futx-int4-skinny-wsk,futx-int4-skinny-wst,futx-int4-skinny-wskt"
STEP_POINTS="${STEP_POINTS:-16x1024,32x4096,64x1024,64x4096}"
STEP_VARIANTS="${STEP_VARIANTS:-\$wskt}"   # the skinny variant routed in each extra step ($V)
for part in "$@"; do
  case "$part" in
    tests)
      TAILN=12 step ws_tests 200 $P tests/test_decode_linear_gpu.py \
        -k "skinny_ws or projection_matches or every_epilogue or split_k_is_exact or public_ops or back_to_back" ;;
    engine)
      TAILN=12 step engine_tests 200 $P tests/test_engine_gpu.py ;;
    proj)
      TAILN=8 step proj_small 60 python3 scripts/bench_decode_linear.py --layers layer-8b,layer-70b --m 1,8 \
        --cands futx-int4,torch-bf16,torch-int4 --budget-s 40
      cp "$OUT/decode_linear.json" "$LOGS/proj_small.json"; cp "$OUT/decode_linear.md" "$LOGS/proj_small.md"
      TAILN=40 step proj 150 python3 scripts/bench_decode_linear.py --layers layer-8b,layer-70b --m 16,32,64 \
        --cands "$WS_CANDS,torch-bf16,torch-int4" --budget-s 110 ;;
    ncu)
      for mm in 16 32 64; do
        case "$mm" in 16) v="rw,rwg,ws,wsk" ;; 32) v="rw1,rwg,ws,wsk" ;; *) v="rww,ws,wsk" ;; esac
        timeout -k 5 90 ncu --clock-control none -k regex:Skinny --metrics "$M" --csv python3 scripts/profile_decode_linear.py \
          --n 28672 --k 4096 --m "$mm" --epilogue swiglu --kernel skinny --variants "$v" \
          > "$LOGS/ncu_gu$mm.csv" 2> "$LOGS/ncu_gu$mm.err"
        echo "== ncu gate/up M=$mm rc=$? $(wc -l < "$LOGS/ncu_gu$mm.csv") lines"
      done ;;
    step)
      TAILN=40 step ws_step 240 python3 -m futx bench decode --weights int4 --cache int4 --points "$STEP_POINTS" \
        --tile-variants "$STEP_VARIANTS" --breakdown '' --out "$OUT/step_ws.json" --md "$OUT/step_ws.md" ;;
    e4m3)   # the E4M3 kernel (decode/skinny_ws_e4m3.py): a one-unit smoke first (a hang stops here), then its tests
      TAILN=6 step e4m3_smoke 90 $P tests/test_decode_linear_gpu.py -k "test_e4m3_ws and 400x64 and store"
      grep -q " passed" "$LOGS/e4m3_smoke.log" && ! grep -q " failed" "$LOGS/e4m3_smoke.log" || { pack; exit 1; }
      TAILN=12 step e4m3_tests 200 $P tests/test_decode_linear_gpu.py -k "e4m3_ws or skinny_ws_chain or skinny_ws_split" ;;
    e4m3proj)   # every 8B/70B projection at M = 16/32/64, E4M3: routed, ws, wsk; torch BF16
      TAILN=60 step e4m3_proj 240 python3 scripts/bench_decode_linear.py --layers layer-8b,layer-70b --m 16,32,64 \
        --cands futx-e4m3,futx-e4m3-ws,futx-e4m3-wsk,torch-bf16 --budget-s "${E4M3_BUDGET:-150}"
      cp "$OUT/decode_linear.json" "$LOGS/e4m3_proj.json"; cp "$OUT/decode_linear.md" "$LOGS/e4m3_proj.md" ;;
    *) echo "unknown part $part" ;;
  esac
done
cp "$OUT"/*.md "$OUT"/*.json "$LOGS"/ 2>/dev/null
pack
