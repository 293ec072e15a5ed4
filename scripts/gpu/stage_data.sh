#!/usr/bin/env bash
# Stage the data of the quality GPU run (scripts/gpu/quality_gpu.sh); both folders are git-ignored.
#   scripts/gpu/stage_data.sh            (about a minute: xz of the GGUF)
# SmolLM2's GGUF (98 MB; 90 MB as .xz) is more than one device run carries (64 MiB), so the .xz travels
# in two parts over two back-to-back runs (three when run 1's kernels leave too little room: then
# .gpu-data-mid/smollm2.gguf.xz.mid travels alone in a run between them, copied to /tmp/futx-stage;
# smollm2.gguf = xz -d of part1 + mid + part2):
#   .gpu-data1/smollm2.gguf.xz.part1   first run, carry [".gpu-data1", ...], command beginning with
#                                      mkdir -p /tmp/futx-stage && cp .gpu-data1/* /tmp/futx-stage/
#   .gpu-data/                         second run, carry [".gpu-data"]: part 2, the gguf wheel, the texts (.xz)
# Part 1's size is chosen so that .gpu-data1 + .gpu/{aot-stage,rt,wheels} + the tree and .gpu-data + the
# tree both stay under 62 MiB (margin split between the two); PART1_BYTES overrides.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY="${PYTHON:-python}"
GGUF="${GGUF:-$($PY -c 'from futx.checkpoint import smollm2_path; print(smollm2_path())')}"
SHARED="${SHARED:-$(cd .. && pwd)/shared/data}"
WIKI="$SHARED/wikitext-2-raw/wiki.test.raw"
ENWIKI="$SHARED/enwiki-sample/enwiki-sample.txt"
GGUF_VERSION="$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')"
LIMIT=$((62 * 1048576))

rm -rf .gpu-data1 .gpu-data
mkdir -p .gpu-data1 .gpu-data/wheels
XZ="${XZ_CACHE:-/tmp/futx-smollm2.gguf.xz}"
gguf_sha=$(sha256sum "$GGUF" | cut -d' ' -f1)
if [ ! -s "$XZ" ] || [ "$(cat "$XZ.src-sha256" 2>/dev/null)" != "$gguf_sha" ]; then
  xz -T2 -6 -c "$GGUF" > "$XZ.tmp" && mv "$XZ.tmp" "$XZ" && echo "$gguf_sha" > "$XZ.src-sha256"
fi
xz -T2 -6 -c "$WIKI" > .gpu-data/wiki.test.raw.xz
xz -T2 -6 -c "$ENWIKI" > .gpu-data/enwiki-sample.txt.xz
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
  -d .gpu-data/wheels "gguf==$GGUF_VERSION" 2>/dev/null \
  || "$PY" -m pip download -q --no-deps --only-binary=:all: -d .gpu-data/wheels "gguf==$GGUF_VERSION"

tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
gpu=$(du -scb .gpu/aot-stage .gpu/rt .gpu/wheels 2>/dev/null | tail -1 | cut -f1)
xz_size=$(stat -c %s "$XZ")
rest=$(( $(du -sb .gpu-data | cut -f1) + 4096 ))   # texts, wheel, SHA256SUMS
upper=$(( LIMIT - gpu - tree - 4096 ))               # run 1 fits
lower=$(( xz_size + rest + tree - LIMIT ))           # run 2 fits
MID_BYTES=0
if [ -z "${PART1_BYTES:-}" ]; then
  if [ "$lower" -gt "$upper" ]; then
    # two runs cannot carry it: a middle part (.gpu-data-mid) travels alone in a run between them
    PART1_BYTES=$upper
    MID_BYTES=$(( lower - upper + 1048576 ))
    mid_max=$(( LIMIT - tree - 4096 ))
    if [ "$MID_BYTES" -gt "$mid_max" ]; then
      echo "cannot split into three parts: the middle part needs $MID_BYTES bytes (at most $mid_max)" >&2
      exit 1
    fi
  else
    PART1_BYTES=$(( (lower + upper) / 2 ))
  fi
fi
rm -rf .gpu-data-mid
head -c "$PART1_BYTES" "$XZ" > .gpu-data1/smollm2.gguf.xz.part1
if [ "$MID_BYTES" -gt 0 ]; then
  mkdir -p .gpu-data-mid
  dd if="$XZ" of=.gpu-data-mid/smollm2.gguf.xz.mid bs=1M iflag=skip_bytes,count_bytes skip="$PART1_BYTES" \
    count="$MID_BYTES" status=none
fi
tail -c +"$((PART1_BYTES + MID_BYTES + 1))" "$XZ" > .gpu-data/smollm2.gguf.xz.part2
{
  echo "# sha256  file   (quality_gpu.sh checks these; smollm2.gguf = xz -d of part1 + part2)"
  echo "$gguf_sha  smollm2.gguf"
  sha256sum .gpu-data1/smollm2.gguf.xz.part1 | awk '{print $1"  smollm2.gguf.xz.part1"}'
  sha256sum .gpu-data/smollm2.gguf.xz.part2 | awk '{print $1"  smollm2.gguf.xz.part2"}'
  sha256sum "$WIKI" | awk '{print $1"  wiki.test.raw"}'
  sha256sum "$ENWIKI" | awk '{print $1"  enwiki-sample.txt"}'
} > .gpu-data/SHA256SUMS
cp .gpu-data/SHA256SUMS .gpu-data1/SHA256SUMS
cat .gpu-data/SHA256SUMS
ls -l .gpu-data1 .gpu-data .gpu-data/wheels
d1=$(du -sb .gpu-data1 | cut -f1); d2=$(du -sb .gpu-data | cut -f1)
mib() { awk -v b="$1" 'BEGIN { printf "%.2f MiB", b / 1048576 }'; }
echo "part 1: $PART1_BYTES bytes (allowed $lower..$upper)"
echo "tree (tracked + untracked, not ignored): $(mib "$tree")"
echo "run 1: .gpu-data1 $(mib "$d1") + .gpu/{aot-stage,rt,wheels} $(mib "$gpu") + tree = $(mib $((d1 + gpu + tree))) (< 62 MiB)"
[ "$MID_BYTES" -gt 0 ] && echo "middle run: .gpu-data-mid $(mib "$MID_BYTES") + tree (< 62 MiB)"
echo "run 2: .gpu-data $(mib "$d2") + tree = $(mib $((d2 + tree))) (< 62 MiB)"
