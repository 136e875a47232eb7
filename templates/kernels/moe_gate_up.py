"""Routed MXFP4 experts, launch 1 of 2: router selection + gate/up GEMVs + SiTU-GLU (template moe_gate_up).

For token m and selected slot j (expert e = ids[m, j]):
    gate = bf16(z[m] . deq(W1[e])^T),  up = bf16(z[m] . deq(W3[e])^T)          (fp32 accumulation)
    h[m, j] = bf16(BETA*tanh(gate/BETA)*sigmoid(gate) * LINEAR_BETA*tanh(up/LINEAR_BETA))
Selection (as k3compile.dialect._select): scores = sigmoid(logits[m]); ids = top-k of scores + bias,
descending (ties: lower expert id); weights = scores[ids] (/ (sum + 1e-20) if RENORMALIZE) * SCALING.

Grid (TILES, TOPK, M): one CTA per (tile of RPC rows of h, slot, token). Selection is recomputed by every
CTA: warp 0 holds the token's E logits (EPL per lane, in registers), runs TOPK rounds of a warp argmax
(butterfly on (key, id) pairs, lower id wins ties, so every lane agrees), and puts this CTA's expert in
shared memory; the CTAs with tile == 0 and slot == 0 also write ids/weights for the token (the only
writers). The logits row is tiny and L2-resident; the cost is TOPK warp-argmax rounds of latency.

GEMVs: the first WARPS/2 warps do gate rows (W1), the others the same up rows (W3). A weight row of
L/2 bytes is NB 16-byte MX blocks (32 codes, one E8M0 scale byte each); G consecutive lanes share a row
and each lane owns BPL blocks (lane j: blocks j, j+G, ...), so a warp covers RPW = 32/G rows and every
load is a coalesced 128-bit LDG. All BPL weight blocks of a lane are loaded before any math (BPL loads in
flight per lane), no shared memory in the main loop. Decode is in registers with byte permutes (no FP4
cvt on sm_90a): prmt against two 8-entry byte tables gives bf16 magnitudes as bf16x2 pairs, a third prmt
gathers the sign bits; the pairs are widened to fp32 and multiplied with z (fp32 FMA). The E8M0 scale is
applied once per block, to the block's dot product, as two exact power-of-two factors (covers 0 and 255
exactly like models/mxfp4.dequantize). A G-lane butterfly finishes each row; gate/up meet in shared
memory and the first RPC threads write h.
"""

import math
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
L = 128  # latent size (reduction length of gate/up)
I = 256  # intermediate size (rows of W1/W3 on this rank)
RENORMALIZE = True  # renormalise the selected scores to sum 1
SCALING = 2.5  # routed scaling factor
BETA = 4.0  # SiTU gate beta
LINEAR_BETA = 25.0  # SiTU linear beta
G = 4  # lanes sharing one weight row
WARPS = 8  # warps per CTA (half gate, half up)
# <<< constants

NB = L // 32  # MX blocks (16 bytes, 32 codes) per weight row
BPL = NB // G  # blocks per lane
RPW = 32 // G  # weight rows per warp
HALF = WARPS // 2  # warps on W1 (gate); the other half on W3 (up)
RPC = HALF * RPW  # rows of h per CTA
TILES = I // RPC
THREADS = 32 * WARPS
EPL = (E + 31) // 32  # router logits per lane (selection)


def _sigmoid(x):
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))


class Kernel:
    @cute.jit
    def __call__(self, mZ: cute.Tensor, mLogits: cute.Tensor, mBias: cute.Tensor, mW1: cute.Tensor,
                 mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor, mH: cute.Tensor, mIds: cute.Tensor,
                 mWts: cute.Tensor, stream):
        mZq = cute.recast_tensor(mZ, Uint32)  # [M, L/2] bf16 pairs
        mW1q = cute.recast_tensor(mW1, Uint32)  # [E, I, L/8] 8 codes per word
        mW3q = cute.recast_tensor(mW3, Uint32)
        self.kernel(mZq, mLogits, mBias, mW1q, mS1, mW3q, mS3, mH, mIds, mWts).launch(
            grid=(TILES, TOPK, M), block=(THREADS, 1, 1), stream=stream)

    @cute.jit
    def select(self, mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor,
               sExpert: cute.Tensor, lane, tile, slot, m):
        """Warp 0: top-TOPK of sigmoid(logits) + bias for token m (every lane ends with the same ids)."""
        rKey = cute.make_rmem_tensor((EPL,), Float32)
        for i in cutlass.range_constexpr(EPL):
            rKey[i] = Float32(-math.inf)
            if lane + 32 * i < E:
                rKey[i] = _sigmoid(mLogits[m, lane + 32 * i]) + mBias[lane + 32 * i]
        mine = Int32(0)  # this CTA's expert (round `slot`)
        total = Float32(0.0)
        for j in cutlass.range(TOPK, unroll=1):  # one warp argmax per round
            bk = rKey[0]
            bi = lane
            for i in cutlass.range_constexpr(1, EPL):
                if rKey[i] > bk:
                    bk = rKey[i]
                    bi = lane + 32 * i
            for s in cutlass.range_constexpr(5):
                ok = cute.arch.shuffle_sync_bfly(bk, offset=16 >> s)
                oi = cute.arch.shuffle_sync_bfly(bi, offset=16 >> s)
                if ok > bk:
                    bk = ok
                    bi = oi
                elif ok == bk:
                    if oi < bi:
                        bi = oi
            for i in cutlass.range_constexpr(EPL):
                if lane + 32 * i == bi:
                    rKey[i] = Float32(-math.inf)
            if j == slot:
                mine = bi
            score = _sigmoid(mLogits[m, bi])
            total = total + score
            if lane == 0:
                if tile == 0:
                    if slot == 0:  # the one writer CTA of token m: ids and raw scores first
                        mIds[m, j] = bi
                        mWts[m, j] = score
        if lane == 0:
            sExpert[0] = mine
            if tile == 0:
                if slot == 0:
                    for j in cutlass.range(TOPK, unroll=1):
                        w = mWts[m, j]  # written above by this thread
                        if cutlass.const_expr(RENORMALIZE):
                            w = w / (total + Float32(1e-20))
                        mWts[m, j] = w * Float32(SCALING)

    @cute.jit
    def row_dot(self, mWq: cute.Tensor, mS: cute.Tensor, mZq: cute.Tensor, sOut: cute.Tensor, expert, m, row,
                rloc, j):
        """G lanes: one weight row . z[m]; lane j == 0 writes the fp32 result to sOut[rloc]."""
        rW = [cute.make_rmem_tensor((4,), Uint32) for _ in range(BPL)]
        rZ = cute.make_rmem_tensor((16,), Uint32)
        for t in cutlass.range_constexpr(BPL):  # all weight blocks of this lane in flight first
            cute.autovec_copy(cute.local_tile(mWq[expert, row, None], (4,), (j + G * t,)), rW[t])
        rS = cute.make_rmem_tensor((BPL,), Uint32)
        for t in cutlass.range_constexpr(BPL):
            rS[t] = Uint32(mS[expert, row, j + G * t])
        acc = Float32(0.0)
        for t in cutlass.range_constexpr(BPL):
            cute.autovec_copy(cute.local_tile(mZq[m, None], (16,), (j + G * t,)), rZ)
            acc = acc + mx_block_dot(rW[t], rZ, rS[t])
        acc = cute.arch.warp_reduction(acc, operator.add, threads_in_group=G)
        if j == 0:
            sOut[rloc] = acc

    @cute.kernel
    def kernel(self, mZq: cute.Tensor, mLogits: cute.Tensor, mBias: cute.Tensor, mW1q: cute.Tensor,
               mS1: cute.Tensor, mW3q: cute.Tensor, mS3: cute.Tensor, mH: cute.Tensor, mIds: cute.Tensor,
               mWts: cute.Tensor):
        tid = cute.arch.thread_idx()[0]
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        tile, slot, m = cute.arch.block_idx()
        smem = cutlass.utils.SmemAllocator()
        sExpert = smem.allocate_tensor(Int32, cute.make_layout((1,)), 16)
        sGate = smem.allocate_tensor(Float32, cute.make_layout((RPC,)), 16)
        sUp = smem.allocate_tensor(Float32, cute.make_layout((RPC,)), 16)

        cute.arch.griddepcontrol_wait()  # logits and z come from the previous kernels

        if warp == 0:
            self.select(mLogits, mBias, mIds, mWts, sExpert, lane, tile, slot, m)
        cute.arch.sync_threads()
        expert = sExpert[0]

        j = lane % G
        rloc = (warp % HALF) * RPW + lane // G  # row of this CTA's tile
        row = tile * RPC + rloc
        if warp < HALF:
            self.row_dot(mW1q, mS1, mZq, sGate, expert, m, row, rloc, j)
        else:
            self.row_dot(mW3q, mS3, mZq, sUp, expert, m, row, rloc, j)
        cute.arch.sync_threads()

        if tid < RPC:
            g = sGate[tid].to(BFloat16).to(Float32)  # the reference rounds gate and up to bf16
            u = sUp[tid].to(BFloat16).to(Float32)
            act = Float32(BETA) * cute.math.tanh(g / Float32(BETA)) * _sigmoid(g)
            lin = Float32(LINEAR_BETA) * cute.math.tanh(u / Float32(LINEAR_BETA))
            mH[m, slot, tile * RPC + tid] = (act * lin).to(BFloat16)
        cute.arch.griddepcontrol_launch_dependents()
