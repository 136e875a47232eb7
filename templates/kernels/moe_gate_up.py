"""Routed MXFP4 experts: router selection + gate/up GEMMs + SiTU-GLU (template moe_gate_up; moe_down_combine
follows).

For token m and selected slot j (expert e = ids[m, j]):
    gate = bf16(z[m] . deq(W1[e])^T),  up = bf16(z[m] . deq(W3[e])^T)          (fp32 accumulation)
    h[m, j] = bf16(BETA*tanh(gate/BETA)*sigmoid(gate) * LINEAR_BETA*tanh(up/LINEAR_BETA))
Selection (as k3compile.dialect._select): scores = sigmoid(logits[m]); ids = top-k of scores + bias,
descending (ties: lower expert id); weights = scores[ids] (/ (sum + 1e-20) if RENORMALIZE) * SCALING.

Persistent grid of CTAS CTAs, WARPS warps each, in three phases:

1. Routing (every CTA, the same result; CTA WRITER alone writes ids/weights). Warp w selects tokens w, w+WARPS,
   ... with moe_lib.select_topk: each lane holds EPL keys (sigmoid(logit) + bias as order-preserving u32;
   the bias, a weight, is loaded before the PDL wait, and the warp's next token's logits while it selects
   the current one), each of TOPK rounds is two ``redux.sync``. The keys' sigmoid uses an approximate
   reciprocal (about 1 ulp); lane j keeps round j's winner and recomputes its score from the logit with the
   IEEE division, as the reference; the weights' sum runs in round order by shuffles.
   With ROUTED (from batch 16, where each warp would select M / WARPS tokens one after another in every CTA)
   moe_route has selected every token once, and this phase only reads its ids.
   SOLO (batch 1): active expert a is round a's winner (not the a-th lowest id), so a CTA runs only the rounds
   up to its last task's expert and starts streaming weights while the CTAs of later experts still select
   (at K3 TP8 shapes the 16 rounds held every CTA's weight loads back for about a third of the kernel);
   CTA WRITER, which has a task on the last expert, runs every round and writes ids, weights and groups.
2. Grouping by expert in shared memory (moe_lib.group_pairs): each expert's tokens as a bit mask (shared
   atomic OR), one block scan over E experts gives each active expert its start in a list of (token, slot)
   pairs, and the pairs land in token order (a popcount of the mask below the token). Each distinct expert is
   then read and decoded once per step, however many tokens picked it. Every CTA writes its share of the
   grouping to ``groups`` (moe_lib.store_groups) for moe_down_combine. SOLO needs no grouping: expert a has
   one pair, slot a.
3. Tasks (active expert, tile of 16 rows of W1 and the same 16 of W3), task t on CTA t % CTAS in its task
   slot (t // CTAS) % SLOTS: a last round of fewer than CTAS * SLOTS tasks is spread over all CTAs (SMs)
   instead of filling the first CTAs' slots while the rest idle. A slot is KSPLIT warps (1; 2 or 4 while
   there are fewer tasks than warps, 4 at batch 1 at K3 TP8 shapes; they split the reduction and meet in
   shared memory behind a named barrier per slot). Tokens of the group are the
   MMA N dimension (8 per ``mma.sync.m16n8k16``, bf16 in, fp32 accumulate), rows the M dimension. In a
   k-step a quad (lanes 4g..4g+3) covers 4 MX blocks, lane t of the quad loading block 4*step + t of rows
   g and g+8, so every weight byte is loaded by one lane, coalesced. The loads are ``cp.async`` copies into
   a per-warp ring of STAGES k-steps in shared memory (16-byte weight copies, the 4-byte word of the four
   blocks' scales and, without XSTAGE, the step's activations of the lane's token; with XSTAGE, up to
   64 KB of activations, every token's row is staged in shared memory once per CTA instead, by cp.async
   copies issued before the routing phase so they land while the warps select: batch 1 to 8 at K3 shapes, from
   batch 2 one CTA of 16 warps per SM): STAGES - 1 steps are in flight while one is decoded,
   without holding registers (register-held double buffering left too few bytes in flight at batch 1). A
   lane reads back only what it copied itself, so the ring needs no barrier. W1 and W3 are in the kernels'
   prepacked layout (mxfp4_mirror.prepack: the bits of each 4-byte word permuted once, at load). Decode
   (moe_lib.block_mma): a shift or rotate and an AND per pair of adjacent codes give e2m1 * 2**-126 as bf16
   (subnormals exact), paired as the activations lie; one packed bf16 multiply by 2**(s-1) makes it the
   dequantised weight (the factor is one multiply-add from the scale pair, the lane's byte of the scale word
   in both halves by one prmt: mxfp4_lib.scale_pair, 4 % fewer cycles at batch 64 in the KDA layer than the
   shift, mask and clamp per byte); a second multiply by 2**(s-128) is needed when s > 128 (block scales of 4 and more):
   the k-steps run without it and, if any lane of the warp met such a byte, the task's k-steps run again with
   it (rare; a branch inside the step is predicated by the compiler, both forms issuing on every step: 64 of
   536 instructions). So every E8M0 byte is exact. The epilogue rounds gate
   and up to bf16, applies SiTU-GLU and writes h for each (token, slot) column.

   DIAG (batch 1, one token: 7 of the MMA's 8 columns would be zero; from batch 2 where the groups are expected to
   be of one token, as at K3 batches 2 and 4, 896 experts taking 16 picks a token): the columns hold MX blocks
   instead, one token at a time. The
   codes go into the MMA unscaled (block_mma_raw: no packed multiply, 64 of a k-step's instructions),
   and lane (g, t) passes its block's activations as column g's only where g = t + 4 (i % 2) (i the warp's
   k-step), zeros (a 64-byte zero row in shared memory) elsewhere. So column c of the window of k-steps i, i + 1
   sums block c (step i) or c - 4 (step i + 1) of each row, never two blocks, and after the window each lane
   multiplies its 2 columns' sums of rows g, g + 8 by their blocks' factors 2**(s - 33) (one fp32 built from the
   scale byte) into its row partials (8 multiply-adds per two k-steps instead of 128 packed multiplies); the quad
   adds its 4 lanes' partials at the end. The staged activations are prescaled by 2**32 once per CTA (exact), which
   keeps every product of an unscaled code (as small as 2**-127) normal in fp32. A scale byte above 160 makes the
   task run again with each factor split in two (2**(min(s, 160) - 33) * 2**(max(s, 160) - 160)): exact for
   every byte, as the other path. A group of several tokens runs the task once per token (its codes read again
   and decoded again: expected for about 1 % of the tasks at K3 batch 2, 3 % at batch 4; at batch 8, 7 %, the
   kernel measured 13 % slower than the other path, which DIAG_MAX_SHARE in the template then keeps there).
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint32
from cutlass.cute.nvgpu import cpasync

from k3compile.templates.kernels.moe_lib import (block_mma, clear_masks, group_buffers, group_pairs, routing_weight,
                                                 select_topk, sigmoid, store_groups)
from k3compile.templates.kernels.mxfp4_lib import (bf16x2_mul, decode_e2m1x8_packed, mma_bf16_16816, prmt,
                                                   scale_big_bits, scale_pair, scale_pair_selector)

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
WARPS = 8  # warps per CTA
KSPLIT = 2  # warps sharing one task (they split its reduction); WARPS / KSPLIT tasks per CTA at a time
CTAS = 16  # persistent CTAs (tasks are strided over their task slots)
OCC = 2  # CTAs per SM (register budget: 65536 / (OCC * THREADS))
STAGES = 4  # k-steps of weights in flight per warp (cp.async ring in shared memory)
XSTAGE = True  # every token's activations staged in shared memory once per CTA (else they travel in the ring)
ROUTED = False  # ids come from moe_route (from batch 16) instead of a selection in every CTA
DIAG = False  # one token at a time: the MMA's 8 columns hold 8 MX blocks, each scale applied once to its sums
# <<< constants

NB = L // 32  # MX blocks (16 bytes, 32 codes) per weight row
STEPS = NB // 4  # k-steps: a quad covers 4 blocks
SLOTS = WARPS // KSPLIT  # tasks a CTA works on at once
RT = I // 16  # row tiles of 16
P = M * TOPK  # (token, slot) pairs
MAXA = min(E, P)  # distinct experts at most
SOLO = M == 1 and not ROUTED  # one token: its experts in selection order, each CTA selects only what it needs
WRITER = (TOPK * RT - 1) % CTAS if SOLO else 0  # the CTA that writes ids, weights and groups (it selects all)
THREADS = 32 * WARPS
NCOL = 1 if DIAG else 8  # (token, slot) columns of a group per pass over a task's weights
EPL = (E + 31) // 32  # router keys per lane (selection)
X_RING = not XSTAGE  # activations travel in the ring with the weights
XCH = 8 if X_RING else 4  # 16-byte chunks per lane in a ring stage
XROW = L // 2 + 4  # words per staged token row (16 bytes of padding: rows start 4 banks apart)
DIAG_X_EXP = 32  # DIAG: the staged activations are prescaled by 2**DIAG_X_EXP (exact below 2**96 in magnitude), so
# the products of the unscaled codes (e2m1 * 2**-126) with them stay normal in fp32
DIAG_X = ((127 + DIAG_X_EXP) << 7) * 0x10001  # 2**DIAG_X_EXP in both bf16 halves
DIAG_FACTOR_BIAS = 127 - 126 + DIAG_X_EXP  # a block's factor 2**(s - 127 + 126 - DIAG_X_EXP) = 2**(s - 33) ...
DIAG_MAX_SCALE = 254 - 127 + DIAG_FACTOR_BIAS  # ... is one fp32 (exponent field s + 94) up to this scale byte, 160;
# above it (a block scale of 2**34 or more) the task runs again with the factor split in two


def _situ(gate, up):
    """h = SiTU-GLU of the fp32 sums, each rounded to bf16 first (as the reference rounds gate and up)."""
    g = gate.to(BFloat16).to(Float32)
    u = up.to(BFloat16).to(Float32)
    act = Float32(BETA) * cute.math.tanh(g / Float32(BETA)) * sigmoid(g)
    return (act * (Float32(LINEAR_BETA) * cute.math.tanh(u / Float32(LINEAR_BETA)))).to(BFloat16)


@cute.jit
def block_mma_raw(rW: cute.Tensor, w0: cutlass.Constexpr, rX: cute.Tensor, acc: cute.Tensor, a0: cutlass.Constexpr):
    """moe_lib.block_mma without the scale (DIAG): the decoded codes (e2m1 * 2**-126 as bf16; the code 0.5 is a
    bf16 subnormal, which the tensor cores take exactly) go into the MMA as they are, and the caller applies each
    (row, block) scale to the accumulators. Same fragments and K permutation as block_mma."""
    for wi in cutlass.range_constexpr(4):
        xb = [rX[4 * wi + j] for j in range(4)]
        dg = decode_e2m1x8_packed(rW[w0 + wi])
        dh = decode_e2m1x8_packed(rW[w0 + 4 + wi])
        for half in cutlass.range_constexpr(2):
            c = mma_bf16_16816((dg[2 * half], dh[2 * half], dg[2 * half + 1], dh[2 * half + 1]),
                               (xb[2 * half], xb[2 * half + 1]), (acc[a0], acc[a0 + 1], acc[a0 + 2], acc[a0 + 3]))
            for i in cutlass.range_constexpr(4):
                acc[a0 + i] = c[i]


class Kernel:
    # The argument list follows templates/moe_experts.py (MoeGateUp.args): with ROUTED the ids are an input
    # (from moe_route) and h the only output.
    if ROUTED:

        @cute.jit
        def __call__(self, mZ: cute.Tensor, mIds: cute.Tensor, mW1: cute.Tensor, mS1: cute.Tensor,
                     mW3: cute.Tensor, mS3: cute.Tensor, mH: cute.Tensor, mGroups: cute.Tensor, stream):
            self._launch(mZ, None, None, mW1, mS1, mW3, mS3, mH, mIds, None, mGroups, stream)

    else:

        @cute.jit
        def __call__(self, mZ: cute.Tensor, mLogits: cute.Tensor, mBias: cute.Tensor, mW1: cute.Tensor,
                     mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor, mH: cute.Tensor, mIds: cute.Tensor,
                     mWts: cute.Tensor, mGroups: cute.Tensor, stream):
            self._launch(mZ, mLogits, mBias, mW1, mS1, mW3, mS3, mH, mIds, mWts, mGroups, stream)

    @cute.jit
    def _launch(self, mZ, mLogits, mBias, mW1, mS1, mW3, mS3, mH, mIds, mWts, mGroups, stream):
        mZq = cute.recast_tensor(mZ, Uint32)  # [M, L/2] bf16 pairs
        mW1q = cute.recast_tensor(mW1, Uint32)  # [E, I, L/8] 8 codes per word
        mW3q = cute.recast_tensor(mW3, Uint32)
        mS1q = cute.recast_tensor(mS1, Uint32)  # [E, I, NB/4]: the scales of a k-step's 4 blocks in one word
        mS3q = cute.recast_tensor(mS3, Uint32)
        self.kernel(mZq, mLogits, mBias, mW1q, mS1q, mW3q, mS3q, mH, mIds, mWts, mGroups).launch(
            grid=(CTAS, 1, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True, min_blocks_per_mp=OCC,
            preferred_smem_carveout=100)

    @cute.jit
    def load_logits(self, mLogits: cute.Tensor, rLog: cute.Tensor, lane, m):
        """Token m's router logits (lane + 32 i) into rLog, when m < M."""
        if m < M:
            for i in cutlass.range_constexpr(EPL):
                if lane + 32 * i < E:
                    rLog[i] = mLogits[m, lane + 32 * i]

    @cute.jit
    def select(self, rLog: cute.Tensor, rBias: cute.Tensor, mLogits: cute.Tensor, mIds: cute.Tensor,
               mWts: cute.Tensor, sIds: cute.Tensor, lane, m, writer, rounds):
        """One warp: token m's experts (its logits in rLog) into sIds[m*TOPK + j] (lane j keeps round j's winner,
        so TOPK lanes store at once; past ``rounds`` rounds, 0); the writer CTA (all rounds) also stores ids and
        routing weights."""
        my_id = select_topk(rLog, rBias, lane, E, TOPK, rounds)
        if lane < TOPK:
            sIds[m * TOPK + lane] = my_id
        if writer:
            w = routing_weight(mLogits, m, my_id, lane, TOPK, RENORMALIZE, SCALING)
            if lane < TOPK:
                mIds[m, lane] = my_id
                mWts[m, lane] = w

    @cute.jit
    def stage_x(self, mZq: cute.Tensor, sX: cute.Tensor, tid):
        """With XSTAGE: every token's activations into sX by cp.async (16 bytes per copy, one commit group), issued
        before the routing phase so the copies travel while the warps select; waited for before the barrier
        ahead of grouping."""
        if cutlass.const_expr(XSTAGE):
            big = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), Uint32,
                                      num_bits_per_copy=128)
            for v in cutlass.range(tid, M * (L // 8), THREADS, unroll=1):
                m = v // (L // 8)
                c = v % (L // 8)
                cute.copy(big, cute.local_tile(mZq[m, None], (4,), (c,)), cute.local_tile(sX[m, None], (4,), (c,)))
            cute.arch.cp_async_commit_group()

    @cute.jit
    def prescale_x(self, sX: cute.Tensor, sZ: cute.Tensor, tid):
        """DIAG: the staged activations times 2**DIAG_X_EXP (exact), each thread the chunks it copied itself in
        stage_x (its own cp.async copies have landed: no barrier needed); and the zero block."""
        for v in cutlass.range(tid, M * (L // 8), THREADS, unroll=1):
            m = v // (L // 8)
            c = v % (L // 8)
            for q in cutlass.range_constexpr(4):
                sX[m, 4 * c + q] = bf16x2_mul(sX[m, 4 * c + q], Uint32(DIAG_X))
        if tid < 16:
            sZ[tid] = Uint32(0)

    @cute.jit
    def issue_step(self, mW1q: cute.Tensor, mS1q: cute.Tensor, mW3q: cute.Tensor, mS3q: cute.Tensor,
                   mZq: cute.Tensor, e, row0, g, t, tok, valid, step, sW: cute.Tensor, sS: cute.Tensor, lane):
        """cp.async of this lane's share of k-step ``step`` into one ring stage (sW [XCH, 32, 4] words, sS [4, 32]):
        MX block 4*step + t of rows g and g + 8 of W1 and W3 (chunks 0..3, 16 bytes each), the same 32
        activations of this lane's token when X_RING (chunks 4..7; not copied for a column past the group), the scale
        word holding blocks 4*step .. 4*step + 3 of each weight row (4 bytes each; the quad's lanes copy the
        same words). A lane reads back only what it copied itself, so the ring needs no barrier."""
        big = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), Uint32,
                                  num_bits_per_copy=128)
        word = cute.make_copy_atom(cpasync.CopyG2SOp(), Uint32, num_bits_per_copy=32)
        blk = 4 * step + t
        for r in cutlass.range_constexpr(4):
            mW = mW1q if r < 2 else mW3q
            mS = mS1q if r < 2 else mS3q
            row = row0 + g + 8 * (r % 2)
            cute.copy(big, cute.local_tile(mW[e, row, None], (4,), (blk,)), sW[r, lane, None])
            cute.copy(word, cute.local_tile(mS[e, row, None], (1,), (step,)), cute.local_tile(sS[r, None], (1,),
                                                                                               (lane,)))
        if cutlass.const_expr(X_RING):
            if valid:
                for q in cutlass.range_constexpr(4):
                    cute.copy(big, cute.local_tile(mZq[tok, None], (4,), (4 * blk + q,)), sW[4 + q, lane, None])

    @cute.jit
    def read_step(self, sW: cute.Tensor, sS: cute.Tensor, sX: cute.Tensor, lane, sel, tok, valid, blk,
                  rW: cute.Tensor, rS: cute.Tensor, rX: cute.Tensor):
        """This lane's weights, scale pairs (mxfp4_lib.scale_pair of its block's byte; sel its selector) and
        activations (block blk of token tok) of one landed ring stage, into registers. With XSTAGE they come from
        sX, the staged rows, for every lane: a column past the group reads the group's last token (tok is
        clamped), whose results are not stored (an MMA column depends only on its own activations), so the read
        needs no branch. With X_RING they come from the ring, zero for a column past the group (not copied)."""
        for r in cutlass.range_constexpr(4):
            cute.autovec_copy(sW[r, lane, None], cute.local_tile(rW, (4,), (r,)))
            rS[r] = scale_pair(sS[r, lane], sel)
        if valid:
            if cutlass.const_expr(X_RING):
                for q in cutlass.range_constexpr(4):
                    cute.autovec_copy(sW[4 + q, lane, None], cute.local_tile(rX, (4,), (q,)))
            else:
                cute.autovec_copy(cute.local_tile(sX[tok, None], (16,), (blk,)), rX)
        else:
            rX.fill(0)

    @cute.jit
    def ring_issue(self, mW1q: cute.Tensor, mS1q: cute.Tensor, mW3q: cute.Tensor, mS3q: cute.Tensor,
                   mZq: cute.Tensor, e, row0, g, t, tok, valid, ks, n_my, i, sW: cute.Tensor, sS: cute.Tensor, lane):
        """Step i of this warp's k-steps ks, ks + KSPLIT, ... into ring stage i % STAGES, if the warp has it, and
        one cp.async group either way (empty past the end): after issuing step i + STAGES - 1,
        ``cp_async_wait_group(STAGES - 1)`` means step i has landed."""
        if i < n_my:
            self.issue_step(mW1q, mS1q, mW3q, mS3q, mZq, e, row0, g, t, tok, valid, ks + i * KSPLIT,
                            sW[i % STAGES, None, None, None], sS[i % STAGES, None, None], lane)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def stream(self, second: cutlass.Constexpr, mW1q: cute.Tensor, mS1q: cute.Tensor, mW3q: cute.Tensor,
               mS3q: cute.Tensor, mZq: cute.Tensor, e, row0, g, t, sel, tok, valid, ks, n_my, sW: cute.Tensor,
               sS: cute.Tensor, sX: cute.Tensor, lane, rW: cute.Tensor, rS: cute.Tensor, rX: cute.Tensor,
               acc: cute.Tensor) -> Uint32:
        """This warp's k-steps ks, ks + KSPLIT, ... of one task through its ring of STAGES k-steps (one
        cp.async group per step, empty past the end), accumulated into acc; block_mma's second factor when
        ``second``. Returns the OR of the lane's scale_big_bits: bit 8 set when one of its scale bytes exceeded
        128 (the result then needs ``second``)."""
        for i in cutlass.range_constexpr(STAGES - 1):
            self.ring_issue(mW1q, mS1q, mW3q, mS3q, mZq, e, row0, g, t, tok, valid, ks, n_my, i, sW, sS, lane)
        big = Uint32(0)
        for i in cutlass.range(n_my, unroll=1):
            self.ring_issue(mW1q, mS1q, mW3q, mS3q, mZq, e, row0, g, t, tok, valid, ks, n_my, i + STAGES - 1, sW,
                            sS, lane)
            cute.arch.cp_async_wait_group(STAGES - 1)  # step i has landed
            self.read_step(sW[i % STAGES, None, None, None], sS[i % STAGES, None, None], sX, lane, sel, tok, valid,
                           4 * (ks + i * KSPLIT) + t, rW, rS, rX)
            if cutlass.const_expr(not second):
                big = big | scale_big_bits(rS[0]) | scale_big_bits(rS[1]) | scale_big_bits(rS[2]) \
                    | scale_big_bits(rS[3])
            block_mma(rW, 0, rS[0], rS[1], rX, acc, 0, second)  # gate: W1 rows g, g + 8
            block_mma(rW, 8, rS[2], rS[3], rX, acc, 4, second)  # up: W3 rows g, g + 8
        return big

    @cute.jit
    def drain(self, second: cutlass.Constexpr, cw: cute.Tensor, rSw: cute.Tensor, rP: cute.Tensor, sel0, sel1) \
            -> Uint32:
        """DIAG: the window's column sums cw (gate c0..c3, up c0..c3: rows g, g + 8 x this lane's columns 2t,
        2t + 1) times their blocks' factors, into the lane's row partials rP (gate g, gate g + 8, up g, up g + 8).
        rSw holds the scale words of the k-step that filled this lane's columns (rows as issue_step's r); sel0 /
        sel1 take the columns' bytes out of them (prmt). Without ``second`` the factor is one fp32 2**(s - 33),
        exact up to DIAG_MAX_SCALE; returns the OR of its exponent field + 1 (bit 31 set: a byte above it, the task
        needs ``second``, which splits the factor in two)."""
        big = Uint32(0)
        for r in cutlass.range_constexpr(4):  # W1 g, W1 g + 8, W3 g, W3 g + 8: cw[4 * (r // 2) + 2 * (r % 2) + u]
            for u in cutlass.range_constexpr(2):
                sb = prmt(rSw[r], Uint32(0), sel0 if u == 0 else sel1)
                v = cw[4 * (r // 2) + 2 * (r % 2) + u]
                if cutlass.const_expr(second):
                    f1 = ((cutlass.min(sb, Uint32(DIAG_MAX_SCALE)) + Uint32(254 - DIAG_MAX_SCALE)) << Uint32(23))
                    f2 = ((cutlass.max(sb, Uint32(DIAG_MAX_SCALE)) - Uint32(DIAG_MAX_SCALE - 127)) << Uint32(23))
                    rP[r] = rP[r] + (v * f2.bitcast(Float32)) * f1.bitcast(Float32)
                else:
                    fb = sb * Uint32(1 << 23) + Uint32((127 - DIAG_FACTOR_BIAS) << 23)
                    big = big | (fb + Uint32(1 << 23))
                    rP[r] = rP[r] + v * fb.bitcast(Float32)
        return big

    @cute.jit
    def stream_diag(self, second: cutlass.Constexpr, mW1q: cute.Tensor, mS1q: cute.Tensor, mW3q: cute.Tensor,
                    mS3q: cute.Tensor, mZq: cute.Tensor, e, row0, g, t, tok, ks, n_my, sW: cute.Tensor,
                    sS: cute.Tensor, sX: cute.Tensor, sZ: cute.Tensor, lane, rW: cute.Tensor, rX: cute.Tensor,
                    rSw: cute.Tensor, cw: cute.Tensor, rP: cute.Tensor) -> Uint32:
        """DIAG: this warp's k-steps ks, ks + KSPLIT, ... of one task for token tok, the ring as in ``stream``; k-step
        i fills MMA columns 4 (i % 2) .. 4 (i % 2) + 3 with its 4 blocks (lane (g, t) passes block t's activations
        as column g's where g = t + 4 (i % 2), sZ's zeros elsewhere), and after each window of two k-steps (or the
        last) ``drain`` scales the columns into rP. Returns drain's OR (bit 31: run again with ``second``)."""
        for i in cutlass.range_constexpr(STAGES - 1):
            self.ring_issue(mW1q, mS1q, mW3q, mS3q, mZq, e, row0, g, t, 0, True, ks, n_my, i, sW, sS, lane)
        for r in cutlass.range_constexpr(4):
            rP[r] = Float32(0.0)
            rSw[r] = Uint32(0)
        sel0 = Uint32(0x4440) + Uint32(2) * (Uint32(t) % Uint32(2))  # prmt: byte 2 (t % 2) (+ 1), zeros above
        sel1 = sel0 + Uint32(1)
        zero = sZ.iterator.toint()
        big = Uint32(0)
        for i in cutlass.range(n_my, unroll=1):
            self.ring_issue(mW1q, mS1q, mW3q, mS3q, mZq, e, row0, g, t, 0, True, ks, n_my, i + STAGES - 1, sW, sS,
                            lane)
            cute.arch.cp_async_wait_group(STAGES - 1)  # step i has landed
            odd = i % 2
            keep = (t < 2) == (odd == 0)  # this lane's columns 2t, 2t + 1 are this step's blocks
            for r in cutlass.range_constexpr(4):
                rSw[r] = Uint32(cutlass.select_(keep, sS[i % STAGES, r, lane], rSw[r]))
            mine = cute.local_tile(sX[tok, None], (16,), (4 * (ks + i * KSPLIT) + t,)).iterator.toint()
            src = cute.make_ptr(Uint32, cutlass.select_(g == t + 4 * odd, mine, zero), cute.AddressSpace.smem,
                                assumed_align=16)
            cute.autovec_copy(cute.make_tensor(src, cute.make_layout((16,))), rX)
            if odd == 0:
                cw.fill(0.0)
            for mat in cutlass.range_constexpr(2):  # gate (W1 rows g, g + 8), then up (W3): 8 words of codes live
                for r in cutlass.range_constexpr(2):  # (the 16 at once spilled at 128 registers, 16-warp CTAs)
                    cute.autovec_copy(sW[i % STAGES, 2 * mat + r, lane, None], cute.local_tile(rW, (4,), (r,)))
                block_mma_raw(rW, 0, rX, cw, 4 * mat)
            if odd == 1 or i == n_my - 1:
                big = big | self.drain(second, cw, rSw, rP, sel0, sel1)
        return big

    @cute.kernel
    def kernel(self, mZq: cute.Tensor, mLogits, mBias, mW1q: cute.Tensor, mS1q: cute.Tensor, mW3q: cute.Tensor,
               mS3q: cute.Tensor, mH: cute.Tensor, mIds: cute.Tensor, mWts, mGroups: cute.Tensor):
        tid = cute.arch.thread_idx()[0]
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        bid = cute.arch.block_idx()[0]
        smem = cutlass.utils.SmemAllocator()
        sIds, sPairs, sMask, sOff, sAct, sStart, sNum, sTot = group_buffers(smem, E, M, TOPK, WARPS)
        sRed = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 2, 16, 8)), 16)
        # the weight ring, row-major: a lane's 16 bytes contiguous, lanes side by side (no bank conflicts)
        sW = smem.allocate_tensor(Uint32, cute.make_layout((WARPS, STAGES, XCH, 32, 4),
                                                           stride=(STAGES * XCH * 128, XCH * 128, 128, 4, 1)), 16)
        sX = smem.allocate_tensor(Uint32, cute.make_layout((1, 4) if X_RING else (M, XROW), stride=(XROW, 1)),
                                  16)  # the staged token rows (XSTAGE)
        sZ = smem.allocate_tensor(Uint32, cute.make_layout((16,)), 16) if DIAG else None  # a zero block (DIAG)
        sS = smem.allocate_tensor(Uint32, cute.make_layout((WARPS, STAGES, 4, 32), stride=(STAGES * 128, 128, 32, 1)),
                                  16)

        clear_masks(sMask, tid, E, M, THREADS)
        if cutlass.const_expr(ROUTED):  # moe_route selected: its ids (and, through it, z) are ready after the wait
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()  # the next kernel may start its prologue now
            self.stage_x(mZq, sX, tid)
            for p in cutlass.range(tid, P, THREADS, unroll=1):
                sIds[p] = mIds[p // TOPK, p % TOPK]
        else:
            rBias = cute.make_rmem_tensor((EPL,), Float32)  # a static weight: loaded before the PDL wait
            for i in cutlass.range_constexpr(EPL):
                rBias[i] = Float32(0.0)
                if lane + 32 * i < E:
                    rBias[i] = mBias[lane + 32 * i]
            cute.arch.griddepcontrol_wait()  # logits and z come from the previous kernels
            cute.arch.griddepcontrol_launch_dependents()  # the next kernel may start its prologue now
            self.stage_x(mZq, sX, tid)  # in flight while the warps select

            # each warp's next token's logits are loaded while it selects the current one
            rLog = cute.make_rmem_tensor((EPL,), Float32)
            self.load_logits(mLogits, rLog, lane, warp)
            rounds = None  # every round (TOPK)
            if cutlass.const_expr(SOLO):  # this CTA's last task (the largest index t = bid mod CTAS) is on the
                rounds = Int32(0)  # expert of round t // RT: the rounds after it are not waited for
                if bid < TOPK * RT:
                    rounds = (bid + CTAS * ((TOPK * RT - 1 - bid) // CTAS)) // RT + 1
            for m in cutlass.range(warp, M, WARPS, unroll=1):
                rCur = cute.make_rmem_tensor((EPL,), Float32)
                rCur.store(rLog.load())
                self.load_logits(mLogits, rLog, lane, m + WARPS)
                self.select(rCur, rBias, mLogits, mIds, mWts, sIds, lane, m, bid == WRITER, rounds)
        if cutlass.const_expr(XSTAGE):  # this thread's staging copies have landed, visible after the barrier
            cute.arch.cp_async_wait_group(0)
            if cutlass.const_expr(DIAG):
                self.prescale_x(sX, sZ, tid)
        cute.arch.sync_threads()
        if cutlass.const_expr(SOLO):  # one token: expert a is round a's winner, its one pair is slot a
            n_active = Int32(TOPK)
            if tid < TOPK:
                sAct[tid] = sIds[tid]
                sStart[tid] = tid
                sNum[tid] = 1
                sPairs[tid] = tid
            cute.arch.sync_threads()
            if bid == WRITER:  # the grouping for moe_down_combine, from the CTA that selected every round
                store_groups(mGroups, sAct, sStart, sNum, sPairs, n_active, tid, 0, MAXA, P, THREADS, 1)
        else:
            n_active = group_pairs(sIds, sMask, sOff, sPairs, sAct, sStart, sNum, sTot, tid, lane, warp, E, M, TOPK,
                                   WARPS)
            # the grouping for moe_down_combine (which then needs none of its own), a share from every CTA
            store_groups(mGroups, sAct, sStart, sNum, sPairs, n_active, tid, bid, MAXA, P, THREADS, CTAS)

        g = lane // 4  # MMA row (and row + 8) of this lane, and its token column
        t = lane % 4  # which block of a k-step this lane loads
        sel = scale_pair_selector(t)  # its byte of each scale word
        slot = warp // KSPLIT  # the task slot of this warp in its CTA
        ks = warp % KSPLIT  # its share of the reduction: k-steps ks, ks + KSPLIT, ...
        acc = cute.make_rmem_tensor((8,), Float32)  # gate c0..c3, up c0..c3
        rX = cute.make_rmem_tensor((16,), Uint32)
        rW = cute.make_rmem_tensor((16,), Uint32)  # W1 g, W1 g+8, W3 g, W3 g+8
        rS = cute.make_rmem_tensor((4,), Uint32)
        rSw = cute.make_rmem_tensor((4,), Uint32)  # DIAG: the scale words of this lane's columns
        cw = cute.make_rmem_tensor((8,), Float32)  # DIAG: a window's column sums (gate c0..c3, up c0..c3)
        rP = cute.make_rmem_tensor((4,), Float32)  # DIAG: row partials (gate g, gate g + 8, up g, up g + 8)
        n_my = (STEPS - ks + KSPLIT - 1) // KSPLIT  # this warp's k-steps: ks, ks + KSPLIT, ...
        # task t: CTA t % CTAS, slot (t // CTAS) % SLOTS, so a last round short of CTAS * SLOTS tasks is spread
        # over every CTA (every SM) rather than filling the first CTAs' slots while the others sit idle
        for task in cutlass.range(slot * CTAS + bid, n_active * RT, CTAS * SLOTS, unroll=1):
            a = task // RT
            row0 = (task % RT) * 16
            e = sAct[a]
            start = sStart[a]
            num = sNum[a]
            for nt in cutlass.range(0, num, NCOL, unroll=1):  # NCOL (token, slot) columns of the group at a time
                col = nt + g
                if cutlass.const_expr(DIAG):  # one token: its row sums land in the C entries of column 0
                    tok = 0 if M == 1 else sPairs[start + nt] // TOPK
                    big = self.stream_diag(False, mW1q, mS1q, mW3q, mS3q, mZq, e, row0, g, t, tok, ks, n_my,
                                           sW[warp, None, None, None, None], sS[warp, None, None, None], sX, sZ, lane,
                                           rW, rX, rSw, cw, rP)
                    if cute.arch.vote_any_sync((big >> Uint32(31)) != Uint32(0)):  # a byte > DIAG_MAX_SCALE (rare)
                        self.stream_diag(True, mW1q, mS1q, mW3q, mS3q, mZq, e, row0, g, t, tok, ks, n_my,
                                         sW[warp, None, None, None, None], sS[warp, None, None, None], sX, sZ, lane,
                                         rW, rX, rSw, cw, rP)
                    for r in cutlass.range_constexpr(4):  # the quad's columns: whole row sums in every lane
                        rP[r] = rP[r] + cute.arch.shuffle_sync_bfly(rP[r], offset=1)
                        rP[r] = rP[r] + cute.arch.shuffle_sync_bfly(rP[r], offset=2)
                        acc[2 * r] = rP[r]  # C entry (row g + 8 (r % 2), column 0) of gate (r < 2) or up
                else:
                    tok = sPairs[start + cutlass.min(col, num - 1)] // TOPK
                    acc.fill(0.0)
                    big = self.stream(False, mW1q, mS1q, mW3q, mS3q, mZq, e, row0, g, t, sel, tok, col < num, ks,
                                      n_my, sW[warp, None, None, None, None], sS[warp, None, None, None], sX, lane,
                                      rW, rS, rX, acc)
                    if cute.arch.vote_any_sync((big & Uint32(0x100)) != Uint32(0)):  # a byte > 128: again, exactly
                        acc.fill(0.0)  # (rare)
                        self.stream(True, mW1q, mS1q, mW3q, mS3q, mZq, e, row0, g, t, sel, tok, col < num, ks, n_my,
                                    sW[warp, None, None, None, None], sS[warp, None, None, None], sX, lane, rW, rS,
                                    rX, acc)
                end = nt + NCOL if DIAG else num  # the columns of this pass: DIAG's one, or the group's
                if cutlass.const_expr(KSPLIT == 1):  # the lane holds whole sums: SiTU from registers
                    for i in cutlass.range_constexpr(4):  # C fragment: rows g, g + 8; columns 2t, 2t + 1
                        cc = nt + 2 * t + i % 2
                        if cc < end:
                            pc = sPairs[start + cc]
                            mH[pc // TOPK, pc % TOPK, row0 + g + 8 * (i // 2)] = _situ(acc[i], acc[4 + i])
                else:  # the slot's KSPLIT warps meet in shared memory (a named barrier per slot)
                    for mat in cutlass.range_constexpr(2):
                        for i in cutlass.range_constexpr(4):
                            sRed[warp, mat, g + 8 * (i // 2), 2 * t + i % 2] = acc[4 * mat + i]
                    cute.arch.barrier(barrier_id=1 + slot, number_of_threads=32 * KSPLIT)
                    for o in cutlass.range(ks * 32 + lane, 128, 32 * KSPLIT, unroll=1):
                        r = o // 8
                        cc = o % 8
                        if nt + cc < end:
                            gate = Float32(0.0)
                            up = Float32(0.0)
                            for w in cutlass.range_constexpr(KSPLIT):
                                gate = gate + sRed[slot * KSPLIT + w, 0, r, cc]
                                up = up + sRed[slot * KSPLIT + w, 1, r, cc]
                            pc = sPairs[start + nt + cc]
                            mH[pc // TOPK, pc % TOPK, row0 + r] = _situ(gate, up)
                    cute.arch.barrier(barrier_id=1 + slot, number_of_threads=32 * KSPLIT)
