#!/usr/bin/env bash
# Every kernel of a prebuilt package against its float64 reference on the GPU host, in SHARDS processes side by
# side (`k3compile bench-kernels --check-only --shard I/N`: NaN-poisoned outputs, fresh random inputs, SEEDS
# checks per kernel, one for inputs over 512 MB), then one report per template. Run from the repository root
# with carry [".gpu", ".whl"]:
#
#   here:   k3compile codegen --config kimi_k3 --tp 8 --buckets 1,2,4,8,16,32,64 --package -o /tmp/p/k3tp8
#           (prune runtime/*.ptx, *.cubin); tar czf .gpu/k3tp8.tgz -C /tmp/p k3tp8
#   there:  bash tests/gpu/check_package.sh .gpu/k3tp8.tgz
#
# Each shard stops at LIMIT seconds (default 500); what a cut-off shard did not reach is reported as not
# checked (its JSON is rewritten after every kernel). Results: $OUT/check_package.json, the shards' JSON and logs.
set -uo pipefail
TGZ=$1
OUT=${OUT:-/tmp/k3gpu}
SHARDS=${SHARDS:-8}
mkdir -p "$OUT" /tmp/cp
tar xzf "$TGZ" -C /tmp/cp || exit 1
PKG=/tmp/cp/$(tar tzf "$TGZ" | head -n 1 | cut -d/ -f1)
source tests/gpu/setup.sh "$PKG" > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
threads=$(( $(nproc) / SHARDS ))
for i in $(seq 1 "$SHARDS"); do
    OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 )) timeout "${LIMIT:-500}" python3 -m k3compile.cli bench-kernels \
        --package "$PKG" --check-only --seeds "${SEEDS:-2}" --shard "$i/$SHARDS" --json "$OUT/shard$i.json" \
        ${ONLY:+--only "$ONLY"} > "$OUT/shard$i.log" 2>&1 &
done
wait
grep -h "^FAIL" "$OUT"/shard*.log | head -n 40
python3 -m k3compile.bench_kernels merge "$PKG" "$OUT/check_package.json" "$OUT"/shard*.json
