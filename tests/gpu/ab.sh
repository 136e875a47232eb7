#!/usr/bin/env bash
# GPU side of a same-call A/B (prepared by tests/gpu/ab_prepare.sh): `k3compile bench` on this tree's package
# and on the other commit's (under its own wheel), ROUNDS times in alternating order, so that the spread
# between rounds of one package is seen beside the difference between packages.
#
#   bash tests/gpu/ab.sh [bench args]     default: --config slice --layers 2,3,4 --tp 8 --buckets 1,8,64
#                                                  --context 1024 --systems k3compile
#
# When ab_prepare.sh built examples packages (EXAMPLES=...), each round first times their kernels alone
# (`bench-kernels --seed 1`: the same inputs for both commits); ONLY (bench-kernels --only, e.g.
# "moe_gate_up,moe_down_combine") limits that to some of them: timing every gemv example with its torch
# baseline takes over 200 s per package; SKIP_KERNELS=1 skips it.
# Prints each run's per-layer lines; everything (JSON, logs) goes into one file, $OUT/ab.tgz (a device call
# returns few files). ROUNDS (default 2) and BENCH_TIMEOUT (seconds per bench, default 200) from the
# environment.
set -uo pipefail
ROOT=$(pwd)
AB=$ROOT/.gpu/ab
OUT=${OUT:-/tmp/k3gpu}
R=/tmp/ab_results
rm -rf "$R" /tmp/ab_pk /tmp/ab_oldsite && mkdir -p "$R" /tmp/ab_pk
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(--config slice --layers 2,3,4 --tp 8 --buckets 1,8,64 --context 1024 --systems k3compile)
tar xzf "$AB/new.tgz" -C /tmp/ab_pk && tar xzf "$AB/old.tgz" -C /tmp/ab_pk || { echo "ab: run ab_prepare.sh first"; exit 1; }
PKGS=(/tmp/ab_pk/new /tmp/ab_pk/old)
for w in new old; do [ -d "/tmp/ab_pk/$w/examples" ] && PKGS+=("/tmp/ab_pk/$w/examples"); done
source tests/gpu/setup.sh "${PKGS[@]}" > "$R/setup.log" 2>&1 || { cat "$R/setup.log"; exit 1; }
python3 -m pip install -q --no-deps --no-compile --target /tmp/ab_oldsite "$AB"/old_wheel/*.whl >> "$R/setup.log" 2>&1
echo "A/B: this tree against $(cut -c1-12 "$AB/REV"); bench ${ARGS[*]}"

side() {  # new|old, then a k3compile command line: this tree's code, or (from outside the checkout) the old wheel's
    local which=$1
    shift
    if [ "$which" = new ]; then
        timeout "${BENCH_TIMEOUT:-200}" python3 -m k3compile.cli "$@"
    else
        (cd /tmp && PYTHONPATH=/tmp/ab_oldsite:$PYTHONPATH timeout "${BENCH_TIMEOUT:-200}" python3 -m k3compile.cli "$@")
    fi
}

kernels() {  # which round: the examples alone, on the same inputs for both
    [ -d "/tmp/ab_pk/$1/examples" ] && [ "${SKIP_KERNELS:-0}" != 1 ] || return 0
    side "$1" bench-kernels --package "/tmp/ab_pk/$1/examples" --seeds 1 --seed 1 --json "$R/kernels_$1_$2.json" \
        ${ONLY:+--only "$ONLY"} > "$R/kernels_$1_$2.log" 2>&1
    echo "-- kernels alone, $1, round $2 (rc $?)"
    grep -E "^(example|[a-z_]+:k3tp8)" "$R/kernels_$1_$2.log" || tail -n 5 "$R/kernels_$1_$2.log"
}

bench() {  # which round
    side "$1" bench "${ARGS[@]}" --package "/tmp/ab_pk/$1" --json "$R/$1_$2.json" > "$R/$1_$2.log" 2>&1
    echo "-- $1, round $2 (rc $?)"
    grep -A12 "^per layer" "$R/$1_$2.log" | grep "^  layer " || tail -n 5 "$R/$1_$2.log"
}

for ((i = 1; i <= ${ROUNDS:-2}; i++)); do
    if ((i % 2)); then order=(new old); else order=(old new); fi
    for w in "${order[@]}"; do kernels "$w" "$i"; done
    for w in "${order[@]}"; do bench "$w" "$i"; done
done
tar czf "$OUT/ab.tgz" -C /tmp ab_results
echo "results: \$OUT/ab.tgz (ab_results/{new,old}_<round>.json: k3compile bench-plot JSON PNG --by-kernel)"
