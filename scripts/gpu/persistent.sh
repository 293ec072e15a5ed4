#!/usr/bin/env bash
# GPU runs of the persistent kernel's task loop (issue 29), AOT kernels:
#   here:  python scripts/tuning_space.py build --out .gpu/aot --only 'decode.persistent.*' --no-runtime \
#            && bash scripts/gpu/stage.sh 'decode.persistent.*'
#   run,   carry [".gpu/aot-stage", ".gpu/rt", ".gpu/wheels"]:
#          source scripts/gpu/remote.sh; bash scripts/gpu/persistent.sh tests handoff layer
# Parts:
#   tests     tests/test_persistent_loop_gpu.py: the chain of rounds ordered by one counter, bit for bit;
#             tests/test_persistent_layer_gpu.py: a layer's projections in one persistent launch = the standalone
#             tile GEMVs, bit for bit
#   handoff   scripts/bench_persistent_loop.py: us per round in one persistent launch vs one launch per round
#   layer     scripts/bench_persistent_layer.py: the 8B layer's four projections, one persistent launch (1 and 2
#             CTAs per SM) vs four launches with PDL
set -u
source scripts/gpu/steps.sh
for part in "$@"; do
  case "$part" in
    tests)   TAILN=12 step persistent_tests 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
               tests/test_persistent_loop_gpu.py tests/test_persistent_layer_gpu.py ;;
    handoff) TAILN=6 step handoff 180 python3 scripts/bench_persistent_loop.py --json $OUT/handoff.json ;;
    layer)   TAILN=6 step layer 180 python3 scripts/bench_persistent_layer.py --json $OUT/persistent-layer.json ;;
    *) echo "unknown part $part" ;;
  esac
done
pack
