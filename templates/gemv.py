"""Template ``gemv``: decode GEMM y = xin @ W.T of a bf16 weight, with an optional prologue forming xin
(RMSNorm or SiTU-GLU) and a split fp32 / bf16 output (kernel: kernels/gemv.py).

One template serves the dialect ops ``linear``, ``linear_gather`` (this rank's rows), ``front_gemm``
(several weights of one input concatenated along N, fp32 entries first), ``rms_norm_linear``,
``situ_linear`` and ``lm_head``.
"""

from __future__ import annotations

import math

import torch

from .base import Arg, Template, const, need, need_bucket

PROLOGUES = ("none", "rms_norm", "situ")
SMS = 132  # H200
LONG_K_STEPS = 16  # batch 4: UNROLL 4 from this many 256-element K steps (else 2)
MMA_MIN_BUCKET = 8  # gemv uses tensor cores from this bucket (plain GEMVs only)
PF_CTAS = 4  # FMA path with an L2 prefetch, batch 1-2: CTAs per SM that fit (<= 64 registers); 2 from batch 4
STAGE_X_BYTES = 64 * 1024  # a prologue's xin (M x K bf16) at most this size is formed once per CTA in shared memory
SMEM_PER_SM = 200 * 1024  # of the H200's 228 KiB, what staged-xin CTAs may take on one SM together
HOLD_VECS = 16  # FMA path with HOLD: 128-bit weight vectors a lane holds at most (64 registers)


def segment_views(out: torch.Tensor, widths: tuple) -> list[torch.Tensor]:
    """The compact [M, w] blocks of a SEGMENTS-layout output ``out`` [M, sum(widths)], in order."""
    m, flat, views, off = out.shape[0], out.view(-1), [], 0
    for w in widths:
        views.append(flat[m * off:m * (off + w)].view(m, w))
        off += w
    return views


def out_blocks(c: dict) -> tuple:
    """Widths of the bf16 output's compact blocks as the kernel stores them (each entry's width times its
    REPLICAS copies); () without SEGMENTS."""
    reps = c["REPLICAS"] or (1,) * len(c["SEGMENTS"])
    return tuple(w * r for w, r in zip(c["SEGMENTS"], reps))


def gathered_in_kernel(c: dict) -> int:
    """Entries a kernel at constants ``c`` writes in their all-gathered layout (every rank's slot)."""
    return int(c["F32_REPLICAS"] > 1) + sum(1 for r in c["REPLICAS"] if r > 1)


def kernel_layout(c: dict, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The outputs a kernel at constants ``c`` writes for the plain result y [M, N] (rows of W in order): the
    fp32 rows copied F32_REPLICAS times side by side, each bf16 entry copied REPLICAS times into its compact
    block (SEGMENTS)."""
    nf, out = c["N_F32"], {}
    if nf > 0:
        out["y_f32"] = y[:, :nf].repeat(1, c["F32_REPLICAS"])
    if nf < c["N"]:
        out["y_bf16"] = bf16_layout(c, y[:, nf:])
    return out


def bf16_layout(c: dict, yb: torch.Tensor) -> torch.Tensor:
    """The bf16 output as the kernel stores it, from the plain yb [M, N - N_F32]: with SEGMENTS each entry
    copied REPLICAS times into its compact block."""
    if not c["SEGMENTS"]:
        return yb
    if c["REPLICAS"]:
        yb = torch.cat([e.repeat(1, r) for e, r in zip(yb.split(list(c["SEGMENTS"]), dim=1), c["REPLICAS"])], 1)
    return segmented(yb, out_blocks(c))


def segmented(y: torch.Tensor, widths: tuple) -> torch.Tensor:
    """y [M, sum(widths)] laid out as consecutive compact [M, w] blocks (the kernel's SEGMENTS layout), returned
    with y's shape; with no widths, y itself."""
    if not widths:
        return y
    out = torch.empty_like(y, memory_format=torch.contiguous_format)
    for view, block in zip(segment_views(out, widths), y.split(list(widths), dim=1)):
        view.copy_(block)
    return out


MAX_STAGES = 16  # tensor-core path: ring stages at most
SMEM_BUDGET = 216 * 1024  # bytes of shared memory one CTA of the tensor-core path may take (H200: 227 KiB)


def mma_smem(m: int, warps: int, rt: int, stages: int) -> int:
    """Shared memory of one tensor-core-path CTA: the ring (per stage and warp a 32-element slice of the 16 * rt
    weight rows and of the m activation rows), whose bytes the fp32 partial sums of every warp reuse after the K
    loop."""
    return max(stages * warps * (16 * rt + m) * 64, warps * m * 16 * rt * 4)


# Row tiles per CTA of the tensor-core path the registers hold without spilling, by n-tiles (batch / 8): each row
# tile costs its A fragments and nt accumulator tiles, about 20 / 22 / 27 / 50 registers a thread at batch 8 / 16 /
# 32 / 64 (ptxas over the real config's 242 tensor-core GEMVs: batch 8 at RT 10 took 238 registers and RT 12
# spilled 8 bytes; batch 16 at RT 9 252, RT 10 spilled; batch 32 at RT 8 with 4 warps spilled up to 104 bytes).
# mma_split takes them only where the grid keeps its number of waves: on the H100 (BENCHMARKS.md, thirty-first
# entry) the spill-free RT was slower wherever it added a wave (the TP8 lm_head at batch 16, 9 against 10 row
# tiles: 138.6 against 103.9 us; TP 1 / 2 front GEMVs 4-16 %) and faster where it did not (batch 32, 7 against
# 8: 114.4 against 119.8 us).
MAX_RT = {1: 10, 2: 9, 4: 8, 8: 4}
MAX_RT_4_WARPS = {4: 7}  # a grid of more than one wave (4 warps): batch 32 at RT 8 spilled, RT 7 does not


def max_row_tiles(nt: int, warps: int = 8) -> int:
    """The most 16-row tiles a tensor-core-path CTA takes at nt = batch / 8 n-tiles without register spills."""
    cap = MAX_RT.get(nt, 32 // nt)
    return min(cap, MAX_RT_4_WARPS.get(nt, cap)) if warps == 4 else cap


def _waves(split_plan: tuple) -> int:
    """Waves of a tensor-core-path grid: one CTA per SM at 8 warps, two at 4."""
    warps, _, _, grid, split = split_plan
    return math.ceil(grid * split / (SMS * (1 if warps == 8 else 2)))


def mma_split(m: int, n: int, k: int, split: int | None = None,
              row_tiles: int | None = None) -> tuple[int, int, int, int, int]:
    """(warps, row tiles per CTA, ring stages, grid, split) of the tensor-core path at batch m, W [n, k].

    About one CTA per SM: RT = ceil(n / (16 * SMS)) row tiles per CTA, at most ``max_row_tiles`` (no register
    spills) unless that costs the grid a wave: then as many as shared memory holds, up to 32 / (m / 8) (128
    accumulator registers; ptxas spills 8-104 bytes, measured faster than the extra wave, see MAX_RT). The
    warps split each K stage into 32-element slices: 8 warps (at batch 64
    a thread then needs 254 registers, so one CTA per SM, two warps per scheduler: the GEMVs of the K3 TP8 shard
    measured 10-20 % faster alone than with 4), or 4 where the grid needs more than one wave (two CTAs per SM:
    the lm_head's 20480 rows at batch 32 and 64); the ring is as deep as the shared-memory budget allows
    (halved when the grid needs two CTAs per SM), at most MAX_STAGES and no more than K has (mma_smem: the
    reduction reuses the ring's bytes); RT shrinks until two stages fit SMEM_BUDGET (the lm_head's 20480 rows).

    Every CTA reads all m activation rows of its K range from L2: m / (16 RT) times its weight bytes. Where that
    exceeds 1 (or is 1/2 or more with one row tile), twice the rows per CTA still fit the registers, a grid of
    pairs is one wave and K has at least 16 stages of 256 (the K3 router + latent front GEMV's 2096 rows from
    batch 8: 1/2 to 4 times the weights at 16 rows per CTA), SPLIT = 2 CTAs of a cluster take half of K each for 2 RT row tiles, and their partial sums
    meet through distributed shared memory: half the activation traffic for the same grid. Measured alone on
    the H200 (BENCHMARKS.md, twenty-fifth entry): 2096 x 7168 at batch 8 10.2 -> 9.6 us with the pair (13.5 over
    4 CTAs); the q/kv up-projection 2304 x 1536 at batch 64 11.1 us with a pair and 3 stages each, 8.7 without.
    Where instead the grid covers half the SMs or less (the FFN tail's row-sharded latent up-projection, 896 x
    3584 at TP 8) and every CTA still reads all m > 16 RT activation rows, SPLIT = 2 keeps RT and doubles the
    CTAs (K of at least 8 stages of 256): at batch 64 11.5 -> 8.8 us alone (BENCHMARKS.md, twenty-seventh entry;
    at batch 8, where m = 8 rows, 3.7 -> 4.1, so not there).

    ``split`` given: that many CTAs per cluster, each with ``split`` times the row tiles (the same number of CTAs
    as without a split, each reading 1 / split of the activations of its K range); ``row_tiles`` given: that RT
    (at most 32 / (m / 8)), whatever the split."""
    dense = _mma_split(m, n, k, split, row_tiles, lambda nt, warps: 32 // nt)
    if row_tiles is not None:
        return dense
    free = _mma_split(m, n, k, split, None, max_row_tiles)
    return free if _waves(free) <= _waves(dense) else dense


def _mma_split(m: int, n: int, k: int, split: int | None, row_tiles: int | None, cap) -> tuple:
    """mma_split with at most ``cap(m // 8, warps)`` row tiles per CTA."""
    nt = m // 8
    rt = max(1, min(math.ceil(n / (16 * SMS)), cap(nt, 8)))
    kst8 = math.ceil(k / 256)  # K stages of 8 warps
    if split is None:
        split = 1
        if ((m > 16 * rt or (m >= 8 and rt == 1)) and 2 * rt <= cap(nt, 8) and 2 * math.ceil(n / (32 * rt)) <= SMS
                and kst8 % 2 == 0 and kst8 >= 16):
            rt, split = 2 * rt, 2
        elif m > 16 * rt and 2 * math.ceil(n / (16 * rt)) <= SMS and kst8 % 2 == 0 and kst8 >= 8:
            split = 2  # a grid of half the SMs or less: twice the CTAs, each pair splitting K (same row tiles)
    else:
        rt = min(split * rt, cap(nt, 8))
    if row_tiles is not None:
        rt = max(1, min(row_tiles, cap(nt, 8)))
    grid = math.ceil(n / (16 * rt))
    warps = 8 if m <= 16 or grid * split <= SMS else 4
    rt = min(rt, cap(nt, warps))
    while rt > 1 and mma_smem(m, warps, rt, 2) > SMEM_BUDGET:  # two stages must fit (large N: more waves instead)
        rt -= 1
    grid = math.ceil(n / (16 * rt))
    kst = math.ceil(k / (32 * warps)) // split
    budget = SMEM_BUDGET // min(2, math.ceil(grid * split / SMS))
    stages = min(MAX_STAGES, kst)
    while stages > 2 and mma_smem(m, warps, rt, stages) > budget:
        stages -= 1
    return warps, rt, max(2, stages), grid, split


class Gemv(Template):
    name = "gemv"
    kernel_file = "gemv.py"
    libs = ("mxfp4_lib.py", "dsmem_lib.py")  # mma_bf16_16816 (tensor-core path), ld_dsmem_f32 (K split over a pair)
    doc = "decode GEMM of a bf16 weight (warp per row, 128-bit loads), RMSNorm/SiTU prologue, fp32+bf16 outputs"

    def constants(self, *, bucket: int, n: int, k: int, n_f32: int = 0, pro: str = "none", eps: float = 1e-5,
                  beta: float = 4.0, linear_beta: float = 25.0, mma: bool | None = None,
                  segments: tuple = (), replicas: tuple = (), f32_replicas: int = 1, prefetch: int = 0,
                  split: int | None = None, row_tiles: int | None = None, hold: bool | None = None) -> list:
        need_bucket("gemv", bucket)
        need(isinstance(n, int) and n >= 1, f"gemv: n (rows of W) must be a positive int, got {n!r}")
        need(isinstance(k, int) and k >= 8 and k % 8 == 0,
             f"gemv: k={k} must be a positive multiple of 8 (one 128-bit load holds 8 bf16); pad K with zero "
             f"columns in W and the activation, or use the eager reference")
        need(isinstance(n_f32, int) and 0 <= n_f32 <= n,
             f"gemv: n_f32={n_f32} must be in [0, n={n}] (the first n_f32 rows of W give fp32 outputs); "
             f"order the weights so that the fp32 ones come first")
        segments = tuple(int(w) for w in segments)
        need(not segments or (all(w > 0 for w in segments) and sum(segments) == n - n_f32),
             f"gemv: segments={segments} must be positive widths summing to the bf16 output's n - n_f32 = "
             f"{n - n_f32} (the consumers' column blocks, in order); pass () for one plain [M, n - n_f32] output")
        replicas = tuple(int(r) for r in replicas)
        need(not replicas or (len(replicas) == len(segments) and all(r >= 1 for r in replicas)),
             f"gemv: replicas={replicas} must give a copy count >= 1 for each of the segments {segments} (an entry "
             f"all-gathered over TP ranks: the TP size); pass () for one copy of each")
        need(isinstance(f32_replicas, int) and f32_replicas >= 1 and (f32_replicas == 1 or n_f32 > 0),
             f"gemv: f32_replicas={f32_replicas!r} must be an int >= 1, and 1 without fp32 rows (n_f32={n_f32})")
        if replicas and all(r == 1 for r in replicas):
            replicas = ()
        need(pro in PROLOGUES, f"gemv: prologue pro={pro!r} is not one of {PROLOGUES}; fold other producers "
                               f"into a separate kernel")
        need(eps > 0, f"gemv: eps={eps} must be > 0 (RMSNorm epsilon; K3 uses 1e-5)")
        need(beta > 0 and linear_beta > 0,
             f"gemv: SiTU beta={beta} and linear_beta={linear_beta} must be > 0 (K3: 4.0 and 25.0)")
        m = bucket
        # Rows per warp task: one for M <= 2 (pure weight stream), more for larger M so that each
        # activation vector loaded serves several weight rows. Must divide N.
        rows = 1 if m <= 2 else 2 if m <= 8 else 4
        while n % rows:
            rows //= 2
        mb = min(m, 8)  # batch chunk: ROWS x MB accumulators per lane (<= 32 registers)
        ksteps = k // 256
        # Weight loads in flight per lane (ROWS x UNROLL vectors). At batch 4 two rows per task halve the
        # grid's warps, and UNROLL 4 restores the bytes in flight of batch 1 where K is long (16 steps or more:
        # the front GEMVs, K 7168); BENCHMARKS.md, thirty-seventh entry: 1 us faster each in the batch-4 layer,
        # while UNROLL 4 on every GEMV unrolled the SiTU GEMV (3 K steps) whole at 168 registers against 68 and
        # lost 8.5 us (short K keeps 2).
        unroll = min(ksteps, 4 if m <= 2 or (m <= 4 and ksteps >= LONG_K_STEPS) else 2 if m <= 8 else 1)
        warps = 8
        tasks = (n // rows) * (m // mb)
        # A prologue's xin formed once per CTA in shared memory (stage_x) when it fits STAGE_X_BYTES; the grid
        # then stays within what shared memory lets be resident (up to 8 CTAs per SM; registers may allow fewer;
        # a cap of 4 per SM measured slower at batch 1). Otherwise rms_norm caps the grid (each CTA recomputes
        # the batch's rstd) and every K step forms xin again.
        stage_x = pro != "none" and m * k * 2 <= STAGE_X_BYTES  # (a prologue never takes the tensor-core path)
        if stage_x:
            cap = SMS * max(1, min(8, SMEM_PER_SM // (m * k * 2 + 2048)))
        else:
            cap = SMS * (2 if pro == "rms_norm" else 8)
        grid = max(1, min(math.ceil(tasks / warps), cap))
        # Tensor cores from batch 8 (plain GEMV: the prologues run as their own kernels there, see
        # codegen._split_prologues): the FMA count grows with M while the bytes do not. mma=False keeps the
        # FMA path (codegen --batch-invariant: bucket 1's reduction order at every bucket).
        auto = m >= MMA_MIN_BUCKET and m % 8 == 0 and pro == "none" and k % 128 == 0
        need(mma is not True or auto, f"gemv: mma=True needs bucket >= {MMA_MIN_BUCKET}, pro='none' and k % 128 == 0 "
                                      f"(got bucket {m}, pro={pro!r}, k={k})")
        use_mma = auto if mma is None else bool(mma)
        need(row_tiles is None or use_mma, f"gemv: row_tiles={row_tiles!r} applies to the tensor-core path only "
                                           f"(bucket >= {MMA_MIN_BUCKET}, no prologue); leave it unset")
        need(split is None or (use_mma and split in (1, 2, 4, 8)),
             f"gemv: split={split!r} (CTAs of a cluster splitting K) must be 1, 2, 4 or 8, on the tensor-core path "
             f"only (bucket >= {MMA_MIN_BUCKET}, no prologue); leave it unset for the default")
        rt, stages = 1, 1
        if use_mma:
            need(row_tiles is None or (isinstance(row_tiles, int) and row_tiles >= 1),
                 f"gemv: row_tiles={row_tiles!r} (16-row MMA tiles per CTA) must be an int >= 1 or unset")
            warps, rt, stages, grid, split = mma_split(m, n, k, split, row_tiles)
            kst = math.ceil(k / (32 * warps))
            need(kst % split == 0, f"gemv: split={split} must divide the {kst} K stages of {32 * warps} elements "
                                   f"(K={k}); pick a divisor or leave it unset")
        split = split or 1
        need(hold in (None, False, True), f"gemv: hold={hold!r} must be True, False or unset (None: where it applies)")
        want, hold = hold, False
        if not use_mma and not prefetch and want is not False:
            # HOLD: where a grid of at most one CTA per SM gives every warp one task whose rows fit HOLD_VECS
            # vectors a lane (fewer rows per task if that is what it takes), the warp loads them all before the
            # PDL wait: whole rows in flight, overlapping the prologue and the previous kernel's end. hold=True
            # also takes larger grids (every warp still one task). On the H100 (BENCHMARKS.md, thirty-seventh
            # entry), the FFN tail's up-projection (896 x 3584, TP 8) alone: 4.3 -> 3.3 us at batch 1, 9.0 -> 6.5
            # at batch 4; in the KDA + MoE layer at batch 4 11.0 -> 8.0 us exposed, at batch 1-2 unchanged. Forced
            # on the MLA's q up-projection (2304 x 1536, 288 CTAs) at batch 1: 4.1 -> 3.5 us alone (not the
            # default: not measured in the layer).
            nsteps = -(-k // 256)
            for r in sorted({rows, 1}, reverse=True):
                t = (n // r) * (m // mb)
                g = max(1, min(math.ceil(t / warps), cap))
                if n % r == 0 and (g <= SMS or want) and t <= g * warps and r * nsteps <= HOLD_VECS:
                    rows, tasks, grid, hold = r, t, g, True
                    break
        need(want is not True or hold,
             f"gemv: hold=True needs the FMA path without prefetch, a grid giving every warp one task, and at most "
             f"{HOLD_VECS} 128-bit weight vectors a lane (bucket {m}, n={n}, k={k}); leave it unset")
        need(isinstance(prefetch, int) and prefetch >= 0 and prefetch % 16 == 0,
             f"gemv: prefetch={prefetch!r} (bytes of each weight row pulled into L2 before the PDL wait) must be a "
             f"non-negative multiple of 16 (cp.async.bulk.prefetch sizes); pass 0 for the default")
        # at most what a row (the tensor-core path: the CTA's share of K past its first ring stages) holds
        row_bytes = 2 * k if not use_mma else 2 * (math.ceil(k / (32 * warps)) // split - (stages - 1)) * 32 * warps
        prefetch = min(prefetch, max(0, row_bytes) // 16 * 16)
        if prefetch and not use_mma:  # every warp prefetches all its tasks' rows: the whole grid resident at once
            grid = min(grid, SMS * (PF_CTAS if m <= 2 else PF_CTAS // 2))  # (more accumulators from batch 4)
        return [const("M", m, "batch rows (the bucket)"), const("N", n, "rows of W (outputs per batch row)"),
                const("K", k, "reduction length (a multiple of 8)"),
                const("N_F32", n_f32, "the first N_F32 rows of W go to the fp32 output, the rest to the bf16 output"),
                const("PRO", pro, "prologue forming xin: none | rms_norm | situ"),
                const("EPS", float(eps), "RMSNorm epsilon (rms_norm prologue)"),
                const("BETA", float(beta), "SiTU gate beta (situ prologue)"),
                const("LINEAR_BETA", float(linear_beta), "SiTU linear beta (situ prologue)"),
                const("ROWS", rows, "weight rows per warp task"),
                const("MB", mb, "batch rows per warp task (batch chunk)"),
                const("WARPS", warps, "warps per CTA"),
                const("UNROLL", unroll, "K steps unrolled in the main loop (weight loads in flight per lane)"),
                const("GRID", grid, "CTAs (they stride over the tasks)"),
                const("MMA", use_mma, "tensor cores (mma.sync; CTA = RT 16-row tiles, K split over the warps, "
                                      "cp.async ring of STAGES)"),
                const("RT", rt, "tensor-core path: 16-row tiles of W per CTA"),
                const("STAGES", stages, "tensor-core path: K stages (32 x WARPS elements each) in flight"),
                const("SPLIT", split, "tensor-core path: CTAs of a cluster splitting K (partial sums meet in "
                                      "distributed shared memory)"),
                const("SEGMENTS", segments, "bf16 output as consecutive compact [M, w] blocks of these widths "
                                            "(() : one [M, n - n_f32] row-major output)"),
                const("REPLICAS", replicas, "with SEGMENTS: copies of each block side by side ([M, r * w], copy p at "
                                            "columns p * w); () : one each"),
                const("F32_REPLICAS", f32_replicas, "copies of the fp32 output side by side: y_f32 is "
                                                    "[M, F32_REPLICAS * N_F32]"),
                const("STAGE_X", stage_x, "the prologue forms xin once per CTA into shared memory (M x K bf16), "
                                          "the main loop reads it there"),
                const("PREFETCH", prefetch, "bytes of each weight row the warp owning it bulk-prefetches into L2 "
                                            "before the PDL wait (0: each warp the first vectors of its first "
                                            "task's rows)"),
                const("HOLD", hold, "one task per warp: its weight rows are loaded into registers before the PDL "
                                    "wait (whole rows in flight)")]

    def examples(self):
        from k3compile.models.config import get_config

        mini, k3 = get_config("k3_mini"), get_config("kimi_k3")
        tp = 8
        ex = {}
        for b in (1, 8, 64):
            # k3-mini (TP1): a plain linear over the hidden state (KDA q projection: heads x head_dim).
            ex[f"mini_b{b}"] = {"bucket": b, "n": mini.kda_num_heads * mini.kda_head_dim, "k": mini.hidden_size}
            # K3 TP8 rank 0: front of attention, 12288 rows of [q, k, v, g, ...] over the 7168 hidden.
            ex[f"k3tp8_b{b}"] = {"bucket": b, "n": 12288, "k": k3.hidden_size}
        # fp32-only router logits (full width on every rank)
        ex["mini_router_b1"] = {"bucket": 1, "n": mini.num_experts, "k": mini.hidden_size, "n_f32": mini.num_experts}
        ex["k3tp8_router_b8"] = {"bucket": 8, "n": k3.num_experts, "k": k3.hidden_size, "n_f32": k3.num_experts}
        # RMSNorm folded in, router rows (fp32) first then a bf16 projection: front_gemm + rms_norm_linear
        ex["mini_rmsnorm_b2"] = {"bucket": 2, "n": mini.num_experts + 1024, "k": mini.hidden_size,
                                 "n_f32": mini.num_experts, "pro": "rms_norm", "eps": mini.rms_norm_eps}
        ex["k3tp8_rmsnorm_b64"] = {"bucket": 64, "n": 12288, "k": k3.hidden_size, "pro": "rms_norm",
                                   "eps": k3.rms_norm_eps}
        # SiTU-GLU folded into the shared expert's down projection (TP1 mini; TP8: 2*3072/8 = 768 inputs)
        situ = {"pro": "situ", "beta": mini.activation_situ_beta, "linear_beta": mini.activation_situ_linear_beta}
        ex["mini_situ_b8"] = {"bucket": 8, "n": mini.hidden_size, "k": mini.shared_intermediate_size, **situ}
        ex["k3tp8_situ_b1"] = {"bucket": 1, "n": k3.hidden_size, "k": k3.shared_intermediate_size // tp, **situ}
        ex["k3tp8_situ_b64"] = {"bucket": 64, "n": k3.hidden_size, "k": k3.shared_intermediate_size // tp, **situ}
        # q_lora -> heads (N=7168 of K=1536)
        ex["k3tp8_qb_b4"] = {"bucket": 4, "n": 7168, "k": k3.q_lora_rank}
        # lm_head: final RMSNorm + this rank's vocab shard, fp32 logits
        ex["k3tp8_lmhead_b1"] = {"bucket": 1, "n": k3.vocab_size // tp, "k": k3.hidden_size,
                                 "n_f32": k3.vocab_size // tp, "pro": "rms_norm", "eps": k3.rms_norm_eps}
        # the lm_head on the tensor cores at batch 32, a grid of more than one SM's worth (4 warps): 7 row tiles,
        # the most a CTA holds without spilling (8 spilled 104 bytes)
        ex["k3tp8_lmhead_b32"] = {"bucket": 32, "n": k3.vocab_size // tp, "k": k3.hidden_size,
                                  "n_f32": k3.vocab_size // tp}
        # K not a multiple of 256 (a partial last K step): k3-mini's 128-wide latent/q_lora RMSNorm GEMVs and
        # the dense layer's SiTU down-projection at TP8 (33792 / 8 = 4224 inputs)
        ex["mini_rmsnorm_k128_b2"] = {"bucket": 2, "n": mini.hidden_size, "k": 128, "pro": "rms_norm",
                                      "eps": mini.rms_norm_eps}
        ex["k3tp8_situ_k4224_b8"] = {"bucket": 8, "n": k3.hidden_size, "k": k3.intermediate_size // tp, **situ}
        # tensor-core path with both outputs and a last row tile past N (6284 = 392 * 16 + 12)
        ex["k3tp8_front_b32"] = {"bucket": 32, "n": 6284, "k": k3.hidden_size, "n_f32": k3.num_experts}
        # a front GEMV whose bf16 entries are written as compact [M, w] blocks (FMA path at 2 rows, MMA at 8)
        ex["mini_front_seg_b2"] = {"bucket": 2, "n": 16 + 512, "k": mini.hidden_size, "n_f32": 16,
                                   "segments": (128, 128, 192, 64)}
        ex["k3tp8_front_seg_b8"] = {"bucket": 8, "n": 6284, "k": k3.hidden_size, "n_f32": k3.num_experts,
                                    "segments": (1536, 1536, 1536, 780)}
        # the MoE front GEMV of the TP8 shard (router, latent down, shared gate / up) with its all-gathered
        # entries (router, latent) written into all 8 ranks' slots (codegen._lower_front_gemm): FMA path at batch
        # 1, tensor cores at 8; k3-mini's at TP 2 and batch 2
        def moe_front(cfg, t):
            segs = (cfg.routed_expert_hidden_size // t,) + (cfg.shared_intermediate_size // t,) * 2
            return {"n": cfg.num_experts // t + sum(segs), "k": cfg.hidden_size, "n_f32": cfg.num_experts // t,
                    "segments": segs, "replicas": (t, 1, 1), "f32_replicas": t}
        ex["k3tp8_front_gather_b1"] = {"bucket": 1, **moe_front(k3, tp)}
        ex["k3tp8_front_gather_b8"] = {"bucket": 8, **moe_front(k3, tp)}
        # at batch 4 (two rows per task): UNROLL 4 (K of 28 steps), the kernel of the real plan
        ex["k3tp8_front_gather_b4"] = {"bucket": 4, **moe_front(k3, tp)}
        ex["mini_front_gather_b2"] = {"bucket": 2, **moe_front(mini, 2)}
        # the router + latent front GEMV of the TP8 shard at batch 64: two CTAs of a cluster split K (SPLIT = 2)
        ex["k3tp8_front_split_b64"] = {"bucket": 64, "n": 2096, "k": k3.hidden_size, "n_f32": k3.num_experts // tp,
                                       "segments": (448, 768, 768)}
        # weights pulled into L2 before the PDL wait (codegen._gemv_prefetch): the o_proj after attention (FMA
        # path, whole rows), k3-mini's SiTU GEMV (STAGE_X), the router + latent front GEMV at batch 8 (tensor
        # cores, from the CTA's third ring stage on, wrapping around its K) and with SPLIT at batch 64
        ex["k3tp8_oproj_pf_b1"] = {"bucket": 1, "n": k3.hidden_size, "k": k3.kda_num_heads * k3.kda_head_dim // tp,
                                   "prefetch": 3328}
        ex["mini_situ_pf_b2"] = {"bucket": 2, "n": mini.hidden_size, "k": mini.shared_intermediate_size, **situ,
                                 "prefetch": 1 << 16}
        ex["k3tp8_front_pf_b8"] = {"bucket": 8, "n": 2096, "k": k3.hidden_size, "n_f32": k3.num_experts // tp,
                                   "prefetch": 11776}
        ex["k3tp8_front_split_pf_b64"] = {"bucket": 64, "n": 2096, "k": k3.hidden_size,
                                          "n_f32": k3.num_experts // tp, "segments": (448, 768, 768),
                                          "prefetch": 11776}
        # the MLA q/kv up-projection at batch 64: K (1536) too short to split over a pair (mma_split); and the
        # router + latent front GEMV's K over a cluster of 4 (the split knob)
        ex["k3tp8_qkvup_b64"] = {"bucket": 64, "n": 2304, "k": k3.q_lora_rank}
        ex["k3tp8_front_split4_b64"] = {"bucket": 64, "n": 2096, "k": k3.hidden_size, "n_f32": k3.num_experts // tp,
                                        "segments": (448, 768, 768), "split": 4}
        # the FFN tail's latent up-projection row-sharded over the 8 ranks (shard_routing): this rank's 896 rows
        # with the latent RMSNorm prologue (batch 1) or after the rms_norm kernel (8), written into every rank's
        # slot of the gathered [B, 7168]
        up = {"n": k3.hidden_size // tp, "k": k3.routed_expert_hidden_size, "segments": (k3.hidden_size // tp,),
              "replicas": (tp,)}
        ex["k3tp8_ffnup_shard_b1"] = {"bucket": 1, **up, "pro": "rms_norm", "eps": k3.rms_norm_eps}
        # at batch 4 one row per warp task, every warp's rows held in registers from before the wait (HOLD)
        ex["k3tp8_ffnup_shard_b4"] = {"bucket": 4, **up, "pro": "rms_norm", "eps": k3.rms_norm_eps}
        # the same two without HOLD (the knob): the kernels before it, timed beside them in one run
        ex["k3tp8_ffnup_shard_nohold_b1"] = {**ex["k3tp8_ffnup_shard_b1"], "hold": False}
        ex["k3tp8_ffnup_shard_nohold_b4"] = {**ex["k3tp8_ffnup_shard_b4"], "hold": False}
        # at TP 16: 448 rows (56 CTAs); and the MLA's q up-projection with the q_a RMSNorm at batch 4 (1152 rows
        # of K 1536: two rows per task, 6 vectors each)
        up16 = {"n": k3.hidden_size // 16, "k": k3.routed_expert_hidden_size, "segments": (k3.hidden_size // 16,),
                "replicas": (16,), "pro": "rms_norm", "eps": k3.rms_norm_eps}
        for b in (1, 2, 4):
            ex[f"k3tp16_ffnup_shard_b{b}"] = {"bucket": b, **up16}
        ex["k3tp8_ffnup_shard_b2"] = {**ex["k3tp8_ffnup_shard_b4"], "bucket": 2}
        ex["k3tp16_qup_norm_b4"] = {"bucket": 4, "n": 1152, "k": k3.q_lora_rank, "pro": "rms_norm", "eps": 1e-6}
        # the MLA's q up-projection with the q_a RMSNorm at batch 1 (288 CTAs: not HOLD by default), and forced
        ex["k3tp8_qup_norm_b1"] = {"bucket": 1, "n": 2304, "k": k3.q_lora_rank, "pro": "rms_norm", "eps": 1e-6}
        ex["k3tp8_qup_norm_hold_b1"] = {**ex["k3tp8_qup_norm_b1"], "hold": True}
        ex["k3tp8_ffnup_shard_b8"] = {"bucket": 8, **up}
        ex["k3tp8_ffnup_shard_b64"] = {"bucket": 64, **up}  # 56 row tiles: K split over CTA pairs (mma_split)
        ex["mini_lmhead_b16"] = {"bucket": 16, "n": mini.vocab_size, "k": mini.hidden_size, "n_f32": mini.vocab_size,
                                 "pro": "rms_norm", "eps": mini.rms_norm_eps}
        return ex

    def args(self, c):
        m, n, k, nf = c["M"], c["N"], c["K"], c["N_F32"]
        out = [Arg("w", "bf16", (n, k), "weight")]
        if c["PRO"] == "none":
            out.append(Arg("x", "bf16", (m, k), "act"))
        elif c["PRO"] == "rms_norm":
            out += [Arg("x", "bf16", (m, k), "act"), Arg("norm_weight", "bf16", (k,), "weight")]
        else:
            out += [Arg("gate", "bf16", (m, k), "act"), Arg("up", "bf16", (m, k), "act")]
        if nf > 0:
            out.append(Arg("y_f32", "f32", (m, nf * c["F32_REPLICAS"]), "out"))
        if nf < n:
            out.append(Arg("y_bf16", "bf16", (m, sum(out_blocks(c)) if c["SEGMENTS"] else n - nf), "out"))
        return out

    def random_inputs(self, c, gen):
        m, n, k = c["M"], c["N"], c["K"]
        inputs = {"w": (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(torch.bfloat16)}
        if c["PRO"] == "none":
            inputs["x"] = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        elif c["PRO"] == "rms_norm":
            # un-normalized residual-stream rows with per-row scales far from 1
            scale = torch.exp(2 * torch.rand(m, 1, generator=gen))
            inputs["x"] = (scale * torch.randn(m, k, generator=gen)).to(torch.bfloat16)
            inputs["norm_weight"] = (1 + 0.1 * torch.randn(k, generator=gen)).to(torch.bfloat16)
        else:
            inputs["gate"] = (2 * torch.randn(m, k, generator=gen)).to(torch.bfloat16)
            inputs["up"] = (2 * torch.randn(m, k, generator=gen)).to(torch.bfloat16)
        return inputs

    def xin(self, c, inputs) -> torch.Tensor:
        """The bf16 GEMM input exactly as the eager model forms it (models/ops.py)."""
        from k3compile.models import ops

        if c["PRO"] == "none":
            return inputs["x"]
        if c["PRO"] == "rms_norm":
            return ops.rms_norm(inputs["x"], inputs["norm_weight"], c["EPS"])
        return ops.situ_glu(inputs["gate"], inputs["up"], c["BETA"], c["LINEAR_BETA"])

    def torch_baseline(self, c, d):
        from k3compile.models import ops

        F = torch.nn.functional
        nf = c["N_F32"]

        def run():
            if c["PRO"] == "rms_norm":
                x = ops.rms_norm(d["x"], d["norm_weight"], c["EPS"])
            elif c["PRO"] == "situ":
                x = ops.situ_glu(d["gate"], d["up"], c["BETA"], c["LINEAR_BETA"])
            else:
                x = d["x"]
            if nf:
                d["y_f32"].copy_(F.linear(x.float(), d["w"][:nf].float()).repeat(1, c["F32_REPLICAS"]))
            if c["N"] > nf:
                d["y_bf16"].copy_(bf16_layout(c, F.linear(x, d["w"][nf:])))
        return run

    def reference(self, c, inputs):
        xin = self.xin(c, inputs)
        assert xin.dtype == torch.bfloat16
        return kernel_layout(c, xin.double() @ inputs["w"].double().T)

    def tolerance(self, c):
        # fp32 outputs: the bf16-rounded xin can differ in the last bit where the kernel's rsqrt / tanh
        # approximations land near a rounding boundary; otherwise only the summation order differs.
        # bf16 outputs: their own rounding (~2e-3).
        return {"y_f32": {"none": 1e-4, "rms_norm": 1e-3, "situ": 5e-3}[c["PRO"]], "y_bf16": 1e-2}

    def flops(self, c):
        return 2 * c["M"] * c["N"] * c["K"]
