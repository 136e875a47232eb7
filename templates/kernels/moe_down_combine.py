"""Routed MXFP4 experts, launch 2 of 2: down GEMVs + routing-weighted combine (template moe_down_combine).

    y[m, l] = bf16( sum_j weights[m, j] * bf16( h[m, j] . deq(W2[ids[m, j]])[l, :] ) )

as ops.latent_moe_experts (each expert's output rounded to bf16, then the fp32 weighted sum over the k
experts, then bf16). ids/weights/h come from moe_gate_up. Under TP, y is this rank's partial sum.

Grid (TILES, M): one warp per output element (m, l), WARPS per CTA. A W2 row of I/2 bytes is NB 16-byte
MX blocks; G consecutive lanes share one (slot, row) and each lane owns BPL blocks, so one pass of the
warp covers SPP = 32/G slots; NPASS passes cover the TOPK slots (a slot past TOPK is clamped and weighted
0). Per pass every lane first loads its BPL weight blocks (128-bit LDG, all in flight), then its h blocks,
decodes in registers (prmt byte-table decode to bf16x2, sign by a third prmt, E8M0 scale once per block as
two exact power-of-two factors) and accumulates in fp32. A G-lane butterfly gives each (slot, row) result,
which is rounded to bf16 and weighted; a full-warp butterfly sums the slots: the combine happens in
registers, deterministic, no atomics, no shared memory.
"""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint32

from k3compile.templates.kernels.mxfp4_lib import mx_block_dot

# >>> constants
# (example values: rendering replaces this block)
M = 2  # tokens (the batch bucket)
E = 16  # experts (n_experts)
TOPK = 4  # experts per token
L = 128  # latent size (rows of W2, outputs)
I = 256  # intermediate size (reduction length of down on this rank)
G = 8  # lanes sharing one (slot, weight row)
WARPS = 8  # warps per CTA (one output element per warp)
# <<< constants

NB = I // 32  # MX blocks per W2 row
BPL = NB // G  # blocks per lane
SPP = 32 // G  # slots per pass of a warp
NPASS = (TOPK + SPP - 1) // SPP
TILES = L // WARPS
THREADS = 32 * WARPS


class Kernel:
    @cute.jit
    def __call__(self, mH: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor, mW2: cute.Tensor,
                 mS2: cute.Tensor, mY: cute.Tensor, stream):
        mHq = cute.recast_tensor(mH, Uint32)  # [M, TOPK, I/2] bf16 pairs
        mW2q = cute.recast_tensor(mW2, Uint32)  # [E, L, I/8] 8 codes per word
        self.kernel(mHq, mIds, mWts, mW2q, mS2, mY).launch(grid=(TILES, M, 1), block=(THREADS, 1, 1),
                                                           stream=stream)

    @cute.kernel
    def kernel(self, mHq: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor, mW2q: cute.Tensor,
               mS2: cute.Tensor, mY: cute.Tensor):
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        tile, m, _ = cute.arch.block_idx()
        row = tile * WARPS + warp  # output element l
        j = lane % G
        rW = [cute.make_rmem_tensor((4,), Uint32) for _ in range(BPL)]
        rH = cute.make_rmem_tensor((16,), Uint32)
        rS = cute.make_rmem_tensor((BPL,), Uint32)

        cute.arch.griddepcontrol_wait()  # h, ids and weights come from moe_gate_up

        acc = Float32(0.0)
        for p in cutlass.range_constexpr(NPASS):
            slot = p * SPP + lane // G
            wscale = Float32(1.0)
            if cutlass.const_expr(TOPK % SPP != 0):  # the last pass has lanes past TOPK: clamp, weight 0
                if slot >= TOPK:
                    slot = Int32(TOPK - 1)
                    wscale = Float32(0.0)
            expert = mIds[m, slot]
            for t in cutlass.range_constexpr(BPL):  # all weight blocks of this lane in flight first
                cute.autovec_copy(cute.local_tile(mW2q[expert, row, None], (4,), (j + G * t,)), rW[t])
            for t in cutlass.range_constexpr(BPL):
                rS[t] = Uint32(mS2[expert, row, j + G * t])
            dot = Float32(0.0)
            for t in cutlass.range_constexpr(BPL):
                cute.autovec_copy(cute.local_tile(mHq[m, slot, None], (16,), (j + G * t,)), rH)
                dot = dot + mx_block_dot(rW[t], rH, rS[t])
            dot = cute.arch.warp_reduction(dot, operator.add, threads_in_group=G)
            contrib = dot.to(BFloat16).to(Float32) * (mWts[m, slot] * wscale)  # expert output rounded to bf16
            if j != 0:
                contrib = Float32(0.0)
            acc = acc + contrib
        acc = cute.arch.warp_reduction(acc, operator.add)
        if lane == 0:
            mY[m, row] = acc.to(BFloat16)
        cute.arch.griddepcontrol_launch_dependents()
