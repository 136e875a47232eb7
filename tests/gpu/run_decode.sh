#!/usr/bin/env bash
# The compiled decode step on the H200: tests/gpu/test_decode_gpu.py, then `k3compile bench` on k3-mini.
#
#   here:   k3compile codegen --config k3_mini --tp 1 --package -o .gpu/mini     (any CPU machine)
#   there:  bash tests/gpu/run_decode.sh .gpu/mini            (STAGES="tests bench" by default)
set -uo pipefail
PKG=${1:-.gpu/mini}
source tests/gpu/setup.sh "$PKG"
export K3_DECODE_PACKAGE="$PKG"
status=0
if [[ " ${STAGES:-tests bench} " == *" tests "* ]]; then
    timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -m gpu tests/gpu/test_decode_gpu.py -p no:cacheprovider -s \
        -o faulthandler_timeout=300 -rf ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/decode_tests.log" | tail -n 40 || status=1
fi
if [[ " ${STAGES:-tests bench} " == *" bench "* ]]; then
    timeout "${BENCH_TIMEOUT:-400}" python3 -m k3compile.cli bench --config k3_mini --package "$PKG" \
        --json "$OUT/bench_mini.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_mini.log" | tail -n 40 || status=1
fi
exit $status
