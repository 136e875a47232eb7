#!/usr/bin/env bash
# Issue #6's table in one device call: the real-shape slice (rank 0's TP8 shard; per-rank compute,
# communication excluded), k3compile beside the PyTorch baselines, each stage under its own time limit, each
# writing its JSON after every row (a stage cut off keeps the rows it finished). Build the package here first:
#
#   k3compile codegen --config slice:4 --tp 8 --buckets 1,2,4,8,16,32,64 --max-context 32768 --package -o /tmp/p/sweep
#   gzip -9 -c /tmp/p/sweep/runtime/libcute_dsl_runtime.so > .gpu/libcute_dsl_runtime.so.gz
#   rm -rf /tmp/p/sweep/runtime; find /tmp/p/sweep \( -name kernel.ptx -o -name kernel.cubin \) -delete
#   tar cJf .gpu/sweep.txz -C /tmp/p sweep      (and .whl/ as tests/gpu/ab_prepare.sh fetches it)
#
# then on the GPU host, with carry [".gpu", ".whl"]:  bash tests/gpu/table.sh
#
# Stages (STAGES picks some; T_<STAGE> seconds each): table (every bucket at context 1k, layers 2, 3, 4: KDA +
# MoE and MLA + MoE by differencing; k3compile and eager with bf16 experts in a CUDA graph, #6's fastest
# PyTorch at batches 8 and 64), inductor (torch.compile replayed from a CUDA graph beside k3compile at
# INDUCTOR_BUCKETS, default 1: an Inductor compile per row takes minutes), eager (eager MXFP4 and bf16, in
# and out of a CUDA graph, at 1, 8, 64), long (k3compile at context 32k, layers 3, 4). Results: $OUT/*.json
# and logs.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/k3gpu}
STAGES=${STAGES:-table inductor long}
mkdir -p "$OUT" /tmp/table
tar xf .gpu/sweep.txz -C /tmp/table || { echo "table: build .gpu/sweep.txz first (see the header)"; exit 1; }
source tests/gpu/setup.sh /tmp/table/sweep > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
B=(python3 -m k3compile.cli bench --config slice --tp 8 --package /tmp/table/sweep)
ALL=1,2,4,8,16,32,64
status=0
stage() {  # name, limit, bench arguments: JSON and log into $OUT, the per-layer lines here
    local name=$1 limit=$2
    shift 2
    [[ " $STAGES " == *" $name "* ]] || return 0
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "${B[@]}" "$@" --json "$OUT/bench_$name.json" > "$OUT/$name.log" 2>&1
    local rc=$?
    grep -E "^  layer |INVALID|MISMATCH|BELOW" "$OUT/$name.log" | head -n 40
    [ $rc -eq 0 ] || { echo "   $name: rc $rc"; status=1; }
}
stage table "${T_TABLE:-270}" --buckets "$ALL" --layers 2,3,4 --context 1024 --systems k3compile,eager-bf16-graph
stage inductor "${T_INDUCTOR:-190}" --buckets "${INDUCTOR_BUCKETS:-1}" --layers 2,3,4 --context 1024 \
    --systems k3compile,inductor-graph
stage eager "${T_EAGER:-150}" --buckets 1,8,64 --layers 2,3,4 --context 1024 \
    --systems k3compile,eager,eager-bf16,eager-graph,eager-bf16-graph
stage long "${T_LONG:-100}" --buckets "$ALL" --layers 3,4 --context 32000 --systems k3compile
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
exit $status
