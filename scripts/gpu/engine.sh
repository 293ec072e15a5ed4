#!/usr/bin/env bash
# GPU runs of the decode engine (issue 11), AOT kernels (scripts/gpu/stage.sh 'smoke.*,decode.*,engine.*').
#   bash scripts/gpu/engine.sh PART...   (after `source scripts/gpu/remote.sh`)
# Parts:
#   stage      keep what a second, back-to-back run needs in /tmp: GGUF part 1 (.gpu-data1, carried), the
#              AOT kernels with their runtime library
#   tests      the engine's GPU tests (tests/test_engine_gpu.py, SmolLM2 test skipped: no model here)
#   bench      futx bench decode, 8B shape (FUTX_BENCH_ARGS overrides the arguments)
#   data       unpack SmolLM2's GGUF and WikiText-2 (part 1 staged by an earlier run on this machine, .gpu-data
#              carried: scripts/gpu/stage_data.sh); needed by the parts below
#   equality   kernel path == simulated quantization, 9 formats x 2 protocols, all windows (FUTX_EQ_ARGS adds)
#   diag       kernels vs emulated vs simulated on the first 32 windows (FUTX_DIAG: weights/cache pairs)
#   cli        futx generate (one prompt, chat, a prompts file) and futx ppl on the kernels
#   peers-bf16, peers-int4  gpt-fast-style peers beside the engine; peers-transformers;  bench70  the 70B shape
#   transformers-diag  the transformers peer alone at (1, 1024), eager then compiled, launch errors synchronous
#   prefill-tests  the prefill GEMM (every chain and variant, the tuning space on two chains, a composed chain),
#              prefill attention, prefill block and serving GPU tests; decode-attn-tests  the decode attention
#              suite (after the argument-structure change)
#   bench-pattn  prefill attention vs SDPA;  bench-block  the 8B prefill block vs compiled PyTorch FP8;
#   ppl-prefill  SmolLM2 serving perplexity with the kernel prefill (FP8, BF16) vs the reference prefill
#   tile-norm  the fused RMSNorm row factor (rule E2): its tests and the step with/without it
#   prefill-graphs-tests  CUDA-graph prefill tests (+ prefill block, engine, serve);  profile-chunk  a 512-token
#              chunk eager vs graph (FUTX_GLUE=eager|kernel|compiled);  serving  scripts/bench_serving.py;
#   row-quant  the per-row E4M3 quantization kernel's tests and its effect on the chunk, the block and serving
# Logs -> $OUT/logs.tgz; results (JSON, Markdown, plot) -> $OUT.
set -u
source scripts/gpu/steps.sh
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
for part in "$@"; do
  case "$part" in
    stage)
      mkdir -p /tmp/futx-stage /tmp/futx-aot
      cp .gpu-data1/* /tmp/futx-stage/ 2>/dev/null
      cp -r "$FUTX_AOT_DIR"/. /tmp/futx-aot/
      echo "staged: $(ls /tmp/futx-stage | tr '\n' ' ')$(du -sh /tmp/futx-aot | cut -f1) of kernels" ;;
    tests)  # with 'data' first, the SmolLM2 test runs too
      FUTX_SMOLLM2_GGUF=$( [ -f /tmp/futx-eq/smollm2.gguf ] && echo /tmp/futx-eq/smollm2.gguf ) \
      FUTX_WIKITEXT=$( [ -f /tmp/futx-eq/wiki.test.raw ] && echo /tmp/futx-eq/wiki.test.raw ) \
      PYTHONPATH=/tmp/futx-eq/site:$PYTHONPATH \
      TAILN=12 step engine_tests 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_engine_gpu.py ;;
    attn_tests)  # the decode-attention suite (its op shares the launch path with the engine's fused entry)
      TAILN=6 step attn_tests 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --maxfail=5 \
        tests/test_decode_attention_gpu.py ;;
    bench)
      TAILN=60 step bench 240 python3 -m futx.cli bench decode ${FUTX_BENCH_ARGS:---rounds 5 --reps 10 \
        --glue --out $OUT/bench.json --md $OUT/bench.md --plot $OUT/bench.png} ;;
    peers-bf16)  # the gpt-fast-style peers; bench_engine times each peer at each point in a process of its own
                 # (two compiled INT4 peers in one process hit a device-side index assert), after the engine
      TAILN=12 step gptfast-bf16 200 python3 -m futx.cli bench decode --weights bf16 --cache int4,bf16 \
        --peers gptfast-bf16 --breakdown "" --rounds 5 --reps 10 --out $OUT/gptfast-bf16.json ;;
    peers-int4)
      for pt in 1x1024 8x1024 32x4096; do
        TAILN=6 step gptfast-int4-$pt 120 python3 -m futx.cli bench decode --weights int4 --cache int4,bf16 \
          --points $pt --peers gptfast-int4 --breakdown "" --rounds 5 --reps 10 --out $OUT/gptfast-int4-$pt.json
      done ;;
    peers-transformers)  # transformers LlamaForCausalLM, static cache, torch.compile(mode="reduce-overhead")
      for pt in 1x1024 32x4096; do
        TAILN=6 step transformers-$pt 280 python3 -m futx.cli bench decode --weights bf16,int4 --cache int4 \
          --points $pt --peers transformers --breakdown "" --rounds 5 --reps 10 --out $OUT/transformers-$pt.json
      done ;;
    bench70)
      TAILN=12 step bench70 200 python3 -m futx.cli bench decode --shape llama-3.1-70b --weights int4 \
        --cache int4 --points 1x1024,32x4096 --rounds 5 --reps 5 --out $OUT/bench70.json ;;
    data)  # the default model's GGUF and WikiText-2 from the staged parts (part 1 left by 'stage')
      W=/tmp/futx-eq; mkdir -p $W
      cat /tmp/futx-stage/smollm2.gguf.xz.part1 .gpu-data/smollm2.gguf.xz.part2 | xz -d > $W/smollm2.gguf \
        || { echo "GGUF part 1 missing: run 'stage' first on this machine"; break; }
      xz -d -c .gpu-data/wiki.test.raw.xz > $W/wiki.test.raw
      python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .gpu-data/wheels/*.whl
      export PYTHONPATH="$W/site:$PYTHONPATH" ;;  # (for the parts below, in this shell)
    equality)
      TAILN=40 step equality 560 python3 scripts/engine_equality.py --model $W/smollm2.gguf --text $W/wiki.test.raw \
        --reference --out $OUT/equality.jsonl ${FUTX_EQ_ARGS:-} ;;
    diag)
      TAILN=12 step diag 300 python3 scripts/engine_equality.py --model $W/smollm2.gguf --text $W/wiki.test.raw \
        --combos int4/int4 --diag-combos ${FUTX_DIAG:-int4/int4,bf16/bf16} --diag-windows 32 \
        --out $OUT/diag.jsonl ;;
    cli)  # the user's commands, on the kernels (a Hopper GPU is present: --backend auto picks them)
      printf 'The capital of France is\nOnce upon a time, there was a\nThe three primary colors are\n' > $W/prompts.txt
      TAILN=8 step generate 60 python3 -m futx.cli generate --model $W/smollm2.gguf --max-new-tokens 32 \
        --weights bf16 --cache bf16
      TAILN=8 step generate_int4 60 python3 -m futx.cli generate --model $W/smollm2.gguf --chat \
        --prompt "What is the capital of France?" --max-new-tokens 24
      TAILN=8 step generate_batch 60 python3 -m futx.cli generate --model $W/smollm2.gguf --prompts $W/prompts.txt \
        --max-new-tokens 24 --weights e4m3 --cache int4
      TAILN=12 step ppl_cli 120 python3 -m futx.cli ppl --model $W/smollm2.gguf --text $W/wiki.test.raw \
        --backend kernels --protocol all-decode serving --max-windows 32 --no-progress --json $OUT/ppl_cli.json ;;
    transformers-diag)
      TAILN=25 step transformers-diag 200 env CUDA_LAUNCH_BLOCKING=1 python3 -c "
import sys, torch; sys.path.insert(0, '.')
from scripts.decode_peers import TransformersPeer; from scripts.bench_engine import config_for
cfg = config_for('llama-3.1-8b', None)
for compile in (False, True):
    p = TransformersPeer(cfg, 1, 1024, compile=compile); p.replay(); torch.cuda.synchronize()
    print('ok compile =', compile, flush=True); del p; torch.cuda.empty_cache()" ;;
    prefill-tests)
      P="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
      TAILN=10 step prefill_gemm_tests 150 $P tests/test_prefill_gpu.py
      TAILN=10 step prefill_attn_tests 90 $P tests/test_prefill_attention_gpu.py
      TAILN=10 step prefill_block_tests 120 $P tests/test_prefill_engine_gpu.py
      TAILN=6 step serve_tests 90 $P tests/test_serve.py ;;
    decode-attn-tests)
      TAILN=8 step decode_attn_tests 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --maxfail=20 \
        tests/test_decode_attention_gpu.py ;;
    bench-pattn)
      TAILN=20 step bench_pattn 150 python3 scripts/bench_prefill_attention.py --rounds 5 ;;
    bench-block)
      TAILN=30 step bench_block 280 python3 scripts/bench_prefill_block.py --rounds 5 --quick ;;
    ppl-prefill)
      for f in e4m3 bf16; do
        TAILN=6 step ppl_prefill_$f 150 python3 -m futx.cli ppl --model $W/smollm2.gguf --text $W/wiki.test.raw \
          --backend kernels --protocol serving --max-windows 32 --no-progress --prefill kernels --prefill-format $f \
          --json $OUT/ppl_prefill_$f.json
      done
      TAILN=6 step ppl_prefill_ref 150 python3 -m futx.cli ppl --model $W/smollm2.gguf --text $W/wiki.test.raw \
        --backend kernels --protocol serving --max-windows 32 --no-progress --prefill reference \
        --json $OUT/ppl_prefill_ref.json ;;
    prefill-graphs-tests)  # the CUDA-graph prefill against the eager one, and what it changed beside it
      P="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
      TAILN=8 step prefill_graphs_tests 200 $P tests/test_prefill_graphs_gpu.py tests/test_prefill_engine_gpu.py
      TAILN=6 step engine_serve_tests 200 $P tests/test_engine_gpu.py tests/test_serve.py ;;
    profile-chunk)  # a 512-token chunk eager vs graph (FUTX_GLUE: kernel (default), eager or compiled)
      TAILN=0 step profile_chunk_${FUTX_GLUE:-kernel} 200 python3 scripts/profile_prefill_chunk.py --cache int4 \
        --glue ${FUTX_GLUE:-kernel}
      grep -E "chunk|GPU time|synchron" $LOGS/profile_chunk_${FUTX_GLUE:-kernel}.log
      cp $LOGS/profile_chunk_${FUTX_GLUE:-kernel}.log $OUT/ ;;
    serving)  # bench_serving, default stream (FUTX_SERVE_ARGS adds options)
      TAILN=30 step serving 400 python3 scripts/bench_serving.py --out $OUT --timeout 300 ${FUTX_SERVE_ARGS:-} ;;
    row-quant)  # the row-quantization kernel (glue "kernel"): its tests, then the chunk, the block and serving with it
      P="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
      TAILN=6 step row_quant_tests 200 $P tests/test_row_quant_gpu.py tests/test_prefill_graphs_gpu.py
      FUTX_GLUE=kernel bash scripts/gpu/engine.sh profile-chunk
      TAILN=20 step bench_block_kq 280 python3 scripts/bench_prefill_block.py --rounds 5 --parts block,packed
      FUTX_SERVE_ARGS="--prefill-glue kernel" bash scripts/gpu/engine.sh serving ;;
    tile-norm)  # the RMSNorm row factor inside the M = 1 QKV/gate-up GEMVs (routing rule E2): tests, then the step
                # with it, with the row factor as its own kernel, and unfused, in one process
      P="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
      TAILN=8 step norm_tests 240 $P tests/test_decode_linear_gpu.py -k "norm_linear" tests/test_engine_gpu.py
      TAILN=40 step bench_norm 240 python3 -m futx.cli bench decode --weights int4 --cache int4 \
        --points 1x1024,8x1024,32x4096 --glue --rounds 5 --reps 10 --out $OUT/bench-norm.json ;;
    *) echo "unknown part $part" ;;
  esac
done
pack
