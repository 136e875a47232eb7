"""Absorbed MLA decode over the latent cache, with the kv_a RMSNorm and latent-row assembly folded in
(dialect op ``mla_decode_latent``). Two kernels, launched one after the other by ``Kernel.__call__``.

Semantics (``k3compile.dialect.mla_decode_latent_impl`` / ``models.ops.mla_decode``), per row m and
local head h:

* ``latent = [bf16(w * bf16(KimiRMSNorm(kv[:, :C]))) | kv[:, C:]]`` (written to the ``latent`` output;
  the graph copies it into the cache afterwards: this kernel never writes the cache);
* ``ql[h] = q_nope[h] @ W_uk[h]`` ([C], fp32), scores over positions p = 0..lengths[m]
  ``s = (ql . c_p + q_pe . kpe_p) * SCALE`` where the row at p = lengths[m] is ``latent`` and earlier
  rows come from the cache, softmax, ``ol = sum_p prob_p c_p`` ([C]), ``o[h] = ol @ W_uv[h]^T`` ([V]),
  ``out = bf16(o * sigmoid(gate))``.

Kernel 1 (``kernel``, grid (NSPLIT, M), one warp per local head, so THREADS = 32 * max(H, 2): with one
local head a second warp shares the cooperative tile loads and the latent row, computes head 0 again and
writes nothing (one warp alone would spill the staging registers)): flash-decoding
split over the context. Row m has n = lengths[m] + 1 valid positions (read on device); it uses
``nact = min(NSPLIT, ceil(n / CHUNK_MIN))`` splits of ``ceil(n / nact)`` positions each; CTAs with a
split index >= nact do nothing. An active CTA
  1. rebuilds the latent row in shared memory (RMSNorm of the C part, rope part copied) -- split 0 also
     writes it to ``latent``;
  2. absorbs the query: warp h computes ql[h] (pre-scaled by SCALE*log2(e), so the softmax runs in exp2)
     and keeps it in registers, lane l owning the 8-element chunks l, l+32, ... of C and R/32 rope dims;
  3. streams its positions TILE rows at a time: all threads copy the rows (16-byte loads; the current
     token's row comes from shared memory) through registers into a shared-memory tile, and the loads of
     the next tile are issued before the current one is consumed. Every cache row is read from global
     memory once per token, for all heads. Each warp then walks the tile: dot products, one warp
     reduction per row, online softmax (running max / sum in registers; ol is rescaled only when the
     running max grows), ol accumulated in registers;
  4. writes its partial (ol [C] unnormalized, running max in log2 units, running sum) to the scratch
     workspace ``ws_ol`` [M, NSPLIT, H, C] / ``ws_ml`` [M, NSPLIT, H, 2].
Kernel 2 (``combine_kernel``, grid (H, M), C/4 threads): merges the nact partials of one (row, head)
(rescaled by exp2(max_s - max)), normalizes, zeroes the partials it consumed (the scratch is left as it
was found: all zero), then o = ol @ W_uv[h]^T (one warp per 32 outputs, one warp reduction per output)
and the sigmoid gate.

The cache is a decode-state argument but read-only here. Lengths outside [0, LMAX-1] are clamped into it
(the model never passes them). All shapes are static; only the lengths are runtime values.
"""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

# >>> constants
# (example values: rendering replaces this block)
M = 2  # rows (the batch bucket)
H = 8  # local heads (one warp each)
NOPE = 128  # qk_nope_head_dim
R = 64  # qk_rope_head_dim (k_pe width, unrotated)
V = 128  # v_head_dim
C = 512  # kv_lora_rank (latent width)
LMAX = 1024  # cache positions per row
KV_EPS = 1e-06  # kv_a_layernorm epsilon
SCALE = 0.07216878364870322  # softmax scale ((nope + rope) ** -0.5)
NSPLIT = 4  # most context splits per row (grid.x of kernel 1)
CHUNK_MIN = 256  # fewest positions per split (short rows use fewer splits)
TILE = 32  # cache rows staged in shared memory per step
# <<< constants

VEC = 8  # bf16 elements per 16-byte load
ROW = C + R  # latent row (cache row) width
QH = NOPE + R  # q elements per head
KVH = NOPE + V  # kv_b_weight rows per head (W_uk rows then W_uv rows)
WARPS = max(H, 2)  # kernel 1: one warp per head, at least two (warps >= H repeat head H - 1, write nothing)
THREADS = 32 * WARPS
CCH = C // (VEC * 32)  # 8-element chunks of C per lane
RPL = R // 32  # rope elements per lane
RCH = ROW // VEC  # 16-byte chunks per latent row
STAGE = (TILE * RCH + THREADS - 1) // THREADS  # 16-byte chunks each thread stages per tile
STAGE_EXACT = TILE * RCH % THREADS == 0
NORM_THREADS = C // VEC  # threads holding the C part of the latent row (whole warps)
NORM_WARPS = NORM_THREADS // 32
ROPE_THREADS = R // VEC  # threads holding the rope part
COMBINE_THREADS = C // 4  # kernel 2: each thread merges 4 consecutive ol elements
COMBINE_WARPS = COMBINE_THREADS // 32
VGROUPS = V // 32  # kernel 2: groups of 32 outputs (one per lane)
MIN_CTAS = 2 if THREADS <= 256 else 1  # kernel 1: ask ptxas for <= 128 registers when 2 CTAs can fit
SCALE_LOG2 = SCALE * 1.4426950408889634  # scores in log2 units: softmax via exp2
NEG = -1.0e30  # finite "minus infinity" for running maxima (exp2(NEG - x) == 0, no inf - inf)


class Kernel:
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKv: cute.Tensor, mKvNormW: cute.Tensor, mGate: cute.Tensor,
                 mCache: cute.Tensor, mLengths: cute.Tensor, mKvB: cute.Tensor, mOut: cute.Tensor,
                 mLatent: cute.Tensor, mWsOl: cute.Tensor, mWsMl: cute.Tensor, stream):
        self.kernel(mQ, mKv, mKvNormW, mCache, mLengths, mKvB, mLatent, mWsOl, mWsMl).launch(
            grid=(NSPLIT, M, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True, min_blocks_per_mp=MIN_CTAS,
            preferred_smem_carveout=100)
        self.combine_kernel(mGate, mLengths, mKvB, mOut, mWsOl, mWsMl).launch(
            grid=(H, M, 1), block=(COMBINE_THREADS, 1, 1), stream=stream, use_pdl=True)

    # ------------------------------------------------------------------------------------ helpers
    @cute.jit
    def splits_of(self, mLengths: cute.Tensor, row):
        """(clamped length, valid positions n, active splits, positions per split) of one row."""
        length = Int32(mLengths[row])
        length = cutlass.max(cutlass.min(length, Int32(LMAX - 1)), Int32(0))
        n = length + 1
        nact = cutlass.min((n + (CHUNK_MIN - 1)) // CHUNK_MIN, Int32(NSPLIT))
        chunk = (n + nact - 1) // nact
        return length, n, nact, chunk

    @cute.jit
    def load_tile(self, mCache: cute.Tensor, sLatent: cute.Tensor, rStage: cute.Tensor, row, t0, end, length,
                  tid):
        """Issue the 16-byte loads of cache rows t0 .. t0+TILE-1 (those < end) into registers."""
        for i in cutlass.range_constexpr(STAGE):
            idx = tid + i * THREADS
            r = idx // RCH
            ch = idx - r * RCH
            p = t0 + r
            valid = p < end
            if cutlass.const_expr(not STAGE_EXACT):
                valid = valid & (idx < TILE * RCH)
            if valid:
                if p == length:
                    cute.autovec_copy(cute.local_tile(sLatent, (VEC,), (ch,)), rStage[None, i])
                else:
                    cute.autovec_copy(cute.local_tile(mCache[row, p, None], (VEC,), (ch,)), rStage[None, i])

    @cute.jit
    def store_tile(self, sTile: cute.Tensor, rStage: cute.Tensor, t0, end, tid):
        for i in cutlass.range_constexpr(STAGE):
            idx = tid + i * THREADS
            r = idx // RCH
            ch = idx - r * RCH
            valid = t0 + r < end
            if cutlass.const_expr(not STAGE_EXACT):
                valid = valid & (idx < TILE * RCH)
            if valid:
                cute.autovec_copy(rStage[None, i], cute.local_tile(sTile[r, None], (VEC,), (ch,)))

    # ------------------------------------------------------------------ kernel 1: split attention
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKv: cute.Tensor, mKvNormW: cute.Tensor, mCache: cute.Tensor,
               mLengths: cute.Tensor, mKvB: cute.Tensor, mLatent: cute.Tensor, mWsOl: cute.Tensor,
               mWsMl: cute.Tensor):
        tid = cute.arch.thread_idx()[0]
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        head = cutlass.min(warp, Int32(H - 1))
        split = cute.arch.block_idx()[0]
        row = cute.arch.block_idx()[1]
        smem = cutlass.utils.SmemAllocator()
        sTile = smem.allocate_tensor(BFloat16, cute.make_layout((TILE, ROW), stride=(ROW, 1)), 16)
        sLatent = smem.allocate_tensor(BFloat16, cute.make_layout((ROW,)), 16)
        sNorm = smem.allocate_tensor(Float32, cute.make_layout((NORM_WARPS,)), 16)
        rX = cute.make_rmem_tensor((VEC,), BFloat16)
        rW = cute.make_rmem_tensor((VEC,), BFloat16)
        rY = cute.make_rmem_tensor((VEC,), BFloat16)
        rWk = cute.make_rmem_tensor((VEC, CCH), BFloat16)
        rQl = cute.make_rmem_tensor((VEC, CCH), Float32)
        rQpeB = cute.make_rmem_tensor((RPL,), BFloat16)
        rQpe = cute.make_rmem_tensor((RPL,), Float32)
        rC = cute.make_rmem_tensor((VEC, CCH), BFloat16)
        rPe = cute.make_rmem_tensor((RPL,), BFloat16)
        rOl = cute.make_rmem_tensor((VEC, CCH), Float32)
        rStage = cute.make_rmem_tensor((VEC, STAGE), BFloat16)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()  # the next kernel may start its prologue now

        length, n, nact, chunk = self.splits_of(mLengths, row)
        start = split * chunk
        end = cutlass.min(start + chunk, n)
        if split < nact:
            # -- 1. the current token's latent row: KimiRMSNorm(kv[:C]) * w | kv[C:]
            ss = Float32(0.0)
            if tid < NORM_THREADS:
                cute.autovec_copy(cute.local_tile(mKv[row, None], (VEC,), (tid,)), rX)
                x = rX.load().to(Float32)
                ss = (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
            ss = cute.arch.warp_reduction(ss, operator.add)
            if lane == 0 and warp < NORM_WARPS:
                sNorm[warp] = ss
            cute.arch.sync_threads()
            total = Float32(0.0)
            for w in cutlass.range_constexpr(NORM_WARPS):
                total = total + sNorm[w]
            rstd = cute.math.rsqrt(total / Float32(C) + Float32(KV_EPS))
            if tid < NORM_THREADS:
                cute.autovec_copy(cute.local_tile(mKvNormW, (VEC,), (tid,)), rW)
                normed = (rX.load().to(Float32) * rstd).to(BFloat16)  # KimiRMSNorm rounds before the weight
                rY.store((normed.to(Float32) * rW.load().to(Float32)).to(BFloat16))
                cute.autovec_copy(rY, cute.local_tile(sLatent, (VEC,), (tid,)))
                if split == 0:
                    cute.autovec_copy(rY, cute.local_tile(mLatent[row, None], (VEC,), (tid,)))
            # the rope part, strided over every thread (with 2 heads there are fewer threads than chunks)
            for r8 in cutlass.range(tid, ROPE_THREADS, THREADS, unroll=1):
                cute.autovec_copy(cute.local_tile(mKv[row, None], (VEC,), (NORM_THREADS + r8,)), rX)
                cute.autovec_copy(rX, cute.local_tile(sLatent, (VEC,), (NORM_THREADS + r8,)))
                if split == 0:
                    cute.autovec_copy(rX, cute.local_tile(mLatent[row, None], (VEC,), (NORM_THREADS + r8,)))
            cute.arch.sync_threads()

            # -- 2. absorbed query of this warp's head, pre-scaled into log2 units
            rQl.fill(0.0)
            for d in cutlass.range(NOPE, unroll=4):
                qd = Float32(mQ[row, head * QH + d])
                for k in cutlass.range_constexpr(CCH):
                    cute.autovec_copy(cute.local_tile(mKvB[head * KVH + d, None], (VEC,), (k * 32 + lane,)),
                                      rWk[None, k])
                    rQl[None, k].store(rQl[None, k].load() + rWk[None, k].load().to(Float32) * qd)
            for k in cutlass.range_constexpr(CCH):
                rQl[None, k].store(rQl[None, k].load() * Float32(SCALE_LOG2))
            cute.autovec_copy(cute.local_tile(mQ[row, None], (RPL,), ((head * QH + NOPE) // RPL + lane,)), rQpeB)
            rQpe.store(rQpeB.load().to(Float32) * Float32(SCALE_LOG2))

            # -- 3. stream the positions [start, end): online softmax per head
            rOl.fill(0.0)
            m_run = Float32(NEG)
            l_run = Float32(0.0)
            self.load_tile(mCache, sLatent, rStage, row, start, end, length, tid)
            for t0 in cutlass.range(start, end, TILE, unroll=1):
                self.store_tile(sTile, rStage, t0, end, tid)
                cute.arch.sync_threads()
                self.load_tile(mCache, sLatent, rStage, row, t0 + TILE, end, length, tid)  # next tile in flight
                rows = cutlass.min(end - t0, Int32(TILE))
                for j in cutlass.range(rows, unroll=1):
                    for k in cutlass.range_constexpr(CCH):
                        cute.autovec_copy(cute.local_tile(sTile[j, None], (VEC,), (k * 32 + lane,)), rC[None, k])
                    cute.autovec_copy(cute.local_tile(sTile[j, None], (RPL,), (C // RPL + lane,)), rPe)
                    part = (rQpe.load() * rPe.load().to(Float32)).reduce(
                        cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
                    for k in cutlass.range_constexpr(CCH):
                        part = part + (rQl[None, k].load() * rC[None, k].load().to(Float32)).reduce(
                            cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
                    score = cute.arch.warp_reduction(part, operator.add)  # identical in every lane
                    if score > m_run:  # warp-uniform: rescale only when the running max grows
                        alpha = cute.math.exp2(m_run - score, fastmath=True)
                        l_run = l_run * alpha
                        for k in cutlass.range_constexpr(CCH):
                            rOl[None, k].store(rOl[None, k].load() * alpha)
                        m_run = score
                    prob = cute.math.exp2(score - m_run, fastmath=True)
                    l_run = l_run + prob
                    for k in cutlass.range_constexpr(CCH):
                        rOl[None, k].store(rOl[None, k].load() + rC[None, k].load().to(Float32) * prob)
                cute.arch.sync_threads()

            # -- 4. this split's partial
            if warp < H:
                for k in cutlass.range_constexpr(CCH):
                    cute.autovec_copy(rOl[None, k],
                                      cute.local_tile(mWsOl[row, split, head, None], (VEC,), (k * 32 + lane,)))
                if lane == 0:
                    mWsMl[row, split, head, 0] = m_run
                    mWsMl[row, split, head, 1] = l_run

    # ------------------------------------------------------- kernel 2: combine, W_uv, output gate
    @cute.kernel
    def combine_kernel(self, mGate: cute.Tensor, mLengths: cute.Tensor, mKvB: cute.Tensor, mOut: cute.Tensor,
                       mWsOl: cute.Tensor, mWsMl: cute.Tensor):
        tid = cute.arch.thread_idx()[0]
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        head = cute.arch.block_idx()[0]
        row = cute.arch.block_idx()[1]
        smem = cutlass.utils.SmemAllocator()
        sOl = smem.allocate_tensor(Float32, cute.make_layout((C,)), 16)
        rAcc = cute.make_rmem_tensor((4,), Float32)
        rPart = cute.make_rmem_tensor((4,), Float32)
        rZero = cute.make_rmem_tensor((4,), Float32)
        rOlc = cute.make_rmem_tensor((VEC, CCH), Float32)
        rWv = cute.make_rmem_tensor((VEC, CCH), BFloat16)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()  # the next kernel may start its prologue now

        length, n, nact, chunk = self.splits_of(mLengths, row)
        m_all = Float32(NEG)
        for s in cutlass.range(nact, unroll=1):
            m_all = cute.arch.fmax(m_all, mWsMl[row, s, head, 0])
        rAcc.fill(0.0)
        rZero.fill(0.0)
        l_all = Float32(0.0)
        for s in cutlass.range(nact, unroll=1):
            weight = cute.math.exp2(mWsMl[row, s, head, 0] - m_all, fastmath=True)
            l_all = l_all + mWsMl[row, s, head, 1] * weight
            gPart = cute.local_tile(mWsOl[row, s, head, None], (4,), (tid,))
            cute.autovec_copy(gPart, rPart)
            rAcc.store(rAcc.load() + rPart.load() * weight)
            cute.autovec_copy(rZero, gPart)  # leave the scratch as it was found
        rAcc.store(rAcc.load() * (Float32(1.0) / l_all))
        cute.autovec_copy(rAcc, cute.local_tile(sOl, (4,), (tid,)))
        cute.arch.sync_threads()
        for s in cutlass.range(tid, nact, COMBINE_THREADS, unroll=1):
            mWsMl[row, s, head, 0] = Float32(0.0)
            mWsMl[row, s, head, 1] = Float32(0.0)

        for k in cutlass.range_constexpr(CCH):
            cute.autovec_copy(cute.local_tile(sOl, (VEC,), (k * 32 + lane,)), rOlc[None, k])
        for g in cutlass.range(warp, VGROUPS, COMBINE_WARPS, unroll=1):
            mine = Float32(0.0)
            for j in cutlass.range(32, unroll=2):
                vrow = head * KVH + NOPE + g * 32 + j
                part = Float32(0.0)
                for k in cutlass.range_constexpr(CCH):
                    cute.autovec_copy(cute.local_tile(mKvB[vrow, None], (VEC,), (k * 32 + lane,)), rWv[None, k])
                    part = part + (rOlc[None, k].load() * rWv[None, k].load().to(Float32)).reduce(
                        cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
                o = cute.arch.warp_reduction(part, operator.add)
                mine = cutlass.select_(lane == j, o, mine)
            col = head * V + g * 32 + lane
            gate = Float32(mGate[row, col])
            mOut[row, col] = (mine / (Float32(1.0) + cute.math.exp(-gate, fastmath=True))).to(BFloat16)
