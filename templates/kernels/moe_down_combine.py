"""Routed MXFP4 experts, launch 2 of 2: down GEMMs + routing-weighted combine (template moe_down_combine).

    y[m, l] = bf16( sum_j weights[m, j] * bf16( h[m, j] . deq(W2[ids[m, j]])[l, :] ) )

as ops.latent_moe_experts (each expert's output rounded to bf16, then the fp32 weighted sum over the k
experts in slot order, then bf16). ids/weights/h come from moe_gate_up. Under TP, y is this rank's partial
sum.

Grid: one CTA per tile of 16 output rows (l). Every CTA groups the (token, slot) pairs of ids by expert in
shared memory (moe_lib.group_pairs), then its WARPS warps take the active experts in turn: for expert e the
warp runs W2[e] rows l0..l0+15 against the h rows of the tokens that picked e, 8 tokens per
``mma.sync.m16n8k16`` (bf16 in, fp32 accumulate; rows are the MMA's M, tokens its N), over the whole
reduction I in k-steps of 4 MX blocks (lane t of a quad loads block 4*step + t of rows g and g+8, 128-bit;
a last step with fewer than 4 blocks leaves the other lanes' operands zero). Decode as in moe_gate_up
(moe_lib.block_mma). The weights of an expert's next turn are prefetched into L2 (one bulk prefetch).
Each (token, slot) result, rounded to bf16, is stored once in shared memory; after a barrier every
(token, row) sums its TOPK slots in slot order with the routing weights: the combine happens in the CTA,
deterministic, no atomics, no workspace. Each weight byte of an active expert is read by one CTA, once.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint32
from cutlass.experimental.primitives import cp_async_bulk_prefetch

from k3compile.templates.kernels.moe_lib import block_mma, group_buffers, group_pairs

# >>> constants
# (example values: rendering replaces this block)
M = 2  # tokens (the batch bucket)
E = 16  # experts (n_experts)
TOPK = 4  # experts per token
L = 128  # latent size (rows of W2, outputs)
I = 256  # intermediate size (reduction length of down on this rank)
WARPS = 8  # warps per CTA (they take the active experts in turn)
# <<< constants

NB = I // 32  # MX blocks per W2 row
STEPS = (NB + 3) // 4  # k-steps of a quad (4 blocks each; the last may be partial)
CTAS = L // 16  # one CTA per 16 output rows
P = M * TOPK  # (token, slot) pairs
MAXA = min(E, P)  # distinct experts at most
THREADS = 32 * WARPS


class Kernel:
    @cute.jit
    def __call__(self, mH: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor, mW2: cute.Tensor,
                 mS2: cute.Tensor, mY: cute.Tensor, stream):
        mHq = cute.recast_tensor(mH, Uint32)  # [M, TOPK, I/2] bf16 pairs
        mW2q = cute.recast_tensor(mW2, Uint32)  # [E, L, I/8] 8 codes per word
        self.kernel(mHq, mIds, mWts, mW2q, mS2, mY).launch(grid=(CTAS, 1, 1), block=(THREADS, 1, 1),
                                                           stream=stream)

    @cute.jit
    def prefetch_expert(self, a, n_active, sAct: cute.Tensor, mW2q: cute.Tensor, mS2: cute.Tensor, row0):
        """Pull expert a's 16 rows of W2 (contiguous) and their scales into L2."""
        if a < n_active:
            e = sAct[a]
            cp_async_bulk_prefetch(mW2q[e, row0, None].iterator, 16 * (I // 2))
            cp_async_bulk_prefetch(mS2[e, row0, None].iterator, 16 * (I // 32))

    @cute.kernel
    def kernel(self, mHq: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor, mW2q: cute.Tensor,
               mS2: cute.Tensor, mY: cute.Tensor):
        tid = cute.arch.thread_idx()[0]
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        row0 = cute.arch.block_idx()[0] * 16
        smem = cutlass.utils.SmemAllocator()
        sIds, sPairs, sCount, sOff, sAct, sStart, sNum, sTot = group_buffers(smem, E, P, WARPS)
        sPart = smem.allocate_tensor(BFloat16, cute.make_layout((P, 16)), 16)  # per (token, slot), per row

        for e in cutlass.range(tid, E, THREADS, unroll=1):
            sCount[e] = Int32(0)
        cute.arch.griddepcontrol_wait()  # h, ids and weights come from moe_gate_up
        for p in cutlass.range(tid, P, THREADS, unroll=1):
            sIds[p] = mIds[p // TOPK, p % TOPK]
        cute.arch.sync_threads()
        n_active = group_pairs(sIds, sCount, sOff, sPairs, sAct, sStart, sNum, sTot, tid, lane, warp, E, P, WARPS)

        g = lane // 4  # MMA rows g and g + 8, and the token column of this lane
        t = lane % 4  # which block of a k-step this lane loads
        rW = cute.make_rmem_tensor((8 * STEPS,), Uint32)  # per step: rows g, g + 8 (4 words each)
        rS = cute.make_rmem_tensor((2 * STEPS,), Uint32)
        rX = cute.make_rmem_tensor((16,), Uint32)
        acc = cute.make_rmem_tensor((4,), Float32)
        if lane == 0:
            self.prefetch_expert(warp, n_active, sAct, mW2q, mS2, row0)
        for a in cutlass.range(warp, n_active, WARPS, unroll=1):
            if lane == 0:  # this warp's next expert
                self.prefetch_expert(a + WARPS, n_active, sAct, mW2q, mS2, row0)
            e = sAct[a]
            start = sStart[a]
            num = sNum[a]
            for s in cutlass.range_constexpr(STEPS):  # the whole reduction's weights of this lane, in flight
                blk = 4 * s + t
                if blk < NB:
                    for r in cutlass.range_constexpr(2):
                        cute.autovec_copy(cute.local_tile(mW2q[e, row0 + g + 8 * r, None], (4,), (blk,)),
                                          cute.local_tile(rW, (4,), (2 * s + r,)))
                        rS[2 * s + r] = Uint32(mS2[e, row0 + g + 8 * r, blk])
                else:  # past I in a partial last step: zero operands
                    for i in cutlass.range_constexpr(8):
                        rW[8 * s + i] = Uint32(0)
                    rS[2 * s] = Uint32(127)
                    rS[2 * s + 1] = Uint32(127)
            for nt in cutlass.range(0, num, 8, unroll=1):
                col = nt + g
                pair = sPairs[start + cutlass.min(col, num - 1)]
                acc.fill(0.0)
                for s in cutlass.range_constexpr(STEPS):
                    blk = 4 * s + t
                    if (col < num) & (blk < NB):
                        cute.autovec_copy(cute.local_tile(mHq[pair // TOPK, pair % TOPK, None], (16,), (blk,)), rX)
                    else:
                        rX.fill(0)
                    block_mma(rW, 8 * s, rS[2 * s], rS[2 * s + 1], rX, acc, 0)
                for i in cutlass.range_constexpr(4):  # C fragment: rows g, g + 8; columns 2t, 2t + 1
                    cc = nt + 2 * t + i % 2
                    if cc < num:
                        sPart[sPairs[start + cc], g + 8 * (i // 2)] = acc[i].to(BFloat16)  # expert output, bf16
        cute.arch.sync_threads()
        for idx in cutlass.range(tid, M * 16, THREADS, unroll=1):  # combine: slot order, fp32
            m = idx // 16
            r = idx % 16
            total = Float32(0.0)
            for j in cutlass.range_constexpr(TOPK):
                total = total + sPart[m * TOPK + j, r].to(Float32) * mWts[m, j]
            mY[m, row0 + r] = total.to(BFloat16)
        cute.arch.griddepcontrol_launch_dependents()
