"""Template ``mla_decode``: absorbed MLA decode for H local heads over the latent cache, with the kv_a
RMSNorm and latent-row assembly folded in (dialect op ``k3::mla_decode_latent``; kernel:
kernels/mla_decode.py).

Per row m: ``latent = [KimiRMSNorm(kv[:, :C], kv_norm_weight, kv_eps) | kv[:, C:]]`` (bf16 output, also
written into the cache at ``cache[m, lengths[m]]``: what the model's ``index_put_`` after the op does, so the
runtime drops that node), then ``models.ops.mla_decode(q, latent, gate, cache, lengths, kv_b_weight, nope, v,
scale)``: the current token attends to cache positions ``0 .. lengths[m]-1`` plus itself (at position
``lengths[m]``).

This template is **three kernels** launched back to back by one ``Kernel.__call__``: an absorb kernel (grid H x C /
32: the absorbed query ``q_nope @ W_uk`` of every row for one head and 32 of its columns, on the tensor cores, rounded
to bf16 into the scratch ``ws_q``, and the latent rows, to ``latent`` and the cache), a split-context attention
kernel on the tensor cores (from batch 2 a grid of SMS CTAs, each taking one (row, split) of the batch's plan,
``split_plan``; at batch 1 and in batch-invariant code a grid NSPLIT x M; all local heads of a token in one CTA as
the MMA rows, so each cache row is read once per token; above 32 local heads, K3 at TP 2 and 1, those grids once per
group of at most 32 heads, ``head_groups``, each group reading the cache again) writing partial (max, sum,
ol) to the scratch workspace, and a combine kernel (grid COMBINE_SPLIT x H x M / RB: ``default_combine_rows`` rows
per CTA unless the point sets ``combine_rows`` (1, 2, 4 or 8); a cluster of CTAs per head (four at K3), each
merging a share of the partials' columns) that merges the partials and applies W_uv and the sigmoid output gate. The
examples ``k3tp8_b64_r2`` / ``_r4`` are batch 64 with 2 and 4 rows per combine CTA (the default there is 8).

Roles: ``cache`` is decode state, written in place at one position per row, ``lengths[m]`` clamped into
``0 .. lmax-1`` as the attention kernel clamps it (the absorb kernel writes the row; the attention kernel never
reads that position from the cache: it takes the current token's row from ``latent``, so the write cannot race
with it); ``lengths`` (int64, as the model's DecodeState holds them) is an activation read on the device, so one
compiled kernel serves any lengths in ``0 .. lmax-1``; ``ws_q``, ``ws_ol`` and ``ws_ml`` are scratch: every
element the kernels read was written by them first in the same call. ``reference`` returns ``out``, ``latent``
and the updated ``cache`` (bf16: the input cache with the new rows, exact values); the GPU check compares the
kernel's cache bit for bit with the input cache holding the kernel's own ``latent`` rows (``copied_state``).
"""

from __future__ import annotations

import math

import torch

from .base import Arg, Template, const, need, need_bucket

SMS = 132  # H200 SMs
MAX_HEADS = 128  # local heads (K3 at TP 1 has 96)
HEADS_PER_CTA = 32  # the attention kernel's heads per CTA (two 16-row MMA tiles); more heads: groups of CTAs
TILE = 64  # cache rows per shared-memory tile (8 per warp of the attention kernel)
SMEM_BUDGET = 227 * 1024  # bytes of shared memory one CTA may take on the H200
CHUNK_MIN = 256  # default fewest positions per split from batch 16 (four tiles; one tile up to batch 8)
WAVES = 4  # the default split count gives at least this many whole waves of attention CTAs at full context


def head_groups(heads: int) -> tuple[int, int]:
    """(groups, heads per group) of the attention kernel: up to HEADS_PER_CTA heads share a CTA (each cache row read
    once for all of them); more are split into equal groups, a grid dimension, each group reading the cache
    again (K3 at TP 2: 2 x 24 heads, at TP 1: 3 x 32)."""
    groups = -(-heads // HEADS_PER_CTA)
    return groups, -(-heads // groups)


def attention_smem(heads: int, row: int) -> int:
    """Shared memory of the attention kernel: two TILE-row tiles and the query of one head group (bf16 rows padded
    by 16 bytes), the fp32 scores of a tile (rows padded by 8)."""
    hp = 16 * -(-head_groups(heads)[1] // 16)
    return 2 * TILE * (row + 8) * 2 + hp * (row + 8) * 2 + hp * (TILE + 8) * 4


def _position(c: dict, length) -> int:
    """The current token's position in row m: lengths[m] clamped into 0 .. LMAX - 1, as the kernels clamp it
    (the model never passes others)."""
    return max(0, min(int(length), c["LMAX"] - 1))


def combine_split(v: int, kv_lora: int = 512) -> int:
    """CTAs per (head, row group) of the combine kernel, a thread-block cluster, each merging C / split columns of
    the partials (at least 128: a 4-element chunk per lane) and adding its part of o = ol @ W_uv^T for every output,
    the parts then added over the cluster: 4, 2 or 1, the most that v (at most v / 32) and kv_lora allow, at every
    batch.

    Measured on the H200 (2026-12-03, K3 TP8 shard, 12 heads, batch 64, 16k capacity, ``bench-kernels``, two runs):
    the whole ``mla_decode`` 289.0 / 290.7 us with four CTAs per head (1,536 CTAs; W_uv's 128 columns staged in
    shared memory), 301.1 / 301.3 with two and 296.8 / 297.1 with one. When each CTA still merged all C columns
    (before 2026-12-03), four CTAs at batch 64 cost 9 us in the layer: the split then stopped at two CTAs per SM."""
    return next(s for s in (4, 2, 1) if s == 1 or (s <= v // 32 and kv_lora % (128 * s) == 0 and v % s == 0))


def default_combine_rows(bucket: int, heads: int, v: int, combine: int) -> int:
    """Rows per combine CTA (W_uv's columns staged once for all of them): the most of 8, 4, 2 that divides the
    bucket, leaves at most 256 outputs per CTA (rows x v / combine) and still gives at least two CTAs per SM
    (combine x heads x bucket / rows >= 2 x SMS); else min(bucket, 2).

    Measured on the H200 (2026-12-04, K3 TP8 shard, 12 heads, the MLA + MoE layer of the slice bench, combine
    kernel's exposed µs): batch 64 at context 1k 21.5 with 2 rows (1,536 CTAs), 10.9 with 8 (384); at 32k 31.9 and
    23.7. Batch 8: 5.3 with 2 rows, 6.0 with 4 and 7.6 with 8 (48 CTAs): the rule keeps 2 there. At K3 TP8 it
    gives 8 rows at batch 64, 4 at 32 (not measured) and 2 below."""
    for rows in (8, 4, 2):
        if bucket % rows == 0 and rows * v <= 256 * combine and combine * heads * bucket // rows >= 2 * SMS:
            return rows
    return min(bucket, 2)


def default_chunk_min(bucket: int) -> int:
    """Fewest positions per split: one tile up to batch 8, CHUNK_MIN (four tiles) from batch 16.

    A short row at a small batch is otherwise a few CTAs streaming tile after tile (batch 1 at context 1k: 5
    CTAs of 4 tiles each); with one tile per split it is 17 CTAs of one. From batch 16 the rows fill the GPU
    anyway and fewer, longer splits write and merge fewer partials."""
    return TILE if bucket <= 8 else CHUNK_MIN


def default_splits(bucket: int, lmax: int, chunk_min: int | None = None) -> int:
    """Most splits per row: at least WAVES waves of attention CTAs (``attention_smem`` leaves room for one per
    SM; one wave at batch 1) and a whole number of them (the fewest splits with bucket x splits a multiple of
    SMS), never more than the context can feed with chunk_min positions each (``default_chunk_min``).

    Measured on the H200 (2026-11-30): ceil(3 x 132 / bucket) splits left a fourth wave a few CTAs long at
    batch 8 (400 CTAs: 3.03 waves), a whole CTA time for almost nothing; one wave (132 // bucket splits) streamed
    equal-length rows with no tail, but rows of different lengths then wait for the longest row's splits (batch
    8 at random lengths: 118 against 73 us). Several whole waves of smaller CTAs serve both. A single row has no
    other rows to wait for: one wave, so that a full context is not 4 x 132 one-tile partials to merge."""
    chunk_min = default_chunk_min(bucket) if chunk_min is None else chunk_min
    most = math.ceil(lmax / chunk_min)
    s = math.ceil((1 if bucket == 1 else WAVES) * SMS / bucket)
    while (bucket * s) % SMS:
        s += 1
    return max(1, min(most, s))


def split_plan(c: dict, lengths) -> list[tuple[int, int]]:
    """(active splits, positions per split) of every row, as ``Kernel.splits_of`` computes them on the device from
    the runtime lengths (clamped into 0 .. LMAX - 1; row m has lengths[m] + 1 valid positions).

    BALANCE (the default) from batch 2: every row's splits are whole runs of tp tiles, tp the smallest number >= lo
    whose splits over the whole batch fit one wave of SMS attention CTAs (one per SM: their shared memory allows no
    second), by the kernel's bisection in [lo, hi]; so rows of one length share the GPU evenly (batch 64 at context
    1k: 2 splits of 9 tiles per row, 128 CTAs, where a fixed split size gave 5 of 4 tiles, 320 CTAs in three
    rounds) and a long row among short ones takes the SMs they leave. Otherwise (one row, whose own rule already
    fills the wave; ``codegen --batch-invariant``, where a row's reduction order must not depend on the other rows)
    min(NSPLIT, ceil(n / CHUNK_MIN)) splits of ceil(n / nact) positions."""
    tile, lmax, nsplit, sms = c["TILE"], c["LMAX"], c["NSPLIT"], c["SMS"]
    ns = [max(0, min(int(x), lmax - 1)) + 1 for x in lengths]
    if not c["BALANCE"] or c["M"] == 1:
        out = []
        for n in ns:
            nact = min((n + c["CHUNK_MIN"] - 1) // c["CHUNK_MIN"], nsplit)
            out.append((nact, (n + nact - 1) // nact))
        return out
    tiles = [(n + tile - 1) // tile for n in ns]
    total, tmax, m = sum(tiles), max(tiles), c["M"]
    lo = max((c["CHUNK_MIN"] + tile - 1) // tile, -(-total // sms), -(-tmax // nsplit))
    hi = max(lo, -(-total // (sms - m)))
    for _ in range((lmax // tile + 1).bit_length()):
        mid = (lo + hi) // 2
        if sum(-(-t // mid) for t in tiles) <= sms:
            hi = mid
        else:
            lo = mid + 1
    return [(-(-n // (hi * tile)), hi * tile) for n in ns]


class MlaDecode(Template):
    name = "mla_decode"
    kernel_file = "mla_decode.py"
    libs = ("mxfp4_lib.py", "dsmem_lib.py")  # mma_bf16_16816, ld_dsmem_f32
    doc = ("absorbed MLA decode + kv_a RMSNorm: the absorbed query once per head, split-context attention on "
           "the tensor cores (all heads of a token per CTA, cache rows read once), then a combine kernel with "
           "W_uv and the output gate")

    def constants(self, *, bucket: int, heads: int, nope: int, rope: int, v: int, kv_lora: int, lmax: int,
                  kv_eps: float, scale: float, splits: int | None = None, chunk_min: int | None = None,
                  combine: int | None = None, combine_rows: int | None = None, balance: bool = True) -> list:
        p = "mla_decode"
        need_bucket(p, bucket)
        need(isinstance(heads, int) and 1 <= heads <= MAX_HEADS,
             f"{p}: heads={heads} must be in 1..{MAX_HEADS} (local heads; the attention kernel takes them "
             f"{HEADS_PER_CTA} at a time): shard the heads over more ranks (a larger TP size)")
        need(isinstance(kv_lora, int) and 0 < kv_lora <= 2048 and kv_lora % 256 == 0,
             f"{p}: kv_lora={kv_lora} must be a multiple of 256 up to 2048 (8-element chunks over the 8 warps' "
             f"output columns and the absorb kernel's 256 threads); K3 uses 512")
        need(isinstance(rope, int) and rope in (32, 64, 128, 256),
             f"{p}: rope={rope} must be 32, 64, 128 or 256 (each lane owns rope/32 contiguous k_pe elements, one "
             f"vector load); K3 uses 64")
        need(isinstance(nope, int) and nope > 0 and nope % 32 == 0,
             f"{p}: nope={nope} must be a positive multiple of 32 (the absorb kernel's K dimension, two 16-wide MMA "
             f"steps per ldmatrix of q_nope); K3 uses 128")
        need(isinstance(v, int) and 0 < v <= 256 and v % 32 == 0,
             f"{p}: v={v} must be a multiple of 32 up to 256 (the combine kernel's 256 threads each own an output "
             f"of a column group); K3 uses 128")
        need(isinstance(lmax, int) and lmax >= 1, f"{p}: lmax={lmax} must be >= 1 (cache positions per row)")
        row = kv_lora + rope
        need(bucket * lmax * row < 2 ** 31,
             f"{p}: the cache [{bucket}, {lmax}, {row}] has >= 2^31 elements and the kernel indexes it with 32-bit "
             f"offsets; use a smaller bucket or lmax (64-bit cache addressing is not implemented)")
        need(kv_eps > 0, f"{p}: kv_eps={kv_eps} must be > 0 (the kv_a_layernorm eps, 1e-6 in HF)")
        need(scale > 0, f"{p}: scale={scale} must be > 0 ((nope + rope) ** -0.5 for K3)")
        if chunk_min is None:
            chunk_min = default_chunk_min(bucket)
        need(isinstance(chunk_min, int) and chunk_min >= 1,
             f"{p}: chunk_min={chunk_min} must be a positive number of positions per split")
        need(isinstance(balance, bool), f"{p}: balance={balance!r} must be True or False")
        if splits is None:
            splits = default_splits(bucket, lmax, chunk_min)
        need(isinstance(splits, int) and 1 <= splits <= 4096,
             f"{p}: splits={splits} must be in 1..4096 (context splits per row); raise chunk_min instead")
        if combine is None:
            combine = combine_split(v, kv_lora)
        need(combine in (1, 2, 4) and kv_lora % (128 * combine) == 0 and v % combine == 0,
             f"{p}: combine={combine} must be 1, 2 or 4 CTAs per head, each at least 128 of the kv_lora={kv_lora} "
             f"columns and a whole share of the v={v} outputs (or None: combine_split)")
        if combine_rows is None:
            combine_rows = default_combine_rows(bucket, heads, v, combine)
        need(combine_rows in (1, 2, 4, 8) and bucket % combine_rows == 0 and combine_rows * v <= 256 * combine,
             f"{p}: combine_rows={combine_rows} must be 1, 2, 4 or 8, divide the bucket {bucket}, and leave at most "
             f"256 outputs per combine CTA (rows x v / combine = {combine_rows} x {v} / {combine}: one per thread); "
             f"or None: default_combine_rows")
        smem = attention_smem(heads, row)
        need(smem <= SMEM_BUDGET,
             f"{p}: the attention kernel needs {smem} bytes of shared memory for {heads} heads and {row}-wide "
             f"rows (two {TILE}-row tiles, the query, the scores) > {SMEM_BUDGET}; use fewer local heads or a "
             f"smaller kv_lora_rank")
        return [const("M", bucket, "rows (the batch bucket)"),
                const("H", heads, "local heads (at most 32 per attention CTA: 16-row MMA tiles, padded)"),
                const("NOPE", nope, "qk_nope_head_dim"),
                const("R", rope, "qk_rope_head_dim (k_pe width, unrotated)"),
                const("V", v, "v_head_dim"),
                const("C", kv_lora, "kv_lora_rank (latent width)"),
                const("LMAX", lmax, "cache positions per row"),
                const("KV_EPS", float(kv_eps), "kv_a_layernorm epsilon"),
                const("SCALE", float(scale), "softmax scale ((nope + rope) ** -0.5)"),
                const("NSPLIT", splits, "most context splits per row (grid.x of the attention kernel)"),
                const("CHUNK_MIN", chunk_min, "fewest positions per split (short rows use fewer splits)"),
                const("BALANCE", bool(balance), "split sizes from the whole batch's lengths (one wave of CTAs), else "
                                                "from each row's own length"),
                const("SMS", SMS, "streaming multiprocessors (BALANCE: one wave of attention CTAs, one per SM)"),
                const("TILE", TILE, "cache rows per shared-memory tile (8 per warp)"),
                const("COMBINE_SPLIT", combine, "combine kernel: CTAs of a cluster per (head, row group), each "
                                                "C / COMBINE_SPLIT columns of ol"),
                const("RB", combine_rows, "combine kernel: rows per CTA (W_uv read once for them)")]

    def examples(self):
        ex = {}
        common = dict(nope=128, rope=64, v=128, kv_lora=512, kv_eps=1e-6, scale=192 ** -0.5)
        for b in (1, 8, 64):
            ex[f"mini_b{b}"] = dict(bucket=b, heads=8, lmax=8192, **common)  # k3-mini TP1, full context
        for b, lmax in ((1, 32768), (8, 32768), (64, 16384)):  # cache <= 2.4 GB; b64 kept smaller for CPU refs
            ex[f"k3tp8_b{b}"] = dict(bucket=b, heads=12, lmax=lmax, **common)
        ex["mini_h2_b4"] = dict(bucket=4, heads=2, lmax=4096, **common)  # the trained k3-mini (2 heads): 64 threads
        ex["mini_h1_b1"] = dict(bucket=1, heads=1, lmax=4096, **common)  # the trained k3-mini at TP 2
        # a two-CTA cluster, one row per combine CTA and per-row splits at a batch of several rows (codegen
        # --batch-invariant's kind)
        ex["mini_b4_c2r1"] = dict(bucket=4, heads=8, lmax=4096, combine=2, combine_rows=1, balance=False, **common)
        # more than 32 local heads (K3 at TP 2 and 1): the attention kernel in head groups, balanced and per-row splits
        ex["k3tp2_b8"] = dict(bucket=8, heads=48, lmax=4096, **common)
        ex["k3tp1_b1"] = dict(bucket=1, heads=96, lmax=4096, **common)
        for rb in (2, 4):  # fewer rows per combine CTA at batch 64 than the default 8
            ex[f"k3tp8_b64_r{rb}"] = dict(bucket=64, heads=12, lmax=16384, combine_rows=rb, **common)
        return ex

    def args(self, c):
        m, h, c_dim, r = c["M"], c["H"], c["C"], c["R"]
        return [Arg("q", "bf16", (m, h * (c["NOPE"] + r)), "act"),
                Arg("kv", "bf16", (m, c_dim + r), "act"),
                Arg("kv_norm_weight", "bf16", (c_dim,), "weight"),
                Arg("gate", "bf16", (m, h * c["V"]), "act"),
                Arg("cache", "bf16", (m, c["LMAX"], c_dim + r), "state"),  # the current token's row written
                Arg("lengths", "i64", (m,), "act", align=8),
                Arg("kv_b_weight", "bf16", (h * (c["NOPE"] + c["V"]), c_dim), "weight"),
                Arg("out", "bf16", (m, h * c["V"]), "out"),
                Arg("latent", "bf16", (m, c_dim + r), "out"),
                Arg("ws_q", "bf16", (m, h, c_dim), "scratch"),
                Arg("ws_ol", "f32", (m, c["NSPLIT"], h, c_dim), "scratch"),
                Arg("ws_ml", "f32", (m, c["NSPLIT"], h, 2), "scratch")]

    def random_inputs(self, c, gen):
        m, h, c_dim, r, lmax = c["M"], c["H"], c["C"], c["R"], c["LMAX"]
        bf = torch.bfloat16
        # lengths: distinct random values in 0..lmax-1; with >= 3 rows, the extremes (full context and an
        # empty cache) are always present
        if lmax >= m:
            lengths = torch.randperm(lmax, generator=gen)[:m]
        else:
            lengths = torch.randint(0, lmax, (m,), generator=gen)
        if m >= 3:
            lengths[0], lengths[1] = lmax - 1, 0
        cache = torch.empty(m, lmax, c_dim + r, dtype=bf)
        for i in range(m):  # row by row: keeps the float32 temporary small
            cache[i] = torch.randn(lmax, c_dim + r, generator=gen).to(bf)
        return {"q": torch.randn(m, h * (c["NOPE"] + r), generator=gen).to(bf),
                "kv": torch.randn(m, c_dim + r, generator=gen).to(bf),
                "kv_norm_weight": (1 + 0.1 * torch.randn(c_dim, generator=gen)).to(bf),
                "gate": torch.randn(m, h * c["V"], generator=gen).to(bf),
                "cache": cache,
                "lengths": lengths.to(torch.int64),
                "kv_b_weight": (torch.randn(h * (c["NOPE"] + c["V"]), c_dim, generator=gen) / math.sqrt(c_dim)).to(bf),
                "ws_q": torch.zeros(m, h, c_dim, dtype=bf),
                "ws_ol": torch.zeros(m, c["NSPLIT"], h, c_dim),
                "ws_ml": torch.zeros(m, c["NSPLIT"], h, 2)}

    def torch_baseline(self, c, d):
        """The eager model's MLA decode (models/layers.py), cache write included."""
        from k3compile.models import ops

        rows = torch.arange(c["M"], device=d["cache"].device)

        def run():
            kv = d["kv"]
            latent = torch.cat([ops.rms_norm(kv[:, :c["C"]], d["kv_norm_weight"], c["KV_EPS"]), kv[:, c["C"]:]], -1)
            d["latent"].copy_(latent)
            d["out"].copy_(ops.mla_decode(d["q"], latent, d["gate"], d["cache"], d["lengths"], d["kv_b_weight"],
                                          c["NOPE"], c["V"], c["SCALE"]))
            d["cache"].index_put_((rows, d["lengths"]), latent.to(d["cache"].dtype))
        return run

    def reference(self, c, inputs):
        """float64, row by row over the valid positions only (never materializes the whole cache in float64).
        ``cache``: the input cache (bf16, a copy) with position lengths[m] (clamped) of each row m set to the
        bf16 latent row, exactly the values written."""
        m, h, nope, r, vd, c_dim = c["M"], c["H"], c["NOPE"], c["R"], c["V"], c["C"]
        kv = inputs["kv"].double()
        x = kv[:, :c_dim]
        normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c["KV_EPS"])).to(torch.bfloat16).double()
        latent_c = (inputs["kv_norm_weight"].double() * normed).to(torch.bfloat16).double()  # bf16 output
        latent = torch.cat([latent_c, kv[:, c_dim:]], dim=-1)  # [m, C+R], bf16-exact values
        w = inputs["kv_b_weight"].double().view(h, nope + vd, c_dim)
        w_uk, w_uv = w[:, :nope], w[:, nope:]  # [h, nope, C], [h, v, C]
        q = inputs["q"].double().view(m, h, nope + r)
        gate = inputs["gate"].double().view(m, h, vd)
        out = torch.empty(m, h, vd, dtype=torch.float64)
        cache = inputs["cache"].clone()
        for i in range(m):
            n = _position(c, inputs["lengths"][i])
            rows = torch.cat([inputs["cache"][i, :n].double(), latent[i:i + 1]], dim=0)  # [n+1, C+R]
            cache[i, n] = latent[i].to(torch.bfloat16)  # bf16-exact values: no rounding
            ql = torch.einsum("hd,hdc->hc", q[i, :, :nope], w_uk)  # [h, C]
            s = (ql @ rows[:, :c_dim].T + q[i, :, nope:] @ rows[:, c_dim:].T) * c["SCALE"]  # [h, n+1]
            p = torch.softmax(s, dim=-1)
            ol = p @ rows[:, :c_dim]  # [h, C]
            o = torch.einsum("hc,hvc->hv", ol, w_uv)
            out[i] = o * torch.sigmoid(gate[i])
        return {"out": out.reshape(m, h * vd), "latent": latent, "cache": cache}

    def copied_state(self, c, inputs, outs):
        """The cache as the kernel must leave it, given its own ``latent`` output: the input cache with position
        lengths[m] (clamped) of row m replaced by latent[m], bit for bit (the absorb kernel stores the same
        registers to both). ``latent`` is checked against the float64 reference within 1e-2: its fp32 RMSNorm
        rounds to the neighbouring bf16 value of the float64 one in rare ties, so the reference's cache row
        cannot be compared exactly with the kernel's."""
        cache = inputs["cache"].clone()
        latent = outs["latent"].detach().cpu()
        for i in range(c["M"]):
            cache[i, _position(c, inputs["lengths"][i])] = latent[i]
        return {"cache": cache}

    def kernel_params(self, c):
        # kernels/mla_decode.py: the absorb kernel, the split-context attention kernel, the combine kernel
        return [["q", "kv", "kv_norm_weight", "cache", "lengths", "kv_b_weight", "latent", "ws_q"],
                ["q", "cache", "lengths", "latent", "ws_q", "ws_ol", "ws_ml"],
                ["gate", "lengths", "kv_b_weight", "out", "ws_ol", "ws_ml"]]

    def tolerance(self, c):
        """bf16 outputs: 1e-2. The cache: exact (0.0): one wrong or missing row among the LMAX positions of a
        row would pass any relative bound of the size of the outputs'."""
        return {"out": 1e-2, "latent": 1e-2, "cache": 0.0}

    def bytes_of(self, c, inputs):
        """``bytes`` with the cache rows the inputs' lengths read: lengths[m] rows of row m (clamped as the kernel
        clamps them; position lengths[m] is the current token, from ``kv``, written not read)."""
        lengths = inputs["lengths"].detach().to("cpu", torch.int64).clamp(0, c["LMAX"] - 1)
        full = c["M"] * (c["LMAX"] - 1) * (c["C"] + c["R"]) * 2  # what bytes() counts as read
        return self.bytes(c) - full + int(lengths.sum()) * (c["C"] + c["R"]) * 2

    def flops(self, c):
        """Full-context figure (every row at lengths = LMAX - 1, i.e. LMAX positions): absorption of q
        and ol, scores and the weighted sum per position, the RMSNorm and the gate ignored."""
        m, h, nope, r, vd, c_dim = c["M"], c["H"], c["NOPE"], c["R"], c["V"], c["C"]
        per_row = 2 * h * nope * c_dim + 2 * h * vd * c_dim + c["LMAX"] * 2 * h * (2 * c_dim + r)
        return m * per_row

    def bytes(self, c):
        """Bytes that must move, at full context: the cache rows actually read (LMAX - 1 per row; the
        current token's row comes from kv) -- the real count is sum over rows of lengths[m] rows -- and the
        row written per row (the current token's), the weights and activations once, the outputs once; the
        scratch not counted."""
        total = 0
        for a in self.args(c):
            if a.role == "scratch":
                continue
            if a.name == "cache":
                total += c["M"] * (c["LMAX"] - 1) * (c["C"] + c["R"]) * 2  # read
                total += c["M"] * (c["C"] + c["R"]) * 2  # written
            else:
                total += a.nbytes
        return total
