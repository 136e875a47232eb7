"""Router selection of the routed experts for a larger batch (template moe_route): ids and weights once per step.

For token m (as k3compile.dialect._select): scores = sigmoid(logits[m]); ids[m] = top-TOPK of scores + bias,
descending (ties: lower expert id); weights[m] = scores[ids[m]] (/ (sum + 1e-20) if RENORMALIZE) * SCALING.

At batch 1..8 moe_gate_up selects in every CTA itself (one token per warp, no extra launch). From batch 16
that costs M / WARPS selections one after another in each of its CTAs, so this kernel selects every token
once (a warp per token, WARPS tokens per CTA, CTAS = M / WARPS CTAs) and moe_gate_up reads ids.

Selection: moe_lib.select_topk (each lane holds E/32 keys, two ``redux.sync`` per round); the score bias, a
weight, is loaded before the PDL wait, the logits after it.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from k3compile.templates.kernels.moe_lib import routing_weight, select_topk

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


class Kernel:
    @cute.jit
    def __call__(self, mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor, stream):
        self.kernel(mLogits, mBias, mIds, mWts).launch(grid=(CTAS, 1, 1), block=(32 * WARPS, 1, 1), stream=stream,
                                                       use_pdl=True)

    @cute.kernel
    def kernel(self, mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor):
        lane = cute.arch.lane_idx()
        m = cute.arch.block_idx()[0] * WARPS + cute.arch.warp_idx()
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
