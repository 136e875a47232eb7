"""Absorbed MLA decode over the latent cache, with the kv_a RMSNorm and latent-row assembly folded in
(dialect op ``mla_decode_latent``). Three kernels, launched one after the other by ``Kernel.__call__``.

Semantics (``k3compile.dialect.mla_decode_latent_impl`` / ``models.ops.mla_decode``), per row m and
local head h:

* ``latent = [bf16(w * bf16(KimiRMSNorm(kv[:, :C]))) | kv[:, C:]]`` (written to the ``latent`` output and
  into the cache in place at ``cache[m, lengths[m]]``, the row the model's ``index_put_`` writes: the runtime
  drops that graph node);
* ``ql[h] = q_nope[h] @ W_uk[h]`` ([C]), scores over positions p = 0..lengths[m]
  ``s = (ql . c_p + q_pe . kpe_p) * SCALE`` where the row at p = lengths[m] is ``latent`` and earlier
  rows come from the cache, softmax, ``ol = sum_p prob_p c_p`` ([C]), ``o[h] = ol @ W_uv[h]^T`` ([V]),
  ``out = bf16(o * sigmoid(gate))``.

Kernel 1 (``absorb_kernel``, grid (H, C / ACB), 256 threads): the absorbed query ``ql = q_nope @ W_uk`` of one head
and ACB = 32 of its C columns for every row, on the tensor cores as ``ql^T = W_uk^T q_nope^T`` (the columns are the
16-row MMA tiles, the batch rows the 8-wide N tiles, zero-padded to a multiple of 8, NOPE the K dimension; fp32
accumulation, rounded once to bf16 into the scratch ``ws_q`` [M, H, C]): each W_uk column is read once per step, not
once per row (at batch 64 the per-row form read W_uk 64 times from L2), and computed once per (row, head) instead of
in every context split. W_uk's [NOPE, ACB] slice is copied into shared memory before the PDL wait, q_nope's rows
after it. CTA i (head-major) also builds the latent rows i, i + H C / ACB, .. and writes them to ``latent`` and to
the cache row at position lengths[m] (clamped as the attention kernel clamps it), after its PDL wait like every
other access but weights. No race with the attention kernel: it reads only cache positions below lengths[m] (the
current token's row it takes from ``latent``), and nothing before its PDL wait, which returns once this kernel's
writes are visible.

Kernel 2 (``kernel``, 8 warps): flash-decoding split over the context, on the tensor cores; grid (SMS, HGN): CTA i takes
the i-th (row, split) item of the batch's plan (BALANCED, ``item_of``), else grid (NSPLIT, M, HGN): CTA (split, row).
The last grid dimension is the head group: up to 32 local heads (HGN = 1) every CTA computes all of them; above
that (K3 at TP 2 and 1) HGN groups of HG heads each (``head_ok`` masks the padding), every group reading the cache
rows again; each head's arithmetic is the same either way.
Row m has n = lengths[m] + 1 valid positions (read on device). BALANCED (BALANCE and M > 1): its splits are runs
of tp whole TILE-row tiles, ``nact = ceil(n / (tp TILE))`` of them, tp the same for every row: the smallest number of
tiles (at least CHUNK_MIN positions, at most NSPLIT splits per row) whose splits over the whole batch fit one wave of
SMS CTAs, computed by every warp from all M lengths (``tiles_per_split``; mirrored by the template's
``split_plan``). A grid of NSPLIT x M CTAs, most of them idle, queued the idle ones behind long active ones: every
CTA holds an SM's shared memory until its PDL wait returns. A BALANCED CTA lets the combine kernel launch only after
its last tile (PDL trigger; the others right after their wait): one wave on part of the SMs otherwise let the
combine's clustered CTAs fill the idle SMs early and wait there (H200, K3 TP8 shard, the template's exposed time at
batch 8 / 32k context 120 -> 117 us, at batch 64 / 32k 795 -> 790).
Otherwise (one row; batch-invariant code, where a row's splits depend only on its own length) ``nact = min(NSPLIT,
ceil(n / CHUNK_MIN))`` splits of ``ceil(n / nact)`` positions. CTAs with a split index >= nact do nothing. An
active CTA:
  1. copies its query into shared memory, ``Q = [ql | q_pe]`` (HP = 16 * HT rows: the local heads padded to
     whole 16-row MMA tiles with zero rows, ROW = C + R bf16 columns);
  2. streams its positions TILE = 64 at a time through a two-stage ``cp.async`` ring (each warp copies 8 cache
     rows; the current token's row comes from ``latent``, positions past the split are zero-filled), so one
     tile is in flight while the other is used. Every cache row is read from global memory once per token,
     for all heads;
  3. per tile: S = Q K^T with ``mma.sync.m16n8k16`` (bf16 in, fp32 accumulate; warp w computes the 8
     positions 8w..8w+7 for every head over the whole ROW; operands through ``ldmatrix``), scaled into log2
     units, positions past the split masked, and exchanged through shared memory; then every warp runs the
     same online softmax over the tile (row max and sum within each quad of lanes; the running max and sum
     are identical in every warp), rounds the probabilities P to bf16 (the sum uses the rounded values, so
     the normalisation matches the weights applied) and accumulates O += P V for its C / 8 output columns
     (``ldmatrix.trans`` reads the value rows straight from the tile: V is the C part of the cache rows);
  4. writes its partial (O [C] unnormalised, running max in log2 units, running sum) to the scratch
     workspace ``ws_ol`` [M, NSPLIT, H, C] / ``ws_ml`` [M, NSPLIT, H, 2]. The combine kernel reads only the
     partials of the active splits, which are written first: the scratch needs no zeroing.
Rows of shared memory are padded by 16 bytes, so the eight row addresses of an ``ldmatrix`` fall in
different banks.

Kernel 3 (``combine_kernel``, grid (COMBINE_SPLIT, H, M / RB), 8 warps): one head of RB rows (RB = min(M, 2)
unless the point fixes it), the COMBINE_SPLIT CTAs of a thread-block cluster each merging CS = C / COMBINE_SPLIT
columns of the partials (at K3's C = 512 four CTAs per head at every batch, ``combine_split``): the bytes of the
partials are split over the cluster, not read again by every CTA.
  1. Statistics: every warp of a row loads the (max, sum) of its nact splits, SPL per lane at once (lane l: splits
     l, l + 32, ...), keeps a running max and a rescaled sum, and a butterfly merges the lanes (both lanes of a pair
     add the same two terms, so every lane ends with the same values).
  2. Merge: the 8 / RB warps of the row take its splits kw, kw + 8 / RB, ... (MERGE_UNROLL splits' loads in flight:
     the max and OCH 16-byte chunks of the CTA's columns per lane), weights exp2(max_s - max) / sum; the warps'
     sums meet in shared memory, added in warp order.
  3. The CTA's part of o = ol @ W_uv[h]^T over its CS columns, for every output and row. When W_uv's CS columns
     fit (STAGE_WUV: four CTAs per head at K3) they are copied into shared memory (cp.async) before the PDL wait,
     while the attention kernel runs, and thread t takes output t % V over a group of columns (fp32 FMAs, no warp
     reductions; the merged ol is a shared-memory broadcast), the groups added in order. Otherwise they are pulled
     into L2 before the wait and each warp takes whole outputs (its lanes read a W_uv row coalesced, one warp
     reduction per output and row): one thread per output reading rows 1 KB apart from L2 cost 15 us at batch 64.
  4. A cluster barrier (release / acquire), then CTA r adds the cluster's parts of outputs r V / COMBINE_SPLIT ..
     in rank order (distributed shared memory loads) and applies the sigmoid gate; a second barrier keeps every
     CTA's parts alive until its peers have read them.
The order of every sum depends on the row's lengths, RB and COMBINE_SPLIT, never on the other rows' values;
``codegen --batch-invariant`` fixes RB to 1 (COMBINE_SPLIT is the same at every bucket). The absorb and combine
kernels prefetch their own W_uk / W_uv columns into L2 before their PDL wait (static weights), while the kernel
before them still runs.

Precision: the scores and the weighted sum run on bf16 operands (``ql`` and P rounded to bf16, the cache is
bf16) with fp32 accumulation, as FlashMLA-style decoders do; the softmax statistics, the partials and the
combine are fp32. The cache is decode state, written in place at one position per row (the current token's)
and otherwise only read. Lengths outside [0, LMAX-1] are clamped into it (the model never passes them): the
clamped position is both the row written and the current token's position. All shapes are static; only the
lengths are runtime values.
"""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

from k3compile.templates.kernels.dsmem_lib import ld_dsmem_f32
from k3compile.templates.kernels.mxfp4_lib import mma_bf16_16816

# >>> constants
# (example values: rendering replaces this block)
M = 2  # rows (the batch bucket)
H = 8  # local heads (16-row MMA tiles, padded)
NOPE = 128  # qk_nope_head_dim
R = 64  # qk_rope_head_dim (k_pe width, unrotated)
V = 128  # v_head_dim
C = 512  # kv_lora_rank (latent width)
LMAX = 1024  # cache positions per row
KV_EPS = 1e-06  # kv_a_layernorm epsilon
SCALE = 0.07216878364870322  # softmax scale ((nope + rope) ** -0.5)
NSPLIT = 4  # most context splits per row (grid.x of the attention kernel)
CHUNK_MIN = 256  # fewest positions per split (short rows use fewer splits)
BALANCE = True  # split sizes from the whole batch's lengths (one wave of CTAs), else from each row's own length
SMS = 132  # streaming multiprocessors (BALANCE: one wave of attention CTAs, one per SM)
TILE = 64  # cache rows per shared-memory tile (8 per warp)
COMBINE_SPLIT = 4  # combine kernel: CTAs of a cluster per (head, row group), each C / COMBINE_SPLIT columns of ol
RB = 2  # combine kernel: rows per CTA (W_uv read once for them)
# <<< constants

VEC = 8  # bf16 elements per 16-byte copy
ROW = C + R  # latent row (cache row) width
QH = NOPE + R  # q elements per head
KVH = NOPE + V  # kv_b_weight rows per head (W_uk rows then W_uv rows)
WARPS = 8  # attention kernel: warp w owns positions 8w..8w+7 of a tile (QK^T) and C/8 output columns (PV)
THREADS = 32 * WARPS
HEADS_PER_CTA = 32  # attention kernel: at most two 16-row MMA tiles of heads per CTA
HGN = (H + HEADS_PER_CTA - 1) // HEADS_PER_CTA  # attention kernel: head groups (a grid dimension; 1 up to 32 heads)
HG = (H + HGN - 1) // HGN  # attention kernel: heads per group (the last group may hold fewer)
HT = (HG + 15) // 16  # 16-head MMA tiles of a group
HP = 16 * HT  # a group's heads padded to whole tiles
SROW = ROW + 8  # bf16 stride of a shared-memory row (16 bytes of padding: conflict-free ldmatrix)
SROWQ = SROW // 2  # the same in 32-bit words
SSROW = TILE + 8  # fp32 stride of a score row
RCH = ROW // VEC  # 16-byte chunks per row
LCH = (RCH + 31) // 32  # chunks per lane per row
CPW = C // WARPS  # output columns per warp (PV)
NPAIR = CPW // 16  # pairs of 8-column MMA tiles per warp (one ldmatrix.x4.trans each)
KSTEPS_PV = TILE // 16  # k16 steps of P V over a tile
ABS_THREADS = 256  # absorb kernel
ACB = 32  # absorb kernel: columns of ql per CTA (two 16-row MMA tiles of W_uk^T)
ACT = ACB // 16  # ... its 16-column MMA tiles
WKROW = ACB + VEC  # ... bf16 stride of a staged W_uk row (16 bytes of padding: conflict-free ldmatrix)
QNROW = NOPE + VEC  # ... bf16 stride of a staged q_nope row
MP = 8 * ((M + 7) // 8)  # ... the batch rows padded to whole 8-row MMA tiles (zero rows)
NORM_THREADS = C // VEC  # threads holding the C part of the latent row (whole warps)
NORM_WARPS = NORM_THREADS // 32
ROPE_THREADS = R // VEC  # 16-byte chunks of the rope part
COMBINE_WARPS = 8  # combine kernel: WPR warps merge each row (W_uv from L2: warp w then takes outputs w, w + 8, ..)
WPR = COMBINE_WARPS // RB  # combine kernel: warps per row in the merge (they split the row's splits)
COMBINE_THREADS = 32 * COMBINE_WARPS
CS = C // COMBINE_SPLIT  # combine kernel: columns of ol one CTA merges (cluster rank r: r * CS ..)
OCH = CS // 128  # combine kernel: 4-element chunks of ol per lane and split
MERGE_UNROLL = min(8, 16 // OCH)  # combine kernel: splits of a warp in flight in the merge
BALANCED = BALANCE and M > 1  # splits from the whole batch (one row keeps its own rule)
TPMIN = (CHUNK_MIN + TILE - 1) // TILE  # BALANCE: fewest tiles per split
ATT_GRID = (SMS, HGN, 1) if BALANCED else (NSPLIT, M, HGN)  # attention CTAs: one wave of (row, split) items per
# head group, or a grid
SEARCH_STEPS = (LMAX // TILE + 1).bit_length()  # BALANCE: bisection steps over tiles per split
SPL = min(8, (NSPLIT + 31) // 32)  # combine kernel: splits' statistics per lane loaded at once
VPC = V // COMBINE_SPLIT  # combine kernel: outputs per CTA in the sum over the cluster
OGR = COMBINE_THREADS // V  # combine kernel: column groups of the partial o (thread t: output t % V, group t // V)
CG = CS // OGR  # combine kernel: columns per group
WV_ROW = CS + VEC  # combine kernel: bf16 stride of a staged W_uv row (16 bytes of padding: conflict-free reads)
STAGE_WUV = V * WV_ROW * 2 <= 40 * 1024  # combine kernel: W_uv's CS columns staged in shared memory before the PDL
# wait (else pulled into L2); small enough to share an SM with an attention CTA
WCH = (CS // VEC + 31) // 32  # combine kernel, W_uv from L2: 16-byte chunks of a W_uv row per lane
WUV_LINES = V * CS * 2 // 128  # 128-byte lines of a combine CTA's W_uv columns (prefetched into L2)
SCALE_LOG2 = SCALE * 1.4426950408889634  # scores in log2 units: softmax via exp2
NEG = -1.0e30  # finite "minus infinity" for running maxima (exp2(NEG - x) == 0, no inf - inf)


@dsl_user_op
def ldsm_x4(addr, trans: bool, *, loc=None, ip=None):
    """``ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16``: four 8x8 bf16 matrices; lane l gives the shared
    address of row l % 8 of matrix l // 8 and gets word j of matrix j (row l // 4, columns 2 (l % 4) and
    2 (l % 4) + 1; with ``trans`` the matrix is transposed first)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4), [Int32(addr).ir_value(loc=loc, ip=ip)],
        f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 {{$0, $1, $2, $3}}, [$4];",
        "=r,=r,=r,=r,r", has_side_effects=True, loc=loc, ip=ip)
    return [Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def pack_bf16x2(lo, hi, *, loc=None, ip=None):
    """(bf16(lo), bf16(hi)) as one 32-bit word, round to nearest even."""
    return Int32(llvm.inline_asm(
        T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
        "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", has_side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def bf16_round(x, *, loc=None, ip=None):
    """x rounded to bf16 (nearest even) and back to fp32."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)],
        "{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; cvt.f32.bf16 $0, h; }", "=f,f", has_side_effects=False,
        loc=loc, ip=ip))


class Kernel:
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKv: cute.Tensor, mKvNormW: cute.Tensor, mGate: cute.Tensor,
                 mCache: cute.Tensor, mLengths: cute.Tensor, mKvB: cute.Tensor, mOut: cute.Tensor,
                 mLatent: cute.Tensor, mWsQ: cute.Tensor, mWsOl: cute.Tensor, mWsMl: cute.Tensor, stream):
        self.absorb_kernel(mQ, mKv, mKvNormW, mCache, mLengths, mKvB, mLatent, mWsQ).launch(
            grid=(H, C // ACB, 1), block=(ABS_THREADS, 1, 1), stream=stream, use_pdl=True)
        self.kernel(cute.recast_tensor(mQ, Uint32), cute.recast_tensor(mCache, Uint32), mLengths,
                    cute.recast_tensor(mLatent, Uint32), cute.recast_tensor(mWsQ, Uint32), mWsOl, mWsMl).launch(
            grid=ATT_GRID, block=(THREADS, 1, 1), stream=stream, use_pdl=True, min_blocks_per_mp=1,
            preferred_smem_carveout=100)
        self.combine_kernel(mGate, mLengths, mKvB, mOut, mWsOl, mWsMl).launch(
            grid=(COMBINE_SPLIT, H, M // RB), block=(COMBINE_THREADS, 1, 1),
            cluster=(COMBINE_SPLIT, 1, 1) if COMBINE_SPLIT > 1 else None, stream=stream, use_pdl=True)

    # ------------------------------------------------------------------------------------ helpers
    @cute.jit
    def length_of(self, mLengths: cute.Tensor, row):
        """lengths[row] clamped into 0 .. LMAX - 1: the current token's position (the cache row written)."""
        length = Int32(mLengths[row])
        return cutlass.max(cutlass.min(length, Int32(LMAX - 1)), Int32(0))

    @cute.jit
    def tiles_of(self, mLengths: cute.Tensor, row):
        """TILE-row tiles of row ``row``'s valid positions (0 for a row index past the batch)."""
        tiles = Int32(0)
        if row < M:
            tiles = (self.length_of(mLengths, row) + TILE) // TILE
        return tiles

    @cute.jit
    def tiles_per_split(self, mLengths: cute.Tensor):
        """BALANCE: tiles per split, the same in every warp of every CTA of both kernels (each warp computes it from
        all M lengths, lane l holding rows l and l + 32): the smallest tp >= lo such that the whole batch's splits,
        sum over rows of ceil(tiles_m / tp), fit one wave of SMS attention CTAs, found by bisection in [lo, hi] with
        lo = max(TPMIN, ceil(T / SMS), ceil(max tiles / NSPLIT)) and hi = max(lo, ceil(T / (SMS - M))) (feasible:
        the sum is at most T / tp + M), T the batch's tiles."""
        lane = cute.arch.lane_idx()
        t0 = self.tiles_of(mLengths, lane)
        t1 = self.tiles_of(mLengths, lane + 32)
        total = cute.arch.warp_reduction(t0 + t1, operator.add)
        tmax = cute.arch.warp_reduction(cutlass.max(t0, t1), lambda a, b: cutlass.max(a, b))
        lo = cutlass.max(cutlass.max(Int32(TPMIN), (total + (SMS - 1)) // SMS), (tmax + (NSPLIT - 1)) // NSPLIT)
        hi = cutlass.max(lo, (total + (SMS - M - 1)) // (SMS - M))
        for _ in cutlass.range_constexpr(SEARCH_STEPS):
            mid = (lo + hi) // 2
            ctas = cute.arch.warp_reduction((t0 + mid - 1) // mid + (t1 + mid - 1) // mid, operator.add)
            fits = ctas <= SMS
            hi = cutlass.select_(fits, mid, hi)
            lo = cutlass.select_(fits, lo, mid + 1)
        return hi

    @cute.jit
    def item_of(self, mLengths: cute.Tensor, tp, item):
        """BALANCED: (row, split) of the attention kernel's CTA ``item``, the items numbered row after row (row m has
        ceil(tiles_m / tp) of them): an inclusive warp scan of the rows' split counts (lane l: rows l and l + 32),
        the row is the number of rows whose splits all come before ``item`` (two ballots). Past the batch's last item
        (the grid has SMS CTAs) the row is M - 1 and the split NSPLIT: no split of any row."""
        lane = cute.arch.lane_idx()
        a0 = (self.tiles_of(mLengths, lane) + tp - 1) // tp
        a1 = (self.tiles_of(mLengths, lane + 32) + tp - 1) // tp
        s0 = a0
        s1 = a1
        for k in cutlass.range_constexpr(5):
            v0 = cute.arch.shuffle_sync_up(s0, offset=1 << k)
            v1 = cute.arch.shuffle_sync_up(s1, offset=1 << k)
            s0 = cutlass.select_(lane >= (1 << k), s0 + v0, s0)
            s1 = cutlass.select_(lane >= (1 << k), s1 + v1, s1)
        s1 = s1 + cute.arch.shuffle_sync(s0, 31)  # rows 32 .. after rows 0 .. 31
        done = (cute.arch.popc(cute.arch.vote_ballot_sync(s0 <= item))
                + cute.arch.popc(cute.arch.vote_ballot_sync(s1 <= item)))  # rows whose items all precede item
        row = cutlass.min(done, Int32(M - 1))
        first = cute.arch.shuffle_sync(cutlass.select_(row < 32, s0 - a0, s1 - a1), row % 32)  # row's first item
        split = cutlass.select_(done < M, item - first, Int32(NSPLIT))
        return row, split

    @cute.jit
    def splits_of(self, mLengths: cute.Tensor, row):
        """(clamped length, valid positions n, active splits, positions per split) of one row. Every thread of the
        CTA calls it (BALANCED: warp shuffles)."""
        tp = Int32(0)
        if cutlass.const_expr(BALANCED):
            tp = self.tiles_per_split(mLengths)
        return self.splits_with(mLengths, row, tp)

    @cute.jit
    def splits_with(self, mLengths: cute.Tensor, row, tp):
        """``splits_of`` given BALANCED's tiles per split ``tp`` (unused otherwise)."""
        length = self.length_of(mLengths, row)
        n = length + 1
        nact = Int32(0)
        chunk = Int32(0)
        if cutlass.const_expr(BALANCED):
            chunk = tp * TILE
            nact = (n + chunk - 1) // chunk
        else:
            nact = cutlass.min((n + (CHUNK_MIN - 1)) // CHUNK_MIN, Int32(NSPLIT))
            chunk = (n + nact - 1) // nact
        return length, n, nact, chunk

    @cute.jit
    def head_ok(self, h, h0):
        """Whether MMA row h of an attention CTA whose group starts at head h0 is a real head (not padding, not past
        the last head in the last group)."""
        ok = h < H
        if cutlass.const_expr(HGN > 1):
            ok = (h < HG) & (h0 + h < H)
        return ok

    # --------------------------------------------------------- kernel 1: absorbed query, latent row
    @cute.jit
    def latent_row(self, mKv: cute.Tensor, mKvNormW: cute.Tensor, mCache: cute.Tensor, mLengths: cute.Tensor,
                   mLatent: cute.Tensor, sNorm: cute.Tensor, row, tid, lane, warp):
        """The current token's latent row of ``row``: KimiRMSNorm(kv[:C]) * w | kv[C:], to ``latent`` and to the
        cache row at lengths[row] (never read by kernel 2). Every thread of the CTA calls it (one CTA barrier)."""
        rW = cute.make_rmem_tensor((VEC,), BFloat16)
        rX = cute.make_rmem_tensor((VEC,), BFloat16)
        rY = cute.make_rmem_tensor((VEC,), BFloat16)
        gRow = mCache[row, self.length_of(mLengths, row), None]
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
            cute.autovec_copy(rY, cute.local_tile(mLatent[row, None], (VEC,), (tid,)))
            cute.autovec_copy(rY, cute.local_tile(gRow, (VEC,), (tid,)))
        for r8 in cutlass.range(tid, ROPE_THREADS, ABS_THREADS, unroll=1):
            cute.autovec_copy(cute.local_tile(mKv[row, None], (VEC,), (NORM_THREADS + r8,)), rX)
            cute.autovec_copy(rX, cute.local_tile(mLatent[row, None], (VEC,), (NORM_THREADS + r8,)))
            cute.autovec_copy(rX, cute.local_tile(gRow, (VEC,), (NORM_THREADS + r8,)))

    @cute.kernel
    def absorb_kernel(self, mQ: cute.Tensor, mKv: cute.Tensor, mKvNormW: cute.Tensor, mCache: cute.Tensor,
                      mLengths: cute.Tensor, mKvB: cute.Tensor, mLatent: cute.Tensor, mWsQ: cute.Tensor):
        """CTA (head, cb) computes ql[:, head, cb ACB .. (cb + 1) ACB] for every row as
        ql^T = W_uk[head]^T q_nope^T on the tensor cores (W_uk^T's columns as the MMA rows, the batch rows as its 8-wide
        N tiles, NOPE as K), so each W_uk column is read once per step, not once per row. W_uk's [NOPE, ACB] slice is
        copied into shared memory before the PDL wait, q_nope's rows after it; the fp32 sums are rounded once to bf16,
        staged in shared memory and stored in 16-byte chunks. CTA i (in head-major order) also builds the latent rows
        i, i + H C / ACB, ..."""
        tid = cute.arch.thread_idx()[0]
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        head = cute.arch.block_idx()[0]
        cb = cute.arch.block_idx()[1]
        g = lane // 4
        t = lane % 4
        smem = cutlass.utils.SmemAllocator()
        sW = smem.allocate_tensor(BFloat16, cute.make_layout((NOPE, WKROW), stride=(WKROW, 1)), 16)
        sX = smem.allocate_tensor(BFloat16, cute.make_layout((MP, QNROW), stride=(QNROW, 1)), 16)
        sY = smem.allocate_tensor(BFloat16, cute.make_layout((MP, WKROW), stride=(WKROW, 1)), 16)
        sNorm = smem.allocate_tensor(Float32, cute.make_layout((NORM_WARPS,)), 16)
        cp16 = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), BFloat16,
                                   num_bits_per_copy=128)
        # W_uk[head][:, cb ACB ..] (a static weight) into shared memory while the previous kernel runs
        for k in cutlass.range_constexpr((NOPE * (ACB // VEC) + ABS_THREADS - 1) // ABS_THREADS):
            ci = tid + k * ABS_THREADS
            if ci < NOPE * (ACB // VEC):
                d = ci // (ACB // VEC)
                ch = ci - d * (ACB // VEC)
                cute.copy(cp16, cute.local_tile(mKvB[head * KVH + d, None], (VEC,), (cb * (ACB // VEC) + ch,)),
                          cute.local_tile(sW[d, None], (VEC,), (ch,)))
        cute.arch.cp_async_commit_group()
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()  # the next kernel may start its prologue now
        for k in cutlass.range_constexpr((M * (NOPE // VEC) + ABS_THREADS - 1) // ABS_THREADS):
            ci = tid + k * ABS_THREADS
            if ci < M * (NOPE // VEC):
                m = ci // (NOPE // VEC)
                ch = ci - m * (NOPE // VEC)
                cute.copy(cp16, cute.local_tile(mQ[m, None], (VEC,), (head * (QH // VEC) + ch,)),
                          cute.local_tile(sX[m, None], (VEC,), (ch,)))
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(MP > M):  # the padding rows of the last N tile: zeros
            rZero = cute.make_rmem_tensor((VEC,), BFloat16)
            rZero.fill(0.0)
            for ci in cutlass.range(tid, (MP - M) * (NOPE // VEC), ABS_THREADS, unroll=1):
                m = M + ci // (NOPE // VEC)
                cute.autovec_copy(rZero, cute.local_tile(sX[m, None], (VEC,), (ci % (NOPE // VEC),)))

        # the latent rows of this CTA (head-major CTA index), while the copies land
        for r in cutlass.range(head * (C // ACB) + cb, M, H * (C // ACB), unroll=1):
            self.latent_row(mKv, mKvNormW, mCache, mLengths, mLatent, sNorm, r, tid, lane, warp)
            cute.arch.sync_threads()  # sNorm is free for the next row

        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        j = lane // 8
        r8 = lane % 8
        # A = W_uk^T (rows: columns c of ql, k: d) by ldmatrix.trans of sW [d][c]: matrix j holds c + 8 (j % 2),
        # d + 8 (j // 2)
        a_addr = sW.iterator.toint() + (8 * (j // 2) + r8) * (WKROW * 2) + 8 * (j % 2) * 2
        # B = q_nope^T (k: d, n: batch rows) by ldmatrix of sX [m][d]: matrix j holds d + 8 j (two k16 steps)
        b_addr = sX.iterator.toint() + r8 * (QNROW * 2) + 8 * j * 2
        for pi in cutlass.range(warp, ACT * (MP // 8), ABS_THREADS // 32, unroll=1):
            mt = pi % ACT
            nt = pi // ACT
            acc0 = [Float32(0.0)] * 4  # two accumulators: half the dependent MMA chain
            acc1 = [Float32(0.0)] * 4
            for kk in cutlass.range_constexpr(NOPE // 32):
                b = ldsm_x4(b_addr + nt * 8 * (QNROW * 2) + kk * 64, False)
                a0 = ldsm_x4(a_addr + (2 * kk) * 16 * (WKROW * 2) + mt * 32, True)
                a1 = ldsm_x4(a_addr + (2 * kk + 1) * 16 * (WKROW * 2) + mt * 32, True)
                acc0 = mma_bf16_16816(a0, (b[0], b[1]), acc0)
                acc1 = mma_bf16_16816(a1, (b[2], b[3]), acc1)
            for e in cutlass.range_constexpr(4):  # D[c][m]: c = mt 16 + g (+ 8 for e >= 2), m = nt 8 + 2 t + e % 2
                sY[nt * 8 + 2 * t + e % 2, mt * 16 + g + 8 * (e // 2)] = (acc0[e] + acc1[e]).to(BFloat16)
        cute.arch.sync_threads()
        for k in cutlass.range_constexpr((M * (ACB // VEC) + ABS_THREADS - 1) // ABS_THREADS):
            ci = tid + k * ABS_THREADS
            if ci < M * (ACB // VEC):
                m = ci // (ACB // VEC)
                ch = ci - m * (ACB // VEC)
                cute.autovec_copy(cute.local_tile(sY[m, None], (VEC,), (ch,)),
                                  cute.local_tile(mWsQ[m, head, None], (VEC,), (cb * (ACB // VEC) + ch,)))

    # ------------------------------------------------------------------ kernel 2: split attention
    @cute.jit
    def issue_tile(self, mCacheQ: cute.Tensor, mLatentQ: cute.Tensor, sTileQ: cute.Tensor, row, t0, end, length,
                   warp, lane):
        """cp.async of positions t0 .. t0 + TILE - 1 into one ring stage (sTileQ [TILE, SROWQ] words): warp w copies
        rows 8w .. 8w + 7, lane l the 16-byte chunks l, l + 32, ... of each; the current token's row comes from
        ``latent``, positions at or past ``end`` are zero-filled (their probabilities are 0, never 0 * NaN)."""
        big = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), Uint32,
                                  num_bits_per_copy=128)
        rZero = cute.make_rmem_tensor((4,), Uint32)
        rZero.fill(0)
        for rr in cutlass.range_constexpr(8):
            r = 8 * warp + rr
            p = t0 + r
            for q in cutlass.range_constexpr(LCH):
                ch = lane + 32 * q
                if cutlass.const_expr(32 * (q + 1) <= RCH):
                    self.copy_chunk(big, rZero, mCacheQ, mLatentQ, sTileQ, row, r, p, ch, end, length)
                elif ch < RCH:
                    self.copy_chunk(big, rZero, mCacheQ, mLatentQ, sTileQ, row, r, p, ch, end, length)

    @cute.jit
    def copy_chunk(self, big, rZero: cute.Tensor, mCacheQ: cute.Tensor, mLatentQ: cute.Tensor, sTileQ: cute.Tensor,
                   row, r, p, ch, end, length):
        """16-byte chunk ch of position p into tile row r: from the cache, from ``latent`` (p = length) or zeros."""
        dst = cute.local_tile(sTileQ[r, None], (4,), (ch,))
        if p < end:
            if p == length:
                cute.copy(big, cute.local_tile(mLatentQ[row, None], (4,), (ch,)), dst)
            else:
                cute.copy(big, cute.local_tile(mCacheQ[row, p, None], (4,), (ch,)), dst)
        else:
            cute.autovec_copy(rZero, dst)

    @cute.kernel
    def kernel(self, mQq: cute.Tensor, mCacheQ: cute.Tensor, mLengths: cute.Tensor, mLatentQ: cute.Tensor,
               mWsQq: cute.Tensor, mWsOl: cute.Tensor, mWsMl: cute.Tensor):
        tid = cute.arch.thread_idx()[0]
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        split = cute.arch.block_idx()[0]
        row = cute.arch.block_idx()[1]
        h0 = 0  # the CTA's first head (head groups: HGN > 1, more than 32 local heads)
        if cutlass.const_expr(HGN > 1):
            h0 = HG * cute.arch.block_idx()[1 if BALANCED else 2]
        g = lane // 4  # MMA fragment row (and row + 8)
        t = lane % 4  # MMA fragment column pair
        smem = cutlass.utils.SmemAllocator()
        sTile = smem.allocate_tensor(Uint32, cute.make_layout((2, TILE, SROWQ), stride=(TILE * SROWQ, SROWQ, 1)),
                                     16)
        sQ = smem.allocate_tensor(Uint32, cute.make_layout((HP, SROWQ), stride=(SROWQ, 1)), 16)
        sS = smem.allocate_tensor(Float32, cute.make_layout((HP, SSROW), stride=(SSROW, 1)), 16)
        big = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), Uint32,
                                  num_bits_per_copy=128)
        rZero = cute.make_rmem_tensor((4,), Uint32)
        rZero.fill(0)
        cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(not BALANCED):
            cute.arch.griddepcontrol_launch_dependents()  # the next kernel may start its prologue now

        if cutlass.const_expr(BALANCED):  # this CTA's (row, split) from the batch's plan
            tp = self.tiles_per_split(mLengths)
            row, split = self.item_of(mLengths, tp, split)
            length, n, nact, chunk = self.splits_with(mLengths, row, tp)
        else:
            length, n, nact, chunk = self.splits_of(mLengths, row)
        start = split * chunk
        end = cutlass.min(start + chunk, n)
        if split < nact:
            # -- 1. Q = [ql | q_pe] of every local head, zero rows up to HP
            for idx in cutlass.range(tid, HP * RCH, THREADS, unroll=1):
                h = idx // RCH
                ch = idx - h * RCH
                dst = cute.local_tile(sQ[h, None], (4,), (ch,))
                if self.head_ok(h, h0):
                    if ch < C // VEC:
                        cute.copy(big, cute.local_tile(mWsQq[row, h0 + h, None], (4,), (ch,)), dst)
                    else:
                        cute.copy(big, cute.local_tile(mQq[row, None], (4,), (((h0 + h) * QH + NOPE) // VEC + ch
                                                                               - C // VEC,)), dst)
                else:
                    cute.autovec_copy(rZero, dst)
            ntiles = (end - start + (TILE - 1)) // TILE
            self.issue_tile(mCacheQ, mLatentQ, sTile[0, None, None], row, start, end, length, warp, lane)
            cute.arch.cp_async_commit_group()

            # lane-constant parts of the ldmatrix addresses (bytes)
            j = lane // 8
            r8 = lane % 8
            tile0 = sTile.iterator.toint()
            q_addr = sQ.iterator.toint() + ((j % 2) * 8 + r8) * (SROW * 2) + (j // 2) * 16
            k_addr = tile0 + (8 * warp + r8) * (SROW * 2) + j * 16  # QK^T: this warp's positions, 8 k per matrix
            v_addr = tile0 + ((j % 2) * 8 + r8) * (SROW * 2) + (warp * CPW + (j // 2) * 8) * 2  # PV (trans)

            acc = cute.make_rmem_tensor((HT, CPW // 8, 4), Float32)  # O: this warp's columns, rows g / g + 8
            acc.fill(0.0)
            m_run = cute.make_rmem_tensor((HT, 2), Float32)
            l_run = cute.make_rmem_tensor((HT, 2), Float32)
            m_run.fill(NEG)
            l_run.fill(0.0)
            pa = cute.make_rmem_tensor((KSTEPS_PV, 4), Int32)  # P as the A operand of P V
            pv = cute.make_rmem_tensor((2, 2 * KSTEPS_PV, 2), Float32)  # this lane's scores, then probabilities
            for i in cutlass.range(ntiles, unroll=1):
                t0 = start + i * TILE
                st = i % 2
                if i + 1 < ntiles:
                    self.issue_tile(mCacheQ, mLatentQ, sTile[1 - st, None, None], row, t0 + TILE, end, length, warp,
                                    lane)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(1)  # tile i (and Q) landed: this thread's copies
                cute.arch.sync_threads()  # ... and everyone's

                # -- S = Q K^T for this warp's 8 positions, every head tile
                kb = k_addr + st * (TILE * SROW * 2)
                for ht in cutlass.range_constexpr(HT):
                    s0 = [Float32(0.0)] * 4  # two accumulators: half the dependent MMA chain
                    s1 = [Float32(0.0)] * 4
                    for kc in cutlass.range_constexpr(ROW // 32):
                        b = ldsm_x4(kb + kc * 64, False)
                        a0 = ldsm_x4(q_addr + ht * 16 * SROW * 2 + kc * 64, False)
                        a1 = ldsm_x4(q_addr + ht * 16 * SROW * 2 + kc * 64 + 32, False)
                        s0 = mma_bf16_16816(a0, (b[0], b[1]), s0)
                        s1 = mma_bf16_16816(a1, (b[2], b[3]), s1)
                    for e in cutlass.range_constexpr(4):
                        pos = 8 * warp + 2 * t + e % 2
                        val = cutlass.select_(t0 + pos >= end, Float32(NEG), (s0[e] + s1[e]) * Float32(SCALE_LOG2))
                        sS[ht * 16 + g + 8 * (e // 2), pos] = val
                cute.arch.sync_threads()

                # -- online softmax over the tile (every warp, the same statistics), then O += P V
                vb = v_addr + st * (TILE * SROW * 2)
                for ht in cutlass.range_constexpr(HT):
                    for hh in cutlass.range_constexpr(2):  # fragment rows g, g + 8
                        hrow = ht * 16 + g + 8 * hh
                        mx = Float32(NEG)
                        for kk in cutlass.range_constexpr(2 * KSTEPS_PV):  # columns 8 kk + 2t, + 1
                            for e in cutlass.range_constexpr(2):
                                pv[hh, kk, e] = sS[hrow, 8 * kk + 2 * t + e]
                                mx = cute.arch.fmax(mx, pv[hh, kk, e])
                        mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1))
                        mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=2))
                        m_new = cute.arch.fmax(m_run[ht, hh], mx)
                        alpha = cute.math.exp2(m_run[ht, hh] - m_new, fastmath=True)
                        tot = Float32(0.0)
                        for kk in cutlass.range_constexpr(2 * KSTEPS_PV):
                            for e in cutlass.range_constexpr(2):
                                pr = bf16_round(cute.math.exp2(pv[hh, kk, e] - m_new, fastmath=True))
                                pv[hh, kk, e] = pr
                                tot = tot + pr
                        tot = tot + cute.arch.shuffle_sync_bfly(tot, offset=1)
                        tot = tot + cute.arch.shuffle_sync_bfly(tot, offset=2)
                        l_run[ht, hh] = l_run[ht, hh] * alpha + tot
                        m_run[ht, hh] = m_new
                        for nt in cutlass.range_constexpr(CPW // 8):
                            for e in cutlass.range_constexpr(2):
                                acc[ht, nt, 2 * hh + e] = acc[ht, nt, 2 * hh + e] * alpha
                    for ks in cutlass.range_constexpr(KSTEPS_PV):  # A fragment: rows g / g + 8, k 2t (+8)
                        pa[ks, 0] = pack_bf16x2(pv[0, 2 * ks, 0], pv[0, 2 * ks, 1])
                        pa[ks, 1] = pack_bf16x2(pv[1, 2 * ks, 0], pv[1, 2 * ks, 1])
                        pa[ks, 2] = pack_bf16x2(pv[0, 2 * ks + 1, 0], pv[0, 2 * ks + 1, 1])
                        pa[ks, 3] = pack_bf16x2(pv[1, 2 * ks + 1, 0], pv[1, 2 * ks + 1, 1])
                    for ks in cutlass.range_constexpr(KSTEPS_PV):
                        a = (pa[ks, 0], pa[ks, 1], pa[ks, 2], pa[ks, 3])
                        for np in cutlass.range_constexpr(NPAIR):
                            b = ldsm_x4(vb + ks * 16 * SROW * 2 + np * 32, True)
                            for half in cutlass.range_constexpr(2):
                                nt = 2 * np + half
                                c = mma_bf16_16816(a, (b[2 * half], b[2 * half + 1]),
                                                   (acc[ht, nt, 0], acc[ht, nt, 1], acc[ht, nt, 2], acc[ht, nt, 3]))
                                for e in cutlass.range_constexpr(4):
                                    acc[ht, nt, e] = c[e]
                cute.arch.sync_threads()  # the stage and the scores are free for the next tile
            if cutlass.const_expr(BALANCED):
                # the combine may launch once this CTA's tiles are done (see the module docstring; an idle CTA
                # triggers by exiting)
                cute.arch.griddepcontrol_launch_dependents()

            # -- this split's partial
            for ht in cutlass.range_constexpr(HT):
                for hh in cutlass.range_constexpr(2):
                    h = ht * 16 + g + 8 * hh
                    if self.head_ok(h, h0):
                        for nt in cutlass.range_constexpr(CPW // 8):
                            col = warp * CPW + nt * 8 + 2 * t
                            for e in cutlass.range_constexpr(2):
                                mWsOl[row, split, h0 + h, col + e] = acc[ht, nt, 2 * hh + e]
                        if warp == 0 and t == 0:
                            mWsMl[row, split, h0 + h, 0] = m_run[ht, hh]
                            mWsMl[row, split, h0 + h, 1] = l_run[ht, hh]

    # ------------------------------------------------------- kernel 3: combine, W_uv, output gate
    @cute.kernel
    def combine_kernel(self, mGate: cute.Tensor, mLengths: cute.Tensor, mKvB: cute.Tensor, mOut: cute.Tensor,
                       mWsOl: cute.Tensor, mWsMl: cute.Tensor):
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        tid = cute.arch.thread_idx()[0]
        rank = cute.arch.block_idx()[0]  # cluster rank: this CTA's columns of ol c0 .. c0 + CS - 1
        head = cute.arch.block_idx()[1]
        row0 = cute.arch.block_idx()[2] * RB
        c0 = rank * CS
        smem = cutlass.utils.SmemAllocator()
        sOl = smem.allocate_tensor(Float32, cute.make_layout((RB, CS), stride=(CS, 1)), 16)
        sPart = smem.allocate_tensor(Float32, cute.make_layout((COMBINE_WARPS, CS), stride=(CS, 1)), 16)
        sQ = smem.allocate_tensor(Float32, cute.make_layout((OGR, RB, V) if STAGE_WUV else (1, 1, 4),
                                                            stride=(RB * V, V, 1)), 16)
        sO = smem.allocate_tensor(Float32, cute.make_layout((RB, V), stride=(V, 1)), 16)
        sWv = smem.allocate_tensor(BFloat16, cute.make_layout((V, WV_ROW) if STAGE_WUV else (1, 8),
                                                              stride=(WV_ROW, 1)), 16)
        rPart = cute.make_rmem_tensor((4, OCH, MERGE_UNROLL), Float32)  # (column-major: 4 contiguous elements)
        rMs = cute.make_rmem_tensor((MERGE_UNROLL,), Float32)
        rAcc = cute.make_rmem_tensor((4 * OCH,), Float32)
        rM = cute.make_rmem_tensor((SPL,), Float32)
        rL = cute.make_rmem_tensor((SPL,), Float32)
        rW8 = cute.make_rmem_tensor((VEC,), BFloat16)
        rOl8 = cute.make_rmem_tensor((VEC,), Float32)
        # W_uv[h][:, c0 .. c0 + CS] is a static weight: before the PDL wait, while the attention kernel runs, it is
        # copied into shared memory (STAGE_WUV) or pulled into L2
        if cutlass.const_expr(STAGE_WUV):
            cp16 = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), BFloat16,
                                       num_bits_per_copy=128)
            for k in cutlass.range_constexpr((V * (CS // VEC) + COMBINE_THREADS - 1) // COMBINE_THREADS):
                ci = tid + k * COMBINE_THREADS
                if ci < V * (CS // VEC):
                    vr = ci // (CS // VEC)
                    ch = ci - vr * (CS // VEC)
                    cute.copy(cp16, cute.local_tile(mKvB[head * KVH + NOPE + vr, None], (VEC,), (c0 // VEC + ch,)),
                              cute.local_tile(sWv[vr, None], (VEC,), (ch,)))
            cute.arch.cp_async_commit_group()
        else:
            for k in cutlass.range_constexpr((WUV_LINES + COMBINE_THREADS - 1) // COMBINE_THREADS):
                li = tid + k * COMBINE_THREADS
                if li < WUV_LINES:
                    vr = li // (CS // 64)
                    cute.arch.prefetch(cute.local_tile(mKvB[head * KVH + NOPE + vr, None], (64,),
                                                       (rank * (CS // 64) + li - vr * (CS // 64),)).iterator.llvm_ptr,
                                       cache_level="L2")
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()  # the next kernel may start its prologue now
        # thread i < RB * VPC writes output rank * VPC + i % VPC of row i // VPC at the end: its gate now
        gate = Float32(0.0)
        if tid < RB * VPC:
            gate = Float32(mGate[row0 + tid // VPC, head * V + rank * VPC + tid % VPC])

        # 1. statistics of row r (every warp of the row, the same values): lane l holds splits l, l + 32, ... (SPL
        #    of them loaded at once, then a running max and a rescaled sum), merged over the lanes by a butterfly
        r = warp // WPR
        kw = warp % WPR
        row = row0 + r
        length, n, nact, chunk = self.splits_of(mLengths, row)
        m_run = Float32(NEG)
        l_run = Float32(0.0)
        for b0 in cutlass.range(0, nact, 32 * SPL, unroll=1):
            for i in cutlass.range_constexpr(SPL):  # every load first (clamped index), then the running statistics
                s = cutlass.min(b0 + lane + 32 * i, nact - 1)
                rM[i] = mWsMl[row, s, head, 0]
                rL[i] = mWsMl[row, s, head, 1]
            for i in cutlass.range_constexpr(SPL):
                valid = b0 + lane + 32 * i < nact
                m_s = cutlass.select_(valid, rM[i], Float32(NEG))
                m_new = cute.arch.fmax(m_run, m_s)
                l_run = l_run * cute.math.exp2(m_run - m_new, fastmath=True) + cutlass.select_(
                    valid, rL[i], Float32(0.0)) * cute.math.exp2(m_s - m_new, fastmath=True)
                m_run = m_new
        for off in cutlass.range_constexpr(5):  # xor butterfly: both lanes of a pair add the same two terms
            m_o = cute.arch.shuffle_sync_bfly(m_run, offset=1 << off)
            l_o = cute.arch.shuffle_sync_bfly(l_run, offset=1 << off)
            m_new = cute.arch.fmax(m_run, m_o)
            l_run = l_run * cute.math.exp2(m_run - m_new, fastmath=True) + l_o * cute.math.exp2(m_o - m_new,
                                                                                                fastmath=True)
            m_run = m_new
        inv = Float32(1.0) / l_run

        # 2. merge this CTA's CS columns: the WPR warps of row r take its splits kw, kw + WPR, ... (MERGE_UNROLL
        #    splits' loads in flight: the max and OCH 16-byte chunks per lane each); their sums meet in shared
        #    memory, added in warp order
        rAcc.fill(0.0)
        for s0 in cutlass.range(kw, nact, WPR * MERGE_UNROLL, unroll=1):
            for u in cutlass.range_constexpr(MERGE_UNROLL):  # loads first (clamped split), weights 0 past nact
                s = cutlass.min(s0 + WPR * u, nact - 1)
                rMs[u] = mWsMl[row, s, head, 0]
                for q in cutlass.range_constexpr(OCH):
                    cute.autovec_copy(cute.local_tile(mWsOl[row, s, head, None], (4,), (c0 // 4 + q * 32 + lane,)),
                                      rPart[None, q, u])
            for u in cutlass.range_constexpr(MERGE_UNROLL):
                weight = cutlass.select_(s0 + WPR * u < nact, cute.math.exp2(rMs[u] - m_run, fastmath=True) * inv,
                                         Float32(0.0))
                for q in cutlass.range_constexpr(OCH):
                    for e in cutlass.range_constexpr(4):
                        rAcc[4 * q + e] = rAcc[4 * q + e] + rPart[e, q, u] * weight
        for q in cutlass.range_constexpr(OCH):
            cute.autovec_copy(cute.local_tile(rAcc, (4,), (q,)),
                              cute.local_tile(sPart[warp, None], (4,), (q * 32 + lane,)))
        if cutlass.const_expr(STAGE_WUV):
            cute.arch.cp_async_wait_group(0)  # this thread's W_uv copies landed (the barrier: everyone's)
        cute.arch.sync_threads()  # every warp of the row has written its sum
        for i in cutlass.range(tid, RB * CS, COMBINE_THREADS, unroll=1):
            rr = i // CS
            cc = i - rr * CS
            tot = sPart[rr * WPR, cc]
            for k in cutlass.range_constexpr(1, WPR):
                tot = tot + sPart[rr * WPR + k, cc]
            sOl[rr, cc] = tot
        cute.arch.sync_threads()

        # 3. the CTA's part of o = ol @ W_uv[h]^T over its CS columns, for every output and row, into sO.
        #    Staged W_uv (shared memory): thread t takes output t % V over the column group t // V (OGR groups of CG
        #    columns; sOl reads are warp-wide broadcasts), the groups added in order. Otherwise (W_uv from L2): warp
        #    w takes outputs w, w + 8, ..., its lanes 16-byte chunks of the output's W_uv row (coalesced), one warp
        #    reduction per output and row
        if cutlass.const_expr(STAGE_WUV):
            if tid < OGR * V:
                v = tid % V
                cg = tid // V
                acc2 = cute.make_rmem_tensor((RB,), Float32)
                acc2.fill(0.0)
                for k in cutlass.range_constexpr(CG // VEC):
                    col = cg * CG + k * VEC  # within the CTA's columns
                    cute.autovec_copy(cute.local_tile(sWv[v, None], (VEC,), (col // VEC,)), rW8)
                    w8 = rW8.load().to(Float32)
                    for rr in cutlass.range_constexpr(RB):
                        cute.autovec_copy(cute.local_tile(sOl[rr, None], (VEC,), (col // VEC,)), rOl8)
                        acc2[rr] = acc2[rr] + (rOl8.load() * w8).reduce(cute.ReductionOp.ADD, Float32(0.0),
                                                                        reduction_profile=0)
                for rr in cutlass.range_constexpr(RB):
                    sQ[cg, rr, v] = acc2[rr]
            cute.arch.sync_threads()
            for i in cutlass.range(tid, RB * V, COMBINE_THREADS, unroll=1):
                rr = i // V
                v = i - rr * V
                tot = sQ[0, rr, v]
                for k in cutlass.range_constexpr(1, OGR):
                    tot = tot + sQ[k, rr, v]
                sO[rr, v] = tot
        else:
            rWv = cute.make_rmem_tensor((VEC, WCH), BFloat16)
            for v in cutlass.range(warp, V, COMBINE_WARPS, unroll=2):
                for k in cutlass.range_constexpr(WCH):  # chunk index clamped (CS < 256), its product masked below
                    ch = cutlass.min(k * 32 + lane, CS // VEC - 1)
                    cute.autovec_copy(cute.local_tile(mKvB[head * KVH + NOPE + v, None], (VEC,), (c0 // VEC + ch,)),
                                      rWv[None, k])
                for rr in cutlass.range_constexpr(RB):
                    part = Float32(0.0)
                    for k in cutlass.range_constexpr(WCH):
                        ch = cutlass.min(k * 32 + lane, CS // VEC - 1)
                        cute.autovec_copy(cute.local_tile(sOl[rr, None], (VEC,), (ch,)), rOl8)
                        dot = (rOl8.load() * rWv[None, k].load().to(Float32)).reduce(
                            cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
                        part = part + cutlass.select_(k * 32 + lane < CS // VEC, dot, Float32(0.0))
                    o = cute.arch.warp_reduction(part, operator.add)
                    if lane == 0:
                        sO[rr, v] = o

        # 4. CTA rank's outputs v = rank * VPC ..: the cluster's parts added in rank order (distributed shared
        #    memory, after a release / acquire cluster barrier; a second one keeps every CTA's sO alive until the
        #    peers have read it), times the sigmoid gate
        if cutlass.const_expr(COMBINE_SPLIT > 1):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        if tid < RB * VPC:
            rr = tid // VPC
            v = rank * VPC + tid - rr * VPC
            if cutlass.const_expr(COMBINE_SPLIT > 1):
                base = sO.iterator.toint()
                o = ld_dsmem_f32(base + 4 * (rr * V + v), 0)
                for q in cutlass.range_constexpr(1, COMBINE_SPLIT):
                    o = o + ld_dsmem_f32(base + 4 * (rr * V + v), q)
            else:
                o = sO[rr, v]
            mOut[row0 + rr, head * V + v] = (o / (Float32(1.0) + cute.math.exp(-gate, fastmath=True))).to(BFloat16)
        if cutlass.const_expr(COMBINE_SPLIT > 1):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
