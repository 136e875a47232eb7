#!/usr/bin/env bash
# The compiled decode step on the H200: tests/gpu/test_decode_gpu.py and `k3compile verify` on the trained
# k3-mini, then `k3compile bench` on a random k3-mini (13 layers).
#
#   here (any CPU machine):
#     k3compile codegen --config checkpoints/k3_mini_text/config.json --tp 1 --max-context 4096 --package -o .gpu/text
#     k3compile codegen --config k3_mini --tp 1 --package -o .gpu/mini                  # for the bench stage
#     k3compile codegen --config slice:4 --tp 8 --buckets 1,16 --max-context 4096 --package -o .gpu/slice4tp8
#                                                                                       # for the shapes stage
#   there:
#     bash tests/gpu/run_decode.sh .gpu/text [.gpu/mini] [.gpu/slice4tp8]
#     (STAGES="tests verify bench" by default; "shapes" runs tests/gpu/test_real_shapes_gpu.py)
set -uo pipefail
PKG=${1:-.gpu/text}
BENCH_PKG=${2:-.gpu/mini}
SLICE_PKG=${3:-.gpu/slice4tp8}
STAGES=${STAGES:-tests verify bench}
pkgs=("$PKG")
[[ " $STAGES " == *" bench "* ]] && pkgs+=("$BENCH_PKG")
[[ " $STAGES " == *" shapes "* ]] && pkgs+=("$SLICE_PKG")
source tests/gpu/setup.sh "${pkgs[@]}"
export K3_DECODE_PACKAGE="$PKG" K3_SLICE_PACKAGE="$SLICE_PKG"
status=0
if [[ " $STAGES " == *" tests "* ]]; then
    timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -m gpu tests/gpu/test_decode_gpu.py -p no:cacheprovider -s \
        -o faulthandler_timeout=300 -rf ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/decode_tests.log" | tail -n 40 || status=1
fi
if [[ " $STAGES " == *" shapes "* ]]; then
    timeout "${SHAPES_TIMEOUT:-420}" python3 -m pytest -q -m gpu tests/gpu/test_real_shapes_gpu.py -p no:cacheprovider -s \
        -o faulthandler_timeout=300 -rf 2>&1 | tee "$OUT/shapes_tests.log" | tail -n 40 || status=1
fi
if [[ " $STAGES " == *" verify "* ]]; then
    timeout "${VERIFY_TIMEOUT:-400}" python3 -m k3compile.cli verify --kernels "package:$PKG" --buckets 1,4,8 \
        --steps "${VERIFY_STEPS:-1000}" --bench --report "$OUT/verify.md" --json "$OUT/verify.json" 2>&1 \
        | grep -v "^DEBUG" | tail -n 30 || status=1
fi
if [[ " $STAGES " == *" bench "* ]]; then
    timeout "${BENCH_TIMEOUT:-400}" python3 -m k3compile.cli bench --config k3_mini --package "$BENCH_PKG" \
        --json "$OUT/bench_mini.json" --png "$OUT/bench_mini.png" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_mini.log" | tail -n 40 || status=1
fi
exit $status
