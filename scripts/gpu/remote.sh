# source scripts/gpu/remote.sh   -- on the GPU machine, in AOT mode: installs the TVM-FFI wheel, unpacks the
# DSL runtime library next to the staged kernels, and points futx at them. Safe to source twice.
_site="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
python3 -c 'import tvm_ffi' 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile .gpu/wheels/apache_tvm_ffi-*.whl
python3 -c 'import cuda.bindings.driver' 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile .gpu/wheels/cuda_*.whl
if [ ! -s .gpu/aot-stage/lib/libcute_dsl_runtime.so ]; then
  xz -d -c .gpu/rt/libcute_dsl_runtime.so.xz > .gpu/aot-stage/lib/libcute_dsl_runtime.so
  cp .gpu/rt/VERSION .gpu/aot-stage/lib/CUTE_DSL_RUNTIME_VERSION
fi
export FUTX_AOT_DIR="$PWD/.gpu/aot-stage" FUTX_KERNELS="${FUTX_KERNELS:-aot}" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
