#!/usr/bin/env bash
# The GPU test entry point, run on the H200 host from the repository root (the device machine has torch,
# but neither the CuTe DSL compiler nor apache-tvm-ffi):
#
#   here:   k3compile codegen --examples --package -o .gpu/pkg      (any CPU machine, no GPU needed)
#           python -m pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl apache-tvm-ffi
#   there:  bash tests/gpu/run.sh .gpu/pkg
#
# Sets up (tests/gpu/setup.sh), then runs the kernel GPU tests (`pytest -m gpu`, with
# timeouts) and `k3compile bench-kernels`; logs and JSON go to $OUT (default /tmp/k3gpu).
set -uo pipefail
PKG=${1:-.gpu/pkg}
source tests/gpu/setup.sh "$PKG"
export K3_KERNEL_PACKAGE="$PKG"
status=0
timeout 120 python3 tests/gpu/smoke.py "$PKG" 2>&1 | tee "$OUT/smoke.log" || { echo "smoke failed: stopping"; exit 1; }
for t in ${TEMPLATES:-rms_norm residual_attn_res gemv moe kda mla}; do  # one process each: a hang costs one
    timeout "${TEST_TIMEOUT:-90}" python3 -m pytest -q -m gpu tests/gpu -k "$t" -p no:cacheprovider \
        --timeout 80 -o faulthandler_timeout=40 -rf 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -n 25 || status=1
done
timeout "${BENCH_TIMEOUT:-200}" python3 -m k3compile.cli bench-kernels --package "$PKG" \
    --json "$OUT/bench_kernels.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_kernels.log" | tail -n 80 || status=1
exit $status
