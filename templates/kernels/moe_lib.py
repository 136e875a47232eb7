"""What the routed-expert kernels share (moe_route, moe_gate_up, moe_down_combine): the router's top-k selection
by one warp, grouping the (token, slot) pairs by expert in shared memory, and one MX block of 16 weight rows
through the tensor cores.

``@cute.jit`` functions traced into the calling kernel; the kernels' sizes come in as Constexpr arguments.
Templates that import this file list it in ``Template.libs`` (cache key, kernel names).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass.cute.nvgpu import cpasync

from k3compile.templates.kernels.mxfp4_lib import (bf16x2_mul, decode_e2m1x8_packed, mma_bf16_16816, scale_bf16x2,
                                                   scale_fast)


def sigmoid(x):
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))


def _key_score(x):
    """The router's sigmoid for the selection keys, with an approximate reciprocal (rcp.approx, about 1 ulp;
    1 + exp(-x) >= 1): the IEEE division is a call with a slow path that ptxas runs one sigmoid after another.
    The winners' weights are recomputed with the IEEE division (sigmoid), as the reference computes them."""
    return cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-x))


def _lane_best(rKey, tk, ti, EPL: int):
    """This lane's largest key after (tk, ti) in the selection order (key descending, index ascending) and its
    index, as a tree of selects (depth log2 EPL rather than a chain of EPL compares); entries at or before
    (tk, ti) count as key 0, below every real key. Plain Python: unrolled at trace time."""
    bk = [Uint32(cutlass.select_((rKey[i] < tk) | ((rKey[i] == tk) & (Int32(i) > ti)), rKey[i], Uint32(0)))
          for i in range(EPL)]
    bi = [Int32(i) for i in range(EPL)]
    width = EPL
    while width > 1:
        half = (width + 1) // 2
        for i in range(width // 2):
            r = half + i
            take = (bk[r] > bk[i]) | ((bk[r] == bk[i]) & (bi[r] < bi[i]))
            bk[i] = Uint32(cutlass.select_(take, bk[r], bk[i]))
            bi[i] = Int32(cutlass.select_(take, bi[r], bi[i]))
        width = half
    return bk[0], bi[0]


@cute.jit
def select_topk(rLog: cute.Tensor, rBias: cute.Tensor, lane, E: cutlass.Constexpr, TOPK: cutlass.Constexpr,
                rounds=None):
    """One warp: the top-TOPK experts of sigmoid(logits) + bias for one token (its logits and the bias in rLog /
    rBias, entry i of lane l for expert l + 32 i); returns round j's winner in lane j (j < TOPK). ``rounds``
    (runtime, at most TOPK; None: TOPK) stops after that many rounds: the caller needs only the first winners
    (lanes past them return 0). Only keys stay
    in registers: each lane keeps its two best (a tree of selects carrying key and index); a round is two
    ``redux.sync`` over the lanes' best (max key, then min id among the lanes holding it: lower id wins ties),
    and only the winning lane moves on, to its second best or, on its third win, to a new tree over its keys
    after the one taken."""
    epl = (E + 31) // 32
    rKey = cute.make_rmem_tensor((epl,), Uint32)
    for i in cutlass.range_constexpr(epl):
        rKey[i] = Uint32(0)  # past E: below every real key
        if lane + 32 * i < E:
            f = _key_score(rLog[i]) + rBias[i]
            u = f.bitcast(Uint32)
            flip = Uint32(f.bitcast(Int32) >> Int32(31)) | Uint32(0x80000000)
            rKey[i] = u ^ flip  # order-preserving: larger float, larger key
    k1, i1 = _lane_best(rKey, Uint32(0xFFFFFFFF), Int32(-1), epl)
    k2, i2 = _lane_best(rKey, k1, i1, epl)
    have2 = Int32(1)
    my_id = Int32(0)
    for j in cutlass.range(TOPK if rounds is None else rounds, unroll=1):
        kmax = cute.arch.warp_redux_sync(k1, "umax")
        cand = Uint32(0xFFFFFFFF)
        if k1 == kmax:
            cand = Uint32(lane) + Uint32(32) * Uint32(i1)
        win = cute.arch.warp_redux_sync(cand, "umin")
        my_id = Int32(cutlass.select_(lane == j, Int32(win), my_id))
        if Uint32(lane) == win % Uint32(32):
            if have2 == Int32(1):
                k1, i1 = k2, i2
                have2 = Int32(0)
            else:
                k1, i1 = _lane_best(rKey, k1, i1, epl)
    return my_id


@cute.jit
def routing_weight(mLogits: cute.Tensor, m, my_id, lane, TOPK: cutlass.Constexpr, RENORMALIZE: cutlass.Constexpr,
                   SCALING: cutlass.Constexpr):
    """The routing weight of lane j's expert (select_topk's round j, j < TOPK) for token m: its score recomputed
    from the logit with the IEEE division, as the reference; renormalised by the sum in round order (shuffles),
    times SCALING. Every lane of the warp must call it (the shuffles)."""
    score = Float32(0.0)
    if lane < TOPK:
        score = sigmoid(mLogits[m, my_id])
    w = score
    if cutlass.const_expr(RENORMALIZE):
        total = Float32(0.0)
        for j in cutlass.range_constexpr(TOPK):  # in round order, as the reference sums them
            total = total + cute.arch.shuffle_sync(score, j)
        w = w / (total + Float32(1e-20))
    return w * Float32(SCALING)


def group_buffers(smem, E: int, M: int, TOPK: int, WARPS: int):
    """Shared memory for group_pairs: (sIds, sPairs, sMask, sOff, sAct, sStart, sNum, sTot). Plain Python,
    traced into the kernel."""
    P = M * TOPK
    maxa = min(E, P)  # distinct experts at most
    sizes = (P, P, E * ((M + 31) // 32), E, maxa, maxa, maxa, 2 * WARPS)
    return tuple(smem.allocate_tensor(Uint32 if i == 2 else Int32, cute.make_layout((n,)), 16)
                 for i, n in enumerate(sizes))


@cute.jit
def clear_masks(sMask: cute.Tensor, tid, E: cutlass.Constexpr, M: cutlass.Constexpr, THREADS: cutlass.Constexpr):
    """Zero group_pairs' token masks (before the barrier ahead of it)."""
    for i in cutlass.range(tid, E * ((M + 31) // 32), THREADS, unroll=1):
        sMask[i] = Uint32(0)


@cute.jit
def group_pairs(sIds: cute.Tensor, sMask: cute.Tensor, sOff: cute.Tensor, sPairs: cute.Tensor, sAct: cute.Tensor,
                sStart: cute.Tensor, sNum: cute.Tensor, sTot: cute.Tensor, tid, lane, warp, E: cutlass.Constexpr,
                M: cutlass.Constexpr, TOPK: cutlass.Constexpr, WARPS: cutlass.Constexpr):
    """The P = M * TOPK (token, slot) pairs of sIds (expert ids, pair p = token * TOPK + slot) grouped by
    expert: sAct[a] = the a-th active expert (ascending id), its pairs sPairs[sStart[a] : sStart[a] + sNum[a]]
    in ascending order; returns the number of active experts. sMask (E x MW words, a bit per token) must be
    zero on entry (clear_masks) and the block synchronised after sIds was written.

    A token picks an expert at most once, so each expert's tokens are a bit mask (shared atomic OR); its count
    is the masks' popcount, one block scan over the experts (count and active flag together) gives each its
    start, and pair (m, j) of expert e lands at start + the number of e's tokens below m (popcount of the
    masked words): the result is deterministic (ref_groups computes the same)."""
    THREADS = 32 * WARPS
    P = M * TOPK
    MW = (M + 31) // 32  # mask words per expert
    EPT = (E + THREADS - 1) // THREADS  # experts per thread in the scan
    for p in cutlass.range(tid, P, THREADS, unroll=1):
        m = p // TOPK
        cute.arch.atomic_or(sMask.iterator + sIds[p] * MW + m // 32, Uint32(1) << Uint32(m % 32), sem="relaxed",
                            scope="cta")
    cute.arch.sync_threads()
    # block scan over experts: (pairs before expert e, active experts before e)
    cnt = Int32(0)
    act = Int32(0)
    for i in cutlass.range_constexpr(EPT):
        e = tid * EPT + i
        if e < E:
            c = Int32(0)
            for w in cutlass.range_constexpr(MW):
                c = c + Int32(cute.arch.popc(sMask[e * MW + w]))
            cnt = cnt + c
            if c > 0:
                act = act + 1
    inc_c = cnt
    inc_a = act
    for s in cutlass.range_constexpr(5):
        oc = cute.arch.shuffle_sync_up(inc_c, offset=1 << s)
        oa = cute.arch.shuffle_sync_up(inc_a, offset=1 << s)
        if lane >= (1 << s):
            inc_c = inc_c + oc
            inc_a = inc_a + oa
    if lane == 31:
        sTot[2 * warp] = inc_c
        sTot[2 * warp + 1] = inc_a
    cute.arch.sync_threads()
    base_c = inc_c - cnt
    base_a = inc_a - act
    n_active = Int32(0)
    for w in cutlass.range_constexpr(WARPS):
        if w < warp:
            base_c = base_c + sTot[2 * w]
            base_a = base_a + sTot[2 * w + 1]
        n_active = n_active + sTot[2 * w + 1]
    for i in cutlass.range_constexpr(EPT):
        e = tid * EPT + i
        if e < E:
            c = Int32(0)
            for w in cutlass.range_constexpr(MW):
                c = c + Int32(cute.arch.popc(sMask[e * MW + w]))
            sOff[e] = base_c
            if c > 0:
                sAct[base_a] = e
                sStart[base_a] = base_c
                sNum[base_a] = c
                base_a = base_a + 1
            base_c = base_c + c
    cute.arch.sync_threads()
    for p in cutlass.range(tid, P, THREADS, unroll=1):
        e = sIds[p]
        m = p // TOPK
        below = Int32(cute.arch.popc(sMask[e * MW + m // 32] & ((Uint32(1) << Uint32(m % 32)) - Uint32(1))))
        for w in cutlass.range_constexpr(MW - 1):
            if w < m // 32:
                below = below + Int32(cute.arch.popc(sMask[e * MW + w]))
        sPairs[sOff[e] + below] = p
    cute.arch.sync_threads()
    return n_active


@cute.jit
def load_groups(mGroups: cute.Tensor, sG: cute.Tensor, tid, THREADS: cutlass.Constexpr):
    """A grouping from store_groups (global) into shared memory: 4-byte cp.async copies, all in flight at once,
    waited for; the caller synchronises the block before reading sG."""
    word = cute.make_copy_atom(cpasync.CopyG2SOp(), Int32, num_bits_per_copy=32)
    for i in cutlass.range(tid, cute.size(sG), THREADS, unroll=1):
        cute.copy(word, cute.local_tile(mGroups, (1,), (i,)), cute.local_tile(sG, (1,), (i,)))
    cute.arch.cp_async_commit_group()
    cute.arch.cp_async_wait_group(0)


@cute.jit
def store_groups(mGroups: cute.Tensor, sAct: cute.Tensor, sStart: cute.Tensor, sNum: cute.Tensor,
                 sPairs: cute.Tensor, n_active, tid, part, MAXA: cutlass.Constexpr, P: cutlass.Constexpr,
                 THREADS: cutlass.Constexpr, PARTS: cutlass.Constexpr):
    """group_pairs' result into global memory for the next kernel (group_len entries: n_active; MAXA experts,
    starts, counts, zero past n_active; the P pairs), every entry written. The grouping is the same in every
    CTA, so CTA ``part`` of PARTS writes only its contiguous share of the entries (instead of CTA 0 writing all
    3,713 at K3 batch 64; in the layer the difference was within the noise: 264.6 / 269.4 against 267.7 us)."""
    GL = 1 + 3 * MAXA + P
    CH = (GL + PARTS - 1) // PARTS
    for e in cutlass.range(part * CH + tid, cutlass.min((part + 1) * CH, GL), THREADS, unroll=1):
        if e == 0:
            mGroups[0] = n_active
        elif e < 1 + MAXA:
            mGroups[e] = Int32(cutlass.select_(e - 1 < n_active, sAct[e - 1], Int32(0)))
        elif e < 1 + 2 * MAXA:
            mGroups[e] = Int32(cutlass.select_(e - 1 - MAXA < n_active, sStart[e - 1 - MAXA], Int32(0)))
        elif e < 1 + 3 * MAXA:
            mGroups[e] = Int32(cutlass.select_(e - 1 - 2 * MAXA < n_active, sNum[e - 1 - 2 * MAXA], Int32(0)))
        else:
            mGroups[e] = sPairs[e - 1 - 3 * MAXA]


@cute.jit
def block_mma(rW: cute.Tensor, w0: cutlass.Constexpr, xg, xh, rX: cute.Tensor, acc: cute.Tensor,
              a0: cutlass.Constexpr, second: cutlass.Constexpr):
    """One MX block of 16 weight rows times 8 activation columns, accumulated into acc[a0 : a0 + 4] (the
    m16n8 C fragment): rW[w0 : w0 + 4] and rW[w0 + 4 : w0 + 8] are this lane's block of rows g and g + 8
    (32 codes each, in the prepacked layout: mxfp4_mirror.prepack), xg / xh their E8M0 scale bytes as scale
    pairs (mxfp4_lib.scale_pair: the byte in both halves), rX[16] the same 32 activations (bf16 pairs) of this
    lane's column. Codes 2j and 2j + 1 of a word form one bf16 pair (decode_e2m1x8_packed), as the activations
    lie; the MMA's K is the quad's four blocks interleaved (a permutation of K, which a dot product allows); the
    scale is applied to the weights before the MMA (the four lanes of a quad hold different blocks).

    ``second`` (compile time) is the second factor 2**max(s - 128, 0): None applies it where the lane's byte
    exceeds 128 (predicated: the 8 products per word issue on every call, switched off or not); True applies
    it always; False never, exact only for scale bytes <= 128 (the usual case: a block's absmax below 12), whose
    first factor is then one multiply-add from the scale pair (mxfp4_lib.scale_fast).
    moe_gate_up runs False and, when scale_big_bits saw a larger byte in any lane of the warp, runs the task
    again with True, in a loop: a branch between the two forms inside one k-step is if-converted by the compiler,
    both forms issuing on every step (the False form's k-step: 407 instructions, None's 536, before scale_fast)."""
    if cutlass.const_expr(second is False):
        fg = (scale_fast(xg),)
        fh = (scale_fast(xh),)
    else:
        sg = xg & Uint32(0xFF)
        sh = xh & Uint32(0xFF)
        fg = scale_bf16x2(sg)
        fh = scale_bf16x2(sh)
    for wi in cutlass.range_constexpr(4):  # word wi of the block: codes 8wi .. 8wi+7
        xb = [rX[4 * wi + j] for j in range(4)]  # activations 8wi + 2j, 8wi + 2j + 1: the pairs as they lie
        dec = cute.make_rmem_tensor((8,), Uint32)  # [row g | row g + 8][pair j]
        for j, w in enumerate(decode_e2m1x8_packed(rW[w0 + wi])):
            dec[j] = bf16x2_mul(w, fg[0])
        for j, w in enumerate(decode_e2m1x8_packed(rW[w0 + 4 + wi])):
            dec[4 + j] = bf16x2_mul(w, fh[0])
        if cutlass.const_expr(second is None):  # per lane: the second product predicated on the lane's bytes
            if cutlass.max(sg, sh) > Uint32(128):
                for j in cutlass.range_constexpr(4):
                    dec[j] = bf16x2_mul(dec[j], fg[1])
                    dec[4 + j] = bf16x2_mul(dec[4 + j], fh[1])
        elif cutlass.const_expr(second):
            for j in cutlass.range_constexpr(4):
                dec[j] = bf16x2_mul(dec[j], fg[1])
                dec[4 + j] = bf16x2_mul(dec[4 + j], fh[1])
        for half in cutlass.range_constexpr(2):  # pairs (0, 1) then (2, 3): one MMA each
            c = mma_bf16_16816((dec[2 * half], dec[4 + 2 * half], dec[2 * half + 1], dec[4 + 2 * half + 1]),
                               (xb[2 * half], xb[2 * half + 1]), (acc[a0], acc[a0 + 1], acc[a0 + 2], acc[a0 + 3]))
            for i in cutlass.range_constexpr(4):
                acc[a0 + i] = c[i]
