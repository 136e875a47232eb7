"""Routed MXFP4 experts, launch 2 of 2: down GEMMs + routing-weighted combine (template moe_down_combine).

    y[m, l] = bf16( sum_j weights[m, j] * bf16( h[m, j] . deq(W2[ids[m, j]])[l, :] ) )

as ops.latent_moe_experts (each expert's output rounded to bf16, then the fp32 weighted sum over the k
experts in slot order, then bf16). h and the grouping of the (token, slot) pairs by expert (``groups``, written
by moe_gate_up: moe_lib.store_groups) come from moe_gate_up, the weights from it or from moe_route. Under TP, y
is this rank's partial sum.

Grid: one CTA per tile of 16 output rows (l). Every CTA copies the grouping into shared memory (cp.async, one
barrier) instead of grouping the ids itself, which at batch 64 took 26 KB more shared memory and held the CTA
to 4 warps (8 now: 173 -> 144 us in the KDA layer; at batch 8 the copy measured 1.5-3 us slower than the
grouping, cause not found; read in place from global memory, 4 us slower). Its WARPS warps take
the active experts in turn: for expert e the
warp runs W2[e] rows l0..l0+15 against the h rows of the tokens that picked e, 8 tokens per
``mma.sync.m16n8k16`` (bf16 in, fp32 accumulate; rows are the MMA's M, tokens its N), over the whole
reduction I in k-steps of 4 MX blocks (lane t of a quad covers block 4*step + t of rows g and g+8; a last
step with fewer than 4 blocks leaves the other lanes' operands zero). A warp's experts stream through a
``cp.async`` ring of STAGES experts in shared memory (16-byte weight copies and, when I/32 is a multiple of
4, the quad's scale words, each copied by one of its lanes; a ``__syncwarp`` after each wait and before each
refill, no barrier), so STAGES - 1 experts are in flight while one is computed; the expert after the ring's
last is prefetched into L2 (one bulk prefetch). A k-step at a time: the column's activations (global,
L2-resident; a column past the group reads the group's last pair instead of a branch), the step's weights
from the ring, the decode and MMA, so a thread needs at most 128 registers and two CTAs of WARPS warps share
an SM (8, or 4 where shared memory leaves 8 warps fewer than 2 stages: 16 warps hide the loads' and MMAs'
latencies; with 4 warps and every step's operands in registers, 252 of them, the SM was idle 46 % of its
cycles; loading all k-steps' activations ahead of the MMAs measured no faster). W2 is in the kernels'
prepacked layout (mxfp4_mirror.prepack). Decode as in moe_gate_up (moe_lib.block_mma). The second scale
factor (bytes above 128): with the scales in the ring, the warp looks at its expert's landed scale words
once and runs the expert with the factor on every block or on none (a warp-uniform branch; predicated per
lane, as without the ring, the factor's 96 multiplies issued on every expert: 14 % of the 680 instructions
of batch 8's loop; moe_gate_up's form, no factor and a rerun where a byte exceeds 128, measured slower here,
243 against 173 us at batch 64 inside the layer with no rerun taken, cause not established).
Each (token, slot) result, rounded to bf16, is stored once in shared memory; after a barrier every
(token, row) sums its TOPK slots in slot order with the routing weights: the combine happens in the CTA,
deterministic, no atomics, no workspace. Each weight byte of an active expert is read by one CTA, once.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint32
from cutlass.cute.nvgpu import cpasync
from cutlass.experimental.primitives import cp_async_bulk_prefetch

from k3compile.templates.kernels.moe_lib import block_mma, load_groups
from k3compile.templates.kernels.mxfp4_lib import scale_pair, scale_pair_selector

# >>> constants
# (example values: rendering replaces this block)
M = 2  # tokens (the batch bucket)
E = 16  # experts (n_experts)
TOPK = 4  # experts per token
L = 128  # latent size (rows of W2, outputs)
I = 256  # intermediate size (reduction length of down on this rank)
WARPS = 8  # warps per CTA (they take the active experts in turn)
STAGES = 2  # experts' weights in flight per warp (cp.async ring in shared memory)
# <<< constants

NB = I // 32  # MX blocks per W2 row
STEPS = (NB + 3) // 4  # k-steps of a quad (4 blocks each; the last may be partial)
CTAS = L // 16  # one CTA per 16 output rows
P = M * TOPK  # (token, slot) pairs
MAXA = min(E, P)  # distinct experts at most
THREADS = 32 * WARPS
SCALE_RING = NB % 4 == 0  # scale rows are whole 4-byte words: the scales travel in the ring too
G_ACT = 1  # the parts of moe_gate_up's grouping (moe_lib.store_groups): the active experts,
G_START = 1 + MAXA  # their starts in the pairs,
G_NUM = 1 + 2 * MAXA  # their pair counts,
G_PAIRS = 1 + 3 * MAXA  # the pairs
GLEN = G_PAIRS + P


class Kernel:
    @cute.jit
    def __call__(self, mH: cute.Tensor, mGroups: cute.Tensor, mWts: cute.Tensor, mW2: cute.Tensor,
                 mS2: cute.Tensor, mY: cute.Tensor, stream):
        mHq = cute.recast_tensor(mH, Uint32)  # [M, TOPK, I/2] bf16 pairs
        mW2q = cute.recast_tensor(mW2, Uint32)  # [E, L, I/8] 8 codes per word
        mS2q = cute.recast_tensor(mS2, Uint32) if SCALE_RING else mS2  # [E, L, NB/4]: a k-step's 4 scales per word
        self.kernel(mHq, mGroups, mWts, mW2q, mS2q, mY).launch(grid=(CTAS, 1, 1), block=(THREADS, 1, 1),
                                                           stream=stream, use_pdl=True, min_blocks_per_mp=2,
                                                           preferred_smem_carveout=100)

    @cute.jit
    def prefetch_expert(self, a, n_active, sG: cute.Tensor, mW2q: cute.Tensor, mS2: cute.Tensor, row0):
        """Pull expert a's 16 rows of W2 (contiguous) and their scales into L2."""
        if a < n_active:
            e = sG[G_ACT + a]
            cp_async_bulk_prefetch(mW2q[e, row0, None].iterator, 16 * (I // 2))
            cp_async_bulk_prefetch(mS2[e, row0, None].iterator, 16 * (I // 32))

    @cute.jit
    def issue_expert(self, mW2q: cute.Tensor, mS2: cute.Tensor, e, row0, g, t, sW: cute.Tensor, sS: cute.Tensor,
                     lane):
        """cp.async of this lane's share of expert e into one ring stage (sW [2 STEPS, 32, 4] words, sS [8,
        2 STEPS]): per k-step s, MX block 4s + t of rows g and g + 8 (16 bytes each; none past I) and, with
        SCALE_RING, a share of the quad's 2 STEPS scale words (word 2s + r: the bytes of blocks 4s .. 4s + 3 of
        row g + 8r), lane t copying words t, t + 4, ... into sS[g, :]. A lane reads back its own weight copies
        and its quad's scale words (visible after the ``__syncwarp`` that follows the wait)."""
        big = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), Uint32,
                                  num_bits_per_copy=128)
        word = cute.make_copy_atom(cpasync.CopyG2SOp(), Uint32, num_bits_per_copy=32)
        for s in cutlass.range_constexpr(STEPS):
            blk = 4 * s + t
            for r in cutlass.range_constexpr(2):
                row = row0 + g + 8 * r
                if blk < NB:
                    cute.copy(big, cute.local_tile(mW2q[e, row, None], (4,), (blk,)), sW[2 * s + r, lane, None])
        if cutlass.const_expr(SCALE_RING):
            for jj in cutlass.range_constexpr((2 * STEPS + 3) // 4):
                j = 4 * jj + t  # word j: k-step j // 2, row g + 8 (j % 2)
                if j < 2 * STEPS:
                    cute.copy(word, cute.local_tile(mS2[e, row0 + g + 8 * (j % 2), None], (1,), (j // 2,)),
                              cute.local_tile(sS[g, None], (1,), (j,)))

    @cute.jit
    def read_step(self, mS2: cute.Tensor, e, row0, g, t, s: cutlass.Constexpr, sW: cute.Tensor, sS: cute.Tensor,
                  lane, rW: cute.Tensor, rS: cute.Tensor):
        """This lane's weights and scale pairs (mxfp4_lib.scale_pair) of k-step s of expert e from its landed ring
        stage (zero operands past I; without SCALE_RING the scale bytes come from global memory)."""
        blk = 4 * s + t
        for r in cutlass.range_constexpr(2):
            if blk < NB:
                cute.autovec_copy(sW[2 * s + r, lane, None], cute.local_tile(rW, (4,), (r,)))
                if cutlass.const_expr(SCALE_RING):
                    rS[r] = scale_pair(sS[g, 2 * s + r], scale_pair_selector(t))
                else:
                    rS[r] = Uint32(mS2[e, row0 + g + 8 * r, blk]) * Uint32(0x10001)
            else:  # past I in a partial last step: zero operands
                for i in cutlass.range_constexpr(4):
                    rW[4 * r + i] = Uint32(0)
                rS[r] = Uint32(0x007F007F)  # scale byte 127 (2**0) in both halves

    @cute.jit
    def scales_big(self, sS: cute.Tensor, g):
        """Whether a scale byte above 128 is among quad g's landed scale words of one ring stage (SCALE_RING;
        a byte b > 128 has bit 7 and a low bit: per byte, bit 7 of b & ((b & 0x7F) + 0x7F))."""
        big = Uint32(0)
        for i in cutlass.range_constexpr(2 * STEPS):
            w = sS[g, i]
            big = big | (w & ((w & Uint32(0x7F7F7F7F)) + Uint32(0x7F7F7F7F)))
        return (big & Uint32(0x80808080)) != Uint32(0)

    @cute.jit
    def expert(self, second: cutlass.Constexpr, mHf: cute.Tensor, mS2: cute.Tensor, sG: cute.Tensor, a, row0, g, t,
               sW: cute.Tensor, sS: cute.Tensor, sPart: cute.Tensor, lane, rW: cute.Tensor, rS: cute.Tensor,
               rX: cute.Tensor, acc: cute.Tensor):
        """Active expert a's 16 rows (landed in ring stage sW / sS) against its tokens' h rows, 8 columns at a
        time, each (token, slot) result rounded to bf16 into sPart; block_mma's second factor as ``second``."""
        e = sG[G_ACT + a]
        start = G_PAIRS + sG[G_START + a]
        num = sG[G_NUM + a]
        for nt in cutlass.range(0, num, 8, unroll=1):
            # a column past the group reads the group's last pair: its results are not stored, and an MMA
            # column depends only on its own activations
            pair = sG[start + cutlass.min(nt + g, num - 1)]
            acc.fill(0.0)
            for s in cutlass.range_constexpr(STEPS):  # one k-step at a time (registers: 16 warps per SM)
                blk = 4 * s + t
                if cutlass.const_expr(4 * s + 4 <= NB):  # every lane's block exists
                    cute.autovec_copy(cute.local_tile(mHf[pair, None], (16,), (blk,)), rX)
                else:
                    if blk < NB:
                        cute.autovec_copy(cute.local_tile(mHf[pair, None], (16,), (blk,)), rX)
                    else:  # past I in a partial last step: zero operands (the weights are zero too; 0 * NaN is not)
                        rX.fill(0)
                self.read_step(mS2, e, row0, g, t, s, sW, sS, lane, rW, rS)
                block_mma(rW, 0, rS[0], rS[1], rX, acc, 0, second)
            for i in cutlass.range_constexpr(4):  # C fragment: rows g, g + 8; columns 2t, 2t + 1
                cc = nt + 2 * t + i % 2
                if cc < num:
                    sPart[sG[start + cc], g + 8 * (i // 2)] = acc[i].to(BFloat16)  # expert output, bf16

    @cute.kernel
    def kernel(self, mHq: cute.Tensor, mGroups: cute.Tensor, mWts: cute.Tensor, mW2q: cute.Tensor,
               mS2: cute.Tensor, mY: cute.Tensor):
        tid = cute.arch.thread_idx()[0]
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        row0 = cute.arch.block_idx()[0] * 16
        smem = cutlass.utils.SmemAllocator()
        sPart = smem.allocate_tensor(BFloat16, cute.make_layout((P, 16)), 16)  # per (token, slot), per row
        sG = smem.allocate_tensor(Int32, cute.make_layout((GLEN,)), 16)  # the grouping
        # the weight ring, row-major: a lane's 16 bytes contiguous, lanes side by side (no bank conflicts)
        sW = smem.allocate_tensor(Uint32, cute.make_layout((WARPS, STAGES, 2 * STEPS, 32, 4),
                                                           stride=(STAGES * STEPS * 256, STEPS * 256, 128, 4, 1)), 16)
        sS = smem.allocate_tensor(Uint32, cute.make_layout((WARPS, STAGES, 8, 2 * STEPS),
                                                           stride=(STAGES * STEPS * 16, STEPS * 16, 2 * STEPS, 1)),
                                  16)

        cute.arch.griddepcontrol_wait()  # h, groups and weights come from moe_gate_up (weights: moe_route)
        cute.arch.griddepcontrol_launch_dependents()  # the next kernel may start its prologue now
        load_groups(mGroups, sG, tid, THREADS)
        cute.arch.sync_threads()
        n_active = sG[0]

        mHf = cute.make_tensor(mHq.iterator, cute.make_layout((P, I // 2), stride=(I // 2, 1)))  # h by pair
        g = lane // 4  # MMA rows g and g + 8, and the token column of this lane
        t = lane % 4  # which block of a k-step this lane loads
        rW = cute.make_rmem_tensor((8,), Uint32)  # one k-step: rows g, g + 8 (4 words each)
        rS = cute.make_rmem_tensor((2,), Uint32)
        rX = cute.make_rmem_tensor((16,), Uint32)  # one k-step's activations of the lane's column
        acc = cute.make_rmem_tensor((4,), Float32)
        n_mine = (n_active - warp + WARPS - 1) // WARPS  # this warp's experts: warp, warp + WARPS, ...
        # a ring of STAGES experts in flight: one cp.async group per expert (empty past the warp's last)
        for k in cutlass.range_constexpr(STAGES - 1):
            if k < n_mine:
                self.issue_expert(mW2q, mS2, sG[G_ACT + warp + k * WARPS], row0, g, t,
                                  sW[warp, k, None, None, None], sS[warp, k, None, None], lane)
            cute.arch.cp_async_commit_group()
        for k in cutlass.range(n_mine, unroll=1):
            if lane == 0:  # the expert after the ring's last: into L2 now
                self.prefetch_expert(warp + (k + STAGES) * WARPS, n_active, sG, mW2q, mS2, row0)
            nxt = k + STAGES - 1
            cute.arch.sync_warp()  # every lane is done with expert k - 1, whose stage is refilled now
            if nxt < n_mine:
                self.issue_expert(mW2q, mS2, sG[G_ACT + warp + nxt * WARPS], row0, g, t,
                                  sW[warp, nxt % STAGES, None, None, None], sS[warp, nxt % STAGES, None, None], lane)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(STAGES - 1)  # expert k has landed (this lane's copies)
            cute.arch.sync_warp()  # ... and every lane's: the quad's scale words
            a = warp + k * WARPS
            stage_w = sW[warp, k % STAGES, None, None, None]
            stage_s = sS[warp, k % STAGES, None, None]
            if cutlass.const_expr(SCALE_RING):  # the expert's scale bytes decide the decode's form, warp-wide
                if cute.arch.vote_any_sync(self.scales_big(stage_s, g)):
                    self.expert(True, mHf, mS2, sG, a, row0, g, t, stage_w, stage_s, sPart, lane, rW, rS, rX, acc)
                else:
                    self.expert(False, mHf, mS2, sG, a, row0, g, t, stage_w, stage_s, sPart, lane, rW, rS, rX, acc)
            else:  # scale bytes from global memory, per lane: the second factor predicated
                self.expert(None, mHf, mS2, sG, a, row0, g, t, stage_w, stage_s, sPart, lane, rW, rS, rX, acc)
        cute.arch.sync_threads()
        for idx in cutlass.range(tid, M * 16, THREADS, unroll=1):  # combine: slot order, fp32
            m = idx // 16
            r = idx % 16
            total = Float32(0.0)
            for j in cutlass.range_constexpr(TOPK):
                total = total + sPart[m * TOPK + j, r].to(Float32) * mWts[m, j]
            mY[m, row0 + r] = total.to(BFloat16)
