"""Residual add + AttnRes read + RMSNorm of decode rows ([M, D] bf16), one CTA per token row.

Per row m, in this order (each step a compile-time option):

1. ``new_prefix = prefix + a`` (ADD; ``a`` is a GEMM output / all-reduced partial). Rounded to bf16 as
   torch rounds ``bf16 + bf16`` and written out. Without HAS_PREFIX, ``new_prefix = a``; without ADD
   there is no ``a`` and the prefix is read as is.
2. The AttnRes read (K3 §1.10) over the NB + 1 sources ``[blocks[m, 0..NB-1], new_prefix[m]]``:
   ``logit_s = rsqrt(mean(v_s^2) + EPS) * <v_s, norm_w * proj_w>`` (the key normalisation is a per-source
   scalar, so it factors out of the dot product), ``alpha = softmax(logit)``,
   ``out = bf16(sum_s alpha_s * v_s)`` with raw (unnormalised) values. With NB = 0, ``out = prefix``.
3. OUT_NORM: ``y = bf16(bf16(out * rsqrt(mean(out^2) + OUT_EPS)) * out_w)`` (KimiRMSNorm); else ``y = out``.

Threads: each thread owns VEC = 8 consecutive elements per step (one 128-bit load), STEPS = D / (8 *
THREADS) steps per row. Pass 1 forms the new prefix (kept in registers as fp32) and accumulates, per
thread, the NB + 1 sums of squares and NB + 1 dot products with the folded weight in registers; ONE block
reduction of that 2 (NB + 1)-vector (warp butterflies, a [WARPS, NSTAT] shared array, a second butterfly)
gives every thread all logits, so each thread computes the softmax itself. Pass 2 re-reads the blocks
(L1/L2 resident: a row is at most 14 KB) and mixes them; with OUT_NORM the mixed row stays in registers for
one more block reduction (its sum of squares) and the normalised store.

TP > 1: step 1 first all-reduces ``a`` in-kernel (one-shot, peer loads over NVLink, no multicast). Each
CTA copies its row of ``a`` into this rank's symmetric buffer ``comm``; thread 0 raises the row's channel-0
epoch flag (``fence.acq_rel.sys`` + ``atom.add.release.sys``) and warp 0 spins (``ld.acquire.sys``, lane p
on rank p's flag, all ranks' loads in flight at once) until every rank's channel-0 flag has reached the same
epoch; the CTA then sums the row over the ranks' buffers in rank
order (so every rank gets bit-identical sums). After those reads thread 0 raises channel 1, and before the
kernel ends it waits for every rank's channel 1: no rank overwrites its buffer (next call) while a peer
still reads it. Epoch counters only grow, so replays of a CUDA graph need no reset and a stale flag never
passes a wait (comparisons are on the wrapped int32 difference).

Static weights (norm_w * proj_w, out_w) are loaded before ``griddepcontrol_wait``; activations after it.
``__call__`` takes the tensors in the order of the template's ``args()`` (absent ones are not passed) and
hands the kernel a fixed list where absent tensors are ``None``; the kernel never touches them (its
branches are ``const_expr`` on the same flags).
"""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

# >>> constants
# (example values: rendering replaces this block)
M = 2  # rows (the batch bucket)
D = 256  # row length (hidden size)
NB = 2  # sealed blocks read by AttnRes (0: out = prefix)
ADD = True  # new_prefix = prefix + a (written out)
HAS_PREFIX = True  # a prefix is read (else new_prefix = a)
OUT_NORM = True  # y = RMSNorm(out) (else y = out)
EPS = 1e-05  # AttnRes key-norm epsilon
OUT_EPS = 1e-05  # output RMSNorm epsilon
THREADS = 32  # threads per CTA (one row per CTA)
TP = 1  # ranks whose a rows are summed in-kernel (one-shot all-reduce; 1: a as is)
# <<< constants

VEC = 8  # bf16 elements per 128-bit access
WARPS = THREADS // 32
STEPS = D // (VEC * THREADS)
NSRC = NB + 1  # AttnRes sources: the sealed blocks, then the prefix
NSTAT = 2 * NSRC  # per source: sum of squares [0, NSRC), dot with the folded weight [NSRC, 2 NSRC)
MAX_TP = 16
# Kernel arguments in call order (the template's args(), then the stream).
ARG_NAMES = ((["a"] if ADD else []) + (["prefix"] if HAS_PREFIX else []) + (["blocks"] if NB > 0 else [])
             + (["norm_weight", "proj_weight"] if NB > 0 else []) + (["out_norm_weight"] if OUT_NORM else [])
             + ["y"] + (["new_prefix"] if ADD else [])
             + (["comm", "signal"] + [f"peer{p}" for p in range(TP)] + [f"peer_signal{p}" for p in range(TP)]
                if TP > 1 else []))


@cute.jit
def block_sum(rVals: cute.Tensor, sRed: cute.Tensor, n: cutlass.Constexpr[int]):
    """Sum each of the n fp32 entries of rVals over the CTA; every thread gets the totals in rVals.

    A warp butterfly per entry, lane 0 of each warp stores its partials in sRed [WARPS, n], then lane w
    of every warp reads warp w's partials and a second butterfly sums them (no second barrier)."""
    for j in cutlass.range_constexpr(n):
        rVals[j] = cute.arch.warp_reduction(rVals[j], operator.add)
    if cutlass.const_expr(WARPS > 1):
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()  # a warp-wide shuffle: never call it from a divergent branch (deadlock)
        if lane == 0:
            for j in cutlass.range_constexpr(n):
                sRed[warp, j] = rVals[j]
        cute.arch.sync_threads()
        for j in cutlass.range_constexpr(n):
            rVals[j] = Float32(0.0)
        if lane < WARPS:
            for j in cutlass.range_constexpr(n):
                rVals[j] = sRed[lane, j]
        for j in cutlass.range_constexpr(n):
            rVals[j] = cute.arch.warp_reduction(rVals[j], operator.add)


@cute.jit
def rms_scale(sum_sq: Float32, eps: Float32) -> Float32:
    """rsqrt(mean(x^2) + eps) of a D-element row from its sum of squares."""
    return cute.math.rsqrt(sum_sq / Float32(D) + eps)


@cute.jit
def attn_res_alpha(rStat: cute.Tensor, rAlpha: cute.Tensor):
    """Softmax weights of the NSRC sources from the reduced statistics (rStat: sums of squares, then dots)."""
    for s in cutlass.range_constexpr(NSRC):
        rAlpha[s] = rStat[NSRC + s] * rms_scale(rStat[s], Float32(EPS))
    mx = rAlpha[0]
    for s in cutlass.range_constexpr(1, NSRC):
        mx = cute.arch.fmax(mx, rAlpha[s])
    den = Float32(0.0)
    for s in cutlass.range_constexpr(NSRC):
        rAlpha[s] = cute.math.exp(rAlpha[s] - mx)
        den = den + rAlpha[s]
    inv = Float32(1.0) / den
    for s in cutlass.range_constexpr(NSRC):
        rAlpha[s] = rAlpha[s] * inv


@cute.jit
def mix_sources(mRowBlocks: cute.Tensor, prefix, rAlpha: cute.Tensor, rIn: cute.Tensor, i) -> cute.TensorSSA:
    """bf16(sum_s alpha_s * v_s) of one VEC-chunk (index i): blocks re-read, the prefix from registers.
    Sources are summed in torch's order (blocks 0..NB-1, then the prefix)."""
    cute.autovec_copy(cute.local_tile(mRowBlocks[0, None], (VEC,), (i,)), rIn)
    acc = rIn.load().to(Float32) * rAlpha[0]
    for b in cutlass.range_constexpr(1, NB):
        cute.autovec_copy(cute.local_tile(mRowBlocks[b, None], (VEC,), (i,)), rIn)
        acc = acc + rIn.load().to(Float32) * rAlpha[b]
    return (acc + prefix * rAlpha[NB]).to(BFloat16)


@cute.jit
def raise_flag(mSignal: cute.Tensor, channel: int, row) -> cutlass.Int32:
    """Advance this rank's epoch flag (channel, row) with release semantics at system scope (every earlier
    write of the CTA is visible to a peer that acquires the new value); returns the new epoch."""
    cute.arch.fence_acq_rel_sys()
    old = cute.arch.atomic_add(mSignal.iterator + channel * M + row, cutlass.Int32(1), sem="release", scope="sys")
    return old + cutlass.Int32(1)


@cute.jit
def wait_flags(peerSignals: list, channel: int, row, epoch: cutlass.Int32):
    """Spin until every rank's flag (channel, row) has reached ``epoch`` (acquire, system scope). Called by
    one whole warp: lane p watches rank p, so the TP flag loads are in flight together (one round trip per
    poll, not TP); ``epoch`` is lane 0's. The warp leaves when every lane has seen its rank's epoch."""
    lane = cute.arch.lane_idx()
    want = cute.arch.shuffle_sync(epoch, 0)
    addr = (peerSignals[0].iterator + channel * M + row).toint()
    for p in cutlass.range_constexpr(1, TP):
        addr = cutlass.select_(lane == p, (peerSignals[p].iterator + channel * M + row).toint(), addr)
    ptr = cute.make_ptr(cutlass.Int32, addr, cute.AddressSpace.gmem, assumed_align=4)
    if lane < TP:
        seen = cute.arch.load(ptr, cutlass.Int32, sem="acquire", scope="sys")
        while seen - want < cutlass.Int32(0):
            seen = cute.arch.load(ptr, cutlass.Int32, sem="acquire", scope="sys")
    cute.arch.sync_warp()


class Kernel:
    @cute.jit
    def __call__(self, *args):
        t = dict(zip(ARG_NAMES, args[:-1]))
        peers = [t.get(f"peer{p}") for p in range(MAX_TP)]
        peer_signals = [t.get(f"peer_signal{p}") for p in range(MAX_TP)]
        self.kernel(t.get("a"), t.get("prefix"), t.get("blocks"), t.get("norm_weight"), t.get("proj_weight"),
                    t.get("out_norm_weight"), t["y"], t.get("new_prefix"), t.get("comm"), t.get("signal"),
                    *peers, *peer_signals).launch(grid=(M, 1, 1), block=(THREADS, 1, 1), stream=args[-1],
                                           use_pdl=True)

    @cute.kernel
    def kernel(self, mA, mPrefix, mBlocks, mNormW, mProjW, mOutW, mY: cute.Tensor, mNewPrefix, mComm, mSignal,
               mP0, mP1, mP2, mP3, mP4, mP5, mP6, mP7, mP8, mP9, mP10, mP11, mP12, mP13, mP14, mP15,
               mS0, mS1, mS2, mS3, mS4, mS5, mS6, mS7, mS8, mS9, mS10, mS11, mS12, mS13, mS14, mS15):
        tid = cute.arch.thread_idx()[0]
        row = cute.arch.block_idx()[0]
        smem = cutlass.utils.SmemAllocator()
        rIn = cute.make_rmem_tensor((VEC,), BFloat16)
        rIn2 = cute.make_rmem_tensor((VEC,), BFloat16)
        rOut = cute.make_rmem_tensor((VEC,), BFloat16)

        # Static weights, before the dependency wait: the folded AttnRes weight and the output norm weight.
        wMix = []
        wOut = []
        for s in cutlass.range_constexpr(STEPS):
            i = s * THREADS + tid
            if cutlass.const_expr(NB > 0):
                cute.autovec_copy(cute.local_tile(mNormW, (VEC,), (i,)), rIn)
                cute.autovec_copy(cute.local_tile(mProjW, (VEC,), (i,)), rIn2)
                wMix.append(rIn.load().to(Float32) * rIn2.load().to(Float32))  # exact: bf16 x bf16 fits fp32
            if cutlass.const_expr(OUT_NORM):
                cute.autovec_copy(cute.local_tile(mOutW, (VEC,), (i,)), rIn)
                wOut.append(rIn.load().to(Float32))
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()  # the next kernel may start its prologue now

        # The one-shot all-reduce of a (TP > 1): publish this rank's row, wait for every rank's.
        peers = [mP0, mP1, mP2, mP3, mP4, mP5, mP6, mP7, mP8, mP9, mP10, mP11, mP12, mP13, mP14, mP15][:TP]
        peerSignals = [mS0, mS1, mS2, mS3, mS4, mS5, mS6, mS7, mS8, mS9, mS10, mS11, mS12, mS13, mS14,
                       mS15][:TP]
        if cutlass.const_expr(TP > 1):
            for s in cutlass.range_constexpr(STEPS):
                i = s * THREADS + tid
                cute.autovec_copy(cute.local_tile(mA[row, None], (VEC,), (i,)), rIn)
                cute.autovec_copy(rIn, cute.local_tile(mComm[row, None], (VEC,), (i,)))
            cute.arch.sync_threads()
            if tid < 32:  # warp 0: thread 0 raises this rank's flag, the warp waits for every rank's
                epoch0 = cutlass.Int32(0)
                if tid == 0:
                    epoch0 = raise_flag(mSignal, 0, row)
                wait_flags(peerSignals, 0, row, epoch0)
            cute.arch.sync_threads()

        # Pass 1: new prefix (stored, kept in registers) and the per-source statistics.
        rStat = cute.make_rmem_tensor((NSTAT,), Float32)
        for j in cutlass.range_constexpr(NSTAT):
            rStat[j] = Float32(0.0)
        prefixVals = []
        for s in cutlass.range_constexpr(STEPS):
            i = s * THREADS + tid
            if cutlass.const_expr(ADD):
                if cutlass.const_expr(TP > 1):  # the ranks' rows, summed in rank order, rounded as bf16
                    cute.autovec_copy(cute.local_tile(peers[0][row, None], (VEC,), (i,)), rIn)
                    acc = rIn.load().to(Float32)
                    for p in cutlass.range_constexpr(1, TP):
                        cute.autovec_copy(cute.local_tile(peers[p][row, None], (VEC,), (i,)), rIn)
                        acc = acc + rIn.load().to(Float32)
                    rIn.store(acc.to(BFloat16))
                else:
                    cute.autovec_copy(cute.local_tile(mA[row, None], (VEC,), (i,)), rIn)
                if cutlass.const_expr(HAS_PREFIX):
                    cute.autovec_copy(cute.local_tile(mPrefix[row, None], (VEC,), (i,)), rIn2)
                    rOut.store((rIn.load().to(Float32) + rIn2.load().to(Float32)).to(BFloat16))
                else:
                    rOut.store(rIn.load())
                cute.autovec_copy(rOut, cute.local_tile(mNewPrefix[row, None], (VEC,), (i,)))
                prefixVals.append(rOut.load().to(Float32))
            else:
                cute.autovec_copy(cute.local_tile(mPrefix[row, None], (VEC,), (i,)), rIn)
                prefixVals.append(rIn.load().to(Float32))
            if cutlass.const_expr(NB > 0):
                p = prefixVals[s]
                rStat[NB] += (p * p).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
                rStat[NSRC + NB] += (p * wMix[s]).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
                for b in cutlass.range_constexpr(NB):
                    cute.autovec_copy(cute.local_tile(mBlocks[row, b, None], (VEC,), (i,)), rIn)
                    v = rIn.load().to(Float32)
                    rStat[b] += (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
                    rStat[NSRC + b] += (v * wMix[s]).reduce(cute.ReductionOp.ADD, Float32(0.0),
                                                            reduction_profile=0)

        epoch1 = cutlass.Int32(0)
        if cutlass.const_expr(TP > 1):  # done reading the peers' rows: say so now, wait for theirs at the end
            cute.arch.sync_threads()
            if tid == 0:
                epoch1 = raise_flag(mSignal, 1, row)

        # Softmax weights (every thread computes all of them from the reduced statistics).
        rAlpha = cute.make_rmem_tensor((NSRC,), Float32)
        if cutlass.const_expr(NB > 0):
            sStat = smem.allocate_tensor(Float32, cute.make_layout((WARPS, NSTAT)), 16)
            block_sum(rStat, sStat, NSTAT)
            attn_res_alpha(rStat, rAlpha)

        # Pass 2: mix the sources (blocks re-read), then store y or keep the row for the output norm.
        rSq = cute.make_rmem_tensor((1,), Float32)
        rSq[0] = Float32(0.0)
        outVals = []
        for s in cutlass.range_constexpr(STEPS):
            i = s * THREADS + tid
            if cutlass.const_expr(NB > 0):
                out = mix_sources(mBlocks[row, None, None], prefixVals[s], rAlpha, rIn, i)
            else:
                out = prefixVals[s].to(BFloat16)  # exact: the prefix is bf16
            if cutlass.const_expr(OUT_NORM):
                o = out.to(Float32)
                outVals.append(o)
                rSq[0] += (o * o).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
            else:
                rOut.store(out)
                cute.autovec_copy(rOut, cute.local_tile(mY[row, None], (VEC,), (i,)))

        if cutlass.const_expr(OUT_NORM):
            sSq = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 1)), 16)
            block_sum(rSq, sSq, 1)
            rstd = rms_scale(rSq[0], Float32(OUT_EPS))
            for s in cutlass.range_constexpr(STEPS):
                i = s * THREADS + tid
                normed = (outVals[s] * rstd).to(BFloat16)  # KimiRMSNorm rounds before the weight
                rOut.store((normed.to(Float32) * wOut[s]).to(BFloat16))
                cute.autovec_copy(rOut, cute.local_tile(mY[row, None], (VEC,), (i,)))
        if cutlass.const_expr(TP > 1):
            if tid < 32:
                wait_flags(peerSignals, 1, row, epoch1)
