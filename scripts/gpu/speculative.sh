#!/usr/bin/env bash
# GPU runs of speculative decoding (issue 27), AOT kernels, three back-to-back device runs on one machine:
#   run 1, carry [".gpu-data1", ".gpu/aot-stage", ".gpu/rt", ".gpu/wheels"]:
#       source scripts/gpu/remote.sh; bash scripts/gpu/speculative.sh stage tests verify8b
#   run 2, carry [".gpu-data-mid"] (only when scripts/gpu/stage_data.sh made one):
#       source scripts/gpu/speculative.sh again; bash scripts/gpu/speculative.sh stage-mid verify70b
#   run 3, carry [".gpu-data"]:
#       source scripts/gpu/speculative.sh again; bash scripts/gpu/speculative.sh data train bench
#   run 4, no carry:  source scripts/gpu/speculative.sh again; bash scripts/gpu/speculative.sh generate
# ('again' points futx at the kernels run 1 left in /tmp; 'data' leaves the model and texts in /tmp/futx-eq.)
# Parts:
#   stage     GGUF part 1 and the AOT kernels (with their runtime library) kept in /tmp for the later runs
#   tests     the speculative and engine GPU tests (tiny models on the kernels)
#   verify8b / verify70b   futx bench decode --speculative: the verify step for k = 0..7 at batch 1/8/32
#   verifykernel  the same at 8B, block rows by the torch prewrite vs the block-rows kernel (futx.ops.qkv_rows)
#   data      SmolLM2's GGUF, WikiText-2 test and the enwiki sample unpacked to /tmp/futx-eq
#   train     futx train-draft (DLite head, SmolLM2) under a deadline; SIGINT saves what is trained
#   generate  futx generate --speculative dlite / ngram on the kernels (the user's command)
#   bench     futx bench speculative: none / ngram / dlite at batch 1 and 8, WikiText-2 and chats, with the plot
# Results -> $OUT (JSON, Markdown, PNG); logs -> $OUT/logs.tgz.
if [ "${1:-}" = again ]; then   # sourced: the environment remote.sh set up in run 1, from /tmp
  export FUTX_AOT_DIR=/tmp/futx-aot FUTX_KERNELS=aot PYTHONPATH="$PWD:/tmp/futx-eq/site${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1 OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
  return 0 2>/dev/null || exit 0
fi
set -u
source scripts/gpu/steps.sh
export TOKENIZERS_PARALLELISM=false
W=/tmp/futx-eq
HEAD=/tmp/futx-dlite
export PYTHONPATH="$W/site:${PYTHONPATH:-}"
for part in "$@"; do
  case "$part" in
    stage-mid)  # the GGUF's middle part, when three runs carry it (scripts/gpu/stage_data.sh)
      mkdir -p /tmp/futx-stage && cp .gpu-data-mid/* /tmp/futx-stage/ && ls -la /tmp/futx-stage ;;
    stage)
      mkdir -p /tmp/futx-stage /tmp/futx-aot
      cp .gpu-data1/* /tmp/futx-stage/ 2>/dev/null
      cp -r "$FUTX_AOT_DIR"/. /tmp/futx-aot/
      echo "staged: $(ls /tmp/futx-stage | tr '\n' ' ')$(du -sh /tmp/futx-aot | cut -f1) of kernels" ;;
    tests)
      TAILN=15 step spec_tests 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --maxfail=8 \
        tests/test_speculative_gpu.py tests/test_engine_gpu.py tests/test_serve.py ;;
    verify8b)
      TAILN=45 step verify8b 200 python3 -m futx.cli bench decode --speculative --weights int4 --cache int4 \
        --points 1x1024,8x1024,32x1024 --rounds 5 --reps 10 --out $OUT/verify-8b.json --md $OUT/verify-8b.md ;;
    verifykernel)  # the block's rows by the torch prewrite vs one futx.ops.qkv_rows launch (the verify step's fixed cost)
      TAILN=45 step verifykernel 240 python3 -m futx.cli bench decode --speculative --weights int4 --cache int4 \
        --points 1x1024,8x1024 --num-draft 0,1,4,7 --block-attention prewrite,kernel --rounds 5 --reps 10 \
        --out $OUT/verify-kernel-8b.json --md $OUT/verify-kernel-8b.md ;;
    verify70b)
      TAILN=30 step verify70b 260 python3 -m futx.cli bench decode --speculative --shape llama-3.1-70b \
        --weights int4 --cache int4 --points 1x1024,8x1024,32x1024 --num-draft 0,1,2,3,4,7 --rounds 3 --reps 5 \
        --out $OUT/verify-70b.json --md $OUT/verify-70b.md ;;
    data)
      mkdir -p $W
      cat /tmp/futx-stage/smollm2.gguf.xz.part1 $(ls /tmp/futx-stage/smollm2.gguf.xz.mid 2>/dev/null) \
        .gpu-data/smollm2.gguf.xz.part2 | xz -d > $W/smollm2.gguf \
        || { echo "GGUF part 1 missing: run 'stage' first on this machine"; break; }
      xz -d -c .gpu-data/wiki.test.raw.xz > $W/wiki.test.raw
      xz -d -c .gpu-data/enwiki-sample.txt.xz > $W/enwiki-sample.txt
      python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .gpu-data/wheels/*.whl
      ls -la $W ;;
    train)  # the deadline sends SIGINT: train-draft then saves the head trained so far
      TAILN=25 step train 340 timeout -s INT "${FUTX_TRAIN_S:-320}" python3 -m futx.cli train-draft \
        --model $W/smollm2.gguf --data $W/enwiki-sample.txt --out $HEAD --device cuda --no-progress \
        --json $OUT/train-draft.json ${FUTX_TRAIN_ARGS:-}
      mkdir -p $OUT/dlite && cp $HEAD/draft.json $HEAD/draft.safetensors $OUT/dlite/ 2>/dev/null ;;
    generate)
      TAILN=10 step gen_dlite 90 python3 -m futx.cli generate --model $W/smollm2.gguf --backend kernels \
        --speculative dlite --draft $HEAD --num-draft 4 --max-new-tokens 128 \
        --prompt "The history of the Roman Empire" --json $OUT/gen-dlite.json
      TAILN=10 step gen_ngram 90 python3 -m futx.cli generate --model $W/smollm2.gguf --backend kernels \
        --speculative ngram --num-draft 4 --max-new-tokens 128 --chat \
        --prompt "Write a short story about a robot who learns to paint." --json $OUT/gen-ngram.json ;;
    bench)
      drafts="--drafts none,ngram"; [ -f $HEAD/draft.json ] && drafts="--drafts none,ngram,dlite --draft $HEAD"
      TAILN=40 step bench_spec 420 python3 -m futx.cli bench speculative --model $W/smollm2.gguf \
        --backend kernels $drafts --num-draft 4 --batches 1,8 --text $W/wiki.test.raw \
        --prompts ${FUTX_SPEC_PROMPTS:-8} --gen-len 256 --rounds 2 \
        --out $OUT/spec.json --md $OUT/spec.md --plot $OUT/spec.png ;;
    *) echo "unknown part $part" ;;
  esac
done
pack
