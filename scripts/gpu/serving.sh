#!/usr/bin/env bash
# GPU runs of the paged cache, the INT4-only cache and the server under load (issue 28), AOT kernels:
#   here:  bash scripts/gpu/stage.sh && python scripts/gpu/load_model.py .gpu-data-load
#   run,   carry [".gpu/aot-stage", ".gpu/rt", ".gpu/wheels", ".gpu-data-load"]:
#          source scripts/gpu/remote.sh; bash scripts/gpu/serving.sh tests capacity ttft sweep load
# Parts:
#   tests     the paged and INT4-only GPU tests (mirror-only decode attention vs paged, the scheduler on the kernels
#             staged vs a main copy on every page, speculative too; paged prefill and decode attention vs contiguous;
#             the block-rows kernel vs the torch prewrite, the speculative verify step)
#   capacity  scripts/cache_capacity.py: tokens per GB and 4096-token requests that fit, both modes (8B shape)
#   ttft      scripts/bench_serving.py: TTFT with and without a cached 1024-token system prompt (8B shape, paged,
#             then the same on the INT4-only cache)
#   sweep     scripts/bench_serving.py --rates: Poisson rates on the 8B shape, paged with a main copy and INT4-only
#   steady    the same at 512 requests per rate (steady state), and with a shared 512-token system prompt
#   load      scripts/load_test.py at full scale (1,000 requests, 64 streams) on futx serve --backend kernels with
#             the INT4-only cache and prefix caching (a small synthetic model: the server, scheduler and kernels
#             under load, not model quality)
# Results -> $OUT (JSON, Markdown, PNG); logs -> $OUT/logs.tgz.
set -u
source scripts/gpu/steps.sh
B8="--layers 32 --max-batch 32 --capacity 2304 --page-size 128"
for part in "$@"; do
  case "$part" in
    tests)
      TAILN=15 step tests 480 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --maxfail=8 \
        tests/test_int4_only_cache_gpu.py tests/test_mirror_rows_gpu.py tests/test_paged_prefill_gpu.py \
        tests/test_decode_attention_paged_gpu.py tests/test_speculative_gpu.py -k "not smollm2" ;;
    capacity)
      TAILN=6 step capacity 120 python3 scripts/cache_capacity.py --json $OUT/capacity-8b.json ;;
    ttft)  # 64 requests at 4 req/s, each a 1024-token system prompt + 64..256 own tokens
      for mode in "full:" "int4only:--staging-pages 36"; do
        name=${mode%%:*}; extra=${mode#*:}
        for pc in cached cold; do
          flag=""; [ $pc = cold ] && flag="--no-prefix-cache"
          TAILN=22 step ttft_${name}_$pc 240 python3 scripts/bench_serving.py $B8 --pages 1024 $extra \
            --shared-prefix 1024 --prompt-len 64:256 --output-len 32:64 --requests 64 --rate 4 $flag \
            --out $OUT/ttft-$name-$pc
        done
      done ;;
    sweep)  # the benchmark's mix (prompts 128..1024, outputs 64..256), Poisson rates, TPOT p99 target 50 ms
      TAILN=12 step sweep_full 300 python3 scripts/bench_serving.py $B8 --max-batch 64 --pages 1152 \
        --requests 128 --rates ${FUTX_RATES:-16,32,48} --out $OUT/sweep-full --plot $OUT/sweep-full.png
      TAILN=12 step sweep_int4only 300 python3 scripts/bench_serving.py $B8 --max-batch 64 --pages 1152 \
        --staging-pages 36 --requests 128 --rates ${FUTX_RATES:-16,32,48} --out $OUT/sweep-int4only \
        --plot $OUT/sweep-int4only.png ;;
    steady)  # the same mix at 512 requests per rate (a 128-request stream is mostly ramp and drain), and with a
             # shared 512-token system prompt before 64..512 own tokens (prefix caching)
      for mode in "full:" "int4only:--staging-pages 36"; do
        name=${mode%%:*}; extra=${mode#*:}
        TAILN=12 step steady_$name 200 python3 scripts/bench_serving.py $B8 --max-batch 64 --pages 1152 $extra \
          --requests 512 --rates ${FUTX_RATES:-24,32,40,48} --out $OUT/steady-$name --plot $OUT/steady-$name.png
        TAILN=12 step steady_${name}_shared 200 python3 scripts/bench_serving.py $B8 --max-batch 64 --pages 1152 \
          $extra --shared-prefix 512 --prompt-len 64:512 --requests 512 --rates ${FUTX_RATES:-24,32,40,48} \
          --out $OUT/steady-$name-shared
      done ;;
    load)
      TAILN=30 step load 560 python3 scripts/load_test.py --spawn --requests 1000 --concurrency 64 \
        --long-fraction 0.3 --long-tokens 2048:4096 --max-tokens 8:128 --malformed 0.1 --disconnect 0.05 \
        --shared-prefix 512 --time-limit 480 --start-timeout 240 --json $OUT/load-h200.json \
        --server-log $LOGS/serve-load.log -- --model .gpu-data-load/model --backend kernels --weights int4 \
        --cache int4 --cache-main none --capacity 4352 --max-batch 32 --max-queue 64 --pages 2048 ;;
    *) echo "unknown part $part" ;;
  esac
done
pack
