#!/usr/bin/env bash
# GPU runs of the persistent kernel's task loop (issue 29), AOT kernels:
#   here:  python scripts/tuning_space.py build --out .gpu/aot --only 'decode.persistent.*' --no-runtime \
#            && bash scripts/gpu/stage.sh
#   run,   carry [".gpu/aot-stage", ".gpu/rt", ".gpu/wheels"]:
#          source scripts/gpu/remote.sh; bash scripts/gpu/persistent.sh tests handoff layer
# Parts:
#   tests     tests/test_persistent_loop_gpu.py: the chain of rounds ordered by one counter, bit for bit;
#             tests/test_persistent_layer_gpu.py: a layer's projections in one persistent launch = the standalone
#             tile GEMVs, bit for bit
#   handoff   scripts/bench_persistent_loop.py: us per round in one persistent launch vs one launch per round
#   layer     scripts/bench_persistent_layer.py: the 8B layer's four projections, one persistent launch (1 and 2
#             CTAs per SM) vs four launches with PDL
#   step      tests/test_persistent_step_gpu.py (the whole layer in the engine vs the shipped step) and decode
#             attention's GPU tests of the shipped kernels (its body is the layer's attention task; the tuning-space
#             variants need their tuning-space build staged)
#   bench8    futx bench decode: the 8B step at batch 1 on the persistent layer (split counts) vs the shipped step
#   bench70   the same for the 70B shape
#   rows      tests/test_persistent_step_gpu.py (1, 3 and 8 rows, contexts to 8191) and
#             tests/test_persistent_sanitizer_gpu.py (compute-sanitizer racecheck and synccheck on a small model),
#             the tile layer's (the ring's: `ring`)
#   tiles     tests/test_decode_linear_gpu.py's tile GEMV tests (its bodies are the layer's projection tasks)
#   bench8r   the 8B step at (1, 1024), (4, 1024) and (8, 1024) on the persistent layer (tile and ring bodies; the
#             ring's 8 rows stage the down input in two chunks) vs the shipped step and the gpt-fast-style INT4 peer
#   timeline8 scripts/step_timeline.py: the 8B step at (8, 1024) on the persistent layer, its kernels traced
#   bench70r  the 70B step at (4, 1024) (8 rows of its down projection do not fit one CTA's shared memory)
#   ring      the ring layer (decode/persistent_ring.py, a producer warp streams the weights): its step tests, its
#             tuning variants bit for bit against it (tuning space staged, as for ringvar) and compute-sanitizer
#             racecheck / synccheck (tests/test_persistent_step_gpu.py -k ring, the sanitizer test)
#   bench8g   the 8B step at (1, 1024) and (1, 8192): ring layer vs tile layer vs shipped step vs gpt-fast INT4 peer
#   bench70g  the 70B step at (1, 1024) and (4, 1024): ring layer vs shipped step
#   timelineg scripts/step_timeline.py: the 8B step at (1, 1024) on the ring layer, its kernels traced
#   traceg    scripts/persistent_trace.py: inside the ring layer, the 8B step at (1, 1024) and (1, 8192): per task
#             kind busy / wait / weight lead and each layer's phases (its traced registry kernel)
#   bufsg     scripts/persistent_buffers.py ring: one ring layer's buffers against the shipped ops (if `ring` fails)
#   ringvar   scripts/bench_ring_variants.py: the 8B step at (1, 1024) and (8, 1024) on the routed ring layer vs its
#             tuning space (consumers one stage ahead, rings of 4 / 8 stages) vs the shipped step, one process
#             (needs the tuning space staged: python scripts/tuning_space.py build --out .gpu/aot
#             --only 'decode.persistent.ring.*' --no-runtime, then stage.sh)
#   ringeq    the ring's tuning variants bit for bit against the routed ring (tuning space staged)
#   ringgrp   scripts/bench_ring_variants.py: the routed ring vs the epilogue warp, the stage groups (g2, g4, ewg2)
#             and the no-arithmetic diagnostic (nm) ($RINGVARS) vs the shipped step at (1, 1024) and (8, 1024)
#   traceg2   scripts/persistent_trace.py --variant g2 / ewg2 ($TRACEVARS): inside the ring layer, (1, 1024)
#   ringeqpf  the early-tile variants (pf, ewg2pf) bit for bit against the routed ring at contexts 1 to 8191
#   ringpf    scripts/bench_ring_variants.py: the early-tile variants (pf, ewg2pf: an attention partial's first cache
#             tiles requested before its counter wait) vs ew / ewg2 and the shipped step (TRACEVARS="pf ewg2pf"
#             traceg2: the partials' busy time and the QKV-to-O chain inside the layer)
#   ringsplit the 8B step at (1, 1024) and (1, 8192) on the ring layer with 4 (auto), 8 and 16 attention splits: does
#             a shorter partial shorten attention's chain inside the layer (its fixed cost ~4.3 µs)?
#   sanring   compute-sanitizer racecheck / synccheck of the ring (routed, ew, g2, pf) and the tile layer
#   ncusrc    Nsight Compute on one ring layer launch of the 8B step at (1, 1024) (the routed kernel and g2): warp
#             state statistics and per-SASS-instruction stall samples, $OUT/ncu-ring-src*.csv
#   ncu       Nsight Compute counters (DRAM throughput, occupancy, issue activity, stalls) of the projections, one
#             persistent launch vs the four standalone tile GEMVs: $OUT/ncu_persistent.csv
#   pdltests  the shipped step's attention as a dependent launch of its QKV projection (decode.attn.*.qkv*.pdl, rule
#             E5): tests/test_attention_pdl_gpu.py, bit for bit against the plain kernel (op and engine step); the
#             final norm as one kernel (engine.rms_rows.gain, rule E6): its tests in tests/test_engine_gpu.py
#   pdlbench  futx bench decode --pdl-attention --final-norm-kernel: the 8B step (INT4 weights, INT4 / E4M3 caches)
#             at (1, 1024), (1, 8192), (4, 1024), (8, 1024), (32, 4096) with E5, E6, both and neither, one process
#             ($PDLCACHES, $PDLPOINTS: fewer caches or points where device time is short)
#   pdl70     the same for the 70B at (1, 1024), (1, 8192), (4, 1024), (8, 1024), with the ring layer where it fits
#   peer70    the gpt-fast-style INT4 peer at the 70B's four points (one process each; its JSON lines in the log)
#   pdlring   the 8B INT4/INT4 step at (1, 1024) with E5 and the tile GEMV's ring pipeline (whole weight
#             share requested before the wait; tuning space staged: python scripts/tuning_space.py build --out .gpu/aot
#             --only 'decode.gemv.int4.m1.*ring*' --no-runtime, then stage.sh)
#   pdlsplit  the 8B INT4/INT4 step at one row (contexts 1024 to 16384) and (8, 1024) with attention forced to 2, 4, 8,
#             16, 32 splits, plain and dependent launch (item 2: which split size makes attention shortest in the step)
#   splitrows the 8B INT4/INT4 step at 2, 4 and 8 rows and long contexts as routed and, E5 off, with attention
#             forced to 2..32 splits: does one CTA per SM beat two there too, as at one row (pdlsplit)?
#   splitcheck rule A8 (decode.attn_plan.step_splits) as routed vs the standalone rule's counts forced (4..32), E5 off
#             and on, the 8B INT4/INT4 step at 1..8 rows
#   pdlsplit70 the 70B INT4/INT4 step at (1, 8192) and (1, 16384) with attention forced to 8, 16, 32 splits and the
#             ring layer at the rule's count and 16: is the ring's one 70B win (1, 8192) its 16 splits?
#   pdltime   scripts/step_timeline.py --pdl-attention: the 8B step at (1, 1024) and (8, 1024), its kernels traced
#   argmax    the greedy-argmax kernel (engine.argmax_rows, rule E7) against torch.argmax and in the engine step
#   e7tests   the engine's and speculative decoding's GPU tests with E7 routed (the DLite drafter's graphs too; the
#             warp-specialized batch tests need the skinny tuning space staged: python scripts/tuning_space.py build
#             --out .gpu/aot --only 'decode.skinny.*' --no-runtime, then stage.sh)
#   argbench  futx bench decode --argmax-kernel: the 8B INT4/INT4 step with E7 on and off ($ARGPOINTS)
#   arg70     the same for the 70B at (1, 1024) and (8, 1024)
#   argtime   scripts/step_timeline.py: the 8B step at (1, 1024) traced with E7 off and on
#   ringcap   the 70B INT4/INT4 step at one row on the ring layer vs the shipped step in caches of 8192 and 16384
#             positions filled to several contexts: does the ring's win at (1, 8192) and (1, 16384) hold where
#             the context is below the capacity (a graph serves every context of its cache)?
set -u
source scripts/gpu/steps.sh
for part in "$@"; do
  case "$part" in
    tests)   TAILN=12 step persistent_tests 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
               tests/test_persistent_loop_gpu.py tests/test_persistent_layer_gpu.py ;;
    handoff) TAILN=6 step handoff 90 python3 scripts/bench_persistent_loop.py --json $OUT/handoff.json ;;
    layer)   TAILN=6 step layer 120 python3 scripts/bench_persistent_layer.py --json $OUT/persistent-layer.json ;;
    step)    TAILN=12 step persistent_step 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE -x \
               tests/test_persistent_step_gpu.py tests/test_decode_attention_gpu.py \
               -k 'not table and not s2 and not vlut and not w6v and not fx and not bench_graphs' ;;
    bench8)  TAILN=16 step bench8 240 python3 -m futx.cli bench decode --weights int4 --cache int4,e4m3 \
               --points 1x1024,1x8192 --persistent auto,8,16 --breakdown '' --json $OUT/persistent-8b.json ;;
    bench70) TAILN=12 step bench70 300 python3 -m futx.cli bench decode --shape llama-3.1-70b --weights int4 \
               --cache int4 --points 1x1024 --persistent auto,16 --breakdown '' --json $OUT/persistent-70b.json ;;
    rows)    TAILN=12 step persistent_rows 420 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
               tests/test_persistent_step_gpu.py tests/test_persistent_sanitizer_gpu.py -k "not ring" ;;
    tiles)   TAILN=6 step tile_tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
               tests/test_decode_linear_gpu.py -k "tile or norm_linear" ;;
    bench8r) TAILN=16 step bench8r 420 python3 -m futx.cli bench decode --weights int4 --cache int4 \
               --points 1x1024,4x1024,8x1024 --persistent auto,ring --peers gptfast-int4 --breakdown '' --json $OUT/persistent-8b-rows.json ;;
    timeline8) TAILN=6 step timeline8 180 python3 scripts/step_timeline.py --batch 8 --persistent \
               --json $OUT/timeline-8b-b8-persistent.json ;;
    bench70r) TAILN=12 step bench70r 300 python3 -m futx.cli bench decode --shape llama-3.1-70b --weights int4 \
               --cache int4 --points 4x1024 --persistent auto --breakdown '' --json $OUT/persistent-70b-rows.json ;;
    ring)    TAILN=12 step persistent_ring 420 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
               tests/test_persistent_step_gpu.py tests/test_persistent_sanitizer_gpu.py -k ring ;;
    bench8g) TAILN=16 step bench8g 420 python3 -m futx.cli bench decode --weights int4 --cache int4,e4m3 \
               --points 1x1024,1x8192 --persistent auto,ring --peers gptfast-int4 --breakdown '' \
               --json $OUT/persistent-ring-8b.json ;;
    bench70g) TAILN=12 step bench70g 300 python3 -m futx.cli bench decode --shape llama-3.1-70b --weights int4 \
               --cache int4 --points 1x1024,4x1024 --persistent ring --breakdown '' --json $OUT/persistent-ring-70b.json ;;
    timelineg) TAILN=6 step timelineg 180 python3 scripts/step_timeline.py --ring \
               --json $OUT/timeline-8b-1x1024-ring.json ;;
    traceg)  TAILN=40 step traceg 180 bash -c "python3 scripts/persistent_trace.py --json $OUT/ring-trace-8b-1024.json \
               && python3 scripts/persistent_trace.py --context 8192 --json $OUT/ring-trace-8b-8192.json" ;;
    bufsg)   TAILN=30 step bufsg 180 python3 scripts/persistent_buffers.py ring ;;
    ringvar) TAILN=24 step ringvar 300 python3 scripts/bench_ring_variants.py --points 1x1024,8x1024 \
               --json $OUT/ring-variants-8b.json ;;
    ringeq)  TAILN=8 step ringeq 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
               tests/test_persistent_step_gpu.py -k variants_equal ;;
    ringeqpf) TAILN=8 step ringeqpf 360 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
               tests/test_persistent_step_gpu.py -k early_tile ;;
    ringpf)  TAILN=24 step ringpf 300 python3 scripts/bench_ring_variants.py --points 1x1024,1x8192,8x1024 \
               --variants ew,ewg2,pf,ewg2pf --json $OUT/ring-early-tiles-8b.json ;;
    ringgrp) TAILN=24 step ringgrp 300 python3 scripts/bench_ring_variants.py --points 1x1024,8x1024 \
               --variants ${RINGVARS:-ew,g2,g4,ewg2,nm} --json $OUT/ring-groups-8b.json ;;
    traceg2) TAILN=40 step traceg2 240 bash -c "for v in ${TRACEVARS:-g2 ewg2}; do python3 scripts/persistent_trace.py \
               --variant \$v --json $OUT/ring-trace-8b-1024-\$v.json || exit 1; done" ;;
    ringsplit) TAILN=16 step ringsplit 300 python3 -m futx.cli bench decode --weights int4 --cache int4 \
               --points 1x1024,1x8192 --persistent ring:auto,ring:8,ring:16 --breakdown '' --json $OUT/ring-splits-8b.json ;;
    sanring) TAILN=12 step sanring 330 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
               tests/test_persistent_sanitizer_gpu.py ;;
    ncusrc)  for v in "" g2; do
               rep=$LOGS/ring${v:+-$v}
               timeout 240 ncu --clock-control none -k regex:RingLayer --launch-skip 40 --launch-count 1 \
                 --section WarpStateStats --section SourceCounters --section SpeedOfLight --section MemoryWorkloadAnalysis \
                 --import-source no -f -o $rep python3 scripts/profile_ring_layer.py ${v:+--variant $v} \
                 > $LOGS/ncusrc$v.log 2>&1
               echo "ncu ring$v rc=$?"; tail -3 $LOGS/ncusrc$v.log
               ncu -i $rep.ncu-rep --page source --csv --print-source sass > $OUT/ncu-ring-src${v:+-$v}.csv 2>> $LOGS/ncusrc$v.log
               ncu -i $rep.ncu-rep --page details --csv > $OUT/ncu-ring-details${v:+-$v}.csv 2>> $LOGS/ncusrc$v.log
               echo "exported rc=$? $(wc -c < $OUT/ncu-ring-src${v:+-$v}.csv) bytes"
             done ;;
    ncu)     source scripts/gpu/ncu_decode.sh
             ncu --clock-control none -k regex:'gemv_tile|persistent_layer' --metrics $M --csv \
               python3 scripts/bench_persistent_layer.py --once > $OUT/ncu_persistent.csv 2> $LOGS/ncu_persistent.err
             echo "ncu rc=$? $(wc -l < $OUT/ncu_persistent.csv) lines" ;;
    pdltests) TAILN=12 step pdl_tests 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
               tests/test_attention_pdl_gpu.py tests/test_engine_gpu.py -k "pdl or gain or final_norm" ;;
    pdlbench) TAILN=40 step pdlbench 540 python3 -m futx.cli bench decode --weights int4 --cache ${PDLCACHES:-int4,e4m3} \
               --points ${PDLPOINTS:-1x1024,1x8192,4x1024,8x1024,32x4096} --pdl-attention --final-norm-kernel --breakdown '' \
               --json $OUT/pdl-attention-8b.json ;;
    pdl70)   TAILN=16 step pdl70 540 python3 -m futx.cli bench decode --shape llama-3.1-70b --weights int4 --cache int4 \
               --points 1x1024,1x8192,4x1024,8x1024 --pdl-attention --final-norm-kernel --persistent ring \
               --breakdown '' --json $OUT/pdl-attention-70b.json ;;
    peer70)  TAILN=8 step peer70 540 bash -c "for p in 1x1024 1x8192 4x1024 8x1024; do echo \$p; \
               python3 scripts/decode_peers.py gptfast-int4 --shape llama-3.1-70b --point \$p || exit 1; done" ;;
    pdlring) TAILN=30 step pdlring 420 python3 -m futx.cli bench decode --weights int4 --cache int4 \
               --points 1x1024 --pdl-attention --tile-variants ring4,ring8 --breakdown '' \
               --json $OUT/pdl-attention-ring-8b.json ;;
    pdlsplit) TAILN=40 step pdlsplit 420 python3 -m futx.cli bench decode --weights int4 --cache int4 \
               --points 1x1024,1x4096,1x8192,1x16384,8x1024 --pdl-attention --attention-splits 2,4,8,16,32 --breakdown '' \
               --json $OUT/pdl-attention-splits-8b.json ;;
    splitrows) TAILN=40 step splitrows 420 python3 -m futx.cli bench decode --weights int4 --cache int4 \
               --points 1x2048,2x8192,4x8192,8x8192,4x16384 --attention-splits 2,4,8,16,32 --breakdown '' \
               --json $OUT/splits-rows-8b.json ;;
    splitcheck) TAILN=70 step splitcheck 420 python3 -m futx.cli bench decode --weights int4 --cache int4 \
               --points 1x8192,2x8192,4x1024,4x8192,8x1024,8x8192 --pdl-attention --attention-splits 4,8,16,32 \
               --breakdown '' --json $OUT/splits-check-8b.json ;;
    pdlsplit70) TAILN=30 step pdlsplit70 420 python3 -m futx.cli bench decode --shape llama-3.1-70b --weights int4 \
               --cache int4 --points 1x8192,1x16384 --attention-splits 8,16,32 --persistent ring,ring:16 --breakdown '' \
               --json $OUT/splits-70b.json ;;
    pdltime) TAILN=30 step pdltime 240 bash -c "for b in 1 8; do for r in off e5e6; do \
               f=--rules-off; [ \$r = off ] || f='--pdl-attention --final-norm-kernel'; \
               python3 scripts/step_timeline.py --batch \$b \$f --json $OUT/timeline-8b-\${b}x1024-\$r.json \
               || exit 1; done; done" ;;
    argmax)  TAILN=20 step argmax_tests 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
               tests/test_argmax_rows_gpu.py tests/test_argmax_rows.py ;;
    e7tests) TAILN=20 step e7_tests 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
               tests/test_engine_gpu.py tests/test_speculative_gpu.py ;;
    argbench) TAILN=30 step argbench 420 python3 -m futx.cli bench decode --weights int4 --cache int4 \
               --points ${ARGPOINTS:-1x1024,1x8192,4x1024,8x1024,32x4096} --argmax-kernel --breakdown '' \
               --json $OUT/argmax-8b.json ;;
    arg70)   TAILN=16 step arg70 420 python3 -m futx.cli bench decode --shape llama-3.1-70b --weights int4 --cache int4 \
               --points 1x1024,8x1024 --argmax-kernel --breakdown '' --json $OUT/argmax-70b.json ;;
    argtime) TAILN=30 step argtime 240 bash -c "for r in '' --argmax-kernel; do \
               python3 scripts/step_timeline.py --batch 1 \$r --json $OUT/timeline-8b-1x1024\${r:+-e7}.json \
               || exit 1; done" ;;
    ringcap) TAILN=30 step ringcap 500 bash -c "for cap in ${RINGCAPS:-8192 16384}; do \
               pts=1x1024,1x4096,1x8192; [ \$cap = 16384 ] && pts=1x2048,1x8192,1x16384; \
               [ \$cap = 32768 ] && pts=1x4096,1x32768; \
               python3 -m futx.cli bench decode --shape llama-3.1-70b --weights int4 --cache int4 --points \$pts \
               --capacity \$cap --persistent ring --breakdown '' --json $OUT/ring-capacity-70b-\$cap.json \
               || exit 1; done" ;;
    *) echo "unknown part $part" ;;
  esac
done
pack
