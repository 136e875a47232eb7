"""One KDA decode step for H local heads (dialect op ``kda_decode_fb``): short conv + SiLU on q, k, v, L2 norms,
the low-rank lower-bound decay gate (with the f_b up-projection folded in), the delta-rule state update and the
gated per-head RMSNorm of the output, in one kernel.

Grid: CL CTAs per (head h, token m), a thread-block cluster; CTA ``rank`` of the cluster owns the value columns
[rank DV, (rank + 1) DV) of the head's fp32 state S[m, h] (D x D = 64 KB, rows = key index i, columns = value
index j), DV = D / CL, and reads and writes its D x DV slice exactly once. The value columns are independent
in the delta rule (u_j = v_j - sum_i S_ij k_i, S_ij += beta k_i u_j, o_j = sum_i S_ij q_i); only the output
norm's sum of squares over the D columns crosses the cluster (one fp32 per CTA through distributed shared
memory). A few heads per token leave most SMs idle with one CTA each (12 CTAs of 64 KB at K3 TP8, batch 1:
latency bound); the cluster spreads a head's state over CL SMs. THREADS = 2*D = 256 threads (8 warps).

State tile per thread: LPR = DV / VEC lanes cover one DV-column slice of a row (VEC = 4 fp32: one 128-bit
access), so a warp instruction moves RPI = 32 / LPR whole row slices (rows (warp ROWS + r) RPI + lane / LPR),
and each thread keeps ROWS x VEC state values in registers between the read and the write (64 at CL = 1: 126
registers, two CTAs per SM, no spills). Memory round trips on the critical path: f_a (256 B, just written by
the previous kernel, so usually an L2 hit; the f_b slice was loaded before the dependency wait), then the
state, the conv windows, beta and g together.

Per-head prologue (every CTA recomputes what its head needs; thread t: channel d = t % D, half = t // D):
  * f[d] = bf16(sum_r f_a[m, r] * f_b_weight[h*D + d, r]): each half does R/2 of the dot product (its f_b
    slice is loaded into registers before the dependency wait: weights only), the halves meet in shared memory;
  * half 0: the q and k short convs (fp32 sum of bf16 products, then SiLU) of channel d (all D channels in
    every CTA: the rows need the whole of q and k), the squared sums for the L2 norms (warp butterflies +
    shared memory); half 1: the v conv of channel d where the CTA owns column d. A channel's conv state is
    shifted in place (shift left by one, append the new bf16 input) by one thread of one CTA: v by its
    column's owner; q and k, which every CTA of the cluster reads, by the owner of column d after the cluster
    barrier of the norm exchange (every CTA's window reads come before it);
  * after a barrier, half 0 normalises q (times D^-0.5) and k, half 1 computes the decay a[d] = exp(gate[d]),
    gate = lower_bound * sigmoid(exp(a_log[h]) * (f + dt_bias)).
State step (ops.kda_decode order): S <- a[i] * S (rows), partial column sums p_j = sum_i S_ij k_i per thread,
lane butterflies over the rows of a warp instruction -> shared memory -> u_j = v_j - sum_w p_j; S <- S +
(beta k_i) u_j, written back in place as it is formed, with the partials of o_j = sum_i S_ij q_i -> shared
memory. Warp 0 finishes: o_j, the sum of squares over the CTA's columns (warp butterfly), over the cluster
(each CTA's sum stored into every CTA's shared memory, a cluster barrier, added in rank order: the same
total everywhere), y_j = o_j * rsqrt(mean(o^2) + eps) * o_norm_weight[j] * sigmoid(g_j), stored as bf16.

Expected speed (H200, ~4.8 TB/s HBM): for M*H*CL >= a few hundred CTAs the state stream should run at 70-85 %
of HBM bandwidth; at M*H = 8..12 (batch 1) one CTA per head keeps 64 KB of the state per SM and the step is
latency bound (~3-5 us), which the cluster split shortens. All shapes are static; the runtime pads the batch
to the bucket M. Launched with PDL like every template: the state and activations are read only after
griddepcontrol.wait.
"""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

from k3compile.templates.kernels.dsmem_lib import st_dsmem_f32

# >>> constants
# (example values: rendering replaces this block)
M = 2  # tokens (the batch bucket)
H = 8  # local KDA heads
D = 128  # head dim (K = V = D)
R = 128  # rank of the low-rank decay input f_a
W = 4  # short conv kernel size
LOWER_BOUND = -5.0  # gate lower bound
EPS = 1e-05  # RMSNorm epsilon of the output norm
CL = 2  # CTAs per (head, token): a thread-block cluster, each owning D / CL value columns of the state
# <<< constants

L2_EPS = 1e-06  # inside the rsqrt of the L2 norms of q and k (sum of squares)
THREADS = 2 * D  # two threads per channel in the prologue
WARPS = THREADS // 32
VEC = 4  # state columns per lane (one 128-bit access)
DV = D // CL  # value columns of this CTA
LPR = DV // VEC  # lanes per row slice
RPI = 32 // LPR  # row slices per warp instruction
ROWS = D // (WARPS * RPI)  # state rows per thread
HALF_R = R // 2  # f_a elements per thread in the f dot product
HALF_WARPS = WARPS // 2  # warps of half 0 (the q/k conv half)
Q_SCALE = float(D) ** -0.5


class Kernel:
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mFa: cute.Tensor, mFb: cute.Tensor,
                 mBeta: cute.Tensor, mG: cute.Tensor, mCq: cute.Tensor, mCk: cute.Tensor, mCv: cute.Tensor,
                 mS: cute.Tensor, mWq: cute.Tensor, mWk: cute.Tensor, mWv: cute.Tensor, mALog: cute.Tensor,
                 mDtBias: cute.Tensor, mOw: cute.Tensor, mY: cute.Tensor, stream):
        self.kernel(mQ, mK, mV, mFa, mFb, mBeta, mG, mCq, mCk, mCv, mS, mWq, mWk, mWv, mALog, mDtBias, mOw,
                    mY).launch(grid=(H * CL, M, 1), block=(THREADS, 1, 1), cluster=(CL, 1, 1) if CL > 1 else None,
                               stream=stream, use_pdl=True)

    @cute.jit
    def load_window(self, mX: cute.Tensor, mC: cute.Tensor, mWc: cute.Tensor, m, c, rWin: cute.Tensor,
                    rWc: cute.Tensor):
        """The conv window of channel c of token m (W-1 state values, then the new input) and its weights."""
        for j in cutlass.range_constexpr(W - 1):
            rWin[j] = mC[m, c, j]
        rWin[W - 1] = mX[m, c]
        for j in cutlass.range_constexpr(W):
            rWc[j] = mWc[c, 0, j]

    @cute.jit
    def conv_silu(self, rWin: cute.Tensor, rWc: cute.Tensor) -> Float32:
        """Short causal conv + SiLU (fp32) of a loaded window."""
        acc = Float32(0.0)
        for j in cutlass.range_constexpr(W):
            acc = acc + rWin[j].to(Float32) * rWc[j].to(Float32)
        return acc / (Float32(1.0) + cute.math.exp(-acc))

    @cute.jit
    def shift(self, mC: cute.Tensor, m, c, rWin: cute.Tensor):
        """The channel's conv state shifted in place: the window's last W-1 values."""
        for j in cutlass.range_constexpr(W - 1):
            mC[m, c, j] = rWin[j + 1]

    @cute.jit
    def f_partial(self, rFa: cute.Tensor, rFb: cute.Tensor) -> Float32:
        """This thread's half of the f dot product (fp32)."""
        return (rFa.load().to(Float32) * rFb.load().to(Float32)).reduce(
            cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mFa: cute.Tensor, mFb: cute.Tensor,
               mBeta: cute.Tensor, mG: cute.Tensor, mCq: cute.Tensor, mCk: cute.Tensor, mCv: cute.Tensor,
               mS: cute.Tensor, mWq: cute.Tensor, mWk: cute.Tensor, mWv: cute.Tensor, mALog: cute.Tensor,
               mDtBias: cute.Tensor, mOw: cute.Tensor, mY: cute.Tensor):
        tid = cute.arch.thread_idx()[0]
        h = cute.arch.block_idx()[0] // CL
        rank = cute.arch.block_idx()[0] % CL  # this CTA's value columns [rank DV, (rank + 1) DV)
        m = cute.arch.block_idx()[1]
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        d = tid % D  # prologue channel within the head
        half = tid // D
        c = h * D + d  # prologue channel within the H*D projection
        mine = d // DV == rank  # channel d is one of this CTA's value columns
        vec = rank * LPR + lane % LPR  # this lane's 4-column group of the head (VEC columns)
        col0 = (lane % LPR) * VEC  # its first column within the CTA's DV
        if cutlass.const_expr(CL > 1):
            cute.arch.cluster_arrive_relaxed()  # "this CTA runs": the norm exchange's DSMEM stores wait for it

        smem = cutlass.utils.SmemAllocator()
        sFpart = smem.allocate_tensor(Float32, cute.make_layout((2, D), stride=(D, 1)), 16)
        sQ = smem.allocate_tensor(Float32, cute.make_layout((D,)), 16)
        sK = smem.allocate_tensor(Float32, cute.make_layout((D,)), 16)
        sV = smem.allocate_tensor(Float32, cute.make_layout((D,)), 16)
        sA = smem.allocate_tensor(Float32, cute.make_layout((D,)), 16)
        sNorm = smem.allocate_tensor(Float32, cute.make_layout((2, HALF_WARPS), stride=(HALF_WARPS, 1)), 16)
        sP = smem.allocate_tensor(Float32, cute.make_layout((WARPS, DV), stride=(DV, 1)), 16)
        sO = smem.allocate_tensor(Float32, cute.make_layout((WARPS, DV), stride=(DV, 1)), 16)
        sSq = smem.allocate_tensor(Float32, cute.make_layout((CL,)), 16)  # each CTA's sum of squares of o

        # weights: may be read before the dependency wait
        rFb = cute.make_rmem_tensor((HALF_R,), BFloat16)
        cute.autovec_copy(cute.local_tile(mFb[c, None], (HALF_R,), (half,)), rFb)
        a_log = mALog[h].to(Float32)
        dt_bias = mDtBias[c].to(Float32)
        rOw = cute.make_rmem_tensor((VEC,), BFloat16)
        cute.autovec_copy(cute.local_tile(mOw, (VEC,), (vec,)), rOw)

        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()  # the next kernel may start its prologue now

        # the whole state tile of this thread, in flight while the prologue runs
        rS = cute.make_rmem_tensor((VEC, ROWS), Float32)
        for r in cutlass.range_constexpr(ROWS):
            i = (warp * ROWS + r) * RPI + lane // LPR
            cute.autovec_copy(cute.local_tile(mS[m, h, i, None], (VEC,), (vec,)), rS[None, r])
        beta_logit = mBeta[m, h].to(Float32)
        rG = cute.make_rmem_tensor((VEC,), BFloat16)  # output gate of this lane's columns (used by warp 0)
        cute.autovec_copy(cute.local_tile(mG[m, None], (VEC,), (h * (D // VEC) + vec,)), rG)
        rFa = cute.make_rmem_tensor((HALF_R,), BFloat16)
        cute.autovec_copy(cute.local_tile(mFa[m, None], (HALF_R,), (half,)), rFa)

        # -- prologue 1: f partial dot products, conv windows (all loads before any conv-state store), convs,
        # squared sums
        sFpart[half, d] = self.f_partial(rFa, rFb)
        rWinA = cute.make_rmem_tensor((W,), BFloat16)  # half 0: q, half 1: v
        rWcA = cute.make_rmem_tensor((W,), BFloat16)
        rWinB = cute.make_rmem_tensor((W,), BFloat16)  # half 0: k
        rWcB = cute.make_rmem_tensor((W,), BFloat16)
        if half == 0:
            self.load_window(mQ, mCq, mWq, m, c, rWinA, rWcA)
            self.load_window(mK, mCk, mWk, m, c, rWinB, rWcB)
        elif mine:
            self.load_window(mV, mCv, mWv, m, c, rWinA, rWcA)
        if half == 0:
            qc = self.conv_silu(rWinA, rWcA)
            kc = self.conv_silu(rWinB, rWcB)
            if cutlass.const_expr(CL == 1):  # the one reader: shift now (else after the cluster barrier)
                self.shift(mCq, m, c, rWinA)
                self.shift(mCk, m, c, rWinB)
            sQ[d] = qc
            sK[d] = kc
            ssq = cute.arch.warp_reduction(qc * qc, operator.add)
            ssk = cute.arch.warp_reduction(kc * kc, operator.add)
            if lane == 0:
                sNorm[0, warp] = ssq
                sNorm[1, warp] = ssk
        elif mine:  # v: only this CTA reads its columns' windows
            sV[d] = self.conv_silu(rWinA, rWcA)
            self.shift(mCv, m, c, rWinA)
        cute.arch.sync_threads()

        # -- prologue 2: L2 norms (half 0), decay gate (half 1)
        if half == 0:
            tq = Float32(0.0)
            tk = Float32(0.0)
            for w in cutlass.range_constexpr(HALF_WARPS):
                tq = tq + sNorm[0, w]
                tk = tk + sNorm[1, w]
            sQ[d] = sQ[d] * cute.math.rsqrt(tq + Float32(L2_EPS)) * Float32(Q_SCALE)
            sK[d] = sK[d] * cute.math.rsqrt(tk + Float32(L2_EPS))
        else:
            f = (sFpart[0, d] + sFpart[1, d]).to(BFloat16).to(Float32)  # f_b(f_a) is a bf16 linear
            z = cute.math.exp(a_log) * (f + dt_bias)
            gate = Float32(LOWER_BOUND) / (Float32(1.0) + cute.math.exp(-z))
            sA[d] = cute.math.exp(gate)
        cute.arch.sync_threads()

        # -- state pass 1: decay the rows, partial column sums of S^T k (the thread's rows, then the lanes of
        # the warp instruction's other rows)
        rP = cute.make_rmem_tensor((VEC,), Float32)
        rP.fill(0.0)
        for r in cutlass.range_constexpr(ROWS):
            i = (warp * ROWS + r) * RPI + lane // LPR
            a_i = sA[i]
            k_i = sK[i]
            for v in cutlass.range_constexpr(VEC):
                rS[v, r] = rS[v, r] * a_i
                rP[v] = rP[v] + rS[v, r] * k_i
        self.rows_sum(rP, sP, warp, lane, col0)
        cute.arch.sync_threads()

        # -- state pass 2: u = v - S^T k, rank-1 update written back in place, partial o = S^T q
        beta = Float32(1.0) / (Float32(1.0) + cute.math.exp(-beta_logit))
        rU = cute.make_rmem_tensor((VEC,), Float32)
        for v in cutlass.range_constexpr(VEC):
            p = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                p = p + sP[w, col0 + v]
            rU[v] = sV[rank * DV + col0 + v] - p
        rO = cute.make_rmem_tensor((VEC,), Float32)
        rO.fill(0.0)
        for r in cutlass.range_constexpr(ROWS):
            i = (warp * ROWS + r) * RPI + lane // LPR
            bk_i = beta * sK[i]
            q_i = sQ[i]
            for v in cutlass.range_constexpr(VEC):
                rS[v, r] = rS[v, r] + bk_i * rU[v]
                rO[v] = rO[v] + rS[v, r] * q_i
            cute.autovec_copy(rS[None, r], cute.local_tile(mS[m, h, i, None], (VEC,), (vec,)))
        self.rows_sum(rO, sO, warp, lane, col0)
        cute.arch.sync_threads()

        # -- epilogue (warp 0): gated per-head RMSNorm of o (the sum of squares over the cluster's columns)
        ss = Float32(0.0)
        if warp == 0:
            for v in cutlass.range_constexpr(VEC):
                o = Float32(0.0)
                for w in cutlass.range_constexpr(WARPS):
                    o = o + sO[w, col0 + v]
                rO[v] = o
                if lane < LPR:
                    ss = ss + o * o
            ss = cute.arch.warp_reduction(ss, operator.add)
        if cutlass.const_expr(CL > 1):  # every CTA's sum into every CTA's sSq[rank], then one cluster barrier
            cute.arch.cluster_wait()  # every CTA of the cluster runs (the arrive at the start)
            if tid < CL:
                st_dsmem_f32(sSq.iterator.toint() + rank * 4, tid, ss)
            cute.arch.cluster_arrive()  # release: this CTA's stores (and its window reads) are done ...
            cute.arch.cluster_wait()  # ... acquire: every CTA's are; no DSMEM access follows
            if half == 0 and mine:  # q and k conv states: every CTA has read the windows
                self.shift(mCq, m, c, rWinA)
                self.shift(mCk, m, c, rWinB)
            ss = sSq[0]
            for r in cutlass.range_constexpr(1, CL):
                ss = ss + sSq[r]
        if warp == 0 and lane < LPR:
            rstd = cute.math.rsqrt(ss / Float32(D) + Float32(EPS))
            rY = cute.make_rmem_tensor((VEC,), BFloat16)
            for v in cutlass.range_constexpr(VEC):
                g = rG[v].to(Float32)
                sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-g))
                rY[v] = (rO[v] * rstd * rOw[v].to(Float32) * sig).to(BFloat16)
            cute.autovec_copy(rY, cute.local_tile(mY[m, None], (VEC,), (h * (D // VEC) + vec,)))

    @cute.jit
    def rows_sum(self, rX: cute.Tensor, sX: cute.Tensor, warp, lane, col0):
        """The warp's partial column sums into sX[warp, col0 ..]: the lanes of one warp instruction's RPI rows
        (lane bits LPR and up) add their VEC sums by butterflies; the first row's lanes store them."""
        for v in cutlass.range_constexpr(VEC):
            for b in cutlass.range_constexpr(RPI.bit_length() - 1):
                rX[v] = rX[v] + cute.arch.shuffle_sync_bfly(rX[v], offset=LPR << b)
        if lane < LPR:
            for v in cutlass.range_constexpr(VEC):
                sX[warp, col0 + v] = rX[v]
