#!/usr/bin/env bash
# Real tensor parallelism on a multi-GPU H200 host (issue #9): the multigpu tests, the fused all-reduce at
# real K3 width, and `k3compile bench` with real communication against NCCL + separate kernels.
#
#   here (any CPU machine; N = GPUs there):
#     k3compile codegen --config checkpoints/k3_mini_text/config.json --tp N --max-context 4096 --package -o .gpu/textN
#     k3compile codegen --config checkpoints/k3_mini_text/config.json --tp 1 --buckets 1,4 --max-context 4096 --package -o .gpu/text
#     for L in 1 2; do k3compile codegen --config slice:$L --tp N --buckets 1,8,64 --max-context 4096 --package -o .gpu/sliceN_$L; done
#   there:
#     bash tests/gpu/run_tp.sh N        (STAGES="allreduce tests bench" by default; results in $OUT)
set -uo pipefail
N=${1:-2}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast off
source tests/gpu/setup.sh .gpu/text$N .gpu/text .gpu/slice${N}_1 .gpu/slice${N}_2
export K3_TP_PACKAGE=.gpu/text$N K3_DECODE_PACKAGE=.gpu/text K3_TP_RESULTS=$OUT
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
status=0
STAGES=${STAGES:-allreduce tests bench}
python3 -c "import torch; print('torch', torch.__version__, 'GPUs', torch.cuda.device_count())"
if [[ " $STAGES " == *" allreduce "* ]]; then  # the fused all-reduce at K3's width (hidden 7168)
    timeout "${ALLREDUCE_TIMEOUT:-150}" python3 -m torch.distributed.run --standalone --nproc-per-node=$N \
        tests/gpu/tp_worker.py allreduce --package .gpu/slice${N}_2 --replays 1000 --out "$OUT/tp${N}_allreduce_k3.json" \
        2>&1 | tail -n 40 > "$OUT/tp${N}_allreduce_k3.log"; rc=$?; tail -n 15 "$OUT/tp${N}_allreduce_k3.log"
    [ -s "$OUT/tp${N}_allreduce_k3.json" ] || status=1
fi
if [[ " $STAGES " == *" tests "* ]]; then
    timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -m multigpu tests/gpu/test_tp_gpu.py -p no:cacheprovider -rf \
        2>&1 | tail -n 60 | tee "$OUT/tp_tests.log" || status=1
fi
if [[ " $STAGES " == *" bench "* ]]; then
    timeout "${BENCH_TIMEOUT:-240}" python3 -m torch.distributed.run --standalone --nproc-per-node=$N -m k3compile.cli \
        bench --config slice --layers 1,2 --tp $N --buckets 1,8,64 --package ".gpu/slice${N}_{layers}" \
        --systems k3compile,k3compile-nccl,eager --steps 20 --json "$OUT/bench_tp${N}.json" --png "$OUT/bench_tp${N}.png" \
        2>&1 | grep -v "^DEBUG" | tail -n 40 || status=1
    timeout "${BENCH_TIMEOUT:-240}" python3 -m k3compile.cli bench --config slice --layers 1,2 --tp $N --buckets 1,8,64 \
        --package ".gpu/slice${N}_{layers}" --systems k3compile --steps 20 --json "$OUT/bench_tp${N}_emulated.json" \
        --png "$OUT/bench_tp${N}_emulated.png" 2>&1 | grep -v "^DEBUG" | tail -n 20 || status=1
fi
exit $status
