#!/usr/bin/env bash
# Every kernel of a prebuilt package against its float64 reference on the GPU host, in SHARDS processes side by
# side (`k3compile bench-kernels --check-only --shard I/N`: NaN-poisoned outputs, fresh random inputs, SEEDS
# checks per kernel, one for inputs over 512 MB), then one report per template. Run from the repository root
# with carry [".gpu", ".whl"]:
#
#   here:   k3compile codegen --config kimi_k3 --tp 8 --buckets 1,2,4,8,16,32,64 --package -o /tmp/p/k3tp8
#           (prune runtime/ and *.ptx, *.cubin); tar cJf .gpu/k3tp8.txz -C /tmp/p k3tp8
#   there:  bash tests/gpu/check_package.sh .gpu/k3tp8.txz
#
# A change to one template: `--templates NAME` keeps only its kernels (every TP and bucket given), `--skip-passed`
# the ones an earlier check passed.
#
# xz over the whole tar compresses a package about 8 x better than gzip (kernels of one template share most of
# their bytes: 306 kernels are 1.1 MB against 8.2), so the real config's 1,420 kernels fit one device call.
#
# Each shard stops at LIMIT seconds (default 500); what a cut-off shard did not reach is reported as not
# checked (its JSON is rewritten after every kernel). Results: $OUT/check_package.json and the shards' JSON and
# logs in $OUT/check_package_shards.tgz. Exit status 1 unless every kernel of the package passed. The shards share
# one GPU's memory: 14 on an 80 GB H100 ran out with the real config's TP 1 / 2 expert kernels (up to 4.6 GiB of
# inputs each), reported as not checked (out of memory), not as failed.
#
# DONE=earlier_shards.tgz (a check_package_shards.tgz of the same package, carried under .gpu/) goes on where an
# earlier run stopped: the kernels that passed there are skipped (`--skip-passed`), the rest are split over the
# shards, and the report merges both runs (a kernel in both counts as the later run says); this run's
# check_package_shards.tgz carries the earlier files too (as shard0_*), so it serves as DONE for the next run.
set -uo pipefail
TGZ=$1
OUT=${OUT:-/tmp/k3gpu}
SHARDS=${SHARDS:-8}
mkdir -p "$OUT" /tmp/cp
tar xf "$TGZ" -C /tmp/cp || exit 1
PKG=/tmp/cp/$(tar tf "$TGZ" | head -n 1 | cut -d/ -f1)
source tests/gpu/setup.sh "$PKG" > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
done_json=() skip=()
if [ -n "${DONE:-}" ]; then
    mkdir -p "$OUT/done" && tar xzf "$DONE" -C "$OUT/done" || exit 1
    done_json=("$OUT"/done/shard*.json)
    skip=(--skip-passed "${done_json[@]}")
fi
threads=$(( $(nproc) / SHARDS ))
for i in $(seq 1 "$SHARDS"); do
    OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 )) timeout "${LIMIT:-500}" python3 -m k3compile.cli bench-kernels \
        --package "$PKG" --check-only --seeds "${SEEDS:-2}" --shard "$i/$SHARDS" --json "$OUT/shard$i.json" \
        ${ONLY:+--only "$ONLY"} "${skip[@]}" > "$OUT/shard$i.log" 2>&1 &
done
wait
grep -h "^FAIL" "$OUT"/shard*.log | head -n 40
python3 -m k3compile.bench_kernels merge "$PKG" "$OUT/check_package.json" "${done_json[@]}" "$OUT"/shard*.json
status=$?
i=0
for f in "${done_json[@]}"; do i=$((i + 1)); mv "$f" "$OUT/shard0_$i.json"; done  # carried on for the next DONE
(cd "$OUT" && tar czf check_package_shards.tgz shard*.json shard*.log && rm -rf shard*.json shard*.log done)  # a device call returns 8 files
exit $status
