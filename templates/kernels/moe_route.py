"""Router selection of the routed experts for a larger batch (template moe_route): ids and weights once per step.

For token m (as k3compile.dialect._select): scores = sigmoid(logits[m]); ids[m] = top-TOPK of scores + bias,
descending (ties: lower expert id); weights[m] = scores[ids[m]] (/ (sum + 1e-20) if RENORMALIZE) * SCALING.

At batch 1..8 moe_gate_up selects in every CTA itself (one token per warp, no extra launch). From batch 16
that costs M / WARPS selections one after another in each of its CTAs, so this kernel selects every token
once (a warp per token, WARPS tokens per CTA, CTAS = M / WARPS CTAs) and groups the (token, slot) pairs by
expert once (``groups``, moe_lib.group_pairs + store_groups), which moe_gate_up and moe_down_combine read:
the last CTA to finish its selection (a ticket: every CTA fences its ids, then adds 1 to ``ticket``; the one
that draws CTAS - 1 sees every CTA's ids) reads all the ids back from L2, groups them and resets the ticket to
0 for the next launch.

Selection: moe_lib.select_topk (each lane holds E/32 keys, two ``redux.sync`` per round); the score bias, a
weight, is loaded before the PDL wait, the logits after it.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from k3compile.templates.kernels.moe_lib import (clear_masks, group_buffers, group_pairs, routing_weight, select_topk,
                                                 store_groups)

# >>> constants
# (example values: rendering replaces this block)
M = 16  # tokens (the batch bucket)
E = 16  # experts (n_experts)
TOPK = 4  # experts per token
RENORMALIZE = True  # renormalise the selected scores to sum 1
SCALING = 2.5  # routed scaling factor
WARPS = 4  # warps per CTA (one token each)
# <<< constants

EPL = (E + 31) // 32  # router keys per lane
CTAS = (M + WARPS - 1) // WARPS
P = M * TOPK  # (token, slot) pairs
MAXA = min(E, P)  # distinct experts at most
THREADS = 32 * WARPS


class Kernel:
    @cute.jit
    def __call__(self, mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor,
                 mGroups: cute.Tensor, mTicket: cute.Tensor, stream):
        self.kernel(mLogits, mBias, mIds, mWts, mGroups, mTicket).launch(grid=(CTAS, 1, 1), block=(THREADS, 1, 1),
                                                                         stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor,
               mGroups: cute.Tensor, mTicket: cute.Tensor):
        tid = cute.arch.thread_idx()[0]
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        m = cute.arch.block_idx()[0] * WARPS + warp
        smem = cutlass.utils.SmemAllocator()
        sIds, sPairs, sMask, sOff, sAct, sStart, sNum, sTot = group_buffers(smem, E, M, TOPK, WARPS)
        sTicket = smem.allocate_tensor(Int32, cute.make_layout((1,)), 16)
        rBias = cute.make_rmem_tensor((EPL,), Float32)  # a static weight: loaded before the PDL wait
        rLog = cute.make_rmem_tensor((EPL,), Float32)
        for i in cutlass.range_constexpr(EPL):
            rBias[i] = Float32(0.0)
            rLog[i] = Float32(0.0)
            if lane + 32 * i < E:
                rBias[i] = mBias[lane + 32 * i]
        cute.arch.griddepcontrol_wait()  # the logits come from the router GEMV
        cute.arch.griddepcontrol_launch_dependents()  # moe_gate_up may start its prologue now
        if m < M:
            for i in cutlass.range_constexpr(EPL):
                if lane + 32 * i < E:
                    rLog[i] = mLogits[m, lane + 32 * i]
            my_id = select_topk(rLog, rBias, lane, E, TOPK)
            w = routing_weight(mLogits, m, my_id, lane, TOPK, RENORMALIZE, SCALING)
            if lane < TOPK:
                mIds[m, lane] = my_id
                mWts[m, lane] = w
        # the ticket: this CTA's ids visible GPU-wide, then one draw; the CTA that draws CTAS - 1 groups
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if tid == 0:
            sTicket[0] = cute.arch.atomic_add(mTicket.iterator, Int32(1), sem="acq_rel", scope="gpu")
        clear_masks(sMask, tid, E, M, THREADS)
        cute.arch.sync_threads()
        if sTicket[0] == Int32(CTAS - 1):
            cute.arch.fence_acq_rel_gpu()
            for i in cutlass.range_constexpr((P + THREADS - 1) // THREADS):  # every CTA's ids, all loads in flight,
                p = tid + i * THREADS  # from L2 (.cg: never a stale L1 line)
                if p < P:
                    sIds[p] = cute.arch.load(mIds.iterator + p, Int32, cop="cg")
            cute.arch.sync_threads()
            n_active = group_pairs(sIds, sMask, sOff, sPairs, sAct, sStart, sNum, sTot, tid, lane, warp, E, M, TOPK,
                                   WARPS)
            store_groups(mGroups, sAct, sStart, sNum, sPairs, n_active, tid, MAXA, P, THREADS)
            if tid == 0:
                mTicket[0] = Int32(0)  # for the next launch (every CTA of this one has drawn)
