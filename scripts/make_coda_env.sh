#!/usr/bin/env bash
# Builds .dsl-coda/ (git-ignored): the environment for the CODA rows of scripts/bench_swiglu.py on the GPU
# machine. coda-kernels 0.2 pins quack-kernels 0.6.1, which pins nvidia-cutlass-dsl 4.6.0, so CODA gets
# its own DSL bundle (made by ../shared/device/make-bundle in a scratch repo; .dsl/ stays 4.8.1), plus
# its pure-Python dependencies and a stand-in `ipdb` (imported by coda, unused at run time).
#   scripts/make_coda_env.sh            (a few minutes: xz of the DSL)
#   GPU: carry [".dsl-coda"], command: source .dsl-coda/prelude.sh; python3 scripts/bench_swiglu.py --only coda
set -euo pipefail
root="$(git rev-parse --show-toplevel)"; out="$root/.dsl-coda"
mkdir -p "$out/wheels" "$out/stub"
if ! ls "$out"/cutedsl-4.6.0-*.tar.xz >/dev/null 2>&1; then
  scratch="$(mktemp -d)"; trap 'rm -rf "$scratch"' EXIT
  (cd "$scratch" && git init -q . && bash "$root/../shared/device/make-bundle" 4.6.0 >/dev/null)
  cp "$scratch"/.dsl/cutedsl-4.6.0-*.tar.xz "$scratch"/.dsl/wheels/*.whl "$out/" 2>/dev/null || true
  mv "$out"/*.whl "$out/wheels/" 2>/dev/null || true
fi
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$out/wheels" \
  "coda-kernels==0.2" "quack-kernels==0.6.1" "flash-linear-attention==0.6.0" "fla-core==0.6.0" \
  "torch-c-dlpack-ext" "apache-tvm-ffi>=0.1.6,<0.2" "einops"
echo "def set_trace(*args, **kwargs):  # stand-in: coda imports ipdb for debugging only
    pass" > "$out/stub/ipdb.py"
# The DSL puts its packages on sys.path through a .pth file, which PYTHONPATH entries do not process:
echo "import site; site.addsitedir('/tmp/coda-site')  # process /tmp/coda-site/*.pth (the DSL's dsl_packages)" \
  > "$out/stub/sitecustomize.py"
cat > "$out/prelude.sh" <<'PRE'
# source .dsl-coda/prelude.sh -- GPU machine: CODA + DSL 4.6.0 into /tmp/coda-site (not the image's
# site-packages, so a futx DSL 4.8.1 install on the same machine is untouched), then PYTHONPATH.
_site=/tmp/coda-site
if [ ! -f "$_site/.futx-ready" ]; then
  mkdir -p "$_site" && tar -xJf .dsl-coda/cutedsl-4.6.0-*.tar.xz -C "$_site" || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$_site" .dsl-coda/wheels/*.whl || return 1
  touch "$_site/.futx-ready"
fi
export PYTHONPATH="$PWD/.dsl-coda/stub:$_site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
python3 -c 'import cutlass, torch, coda; print("coda env: cutlass", cutlass.__version__, "torch", torch.__version__, torch.cuda.get_device_name())'
PRE
du -sh "$out"; ls -la "$out" "$out/wheels"
