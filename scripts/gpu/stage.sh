#!/usr/bin/env bash
# Prepare .gpu/ (ignored by git) for a GPU run in AOT mode: kernels compiled here, no DSL compiler there.
#   scripts/gpu/stage.sh [PATTERN]      e.g. 'smoke.*,prefill.*'   (default: every kernel)
# Then: device run with carry [".gpu"] and a command starting `source scripts/gpu/remote.sh;`.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
pattern="${1:-*}"
mkdir -p .gpu/rt .gpu/wheels
python -m futx build --out .gpu/aot --only "$pattern" --no-runtime
# Only the linked libraries travel; objects stay here.
rm -rf .gpu/aot-carry && mkdir -p .gpu/aot-carry/lib
cp .gpu/aot/manifest.json .gpu/aot-carry/
python - <<'PY'
import json, shutil
m = json.load(open(".gpu/aot/manifest.json"))
for e in m["entries"].values():
    shutil.copy(".gpu/aot/" + e["library"], ".gpu/aot-carry/" + e["library"])
PY
rt=$(python -c 'from futx.runtime.dsl_libs import installed_runtime_lib as f; print(f())')
ver=$(python -c 'from futx.runtime.dsl_libs import installed_dsl_version as f; print(f())')
if [ ! -s .gpu/rt/libcute_dsl_runtime.so.xz ] || [ "$(cat .gpu/rt/VERSION 2>/dev/null)" != "$ver" ]; then
  xz -T2 -6 -c "$rt" > .gpu/rt/libcute_dsl_runtime.so.xz && echo "$ver" > .gpu/rt/VERSION
fi
if ! ls .gpu/wheels/apache_tvm_ffi-*cp312*.whl >/dev/null 2>&1; then
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d .gpu/wheels "apache-tvm-ffi>=0.1.6,<0.2"
fi
# cuda-python's driver bindings (futx.hardware.cluster_slots), in case that machine's torch lacks them
if ! ls .gpu/wheels/cuda_bindings-*cp312*.whl >/dev/null 2>&1; then
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d .gpu/wheels "cuda-bindings>=13,<14" "cuda-pathfinder>=1.1,<2"
fi
rm -rf .gpu/aot-stage && mv .gpu/aot-carry .gpu/aot-stage
du -sh .gpu/aot-stage .gpu/rt .gpu/wheels
echo "tree that travels (tracked + untracked):"; git ls-files -co --exclude-standard | xargs du -cb 2>/dev/null | tail -1
