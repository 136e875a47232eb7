#!/usr/bin/env bash
# The GPU test entry point, run on the H200 host from the repository root (the device machine has torch,
# but neither the CuTe DSL compiler nor apache-tvm-ffi):
#
#   here:   k3compile codegen --examples --package -o .gpu/pkg      (any CPU machine, no GPU needed)
#           python -m pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl apache-tvm-ffi
#   there:  bash tests/gpu/run.sh .gpu/pkg
#
# Installs tvm-ffi from .whl/, k3compile itself without dependencies, restores the package's runtime library
# if it travelled gzipped (.gpu/libcute_dsl_runtime.so.gz), then runs the GPU tests (`pytest -m gpu`, with
# timeouts) and `k3compile bench-kernels`; logs and JSON go to $OUT (default /tmp/k3gpu).
set -uo pipefail
PKG=${1:-.gpu/pkg}
OUT=${OUT:-/tmp/k3gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q -e . --no-deps --no-build-isolation >/dev/null 2>&1 || { echo "installing k3compile failed"; exit 1; }
if [ ! -f "$PKG/runtime/libcute_dsl_runtime.so" ]; then
    mkdir -p "$PKG/runtime" && gunzip -c .gpu/libcute_dsl_runtime.so.gz > "$PKG/runtime/libcute_dsl_runtime.so" || exit 1
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
export K3_KERNEL_PACKAGE="$PKG" PYTHONUNBUFFERED=1
status=0
timeout 120 python3 tests/gpu/smoke.py "$PKG" 2>&1 | tee "$OUT/smoke.log" || { echo "smoke failed: stopping"; exit 1; }
for t in ${TEMPLATES:-rms_norm residual_attn_res gemv moe kda mla}; do  # one process each: a hang costs one
    timeout "${TEST_TIMEOUT:-90}" python3 -m pytest -q -m gpu tests/gpu -k "$t" -p no:cacheprovider \
        --timeout 80 -o faulthandler_timeout=40 -rf 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -n 25 || status=1
done
timeout "${BENCH_TIMEOUT:-200}" python3 -m k3compile.cli bench-kernels --package "$PKG" \
    --json "$OUT/bench_kernels.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_kernels.log" | tail -n 80 || status=1
exit $status
