"""Residual add + AttnRes read + RMSNorm of decode rows ([M, D] bf16), a cluster of CL CTAs per token row.

Per row m, in this order (each step a compile-time option):

1. ``new_prefix = prefix + a`` (ADD; ``a`` is a GEMM output / all-reduced partial). Rounded to bf16 as
   torch rounds ``bf16 + bf16`` and written out. Without HAS_PREFIX, ``new_prefix = a``; without ADD
   there is no ``a`` and the prefix is read as is. ADD_R first adds the FFN's up-projection output:
   ``a = bf16(r + a)`` (after the all-reduce of ``a``, as the eager ``r + all_reduce(partial)``).
2. The AttnRes read (K3 §1.10) over the NB + 1 sources ``[blocks[m, 0..NB-1], new_prefix[m]]``:
   ``logit_s = rsqrt(mean(v_s^2) + EPS) * <v_s, norm_w * proj_w>`` (the key normalisation is a per-source
   scalar, so it factors out of the dot product), ``alpha = softmax(logit)``,
   ``out = bf16(sum_s alpha_s * v_s)`` with raw (unnormalised) values. With NB = 0, ``out = prefix``.
3. OUT_NORM: ``y = bf16(bf16(out * rsqrt(mean(out^2) + OUT_EPS)) * out_w)`` (KimiRMSNorm); else ``y = out``.

The sealed blocks come as NB separate ``[M, D]`` tensors (``block0`` ..), so the graph never stacks them
into one ``[M, NB, D]`` copy before the call.

Grid (CL, M): the CL CTAs of row m form a thread-block cluster, CTA r owning columns [r DS, (r + 1) DS) with
DS = D / CL. One CTA alone reads a 7,168-wide row and its blocks at one SM's bandwidth (3-4 us at batch 1 on
the H200); CL SMs read it CL times faster. The row's statistics meet through distributed shared memory
(``cluster_sum``): each CTA block-reduces its partials, thread t < CL stores them into row r of CTA t's
[CL, n] array (``st.shared::cluster``), a cluster barrier (arrive.release / wait.acquire), and every thread of
every CTA adds the CL rows in rank order (the same sums everywhere). A relaxed cluster arrive at the start and
its wait before the first DSMEM store make sure every CTA of the cluster runs before its shared memory is
written; no DSMEM access follows the last barrier, so a CTA may exit after it.

Threads: each thread owns VEC = 8 consecutive elements per step (one 128-bit load), STEPS = DS / (8 *
THREADS) steps. A row is a chain of dependent round trips to L2, so the kernel issues every load of its slice
before any store (a load after a store that may alias it would wait for it): ``a``, the prefix and (UPFRONT:
at most 8 vectors per thread) the blocks of all steps first, and the new prefix is stored only after pass 1.
Pass 1 forms the new prefix (kept in registers, bf16) and accumulates, per thread, the NB + 1 sums of squares
and NB + 1 dot products with the folded weight; ONE block reduction of those statistics (warp butterflies, a
[WARPS, NRED] shared array, a second butterfly) and the cluster sum give every thread all logits, so each
thread computes the softmax itself. Pass 2 mixes the sources (the blocks still in registers, else re-read).

The output norm needs sum(out^2) of the mixed row, known only after the softmax: a second row reduction (and
cluster barrier) on the critical path. With GRAM (OUT_NORM, 1 to 8 blocks) pass 1 also accumulates the
sources' pairwise dot products <v_s, v_t>, reduced with the rest, and sum(out^2) = sum_s,t alpha_s alpha_t
<v_s, v_t> (gram_rstd: the unrounded mix, where eager squares the bf16-rounded one; the difference is far
below bf16's rounding of y). Without blocks the output is the new prefix, whose sum of squares pass 1 takes
directly. Either way the row has one reduction; with more than 8 blocks the mixed slice stays in registers
for a second one.

TP > 1: step 1 first all-reduces ``a`` in-kernel (one-shot, peer loads over NVLink, no multicast). Each CTA
copies its slice of ``a`` into this rank's symmetric buffer ``comm``; after a cluster barrier (every slice of
the row written) thread 0 of CTA 0 raises the row's channel-0 epoch flag (``fence.acq_rel.sys`` +
``atom.add.release.sys``; with CL = 1 after a CTA barrier), and warp 0 of every CTA spins (``ld.acquire.sys``,
lane p on rank p's flag, all ranks' loads in flight at once) until every rank's channel-0 flag has reached
the row's epoch (the old value, read by every CTA before the barrier, plus one). The CTAs then sum their
slices over the ranks' buffers in rank order (so every rank gets bit-identical sums). The prefix loads, and
the block loads where they fit in registers (``UPFRONT``: at most 8 vectors per thread), are issued before
the exchange and arrive while the flags are polled. Once every CTA has read the peers (the statistics'
cluster barrier) thread 0 of CTA 0 raises channel 1, and before the grid ends CTA 0 waits for every rank's
channel 1: no rank overwrites its buffer (next call) while a peer still reads it. Epoch counters only grow,
so replays of a CUDA graph need no reset and a stale flag never passes a wait (comparisons are on the
wrapped int32 difference). The local wiring of ``k3compile.comm`` (single-GPU emulation, or after an NCCL
all-reduce) hands the kernel the sum as ``a`` and this rank's flag pad as every rank's; the kernel recognises
it (``peer_signal0`` and ``peer_signal1`` are one pad, which no two real ranks share) and skips the exchange:
no copy into ``comm``, no flag, no wait, no peer read (the sum over ``a`` and zero rows would be ``a``).

Static weights (norm_w * proj_w, out_w) are loaded before ``griddepcontrol_wait``; activations after it.
``__call__`` takes the tensors in the order of the template's ``args()`` (absent ones are not passed) and
hands the kernel a fixed list where absent tensors are ``None``; the kernel never touches them (its
branches are ``const_expr`` on the same flags). The kernel's parameters are in ``args()`` order too: the
memory-ordering audit maps PTX parameters to arguments by position.
"""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from k3compile.templates.kernels.dsmem_lib import st_dsmem_f32

# >>> constants
# (example values: rendering replaces this block)
M = 2  # rows (the batch bucket)
D = 256  # row length (hidden size)
NB = 2  # sealed blocks read by AttnRes (0: out = prefix)
ADD = True  # new_prefix = prefix + a (written out)
ADD_R = False  # a = r + a first (the FFN up-projection output r added to the all-reduced partial)
HAS_PREFIX = True  # a prefix is read (else new_prefix = a)
OUT_NORM = True  # y = RMSNorm(out) (else y = out)
EPS = 1e-05  # AttnRes key-norm epsilon
OUT_EPS = 1e-05  # output RMSNorm epsilon
THREADS = 32  # threads per CTA (one row per CTA)
TP = 1  # ranks whose a rows are summed in-kernel (one-shot all-reduce; 1: a as is)
CL = 1  # CTAs per row (a thread-block cluster, each CTA owns D / CL columns)
# <<< constants

VEC = 8  # bf16 elements per 128-bit access
WARPS = THREADS // 32
DS = D // CL  # columns of this CTA's slice of the row
STEPS = DS // (VEC * THREADS)
NSRC = NB + 1  # AttnRes sources: the sealed blocks, then the prefix
NSTAT = 2 * NSRC  # per source: sum of squares [0, NSRC), dot with the folded weight [NSRC, 2 NSRC)
MAX_TP = 16
MAX_NB = 16
UPFRONT = NB * STEPS <= 8  # blocks loaded with a and the prefix (4 registers each), kept for pass 2 (else re-read)
GRAM = OUT_NORM and 0 < NB <= 8  # the output norm's sum of squares from the sources' Gram matrix (one reduction)
NCROSS = NSRC * (NSRC - 1) // 2 if GRAM else 0  # <v_s, v_t> for s < t, after the NSTAT statistics
NRED = NSTAT + NCROSS if NB > 0 else (1 if OUT_NORM else 0)  # statistics of the row's one reduction
EXCHANGE = CL > 1 and (NB > 0 or OUT_NORM or TP > 1)  # the cluster's CTAs exchange row statistics / flags
# Kernel arguments in call order (the template's args(), then the stream).
ARG_NAMES = ((["a"] if ADD else []) + (["r"] if ADD_R else []) + (["prefix"] if HAS_PREFIX else [])
             + [f"block{b}" for b in range(NB)]
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
def cluster_sum(rVals: cute.Tensor, sAll: cute.Tensor, rank, n: cutlass.Constexpr[int],
                first: cutlass.Constexpr[bool]):
    """Sum each of the n CTA totals in rVals (every thread holds them) over the CL CTAs of the cluster; every
    thread of every CTA gets the same sums (added in rank order). Thread t < CL stores this CTA's totals into
    row ``rank`` of CTA t's [CL, n] array ``sAll`` (DSMEM), then a cluster barrier (arrive.release /
    wait.acquire) and a local read. ``first``: the kernel's first DSMEM access, which waits until every CTA of
    the cluster runs (the arrive is at the kernel's start)."""
    tid = cute.arch.thread_idx()[0]
    if cutlass.const_expr(first):
        cute.arch.cluster_wait()
    if tid < CL:
        base = sAll.iterator.toint() + rank * (n * 4)
        for j in cutlass.range_constexpr(n):
            st_dsmem_f32(base + j * 4, tid, rVals[j])
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()
    for j in cutlass.range_constexpr(n):
        acc = sAll[0, j]
        for r in cutlass.range_constexpr(1, CL):
            acc = acc + sAll[r, j]
        rVals[j] = acc


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
def mix_sources(blocks: list, row, prefix, rAlpha: cute.Tensor, rIn: cute.Tensor, i) -> cute.TensorSSA:
    """bf16(sum_s alpha_s * v_s) of one VEC-chunk (index i): blocks re-read (L1), the prefix from registers.
    Sources are summed in torch's order (blocks 0..NB-1, then the prefix)."""
    cute.autovec_copy(cute.local_tile(blocks[0][row, None], (VEC,), (i,)), rIn)
    acc = rIn.load().to(Float32) * rAlpha[0]
    for b in cutlass.range_constexpr(1, NB):
        cute.autovec_copy(cute.local_tile(blocks[b][row, None], (VEC,), (i,)), rIn)
        acc = acc + rIn.load().to(Float32) * rAlpha[b]
    return (acc + prefix * rAlpha[NB]).to(BFloat16)


@cute.jit
def mix_kept(rB: list, s: int, prefix, rAlpha: cute.Tensor) -> cute.TensorSSA:
    """mix_sources of step s with the blocks still in registers (UPFRONT), in the same order."""
    acc = rB[s * NB].load().to(Float32) * rAlpha[0]
    for b in cutlass.range_constexpr(1, NB):
        acc = acc + rB[s * NB + b].load().to(Float32) * rAlpha[b]
    return (acc + prefix * rAlpha[NB]).to(BFloat16)


@cute.jit
def gram_rstd(rStat: cute.Tensor, rAlpha: cute.Tensor) -> Float32:
    """rsqrt(mean(out^2) + OUT_EPS) of out = sum_s alpha_s v_s from the reduced statistics: sum(out^2) =
    sum_s alpha_s^2 <v_s, v_s> + 2 sum_{s<t} alpha_s alpha_t <v_s, v_t> (before out is rounded to bf16)."""
    ss = Float32(0.0)
    for a in cutlass.range_constexpr(NSRC):
        ss = ss + rAlpha[a] * rAlpha[a] * rStat[a]
    j = NSTAT
    for a in cutlass.range_constexpr(NSRC):
        for b in cutlass.range_constexpr(a + 1, NSRC):
            ss = ss + Float32(2.0) * rAlpha[a] * rAlpha[b] * rStat[j]
            j += 1
    return rms_scale(ss, Float32(OUT_EPS))


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
        blocks = [t.get(f"block{b}") for b in range(MAX_NB)]
        peers = [t.get(f"peer{p}") for p in range(MAX_TP)]
        peer_signals = [t.get(f"peer_signal{p}") for p in range(MAX_TP)]
        self.kernel(t.get("a"), t.get("r"), t.get("prefix"), *blocks, t.get("norm_weight"), t.get("proj_weight"),
                    t.get("out_norm_weight"), t["y"], t.get("new_prefix"), t.get("comm"), t.get("signal"), *peers,
                    *peer_signals).launch(grid=(CL, M, 1), block=(THREADS, 1, 1),
                                          cluster=(CL, 1, 1) if CL > 1 else None, stream=args[-1], use_pdl=True)

    @cute.kernel
    def kernel(self, mA, mR, mPrefix, mB0, mB1, mB2, mB3, mB4, mB5, mB6, mB7, mB8, mB9, mB10, mB11, mB12, mB13, mB14,
               mB15, mNormW, mProjW, mOutW, mY: cute.Tensor, mNewPrefix, mComm, mSignal,
               mP0, mP1, mP2, mP3, mP4, mP5, mP6, mP7, mP8, mP9, mP10, mP11, mP12, mP13, mP14, mP15,
               mS0, mS1, mS2, mS3, mS4, mS5, mS6, mS7, mS8, mS9, mS10, mS11, mS12, mS13, mS14, mS15):
        tid = cute.arch.thread_idx()[0]
        rank = cute.arch.block_idx()[0]  # this CTA's slice of the row (its rank in the cluster)
        row = cute.arch.block_idx()[1]
        smem = cutlass.utils.SmemAllocator()
        rIn = cute.make_rmem_tensor((VEC,), BFloat16)
        rIn2 = cute.make_rmem_tensor((VEC,), BFloat16)
        rOut = cute.make_rmem_tensor((VEC,), BFloat16)
        blocks = [mB0, mB1, mB2, mB3, mB4, mB5, mB6, mB7, mB8, mB9, mB10, mB11, mB12, mB13, mB14, mB15][:NB]
        peers = [mP0, mP1, mP2, mP3, mP4, mP5, mP6, mP7, mP8, mP9, mP10, mP11, mP12, mP13, mP14, mP15][:TP]
        peerSignals = [mS0, mS1, mS2, mS3, mS4, mS5, mS6, mS7, mS8, mS9, mS10, mS11, mS12, mS13, mS14,
                       mS15][:TP]
        if cutlass.const_expr(EXCHANGE):
            cute.arch.cluster_arrive_relaxed()  # "this CTA runs": DSMEM stores wait for every CTA's arrival
        col0 = rank * (DS // VEC) + tid  # 8-element chunk of step 0 (step s: + s * THREADS)

        # Static weights, before the dependency wait: the folded AttnRes weight and the output norm weight.
        wMix = []
        wOut = []
        for s in cutlass.range_constexpr(STEPS):
            i = col0 + s * THREADS
            if cutlass.const_expr(NB > 0):
                cute.autovec_copy(cute.local_tile(mNormW, (VEC,), (i,)), rIn)
                cute.autovec_copy(cute.local_tile(mProjW, (VEC,), (i,)), rIn2)
                wMix.append(rIn.load().to(Float32) * rIn2.load().to(Float32))  # exact: bf16 x bf16 fits fp32
            if cutlass.const_expr(OUT_NORM):
                wOut.append(cute.make_rmem_tensor((VEC,), BFloat16))  # bf16: half the registers of fp32
                cute.autovec_copy(cute.local_tile(mOutW, (VEC,), (i,)), wOut[s])
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()  # the next kernel may start its prologue now

        # The row's loads before any store: a, r, the prefix (and the blocks if UPFRONT), all steps.
        rA, rR, rP, rB = [], [], [], []
        for s in cutlass.range_constexpr(STEPS):
            i = col0 + s * THREADS
            if cutlass.const_expr(ADD):
                rA.append(cute.make_rmem_tensor((VEC,), BFloat16))
                cute.autovec_copy(cute.local_tile(mA[row, None], (VEC,), (i,)), rA[s])
            if cutlass.const_expr(ADD_R):
                rR.append(cute.make_rmem_tensor((VEC,), BFloat16))
                cute.autovec_copy(cute.local_tile(mR[row, None], (VEC,), (i,)), rR[s])
            if cutlass.const_expr(HAS_PREFIX):
                rP.append(cute.make_rmem_tensor((VEC,), BFloat16))
                cute.autovec_copy(cute.local_tile(mPrefix[row, None], (VEC,), (i,)), rP[s])
            if cutlass.const_expr(UPFRONT):
                for b in cutlass.range_constexpr(NB):
                    rB.append(cute.make_rmem_tensor((VEC,), BFloat16))
                    cute.autovec_copy(cute.local_tile(blocks[b][row, None], (VEC,), (i,)), rB[s * NB + b])

        # The one-shot all-reduce of a (TP > 1): publish this rank's row, wait for every rank's. The local wiring
        # (one pad for every rank: k3compile.comm, single-GPU emulation or after NCCL) passes the sum as a and
        # skips the exchange; no two real ranks share a pad.
        epoch1 = Int32(0)
        exchange = Int32(1)  # 0: the local wiring
        if cutlass.const_expr(TP > 1):
            if mS0.iterator.toint() == mS1.iterator.toint():
                exchange = Int32(0)
            if exchange == Int32(0):
                if cutlass.const_expr(CL > 1):
                    cute.arch.cluster_wait()  # every CTA of the cluster runs (the exchange's first wait otherwise)
            else:
                for s in cutlass.range_constexpr(STEPS):
                    cute.autovec_copy(rA[s], cute.local_tile(mComm[row, None], (VEC,), (col0 + s * THREADS,)))
                if cutlass.const_expr(CL > 1):
                    # every CTA reads the row's epoch before the barrier below, so before CTA 0 raises it
                    epoch0 = mSignal[0, row] + Int32(1)
                    cute.arch.cluster_wait()  # every CTA of the cluster runs
                    cute.arch.cluster_arrive()  # release: this CTA's slice of comm is written ...
                    cute.arch.cluster_wait()  # ... acquire: every slice is; CTA 0 publishes the row
                    if tid == 0 and rank == 0:
                        raise_flag(mSignal, 0, row)
                    if tid < 32:
                        wait_flags(peerSignals, 0, row, epoch0)
                else:
                    cute.arch.sync_threads()
                    if tid < 32:  # warp 0: thread 0 raises this rank's flag, the warp waits for every rank's
                        epoch0 = Int32(0)
                        if tid == 0:
                            epoch0 = raise_flag(mSignal, 0, row)
                        wait_flags(peerSignals, 0, row, epoch0)
                cute.arch.sync_threads()
                for s in cutlass.range_constexpr(STEPS):  # the ranks' rows, summed in rank order, rounded as bf16
                    i = col0 + s * THREADS
                    cute.autovec_copy(cute.local_tile(peers[0][row, None], (VEC,), (i,)), rIn)
                    acc = rIn.load().to(Float32)
                    for p in cutlass.range_constexpr(1, TP):
                        cute.autovec_copy(cute.local_tile(peers[p][row, None], (VEC,), (i,)), rIn)
                        acc = acc + rIn.load().to(Float32)
                    rA[s].store(acc.to(BFloat16))
        if cutlass.const_expr(ADD_R):  # the FFN output: up-projection + the (all-reduced) partial, rounded as bf16
            for s in cutlass.range_constexpr(STEPS):
                rA[s].store((rR[s].load().to(Float32) + rA[s].load().to(Float32)).to(BFloat16))

        # Pass 1: new prefix (kept in registers) and the per-source statistics of this CTA's slice (with GRAM
        # also the sources' pairwise dot products; without blocks the new prefix's sum of squares).
        rStat = cute.make_rmem_tensor((max(NRED, 1),), Float32)
        for j in cutlass.range_constexpr(max(NRED, 1)):
            rStat[j] = Float32(0.0)
        prefixVals = []
        for s in cutlass.range_constexpr(STEPS):
            i = col0 + s * THREADS
            if cutlass.const_expr(ADD):
                if cutlass.const_expr(HAS_PREFIX):
                    rA[s].store((rA[s].load().to(Float32) + rP[s].load().to(Float32)).to(BFloat16))
                prefixVals.append(rA[s])  # now the new prefix (bf16: half the registers of fp32)
            else:
                prefixVals.append(rP[s])
            if cutlass.const_expr(NB > 0):
                p = prefixVals[s].load().to(Float32)
                rStat[NB] += (p * p).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
                rStat[NSRC + NB] += (p * wMix[s]).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
                vals = []
                for b in cutlass.range_constexpr(NB):
                    if cutlass.const_expr(UPFRONT):
                        v = rB[s * NB + b].load().to(Float32)
                    else:
                        cute.autovec_copy(cute.local_tile(blocks[b][row, None], (VEC,), (i,)), rIn)
                        v = rIn.load().to(Float32)
                    rStat[b] += (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
                    rStat[NSRC + b] += (v * wMix[s]).reduce(cute.ReductionOp.ADD, Float32(0.0),
                                                            reduction_profile=0)
                    vals.append(v)
                if cutlass.const_expr(GRAM):
                    vals.append(p)
                    j = NSTAT
                    for a in cutlass.range_constexpr(NSRC):
                        for b in cutlass.range_constexpr(a + 1, NSRC):
                            rStat[j] += (vals[a] * vals[b]).reduce(cute.ReductionOp.ADD, Float32(0.0),
                                                                   reduction_profile=0)
                            j += 1
            elif cutlass.const_expr(OUT_NORM):  # out is the new prefix: its sum of squares now
                p = prefixVals[s].load().to(Float32)
                rStat[0] += (p * p).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
        if cutlass.const_expr(ADD):  # the new prefix, stored after every load of pass 1
            for s in cutlass.range_constexpr(STEPS):
                cute.autovec_copy(rA[s], cute.local_tile(mNewPrefix[row, None], (VEC,), (col0 + s * THREADS,)))

        # The row's statistics, reduced once (every thread gets them): softmax weights and, with GRAM or without
        # blocks, the output norm's scale.
        rAlpha = cute.make_rmem_tensor((NSRC,), Float32)
        rstd = Float32(0.0)
        if cutlass.const_expr(NRED > 0):
            sStat = smem.allocate_tensor(Float32, cute.make_layout((WARPS, NRED)), 16)
            block_sum(rStat, sStat, NRED)
            if cutlass.const_expr(CL > 1):  # also the barrier after every CTA's reads of the peers' rows
                sAll = smem.allocate_tensor(Float32, cute.make_layout((CL, NRED), stride=(NRED, 1)), 16)
                cluster_sum(rStat, sAll, rank, NRED, TP == 1)
            if cutlass.const_expr(NB > 0):
                attn_res_alpha(rStat, rAlpha)
            if cutlass.const_expr(GRAM):
                rstd = gram_rstd(rStat, rAlpha)
            elif cutlass.const_expr(NB == 0):
                rstd = rms_scale(rStat[0], Float32(OUT_EPS))
        elif cutlass.const_expr(TP > 1 and CL > 1):  # every CTA done reading the peers' rows
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        if cutlass.const_expr(TP > 1):  # done reading the peers' rows: say so now, wait for theirs at the end
            if cutlass.const_expr(CL == 1):
                cute.arch.sync_threads()
            if tid == 0 and rank == 0 and exchange != Int32(0):
                epoch1 = raise_flag(mSignal, 1, row)

        # Pass 2: mix the sources (blocks from registers, or re-read), then store y (normalised with the scale
        # known) or keep the row for the output norm's own reduction (more than 8 blocks).
        rSq = cute.make_rmem_tensor((1,), Float32)
        rSq[0] = Float32(0.0)
        outVals = []
        for s in cutlass.range_constexpr(STEPS):
            i = col0 + s * THREADS
            if cutlass.const_expr(NB > 0 and UPFRONT):
                out = mix_kept(rB, s, prefixVals[s].load().to(Float32), rAlpha)
            elif cutlass.const_expr(NB > 0):
                out = mix_sources(blocks, row, prefixVals[s].load().to(Float32), rAlpha, rIn, i)
            else:
                out = prefixVals[s].load()
            if cutlass.const_expr(OUT_NORM and (GRAM or NB == 0)):
                normed = (out.to(Float32) * rstd).to(BFloat16)  # KimiRMSNorm rounds before the weight
                rOut.store((normed.to(Float32) * wOut[s].load().to(Float32)).to(BFloat16))
                cute.autovec_copy(rOut, cute.local_tile(mY[row, None], (VEC,), (i,)))
            elif cutlass.const_expr(OUT_NORM):
                o = out.to(Float32)
                outVals.append(o)
                rSq[0] += (o * o).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
            else:
                rOut.store(out)
                cute.autovec_copy(rOut, cute.local_tile(mY[row, None], (VEC,), (i,)))

        if cutlass.const_expr(OUT_NORM and not (GRAM or NB == 0)):
            sSq = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 1)), 16)
            block_sum(rSq, sSq, 1)
            if cutlass.const_expr(CL > 1):
                sSqAll = smem.allocate_tensor(Float32, cute.make_layout((CL, 1)), 16)
                cluster_sum(rSq, sSqAll, rank, 1, False)
            rstd = rms_scale(rSq[0], Float32(OUT_EPS))
            for s in cutlass.range_constexpr(STEPS):
                normed = (outVals[s] * rstd).to(BFloat16)  # KimiRMSNorm rounds before the weight
                rOut.store((normed.to(Float32) * wOut[s].load().to(Float32)).to(BFloat16))
                cute.autovec_copy(rOut, cute.local_tile(mY[row, None], (VEC,), (col0 + s * THREADS,)))
        if cutlass.const_expr(TP > 1):
            if tid < 32 and rank == 0 and exchange != Int32(0):  # one CTA per row: the grid ends only after it
                wait_flags(peerSignals, 1, row, epoch1)
