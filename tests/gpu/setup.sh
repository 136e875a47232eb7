# Sourced by the GPU entry points on the H200 host (which has torch, but neither the CuTe DSL compiler nor
# apache-tvm-ffi): installs tvm-ffi from .whl/ and k3compile itself without dependencies, and restores the
# CuTe DSL runtime library into the package $1 if it travelled gzipped (.gpu/libcute_dsl_runtime.so.gz).
OUT=${OUT:-/tmp/k3gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q -e . --no-deps --no-build-isolation >/dev/null 2>&1 || { echo "installing k3compile failed"; exit 1; }
for pkg in "$@"; do
    if [ ! -f "$pkg/runtime/libcute_dsl_runtime.so" ]; then
        mkdir -p "$pkg/runtime" && gunzip -c .gpu/libcute_dsl_runtime.so.gz > "$pkg/runtime/libcute_dsl_runtime.so" || exit 1
    fi
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
