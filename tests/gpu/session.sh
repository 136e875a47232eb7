#!/usr/bin/env bash
# One device call that checks and measures a change (the device budget is 30 min a session, 10 per call, and a
# cold start costs minutes): run on the GPU host after tests/gpu/ab_prepare.sh (with EXAMPLES=... for kernel
# tests) and, for the decode tests, .gpu/text.tgz (a pruned `k3compile codegen --config
# checkpoints/k3_mini_text/config.json --tp 1 --max-context 4096 --package` as textpkg/, tarred).
#
#   bash tests/gpu/session.sh [bench args for ab.sh]          (run with carry [".gpu", ".whl"])
#
# Stages, each under its own time limit, each writing its log into $OUT as soon as it ends (a stage that runs
# out of time loses only itself): kernels (tests/gpu/test_kernels_gpu.py on this tree's examples), decode
# (test_decode_gpu.py), shapes (test_real_shapes_gpu.py on this tree's slice package: buckets 1 and 16 must be
# in it), ab (ab.sh, ROUNDS rounds). STAGES picks some ("kernels decode shapes ab" by default); T_<STAGE> sets a
# limit in seconds. ONLY is passed to ab.sh (bench-kernels of those examples alone; unset: none are timed).
set -uo pipefail
OUT=${OUT:-/tmp/k3gpu}
mkdir -p "$OUT"
STAGES=${STAGES:-kernels decode shapes ab}
has() { [[ " $STAGES " == *" $1 "* ]]; }
rm -rf /tmp/ab_pk /tmp/tx && mkdir -p /tmp/ab_pk /tmp/tx
tar xzf .gpu/ab/new.tgz -C /tmp/ab_pk || { echo "session: run tests/gpu/ab_prepare.sh first"; exit 1; }
PKGS=(/tmp/ab_pk/new)
[ -d /tmp/ab_pk/new/examples ] && PKGS+=(/tmp/ab_pk/new/examples)
if has decode && [ -f .gpu/text.tgz ]; then tar xzf .gpu/text.tgz -C /tmp/tx && PKGS+=(/tmp/tx/textpkg); fi
source tests/gpu/setup.sh "${PKGS[@]}" > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
status=0
stage() {  # name, limit, command...: the command's output into $OUT/<name>.log, its last lines here
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    grep -E "passed|failed|error|VERIFIED|^  layer |^-- " "$OUT/$name.log" | tail -n 30
    [ $rc -eq 0 ] || { echo "   $name: rc $rc"; status=1; }
}
if has kernels && [ -d /tmp/ab_pk/new/examples ]; then
    K3_KERNEL_PACKAGE=/tmp/ab_pk/new/examples stage kernels "${T_KERNELS:-150}" python3 -m pytest -q -m gpu \
        tests/gpu/test_kernels_gpu.py -p no:cacheprovider --timeout 80 -rf
fi
if has decode && [ -d /tmp/tx/textpkg ]; then
    K3_DECODE_PACKAGE=/tmp/tx/textpkg stage decode "${T_DECODE:-150}" python3 -m pytest -q -m gpu \
        tests/gpu/test_decode_gpu.py -p no:cacheprovider -s -o faulthandler_timeout=140 -rf
fi
if has shapes; then
    K3_SLICE_PACKAGE=/tmp/ab_pk/new stage shapes "${T_SHAPES:-120}" python3 -m pytest -q -m gpu \
        tests/gpu/test_real_shapes_gpu.py -p no:cacheprovider -s -o faulthandler_timeout=110 -rf
fi
if has ab; then
    skip=0
    [ -n "${ONLY:-}" ] || skip=1
    stage ab "${T_AB:-300}" env ONLY="${ONLY:-}" SKIP_KERNELS=$skip ROUNDS="${ROUNDS:-2}" \
        BENCH_TIMEOUT="${BENCH_TIMEOUT:-90}" bash tests/gpu/ab.sh "$@"
    [ -f "$OUT/ab.tgz" ] || tar czf "$OUT/ab.tgz" -C /tmp ab_results 2>/dev/null  # what a cut-off A/B left
fi
exit $status
