"""Skinny GEMM for decode: y[m, n] = sum_k xin[m, k] * W[n, k] for a batch of M <= 64 rows.

W is bf16 [N, K] row-major (K contiguous) and is the only large operand: the kernel is a weight stream.
xin is formed on the fly from tiny, L2-resident activations by the prologue PRO:

* ``none``:     xin = x                                                        (x [M, K] bf16)
* ``rms_norm``: xin = bf16(bf16(x * rsqrt(mean(x^2) + EPS)) * norm_weight)    (KimiRMSNorm of x)
* ``situ``:     xin = bf16(BETA*tanh(g/BETA)*sigmoid(g) * LINEAR_BETA*tanh(u/LINEAR_BETA))  (SiTU-GLU)

Outputs: rows n < N_F32 of W go to y_f32 [M, N_F32] unrounded (router / lm_head logits), rows
n >= N_F32 to y_bf16 [M, N - N_F32] rounded to bf16. An output with no rows is not an argument.
With SEGMENTS (a front GEMV over concatenated weights at M > 1, or any GEMV whose entries are written with
REPLICAS), y_bf16 holds consecutive compact [M, w] blocks, one per entry, instead of one row-major
[M, N - N_F32] array: a column slice of the latter is strided once M > 1, and every consumer would need a copy
(store_bf16 picks the block by a chain of selects).
With REPLICAS (TP > 1: an entry that is all-gathered after the kernel: the MoE front GEMV's router logits and
latent rows, the FFN tail's row-sharded up-projection) a block holds r copies side by side,
[M, r * w] with copy p at columns p * w, and F32_REPLICAS does the same for the fp32 output: the kernel writes
its rows into every rank's slot of the gathered layout. In single-GPU TP emulation that is the all-gather
(every rank's shard taken to equal this rank's) with no copy kernel after this one; real ranks hand one slot
to the collective.

Work split. A *task* is (a group of ROWS consecutive rows of W, a chunk of MB batch rows). One warp owns
one task at a time; the WARPS warps of a CTA take consecutive tasks and the GRID CTAs stride over all
tasks (the chunks of one row group sit next to each other, so their re-reads of the W rows hit L1/L2).
Per K step (256 elements; a last partial step when K is not a multiple of 256, done by the first
K % 256 / 8 lanes) every lane loads 8 consecutive bf16 of each of its ROWS weight rows (one 128-bit load each),
then, for each batch row of the chunk, 8 elements of xin, and accumulates ROWS x MB fp32 dot products
in registers. A warp butterfly reduces each accumulator once at the end; lane 0 writes the results.
No shared memory in the main loop and no CTA barrier after the prologue: warps retire independently.
Weight loads are marked L1 evict-first with a 256-byte L2 prefetch (activations stay in L1). Before the PDL
wait (weights are static, so that is safe while the previous kernel still runs; activations are only read
after the wait) each warp pulls weight rows into L2: with PREFETCH = 0 each lane the first UNROLL vectors
of its first task's rows; else, for every task of the warp, lane r the first PREFETCH bytes of row r in one
``cp.async.bulk.prefetch.L2``, and the template caps the grid to what is resident (and prefetching) at
once. Codegen sets PREFETCH where the kernel before this one moves few bytes (attention,
the residual kernel: their latency leaves HBM idle), so that much of the weight stream is already in L2
when the wait returns (``codegen._gemv_prefetch``).
For M <= 2 this is one warp per weight row streaming at the copy ceiling; for larger M the batch is
processed MB rows at a time so the accumulators (ROWS x MB) stay in registers without spilling.
HOLD (a grid of at most one CTA per SM where every warp has exactly one task of at most 16 vectors a lane:
the FFN tail's row-sharded latent up-projection, 896 x 3584 at TP 8, batch 1-4): the warp loads every
vector of its task's rows into registers before the PDL wait, so whole rows are in flight while the
previous kernel ends and the prologue runs. Such a grid leaves few warps per SM, and with UNROLL vectors in
flight a warp their bytes in flight, not HBM, set the rate (at batch 4 two rows per task halved the grid
to 56 CTAs: 11.4 us for a 2.2 us floor on the H100); with HOLD the template takes one row per task if that
is what fits.

RMSNorm prologue: before its tasks, each CTA computes rstd for all M batch rows, one row after another with
all of its threads (each sums the squares of its vectors of the row, loaded together; a warp butterfly, then
the warps' partial sums in warp order through shared memory), so the order does not depend on M.
With STAGE_X (a prologue, and the M x K bf16 xin fits in shared memory: batch 1 to 4) each CTA then forms
xin once into shared memory and the main loop reads it there: the prologue's per-element work is done once
per CTA instead of once per weight row (for SiTU-GLU an exp and two tanh per element), and GRID stays within
what shared memory lets be resident at once. Without it, xin is formed in every K step, and GRID is capped
for RMSNorm so that the redundant per-CTA statistics stay small next to the weight stream.
"""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

from k3compile.templates.kernels.dsmem_lib import ld_dsmem_f32
from k3compile.templates.kernels.mxfp4_lib import mma_bf16_16816

# >>> constants
# (example values: rendering replaces this block)
M = 2  # batch rows (the bucket)
N = 512  # rows of W (outputs per batch row)
K = 256  # reduction length (a multiple of 8)
N_F32 = 16  # the first N_F32 rows of W go to the fp32 output, the rest to the bf16 output
PRO = "rms_norm"  # prologue forming xin: none | rms_norm | situ
EPS = 1e-05  # RMSNorm epsilon (rms_norm prologue)
BETA = 4.0  # SiTU gate beta (situ prologue)
LINEAR_BETA = 25.0  # SiTU linear beta (situ prologue)
ROWS = 1  # weight rows per warp task
MB = 2  # batch rows per warp task (batch chunk)
WARPS = 8  # warps per CTA
UNROLL = 4  # K steps unrolled in the main loop (weight loads in flight per lane)
GRID = 32  # CTAs (they stride over the tasks)
MMA = False  # tensor cores (mma.sync; CTA = RT 16-row tiles, K split over the warps, cp.async ring of STAGES)
RT = 1  # tensor-core path: 16-row tiles of W per CTA
STAGES = 1  # tensor-core path: K stages (32 x WARPS elements each) in flight
SPLIT = 1  # tensor-core path: CTAs of a cluster splitting K (partial sums meet in distributed shared memory)
SEGMENTS = ()  # bf16 output as consecutive compact [M, w] blocks of these widths (() : one [M, n - n_f32] output)
REPLICAS = ()  # with SEGMENTS: copies of each block side by side ([M, r * w], copy p at columns p * w); () : one each
F32_REPLICAS = 1  # copies of the fp32 output side by side: y_f32 is [M, F32_REPLICAS * N_F32]
STAGE_X = True  # the prologue forms xin once per CTA into shared memory (M x K bf16), the main loop reads it there
PREFETCH = 0  # bytes of each weight row the warp owning it bulk-prefetches into L2 before the PDL wait (0: each warp the first vectors of its first task's rows)
HOLD = False  # one task per warp: its weight rows are loaded into registers before the PDL wait (whole rows in flight)
# <<< constants

VEC = 8  # bf16 per 128-bit load
THREADS = 32 * WARPS
KSTEPS = K // (32 * VEC)  # whole K steps of one warp (each covers 256 elements)
KTAIL = (K % (32 * VEC)) // VEC  # lanes with work in a last, partial K step (0: none)
NSTEPS = KSTEPS + (1 if KTAIL else 0)  # K steps of a task, the partial one included (HOLD: vectors a lane holds per row)
NV = K // VEC  # 8-element vectors of one activation row
VPT = (NV + THREADS - 1) // THREADS  # of them per thread when the CTA sums a row's squares
MCHUNKS = M // MB
TASKS = (N // ROWS) * MCHUNKS
HAS_F32 = N_F32 > 0
HAS_BF16 = N_F32 < N
TWO_ACTS = PRO != "none"  # rms_norm: (x, norm_weight); situ: (gate, up)
R = 16 * RT  # tensor-core path: rows of W per CTA
NT = M // 8  # tensor-core path: MMA column tiles of 8 batch rows (M is a multiple of 8 there)
KB = 32 * WARPS  # tensor-core path: K elements per ring stage (a 32-element slice per warp)
KST = (K + KB - 1) // KB  # tensor-core path: ring stages over K (the last may be partial: K % 128 == 0)
CPR = KB // VEC  # tensor-core path: 16-byte chunks of one row in a stage
KSP = KST // SPLIT  # tensor-core path: K stages of one CTA (its cluster rank's share of K)
REPS = REPLICAS if REPLICAS else (1,) * len(SEGMENTS)  # copies of each bf16 block
BLOCKS = tuple(w * r for w, r in zip(SEGMENTS, REPS))  # widths of the bf16 blocks as stored
NB_OUT = sum(BLOCKS) if SEGMENTS else N - N_F32  # columns of y_bf16
RMAX = max(REPS, default=1)


@dsl_user_op
def prefetch_l2(addr, size, *, loc=None, ip=None):
    """``cp.async.bulk.prefetch.L2.global``: pull ``size`` bytes (a multiple of 16) at global address ``addr``
    (16-byte aligned) into L2, asynchronously (a hint: nothing waits for it)."""
    llvm.inline_asm(res=None, operands_=[Int64(addr).ir_value(loc=loc, ip=ip), Int32(size).ir_value(loc=loc, ip=ip)],
                    asm_string="cp.async.bulk.prefetch.L2.global [$0], $1;", constraints="l,r",
                    has_side_effects=True, loc=loc, ip=ip)


class Kernel:
    # The argument list follows templates/gemv.py (Gemv.args): W, the activation(s), then the output(s)
    # that have rows. Exactly one of the four signatures below is this instance's __call__.
    if not TWO_ACTS and not (HAS_F32 and HAS_BF16):  # one activation, one output

        @cute.jit
        def __call__(self, mW: cute.Tensor, mX: cute.Tensor, mY: cute.Tensor, stream):
            if cutlass.const_expr(HAS_F32):
                self._launch(mW, mX, None, mY, None, stream)
            else:
                self._launch(mW, mX, None, None, mY, stream)

    elif not TWO_ACTS:  # both outputs

        @cute.jit
        def __call__(self, mW: cute.Tensor, mX: cute.Tensor, mYf: cute.Tensor, mYb: cute.Tensor, stream):
            self._launch(mW, mX, None, mYf, mYb, stream)

    elif not (HAS_F32 and HAS_BF16):  # two activations, one output

        @cute.jit
        def __call__(self, mW: cute.Tensor, mX: cute.Tensor, mAux: cute.Tensor, mY: cute.Tensor, stream):
            if cutlass.const_expr(HAS_F32):
                self._launch(mW, mX, mAux, mY, None, stream)
            else:
                self._launch(mW, mX, mAux, None, mY, stream)

    else:  # two activations, both outputs

        @cute.jit
        def __call__(self, mW: cute.Tensor, mX: cute.Tensor, mAux: cute.Tensor, mYf: cute.Tensor,
                     mYb: cute.Tensor, stream):
            self._launch(mW, mX, mAux, mYf, mYb, stream)

    @cute.jit
    def _launch(self, mW, mX, mAux, mYf, mYb, stream):
        """mX: x (none, rms_norm) or gate (situ); mAux: norm_weight (rms_norm), up (situ) or None."""
        # min_blocks_per_mp=1: lets ptxas use the registers it needs (left alone, it trims some variants to
        # 64 registers for occupancy and spills).
        if cutlass.const_expr(MMA):
            self.kernel_mma(cute.recast_tensor(mW, Uint32), cute.recast_tensor(mX, Uint32), mYf, mYb).launch(
                grid=(SPLIT, GRID, 1), block=(THREADS, 1, 1), cluster=(SPLIT, 1, 1) if SPLIT > 1 else None,
                stream=stream, use_pdl=True, min_blocks_per_mp=1)
        else:
            self.kernel(mW, mX, mAux, mYf, mYb).launch(grid=(GRID, 1, 1), block=(THREADS, 1, 1), stream=stream,
                                                        use_pdl=True, min_blocks_per_mp=1)

    @cute.jit
    def store_bf16(self, mYb: cute.Tensor, m, nb, total):
        """y_bf16 for batch row m, bf16 output column nb: at [m, nb], or with SEGMENTS in the compact [M, w]
        block of the segment holding nb (the blocks lie back to back), so each consumer of a segment gets a
        compact tensor rather than a strided column slice."""
        if cutlass.const_expr(len(SEGMENTS) == 0):
            mYb[m, nb] = total.to(BFloat16)
        else:
            flat = cute.make_tensor(mYb.iterator, cute.make_layout(M * NB_OUT))
            idx = m * BLOCKS[0] + nb
            width = Int32(SEGMENTS[0])  # a copy's stride in the block (with REPLICAS)
            reps = Int32(REPS[0])
            off = 0
            boff = 0
            for i in cutlass.range_constexpr(1, len(SEGMENTS)):  # unrolled at trace time
                off += SEGMENTS[i - 1]
                boff += BLOCKS[i - 1]
                idx = cutlass.select_(nb >= off, M * boff + m * BLOCKS[i] + (nb - off), idx)
                if cutlass.const_expr(RMAX > 1):
                    width = cutlass.select_(nb >= off, Int32(SEGMENTS[i]), width)
                    reps = cutlass.select_(nb >= off, Int32(REPS[i]), reps)
            v = total.to(BFloat16)
            flat[idx] = v
            for p in cutlass.range_constexpr(1, RMAX):
                if p < reps:
                    flat[idx + p * width] = v

    @cute.jit
    def store_f32(self, mYf: cute.Tensor, m, n, total):
        """y_f32 for batch row m, fp32 output column n: at [m, n], and with F32_REPLICAS at [m, p * N_F32 + n]
        for every copy p."""
        for p in cutlass.range_constexpr(F32_REPLICAS):
            mYf[m, p * N_F32 + n] = total

    @cute.jit
    def xin_math(self, rX, rAux, rNw, rstd, rXin):
        """xin of one 8-element vector from registers into rXin (fp32 holding bf16 values): rX the x (or gate)
        vector, rAux the up vector (situ), rNw the norm weight's (rms_norm), rstd the row's 1/rms (rms_norm)."""
        if cutlass.const_expr(PRO == "none"):
            rXin.store(rX.load().to(Float32))
        elif cutlass.const_expr(PRO == "rms_norm"):
            normed = (rX.load().to(Float32) * rstd).to(BFloat16)  # rounded before the weight
            rXin.store((normed.to(Float32) * rNw.load().to(Float32)).to(BFloat16).to(Float32))
        else:  # situ
            g = rX.load().to(Float32)
            u = rAux.load().to(Float32)
            sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-g, fastmath=True))
            act = Float32(BETA) * cute.math.tanh(g * Float32(1.0 / BETA), fastmath=True) * sig
            lin = Float32(LINEAR_BETA) * cute.math.tanh(u * Float32(1.0 / LINEAR_BETA), fastmath=True)
            rXin.store((act * lin).to(BFloat16).to(Float32))

    @cute.jit
    def k_step(self, kv, n0, m0, mW, mX, mAux, sRstd, sXin, wLoad, rW, rWf, rX, rAux, rNw, rXin, rAcc):
        """One K step of a task: this lane's 8-element vector ``kv`` (index along K) of each of the task's
        weight rows n0.., times xin of each batch row m0.. of the chunk (from sXin with STAGE_X), accumulated
        into rAcc."""
        for r in cutlass.range_constexpr(ROWS):
            cute.copy(wLoad, cute.local_tile(mW[n0 + r, None], (VEC,), (kv,)), rW[r])
        self.k_math(kv, m0, mX, mAux, sRstd, sXin, rW, rWf, rX, rAux, rNw, rXin, rAcc)

    @cute.jit
    def k_math(self, kv, m0, mX, mAux, sRstd, sXin, rW, rWf, rX, rAux, rNw, rXin, rAcc):
        """The math of a K step whose weight vectors (one per row of the task) are in ``rW``."""
        for r in cutlass.range_constexpr(ROWS):
            rWf[r].store(rW[r].load().to(Float32))
        if cutlass.const_expr(PRO == "rms_norm" and not STAGE_X):
            cute.autovec_copy(cute.local_tile(mAux, (VEC,), (kv,)), rNw)
        for b in cutlass.range_constexpr(MB):
            m = m0 + b
            if cutlass.const_expr(STAGE_X):  # formed by the prologue
                cute.autovec_copy(cute.local_tile(sXin[m, None], (VEC,), (kv,)), rX)
                rXin.store(rX.load().to(Float32))
            else:
                cute.autovec_copy(cute.local_tile(mX[m, None], (VEC,), (kv,)), rX)
                if cutlass.const_expr(PRO == "situ"):
                    cute.autovec_copy(cute.local_tile(mAux[m, None], (VEC,), (kv,)), rAux)
                self.xin_math(rX, rAux, rNw, sRstd[m] if PRO == "rms_norm" else None, rXin)
            for r in cutlass.range_constexpr(ROWS):
                a = rAcc[r * MB + b]
                for i in cutlass.range_constexpr(VEC):
                    a = a + rWf[r][i] * rXin[i]
                rAcc[r * MB + b] = a

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mX: cute.Tensor, mAux, mYf, mYb):
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        cta = cute.arch.block_idx()[0]

        # Weights are streamed: 128-bit loads that L1 evicts first (activations stay in L1), with a 256-byte
        # L2 prefetch (the next lanes' vectors of the same row).
        wLoad = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128,
                                    l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.EVICT_FIRST,
                                    l2_prefetch_size=cute.nvgpu.L2PrefetchSize.SIZE_256B)
        rW = [cute.make_rmem_tensor((VEC,), BFloat16) for _ in range(ROWS)]  # raw weight vectors
        rWf = [cute.make_rmem_tensor((VEC,), Float32) for _ in range(ROWS)]  # the same, widened
        rX = cute.make_rmem_tensor((VEC,), BFloat16)  # x, or gate (situ)
        rAux = cute.make_rmem_tensor((VEC,), BFloat16)  # up (situ)
        rNw = cute.make_rmem_tensor((VEC,), BFloat16)  # norm weight (rms_norm)
        rXin = cute.make_rmem_tensor((VEC,), Float32)  # xin of one batch row, 8 elements
        rAcc = cute.make_rmem_tensor((ROWS * MB,), Float32)  # per-lane partial dot products

        tid = cute.arch.thread_idx()[0]
        smem = cutlass.utils.SmemAllocator()
        sRstd = smem.allocate_tensor(Float32, cute.make_layout((M,)), 16)
        sPart = smem.allocate_tensor(Float32, cute.make_layout((M, WARPS), stride=(WARPS, 1)), 16)
        sXin = smem.allocate_tensor(BFloat16, cute.make_layout((M, K) if STAGE_X else (1, VEC), stride=(K, 1)), 16)

        # HOLD: the vectors of the warp's task, NSTEPS per weight row
        rHold = [[cute.make_rmem_tensor((VEC,), BFloat16) for _ in range(NSTEPS)] for _ in range(ROWS if HOLD else 0)]
        # Before waiting on the previous kernel: start pulling this warp's weight rows into L2 (HOLD: load them).
        if cutlass.const_expr(PREFETCH > 0):  # every task's rows: lane r the first PREFETCH bytes of row r
            for task in cutlass.range(cta * WARPS + warp, TASKS, GRID * WARPS, unroll=1):
                if lane < ROWS:
                    prefetch_l2(mW[(task // MCHUNKS) * ROWS + lane, None].iterator.toint(), Int32(PREFETCH))
        elif cutlass.const_expr(HOLD):  # the warp's one task: every vector of its rows, into registers
            first = cta * WARPS + warp
            if first < TASKS:
                for r in cutlass.range_constexpr(ROWS):
                    for s in cutlass.range_constexpr(KSTEPS):
                        cute.copy(wLoad, cute.local_tile(mW[(first // MCHUNKS) * ROWS + r, None], (VEC,),
                                                         (s * 32 + lane,)), rHold[r][s])
                    if cutlass.const_expr(KTAIL > 0):
                        if lane < KTAIL:
                            cute.copy(wLoad, cute.local_tile(mW[(first // MCHUNKS) * ROWS + r, None], (VEC,),
                                                             (KSTEPS * 32 + lane,)), rHold[r][KSTEPS])
        else:  # the first task's: each lane its first UNROLL vectors of each row
            first = cta * WARPS + warp
            if first < TASKS:
                for r in cutlass.range_constexpr(ROWS):
                    for s in cutlass.range_constexpr(UNROLL):
                        gW = cute.local_tile(mW[(first // MCHUNKS) * ROWS + r, None], (VEC,), (s * 32 + lane,))
                        cute.arch.prefetch(gW.iterator.llvm_ptr, cache_level="L2")

        # The CTA-wide prologue's registers (thread tid: vectors kv = tid + THREADS * i of a row); the staged
        # RMSNorm weight vectors, a weight, are loaded before the wait.
        rXs = [cute.make_rmem_tensor((VEC,), BFloat16) for _ in range(VPT)]  # x (or gate) vectors of one row
        rUs = [cute.make_rmem_tensor((VEC,), BFloat16) for _ in range(VPT)]  # up vectors (situ)
        rNws = [cute.make_rmem_tensor((VEC,), BFloat16) for _ in range(VPT)]  # norm weight vectors (rms_norm)
        if cutlass.const_expr(STAGE_X and PRO == "rms_norm"):
            for i in cutlass.range_constexpr(VPT):
                if tid + THREADS * i < NV:
                    cute.autovec_copy(cute.local_tile(mAux, (VEC,), (tid + THREADS * i,)), rNws[i])

        cute.arch.griddepcontrol_wait()  # everything below may read the previous kernel's activations
        cute.arch.griddepcontrol_launch_dependents()  # the next kernel may start its prologue now

        if cutlass.const_expr(PRO == "rms_norm"):
            # rstd of every batch row, one row at a time with the whole CTA: thread tid sums the squares of
            # vectors tid, tid + THREADS, ... (loaded together), then a warp butterfly and the warps in order.
            for m in cutlass.range(M, unroll=1):
                for i in cutlass.range_constexpr(VPT):
                    if tid + THREADS * i < NV:
                        cute.autovec_copy(cute.local_tile(mX[m, None], (VEC,), (tid + THREADS * i,)), rXs[i])
                ss = Float32(0.0)
                for i in cutlass.range_constexpr(VPT):
                    if tid + THREADS * i < NV:
                        v = rXs[i].load().to(Float32)
                        ss = ss + (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
                ss = cute.arch.warp_reduction(ss, operator.add)
                if lane == 0:
                    sPart[m, warp] = ss
            cute.arch.sync_threads()
            for m in cutlass.range(tid, M, THREADS, unroll=1):
                ss = Float32(0.0)
                for w in cutlass.range_constexpr(WARPS):
                    ss = ss + sPart[m, w]
                sRstd[m] = cute.math.rsqrt(ss / Float32(K) + Float32(EPS))
            cute.arch.sync_threads()
        if cutlass.const_expr(STAGE_X):  # xin of every batch row, once per CTA (thread tid: the same vectors)
            for m in cutlass.range(M, unroll=1):
                if cutlass.const_expr(not (PRO == "rms_norm" and M == 1)):  # (one row: rXs still holds it)
                    for i in cutlass.range_constexpr(VPT):
                        if tid + THREADS * i < NV:
                            cute.autovec_copy(cute.local_tile(mX[m, None], (VEC,), (tid + THREADS * i,)), rXs[i])
                            if cutlass.const_expr(PRO == "situ"):
                                cute.autovec_copy(cute.local_tile(mAux[m, None], (VEC,), (tid + THREADS * i,)),
                                                  rUs[i])
                for i in cutlass.range_constexpr(VPT):
                    if tid + THREADS * i < NV:
                        self.xin_math(rXs[i], rUs[i], rNws[i], sRstd[m] if PRO == "rms_norm" else None, rXin)
                        rX.store(rXin.load().to(BFloat16))
                        cute.autovec_copy(rX, cute.local_tile(sXin[m, None], (VEC,), (tid + THREADS * i,)))
            cute.arch.sync_threads()

        if cutlass.const_expr(HOLD):  # the one task, from the vectors loaded before the wait
            task = cta * WARPS + warp
            if task < TASKS:
                m0 = (task % MCHUNKS) * MB
                rAcc.fill(0.0)
                for s in cutlass.range_constexpr(KSTEPS):
                    self.k_math(s * 32 + lane, m0, mX, mAux, sRstd, sXin, [rHold[r][s] for r in range(ROWS)], rWf,
                                rX, rAux, rNw, rXin, rAcc)
                if cutlass.const_expr(KTAIL > 0):
                    if lane < KTAIL:
                        self.k_math(KSTEPS * 32 + lane, m0, mX, mAux, sRstd, sXin,
                                    [rHold[r][KSTEPS] for r in range(ROWS)], rWf, rX, rAux, rNw, rXin, rAcc)
                self.finish(task, rAcc, lane, mYf, mYb)
        else:
            for task in cutlass.range(cta * WARPS + warp, TASKS, GRID * WARPS):
                n0 = (task // MCHUNKS) * ROWS  # first weight row of the task
                m0 = (task % MCHUNKS) * MB  # first batch row of the task
                rAcc.fill(0.0)
                for s in cutlass.range(KSTEPS, unroll=UNROLL):
                    self.k_step(s * 32 + lane, n0, m0, mW, mX, mAux, sRstd, sXin, wLoad, rW, rWf, rX, rAux, rNw,
                                rXin, rAcc)
                if cutlass.const_expr(KTAIL > 0):  # K is not a multiple of 256: lanes past its end sit this one out
                    if lane < KTAIL:
                        self.k_step(KSTEPS * 32 + lane, n0, m0, mW, mX, mAux, sRstd, sXin, wLoad, rW, rWf, rX, rAux,
                                    rNw, rXin, rAcc)
                self.finish(task, rAcc, lane, mYf, mYb)

    @cute.jit
    def finish(self, task, rAcc, lane, mYf, mYb):
        """A task's outputs: each accumulator summed over the warp, written by lane 0."""
        n0 = (task // MCHUNKS) * ROWS
        m0 = (task % MCHUNKS) * MB
        for r in cutlass.range_constexpr(ROWS):
            for b in cutlass.range_constexpr(MB):
                total = cute.arch.warp_reduction(rAcc[r * MB + b], operator.add)
                if lane == 0:
                    self.store_out(mYf, mYb, m0 + b, n0 + r, total)

    @cute.jit
    def issue_stage(self, mWq: cute.Tensor, mXq: cute.Tensor, sW: cute.Tensor, sX: cute.Tensor, slot, kst, row0,
                    tid, weights: cutlass.Constexpr, acts: cutlass.Constexpr):
        """cp.async of K stage kst (elements KB * kst ..) into ring slot ``slot``: the CTA's R weight rows (rows
        past N repeat row N-1) and/or the M activation rows. A row's stage is CPR 16-byte chunks; thread tid
        copies chunk j = tid % CPR of rows tid // CPR + 8 i (THREADS = 8 CPR, so R / 8 and M / 8 rows each);
        chunk j lands in the 32-element slice j // 4 (warp j // 4 reads it), quarter j % 4. A partial last
        stage copies only the chunks before K."""
        big = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), Uint32,
                                  num_bits_per_copy=128)
        j = tid % CPR
        kc = kst * CPR + j  # this thread's 8-element chunk along K
        if kc < K // VEC:
            if cutlass.const_expr(weights):
                for i in cutlass.range_constexpr(R // 8):
                    row = tid // CPR + 8 * i
                    cute.copy(big, cute.local_tile(mWq[cutlass.min(row0 + row, N - 1), None], (4,), (kc,)),
                              cute.local_tile(sW[slot, j // 4, row, None], (4,), (j % 4,)))
            if cutlass.const_expr(acts):
                for i in cutlass.range_constexpr(M // 8):
                    row = tid // CPR + 8 * i
                    cute.copy(big, cute.local_tile(mXq[row, None], (4,), (kc,)),
                              cute.local_tile(sX[slot, j // 4, row, None], (4,), (j % 4,)))

    @cute.kernel
    def kernel_mma(self, mWq: cute.Tensor, mXq: cute.Tensor, mYf, mYb):
        """Tensor-core path (MMA): a CTA owns R = 16 RT rows of W (RT MMA row tiles, the MMA's M) for all M batch
        rows (NT column tiles of 8, the MMA's N); with SPLIT, the SPLIT CTAs of a cluster each take KSP = KST /
        SPLIT of the K stages for the same rows. K goes in stages of KB = 32 WARPS elements (CTA c from stage
        c * KSP / GRID of its share on, wrapping around) through a
        STAGES-deep cp.async ring in shared memory (weights and activations; every thread copies its share,
        one barrier per stage); warp w takes the stage's 32-element slice w, so each weight and activation
        element is read from shared memory once. In a slice, lane (g, t) reads elements 8t .. 8t+7 of rows g
        and g + 8 of each row tile and of batch row g of each column tile (one 128-bit load each; rows 64
        bytes apart, no bank conflicts); MMA i of the slice takes elements 8t + 4i .. 8t + 4i + 3 as its
        logical k (2t, 2t+1, 2t+8, 2t+9), a permutation of K that a dot product allows. A warp issues the
        MMAs of a column tile's two k-halves row tile by row tile, so no MMA waits for the one just before it
        (the accumulator is the same). The warps' partial sums meet in shared memory, in the ring's bytes once
        the K loop is done (so the ring is as deep as the shared memory allows, not less the reduction buffer);
        the output rows are written contiguously along N."""
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        tid = cute.arch.thread_idx()[0]
        rank = cute.arch.block_idx()[0]  # this CTA's share of K: stages k0 .. k0 + KSP - 1 (0 and all without SPLIT)
        cta = cute.arch.block_idx()[1]
        row0 = cta * R
        k0 = rank * KSP
        # Every CTA reads the same activations: starting all of them at K stage 0 would have ~GRID SMs fetch the
        # same few L2 lines at once. CTA c starts at stage c * KSP / GRID of its share instead and wraps around.
        rot = (cta * KSP) // GRID
        g = lane // 4
        t = lane % 4
        smem = cutlass.utils.SmemAllocator()
        # row-major: [slot, slice, row, 16 words]; a row's 32 elements of a slice are 64 contiguous bytes
        # the weight ring, then the activation ring, and once the K loop is done the warps' partial sums
        buf = smem.allocate_tensor(Uint32, cute.make_layout(max(STAGES * WARPS * (R + M) * 16, WARPS * M * R)), 16)
        sW = cute.make_tensor(buf.iterator, cute.make_layout((STAGES, WARPS, R, 16),
                                                             stride=(WARPS * R * 16, R * 16, 16, 1)))
        sX = cute.make_tensor(buf.iterator + STAGES * WARPS * R * 16,
                              cute.make_layout((STAGES, WARPS, M, 16), stride=(WARPS * M * 16, M * 16, 16, 1)))
        sRed = cute.make_tensor(cute.recast_ptr(buf.iterator, dtype=Float32),
                                cute.make_layout((WARPS, M, R), stride=(M * R, R, 1)))
        rA = cute.make_rmem_tensor((8 * RT,), Uint32)  # per row tile: rows g, g + 8 (4 words each)
        rB = cute.make_rmem_tensor((4,), Uint32)
        acc = cute.make_rmem_tensor((4 * RT * NT,), Float32)
        acc.fill(0.0)
        # Weights are static: their first stages may stream in while the previous kernel still runs, and with
        # PREFETCH the next PREFETCH bytes of each row (in the CTA's stage order, wrapping around its share of
        # K) into L2, thread r row r.
        for s in cutlass.range_constexpr(STAGES - 1):
            if s < KSP:
                self.issue_stage(mWq, mXq, sW, sX, s, k0 + (s + rot) % KSP, row0, tid, True, False)
        if cutlass.const_expr(PREFETCH > 0):
            if tid < R and row0 + tid < N:
                lo = k0 * KB  # the CTA's share of K, in elements: [lo, hi)
                hi = cutlass.min((k0 + KSP) * KB, K)
                start = lo + ((rot + STAGES - 1) % KSP) * KB
                first_len = cutlass.min(hi - start, PREFETCH // 2)
                row = mWq[row0 + tid, None].iterator.toint()  # (mWq: W's rows as 32-bit words)
                prefetch_l2(row + Int64(start) * 2, first_len * 2)
                wrap = cutlass.min(PREFETCH // 2 - first_len, start - lo)  # elements from the share's start
                if wrap > 0:
                    prefetch_l2(row + Int64(lo) * 2, wrap * 2)
        cute.arch.griddepcontrol_wait()  # the activations come from the previous kernel
        cute.arch.griddepcontrol_launch_dependents()  # the next kernel may start its prologue now
        for s in cutlass.range_constexpr(STAGES - 1):  # group s: stage s complete (with the weights above)
            if s < KSP:
                self.issue_stage(mWq, mXq, sW, sX, s, k0 + (s + rot) % KSP, row0, tid, False, True)
            cute.arch.cp_async_commit_group()
        for s in cutlass.range(KSP, unroll=1):
            cute.arch.cp_async_wait_group(STAGES - 2)  # stage s has landed (this thread's copies) ...
            cute.arch.sync_threads()  # ... and every thread's; the slot of stage s - 1 is free again
            nxt = s + STAGES - 1
            if nxt < KSP:
                self.issue_stage(mWq, mXq, sW, sX, nxt % STAGES, k0 + (nxt + rot) % KSP, row0, tid, True, True)
            cute.arch.cp_async_commit_group()
            slot = s % STAGES
            if (k0 + (s + rot) % KSP) * KB + 32 * warp < K:  # a partial last stage: its last warps have no slice
                for rt in cutlass.range_constexpr(RT):
                    for h in cutlass.range_constexpr(2):
                        cute.autovec_copy(cute.local_tile(sW[slot, warp, rt * 16 + g + 8 * h, None], (4,), (t,)),
                                          cute.local_tile(rA, (4,), (2 * rt + h,)))
                for nt in cutlass.range_constexpr(NT):
                    cute.autovec_copy(cute.local_tile(sX[slot, warp, nt * 8 + g, None], (4,), (t,)), rB)
                    for i in cutlass.range_constexpr(2):  # no MMA waits for the one just issued
                        for rt in cutlass.range_constexpr(RT):
                            a = 4 * (rt * NT + nt)
                            c = mma_bf16_16816((rA[8 * rt + 2 * i], rA[8 * rt + 4 + 2 * i], rA[8 * rt + 2 * i + 1],
                                                rA[8 * rt + 4 + 2 * i + 1]), (rB[2 * i], rB[2 * i + 1]),
                                               (acc[a], acc[a + 1], acc[a + 2], acc[a + 3]))
                            for j in cutlass.range_constexpr(4):
                                acc[a + j] = c[j]
        # C fragment of tile (rt, nt): rows rt*16 + g (+ 8 for j >= 2), batch rows nt*8 + 2t (+ 1 for odd j),
        # written over the weight ring once every warp is done reading it
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        for rt in cutlass.range_constexpr(RT):
            for nt in cutlass.range_constexpr(NT):
                for j in cutlass.range_constexpr(4):
                    sRed[warp, nt * 8 + 2 * t + j % 2, rt * 16 + g + 8 * (j // 2)] = acc[4 * (rt * NT + nt) + j]
        cute.arch.sync_threads()
        if cutlass.const_expr(SPLIT == 1):
            for idx in cutlass.range(tid, M * R, THREADS, unroll=1):  # consecutive threads: consecutive rows n
                m = idx // R
                r = idx % R
                if row0 + r < N:
                    total = Float32(0.0)
                    for w in cutlass.range_constexpr(WARPS):
                        total = total + sRed[w, m, r]
                    self.store_out(mYf, mYb, m, row0 + r, total)
        else:
            # The CTA's sums over its warps go to sRed[0] (each entry read and written by one thread); after a
            # cluster barrier (release / acquire) CTA q adds the SPLIT CTAs' entries of its share of the outputs
            # in rank order (DSMEM loads) and writes them; a second barrier keeps every CTA's shared memory alive
            # until the peers have read it.
            for idx in cutlass.range(tid, M * R, THREADS, unroll=1):
                m = idx // R
                r = idx % R
                total = Float32(0.0)
                for w in cutlass.range_constexpr(WARPS):
                    total = total + sRed[w, m, r]
                sRed[0, m, r] = total
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            base = sRed.iterator.toint()
            for idx in cutlass.range(rank * (M * R // SPLIT) + tid, (rank + 1) * (M * R // SPLIT), THREADS,
                                     unroll=1):
                m = idx // R
                r = idx % R
                if row0 + r < N:
                    total = ld_dsmem_f32(base + 4 * idx, 0)
                    for q in cutlass.range_constexpr(1, SPLIT):
                        total = total + ld_dsmem_f32(base + 4 * idx, q)
                    self.store_out(mYf, mYb, m, row0 + r, total)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def store_out(self, mYf, mYb, m, n, total):
        """Output n of batch row m: fp32 for n < N_F32, else bf16 (store_bf16)."""
        if cutlass.const_expr(not HAS_BF16):
            self.store_f32(mYf, m, n, total)
        elif cutlass.const_expr(not HAS_F32):
            self.store_bf16(mYb, m, n, total)
        else:
            if n < N_F32:
                self.store_f32(mYf, m, n, total)
            else:
                self.store_bf16(mYb, m, n - N_F32, total)
