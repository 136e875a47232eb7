"""Templates ``moe_route``, ``moe_gate_up`` and ``moe_down_combine``: the dialect op ``routed_experts`` in two
launches, three from batch ROUTE_MIN_BUCKET (kernels/moe_route.py, moe_gate_up.py, moe_down_combine.py).

``moe_gate_up`` selects each token's experts from its router logits (sigmoid + biased top-k, exactly
``k3compile.dialect._select``), runs the MXFP4 gate/up GEMVs of every (token, slot) and applies SiTU-GLU:
``h [M, TOPK, I]`` bf16, ``ids [M, TOPK]`` i32 and ``weights [M, TOPK]`` f32, and the (token, slot) pairs
grouped by expert, ``groups`` i32 (ref_groups). Every one of its CTAs selects every token (it needs all the
groups; at batch 1 only the selection rounds up to its own tasks' experts); from batch ROUTE_MIN_BUCKET that is M / WARPS selections one after another per warp, so ``moe_route``
selects once (ids, weights) and ``moe_gate_up`` (ROUTED) reads the ids and returns h and groups.
``moe_down_combine`` runs the down GEMVs of the grouped pairs and sums them with the routing weights:
``y [M, L] = bf16(sum_j weights[m, j] * bf16(h[m, j] . deq(W2[ids[m, j]])^T))`` (ops.latent_moe_experts).
Under TP the experts hold an intermediate-dim shard and y is a partial sum.

At batch 1, and where the expert groups are expected to be of one token (DIAG_MAX_SHARE: batches 2 and 4 at K3,
896 experts taking 16 picks a token), ``moe_gate_up`` runs DIAG (kernels/moe_gate_up.py): one token at a time,
the MMA's columns hold MX blocks, the codes go in unscaled and each block's scale multiplies its sums once. Its
range: the activations are prescaled by 2**32 in bf16, so a latent activation of magnitude 2**96 or more
overflows (inf, where the other path is finite), and a product of a code with an activation below 2**-32 in
magnitude may fall below fp32's normal range in the tensor cores (bits of a term smaller than 2**-32 of the unit
weight's; the float64 checks never met either).
"""

from __future__ import annotations

import math

import torch

from .base import Arg, Template, const, need, need_bucket

_MINI = {"n_experts": 16, "top_k": 4, "latent": 128, "inter": 256}
_K3TP8 = {"n_experts": 896, "top_k": 16, "latent": 3584, "inter": 384}
_ROUTING = {"renormalize": True, "scaling_factor": 2.5}
_SITU = {"beta": 4.0, "linear_beta": 25.0}
MAX_EXPERTS = 1024  # selection keeps E/32 logits per lane in registers
SMEM_PER_SM = 228 * 1024  # H100/H200 shared memory per SM (each resident CTA also reserves 1 KB)
DOWN_WARPS = 8  # moe_down_combine warps per CTA (one CTA per 16 output rows; 4 or 2 where 8 leave too little smem)
GATE_UP_WARPS = 4  # moe_gate_up warps per CTA (its persistent grid: OCC CTAs on each of the 132 SMs of an H200)
WIDE_WARPS = 16  # moe_gate_up warps of its one CTA per SM when the activations are staged (batch 2 .. 8 at K3;
# 128 registers a thread: no spill since the decode reads prepacked codes)
WIDE_MAX_STAGES = 3  # its ring: a fourth k-step in flight spilled 8-16 bytes at those 128 registers (batch 2 and 4,
# every TP of the real config; 121 registers at 3 stages)
XSTAGE_MAX_BYTES = 64 * 1024  # moe_gate_up stages every token's activations in shared memory up to this size
RING_MAX_STAGES = 4  # moe_gate_up's ring when the activations travel in it (batch >= 16 at K3), at 2 CTAs per
# SM: at K3 batch 64 a fifth stage measured slower (298 against 286 us alone, in a variant that read moe_route's
# grouping), and so did 3 CTAs of 3 stages (305)
DIAG_MAX_SHARE = 1.05  # moe_gate_up runs DIAG (one token per pass over a task's codes) where the expected (token,
# slot) pairs per distinct expert are at most this: K3's 896 experts x 16 picks at batch 2 / 4 / 8: 1.01 / 1.03 /
# 1.07 (each extra pass reads its codes again; at batch 8 the kernel measured 91.4 against 80.7 us in the KDA
# layer, H100, BENCHMARKS fortieth entry); k3-mini's 16 x 4 from batch 2: 1.23 and more
ROUTE_MIN_BUCKET = 16  # from this batch moe_route selects once and moe_gate_up reads its ids
ROUTE_WARPS = 4  # moe_route warps per CTA (one token each)


def _check_common(name, bucket, n_experts, top_k, latent, inter):
    need_bucket(name, bucket)
    need(isinstance(n_experts, int) and 1 <= n_experts <= MAX_EXPERTS,
         f"{name}: n_experts={n_experts!r} must be an int in 1..{MAX_EXPERTS} (selection holds E/32 logits per "
         f"lane in registers); split the experts or use the eager reference")
    need(isinstance(top_k, int) and 1 <= top_k <= min(n_experts, 32),
         f"{name}: top_k={top_k!r} must be an int in 1..min(n_experts={n_experts}, 32)")
    for what, v in (("latent", latent), ("inter", inter)):
        need(isinstance(v, int) and v > 0 and v % 32 == 0,
             f"{name}: {what}={v!r} must be a positive multiple of 32 (one MXFP4 scale per 32 elements); pad the "
             f"weights to a multiple of 32")


def _expected_experts(c) -> float:
    """Expected distinct experts among M tokens x TOPK uniform picks (for bytes())."""
    e, k, m = c["E"], c["TOPK"], c["M"]
    return e * (1 - (1 - k / e) ** m)


def group_len(c) -> int:
    """Entries of ``groups`` (moe_lib.store_groups): the active-expert count, then MAXA experts, their starts
    and their counts (zero past the count), then the M * TOPK pairs."""
    p = c["M"] * c["TOPK"]
    return 1 + 3 * min(c["E"], p) + p


def ref_groups(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``groups`` as moe_lib.group_pairs + store_groups build them from ids [M, TOPK]: the active experts in
    ascending id, each one's pairs (p = token * TOPK + slot) in ascending order. One token (moe_gate_up's SOLO):
    its experts in slot order, slot a the one pair of expert a. Sort-based, no host sync (the torch baseline runs
    it inside a CUDA graph)."""
    if ids.shape[0] == 1:
        k = ids.shape[1]
        ar = torch.arange(k, device=ids.device)
        return torch.cat([torch.full((1,), k, device=ids.device), ids.reshape(-1).long(), ar, torch.ones_like(ar),
                          ar]).to(torch.int32)
    flat = ids.reshape(-1).long()
    p, maxa = flat.numel(), min(n_experts, flat.numel())
    ar = torch.arange(p, device=ids.device)
    pairs = torch.sort(flat * p + ar).values % p  # by (expert, pair)
    # scatter_add, not bincount: bincount on CUDA reads the max id back to the host (no graph capture)
    counts = torch.zeros(n_experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    first = torch.cumsum(counts, 0) - counts
    order = torch.sort((counts == 0).long() * n_experts + torch.arange(n_experts, device=ids.device)).values
    act = order[:maxa] % n_experts  # active experts first, ascending
    n_active = (counts > 0).sum()
    live = (torch.arange(maxa, device=ids.device) < n_active).long()
    return torch.cat([n_active.reshape(1), act * live, first[act] * live, counts[act] * live,
                      pairs]).to(torch.int32)


def ids_from_groups(groups: torch.Tensor, c) -> torch.Tensor:
    """ids [M, TOPK] back from ``groups`` (no host sync)."""
    m, p = c["M"], c["M"] * c["TOPK"]
    maxa = min(c["E"], p)
    g = groups.long()
    act, num, pairs = g[1:1 + maxa], g[1 + 2 * maxa:1 + 3 * maxa], g[1 + 3 * maxa:]
    ids = torch.empty(p, dtype=torch.long, device=groups.device)
    ids[pairs] = torch.repeat_interleave(act, num, output_size=p)
    return ids.reshape(m, c["TOPK"])


def _balanced_split(tasks: int, slots: int, steps: int) -> int:
    """KSPLIT (1, 2 or 4 warps per task, each keeping at least 4 k-steps) whose tasks x KSPLIT warp-tasks best
    fill their last round over ``slots`` warps; a smaller split unless a larger one fills 2 % more."""
    best_fill, best = 0.0, 1
    for k in (1, 2, 4):
        if k > 1 and steps < 4 * k:
            break
        w = tasks * k
        fill = w / (-(-w // slots) * slots)
        if fill > best_fill + 0.02:
            best_fill, best = fill, k
    return best


BIG_SCALE_EXPERTS = 32  # random inputs: one expert in this many (at least one) also has scale bytes above 128


def _random_bytes(gen, shape) -> torch.Tensor:
    """Uniform random bytes, drawn 8 at a time (int64 draws viewed as bytes: 3 x faster than a draw per byte,
    1.4 against 4.1 s for the 616 MB of K3 TP8's W1 codes on one CPU core, the bulk of a kernel check's inputs).
    The byte count must be a multiple of 8."""
    n = math.prod(shape)
    return torch.randint(-2 ** 63, 2 ** 63 - 1, (n // 8,), generator=gen, dtype=torch.int64).view(torch.uint8) \
        .reshape(shape)


def _random_mx(gen, e, rows, cols):
    """Random MXFP4 experts. Scale bytes 116..128 (2**-11 .. 2**1, as real checkpoints hold them: a byte above
    128 needs a block absmax above 12); the first e // BIG_SCALE_EXPERTS experts (at least one) draw from
    120..130, so the kernels' exact path for bytes above 128 runs whenever one of them is selected, without
    making every timed task take it."""
    packed = _random_bytes(gen, (e, rows, cols // 2))
    scale = torch.randint(116, 129, (e, rows, cols // 32), generator=gen, dtype=torch.uint8)
    n_big = max(1, e // BIG_SCALE_EXPERTS)
    scale[:n_big] = torch.randint(120, 131, (n_big, rows, cols // 32), generator=gen, dtype=torch.uint8)
    return packed, scale


def _deq64(packed, scale):
    from k3compile.models import mxfp4

    return mxfp4.dequantize(packed, scale, torch.float32).double()  # exact (bf16-exact values)


def _per_expert(ids: torch.Tensor, rows: torch.Tensor, packed, scale, out_features: int) -> torch.Tensor:
    """float64 ``rows[m, j] @ deq(W[ids[m, j]]).T`` for every token m and slot j, dequantising each
    distinct expert once (gathering [M, k, out, in] first would need gigabytes at real K3 shapes).
    ``rows`` is [M, k, in]."""
    out = torch.empty(*ids.shape, out_features, dtype=torch.float64)
    for e in torch.unique(ids).tolist():
        m, j = (ids == e).nonzero(as_tuple=True)
        out[m, j] = rows[m, j] @ _deq64(packed[e], scale[e]).T
    return out


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def select_reference(logits, bias, top_k, renormalize, scaling_factor):
    """Exactly k3compile.dialect._select (fp32), kept local so the templates do not import the dialect."""
    scores = torch.sigmoid(logits.float())
    ids = torch.topk(scores + bias.float(), top_k, dim=-1, sorted=True).indices
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids


class _RoutedExperts(Template):
    """What the two launches of the routed experts share: their parameters and example points."""

    def examples(self):
        ex = {f"{cfg}_b{b}": {"bucket": b, **shape, **_ROUTING, **_SITU}
              for cfg, shape in (("mini", _MINI), ("k3tp8", _K3TP8)) for b in (1, 8, 64)}
        # 6 MX blocks of reduction in down (K3 at TP 16: 3072 / 16 = 192): a partial last k-step
        ex["mini_i192_b8"] = {"bucket": 8, **_MINI, "inter": 192, **_ROUTING, **_SITU}
        return ex


class MoeGateUp(_RoutedExperts):
    name = "moe_gate_up"
    kernel_file = "moe_gate_up.py"
    libs = ("mxfp4_lib.py", "moe_lib.py")
    doc = ("router top-k + MXFP4 gate/up + SiTU-GLU, grouped by expert: each selected expert decoded once, "
           "its tokens the N of mma.sync (bf16, fp32 accumulate); persistent CTAs")

    def examples(self):
        ex = super().examples()
        # batch 2: 16 warps at 128 registers a thread, WIDE_MAX_STAGES k-steps in flight (a fourth spilled)
        ex["k3tp8_b2"] = {"bucket": 2, **_K3TP8, **_ROUTING, **_SITU}
        # DIAG forced where most groups hold several tokens (16 experts, 32 picks): each token its own pass
        ex["mini_b8_diag"] = {"bucket": 8, **_MINI, **_ROUTING, **_SITU, "diag": True}
        return ex

    def constants(self, *, bucket: int, n_experts: int, top_k: int, latent: int, inter: int,
                  renormalize: bool, scaling_factor: float, beta: float, linear_beta: float,
                  ksplit: int | None = None, occ: int | None = None, stages: int | None = None,
                  diag: bool | None = None) -> list:
        # ksplit, occ, stages: None (chosen from the bucket and shared memory) unless an experiment fixes them;
        # diag: None is DIAG_MAX_SHARE's rule (False: codegen --batch-invariant, every bucket sums a row in one order)
        _check_common(self.name, bucket, n_experts, top_k, latent, inter)
        need(ksplit in (None, 1, 2, 4), f"{self.name}: ksplit={ksplit!r} must be 1, 2, 4 or None (chosen by the "
                                                 f"bucket)")
        need(occ in (None, 1, 2, 3), f"{self.name}: occ={occ!r} must be 1, 2, 3 or None (chosen by the bucket)")
        need(stages is None or (isinstance(stages, int) and stages >= 1),
             f"{self.name}: stages={stages!r} must be a positive int or None (chosen from shared memory)")
        need(beta > 0 and linear_beta > 0, f"{self.name}: beta={beta} and linear_beta={linear_beta} must be > 0")
        need(latent % 128 == 0, f"{self.name}: latent={latent} must be a multiple of 128 (a k-step of the MMA "
                                f"quad covers 4 MX blocks); pad the latent size")
        need(inter % 16 == 0, f"{self.name}: inter={inter} must be a multiple of 16 (MMA tiles of 16 rows); pad "
                              f"the intermediate size")
        tasks = min(n_experts, bucket * top_k) * (inter // 16)  # (active expert, row tile) at most
        steps = latent // 128
        # Activations: with at most XSTAGE_MAX_BYTES of them (batch <= 8 at K3 shapes) every token's row is staged
        # in shared memory once per CTA; from batch 2 that is one CTA of WIDE_WARPS per SM (the rows staged once
        # per SM, and more warps than two 4-warp CTAs to hide the decode's latencies). Larger batches carry
        # each lane's token block in the cp.async ring with the weights (4-warp CTAs, 2 or 3 per SM).
        xstage = bucket * latent * 2 <= XSTAGE_MAX_BYTES
        wide = xstage and bucket > 1
        need(diag in (None, False) or xstage,
             f"{self.name}: diag=True needs the activations staged (bucket x latent <= {XSTAGE_MAX_BYTES // 2}); "
             f"got bucket {bucket}, latent {latent}; use diag=None")
        if diag is None:  # DIAG runs a group of several tokens once per token: only where such groups are rare
            share = bucket * top_k / _expected_experts({"E": n_experts, "TOPK": top_k, "M": bucket})
            diag = xstage and share <= DIAG_MAX_SHARE
        wpc, occs = (WIDE_WARPS, (1,)) if wide else (GATE_UP_WARPS, (3, 2) if xstage else (2,))
        occs = occs if occ is None else (occ,)
        if ksplit is None:  # ksplit=1: codegen --batch-invariant (every bucket sums K in one warp's order)
            if wide:  # the split that best fills the last round of tasks over the warps (expected experts)
                ksplit = _balanced_split(round(_expected_experts({"E": n_experts, "TOPK": top_k, "M": bucket}))
                                         * (inter // 16), 132 * wpc, steps)
            else:  # split the reduction (KSPLIT 2 or 4) while there are fewer tasks than warps to run them (at 3
                # CTAs per SM), each warp keeping at least 4 k-steps; a warp with a whole task pipelines its
                # k-steps and needs no shared-memory reduction
                ksplit = 1
                while ksplit < 4 and tasks * 2 * ksplit <= 3 * 132 * wpc and steps >= 8 * ksplit:
                    ksplit *= 2
        need(steps >= ksplit, f"{self.name}: ksplit={ksplit} needs latent >= {128 * ksplit} (a k-step per warp)")
        # the cp.async ring: as many k-steps per warp as OCC CTAs' shared memory allows (at most the warp's
        # share of the steps, at most 8, WIDE_MAX_STAGES at 16 warps, RING_MAX_STAGES with the activations in
        # it); a stage is 32 lanes x ((4 or 8) x 16 + 4 x 4) bytes (weights, the activations unless staged,
        # scales; one lane of each quad copying each scale word, as moe_down_combine does, measured no faster
        # at batch 1 and 8 and 3.5 % slower per byte at 64: 267.7 us for 479 MB against 242.1 for 448, alone).
        # With 4-warp CTAs and staged activations, 3 per SM or 2 with a deeper ring: whichever keeps more k-steps in flight per SM
        # (the one being decoded does not count); with the activations in the ring, 2 per SM (measured).
        p, maxa = bucket * top_k, min(n_experts, bucket * top_k)
        mask = n_experts * ((bucket + 31) // 32)  # group_pairs' token masks
        fixed = 4 * (2 * p + mask + n_experts + 3 * maxa + 2 * wpc) + 4 * wpc * 256 + 1024  # grouping, sRed, pad
        fixed += bucket * (latent * 2 + 16) if xstage else 16  # the staged rows (16 bytes of padding each)
        fixed += 64 if diag else 0  # DIAG's block of zero activations
        per_stage = wpc * 32 * ((4 if xstage else 8) * 16 + 4 * 4)
        my_steps = -(-steps // ksplit)
        options = []
        for occ in occs:
            room = (SMEM_PER_SM // occ - 1024 - fixed) // per_stage
            most = WIDE_MAX_STAGES if wide else 8 if xstage else RING_MAX_STAGES
            want = min(most, my_steps, room) if stages is None else stages
            if room >= max(want, min(2, my_steps)):
                options.append((occ * wpc * (want - 1), occ, want))
        need(bool(options) or stages is None, f"{self.name}: stages={stages} do not fit in shared memory at "
                                              f"{occs} CTAs per SM; use fewer stages (or stages=None)")
        need(bool(options), f"{self.name}: bucket {bucket} x top_k {top_k} leaves shared memory for fewer than 2 "
                            f"k-steps in flight per warp; use a smaller bucket")
        _, occ, stages = max(options)
        # the fewest CTAs that hold every task: at K3 TP8 batch 2 that is 96 of the 132 SMs, and the shared expert's
        # down-projection on the side stream runs on the other 36, hidden. Spread over all 132 (H200, BENCHMARKS
        # thirty-ninth entry) this kernel took 21.6 us exposed against 27.5, but the side GEMV then ran after it,
        # 10.3 us exposed against 0.3: the layer the same (98.0 against 98.1 us busy)
        ctas = min(-(-tasks // (wpc // ksplit)), occ * 132)
        return [const("M", bucket, "tokens (the batch bucket)"), const("E", n_experts, "experts (n_experts)"),
                const("TOPK", top_k, "experts per token"),
                const("L", latent, "latent size (reduction length of gate/up)"),
                const("I", inter, "intermediate size (rows of W1/W3 on this rank)"),
                const("RENORMALIZE", bool(renormalize), "renormalise the selected scores to sum 1"),
                const("SCALING", float(scaling_factor), "routed scaling factor"),
                const("BETA", float(beta), "SiTU gate beta"), const("LINEAR_BETA", float(linear_beta),
                                                                   "SiTU linear beta"),
                const("WARPS", wpc, "warps per CTA"),
                const("KSPLIT", ksplit, "warps sharing one task (they split its reduction); WARPS / KSPLIT tasks "
                                        "per CTA at a time"),
                const("CTAS", ctas, "persistent CTAs (task t runs on CTA t % CTAS)"),
                const("OCC", occ, "CTAs per SM (register budget: 65536 / (OCC * THREADS))"),
                const("STAGES", stages, "k-steps of weights in flight per warp (cp.async ring in shared memory)"),
                const("XSTAGE", xstage, "every token's activations staged in shared memory once per CTA (else "
                                        "they travel in the ring)"),
                const("ROUTED", bucket >= ROUTE_MIN_BUCKET, "ids come from moe_route (from batch "
                                                            f"{ROUTE_MIN_BUCKET}) instead of a selection in every CTA"),
                const("DIAG", bool(diag), "one token at a time: the MMA's 8 columns hold 8 MX blocks, each scale "
                                          "applied once to its column's sums")]

    def args(self, c):
        m, e, k, l, i = c["M"], c["E"], c["TOPK"], c["L"], c["I"]
        weights = [Arg("w1_packed", "u8", (e, i, l // 2), "weight", layout="mxfp4_prepacked"),
                   Arg("w1_scale", "u8", (e, i, l // 32), "weight"),
                   Arg("w3_packed", "u8", (e, i, l // 2), "weight", layout="mxfp4_prepacked"),
                   Arg("w3_scale", "u8", (e, i, l // 32), "weight")]
        groups = Arg("groups", "i32", (group_len(c),), "out")
        if c["ROUTED"]:
            return [Arg("z", "bf16", (m, l), "act"), Arg("ids", "i32", (m, k), "act"), *weights,
                    Arg("h", "bf16", (m, k, i), "out"), groups]
        return [Arg("z", "bf16", (m, l), "act"), Arg("logits", "f32", (m, e), "act"),
                Arg("score_bias", "f32", (e,), "weight"), *weights,
                Arg("h", "bf16", (m, k, i), "out"), Arg("ids", "i32", (m, k), "out"),
                Arg("weights", "f32", (m, k), "out"), groups]

    def kernel_params(self, c):
        """The kernel entry's parameters, in the order ``_launch`` hands them to ``kernel`` (kernels/moe_gate_up.py;
        a None argument is no parameter): with ROUTED the ids come after h, not second as in ``args``, so the
        memory-ordering audit names each access by its real argument."""
        names = [a.name for a in self.args(c)]
        if c["ROUTED"]:
            names.remove("ids")
            names.insert(names.index("h") + 1, "ids")
        return [names]

    def random_inputs(self, c, gen):
        m, e, l, i = c["M"], c["E"], c["L"], c["I"]
        w1, s1 = _random_mx(gen, e, i, l)
        w3, s3 = _random_mx(gen, e, i, l)
        logits, bias = torch.randn(m, e, generator=gen), 0.1 * torch.randn(e, generator=gen)
        out = {"z": torch.randn(m, l, generator=gen).to(torch.bfloat16),
               "w1_packed": w1, "w1_scale": s1, "w3_packed": w3, "w3_scale": s3}
        if c["ROUTED"]:  # ids as moe_route selects them
            out["ids"] = select_reference(logits, bias, c["TOPK"], c["RENORMALIZE"], c["SCALING"])[1].to(torch.int32)
        else:
            out.update(logits=logits, score_bias=bias)
        return out

    def _ids(self, c, d):
        """(routing weights or None, ids): selected from the logits, or moe_route's ids (ROUTED)."""
        if c["ROUTED"]:
            return None, d["ids"].long()
        return select_reference(d["logits"], d["score_bias"], c["TOPK"], c["RENORMALIZE"], c["SCALING"])

    def torch_baseline(self, c, d):
        """Eager: selection, then the selected experts gathered and dequantised to bf16 on the fly."""
        from k3compile.models import ops
        from k3compile.models.mxfp4 import dequantize

        def run():
            w, ids = self._ids(c, d)
            z = d["z"][:, None, None, :]
            gate = torch.matmul(z, dequantize(d["w1_packed"][ids], d["w1_scale"][ids]).transpose(-1, -2))[..., 0, :]
            up = torch.matmul(z, dequantize(d["w3_packed"][ids], d["w3_scale"][ids]).transpose(-1, -2))[..., 0, :]
            d["h"].copy_(ops.situ_glu(gate, up, c["BETA"], c["LINEAR_BETA"]))
            d["groups"].copy_(ref_groups(ids, c["E"]))
            if not c["ROUTED"]:
                d["ids"].copy_(ids)
                d["weights"].copy_(w)
        return run

    def reference(self, c, inputs):
        weights, ids = self._ids(c, inputs)
        z = inputs["z"].double()[:, None, :].expand(-1, ids.shape[1], -1)  # [M, K, L]
        gate = _bf16(_per_expert(ids, z, inputs["w1_packed"], inputs["w1_scale"], c["I"]))
        up = _bf16(_per_expert(ids, z, inputs["w3_packed"], inputs["w3_scale"], c["I"]))
        b, lb = c["BETA"], c["LINEAR_BETA"]
        h = b * torch.tanh(gate / b) * torch.sigmoid(gate) * (lb * torch.tanh(up / lb))
        groups = ref_groups(ids, c["E"])
        if c["ROUTED"]:
            return {"h": h, "groups": groups}
        return {"h": h, "ids": ids.to(torch.int32), "weights": weights.double(), "groups": groups}

    def tolerance(self, c):
        return {"h": 1e-2, "weights": 1e-5}

    def flops(self, c):
        return 2 * c["M"] * c["TOPK"] * 2 * c["I"] * c["L"]

    def bytes(self, c):
        per_expert = 2 * c["I"] * (c["L"] // 2 + c["L"] // 32)  # W1 + W3 codes and scales
        if c["ROUTED"]:
            acts, outs = c["M"] * (2 * c["L"] + 4 * c["TOPK"]), c["M"] * c["TOPK"] * 2 * c["I"]  # z, ids; h, groups
        else:
            acts = c["M"] * (2 * c["L"] + 4 * c["E"]) + 4 * c["E"]  # z, logits, bias
            outs = c["M"] * c["TOPK"] * (2 * c["I"] + 8)
        return int(round(per_expert * _expected_experts(c))) + acts + outs + 4 * group_len(c)


class MoeRoute(_RoutedExperts):
    name = "moe_route"
    kernel_file = "moe_route.py"
    libs = ("mxfp4_lib.py", "moe_lib.py")
    doc = "router top-k (sigmoid + biased top-k, renormalised weights) once per step, a warp per token"

    def examples(self):  # the buckets that launch it
        ex = {f"{cfg}_b{b}": {"bucket": b, "n_experts": shape["n_experts"], "top_k": shape["top_k"], **_ROUTING}
              for cfg, shape in (("mini", _MINI), ("k3tp8", _K3TP8)) for b in (16, 64)}
        ex["mini_norenorm_b32"] = {"bucket": 32, "n_experts": 16, "top_k": 4, "renormalize": False,
                                   "scaling_factor": 1.0}
        return ex

    def constants(self, *, bucket: int, n_experts: int, top_k: int, renormalize: bool, scaling_factor: float,
                  latent: int = 32, inter: int = 32, beta: float = 1.0, linear_beta: float = 1.0) -> list:
        # latent .. linear_beta: accepted so that codegen hands the three kernels the same parameters
        _check_common(self.name, bucket, n_experts, top_k, latent, inter)
        return [const("M", bucket, "tokens (the batch bucket)"), const("E", n_experts, "experts (n_experts)"),
                const("TOPK", top_k, "experts per token"),
                const("RENORMALIZE", bool(renormalize), "renormalise the selected scores to sum 1"),
                const("SCALING", float(scaling_factor), "routed scaling factor"),
                const("WARPS", ROUTE_WARPS, "warps per CTA (one token each)")]

    def args(self, c):
        m, e, k = c["M"], c["E"], c["TOPK"]
        return [Arg("logits", "f32", (m, e), "act"), Arg("score_bias", "f32", (e,), "weight"),
                Arg("ids", "i32", (m, k), "out"), Arg("weights", "f32", (m, k), "out")]

    def random_inputs(self, c, gen):
        return {"logits": torch.randn(c["M"], c["E"], generator=gen),
                "score_bias": 0.1 * torch.randn(c["E"], generator=gen)}

    def torch_baseline(self, c, d):
        def run():
            w, ids = select_reference(d["logits"], d["score_bias"], c["TOPK"], c["RENORMALIZE"], c["SCALING"])
            d["ids"].copy_(ids)
            d["weights"].copy_(w)
        return run

    def reference(self, c, inputs):
        weights, ids = select_reference(inputs["logits"], inputs["score_bias"], c["TOPK"], c["RENORMALIZE"],
                                        c["SCALING"])
        return {"ids": ids.to(torch.int32), "weights": weights.double()}

    def tolerance(self, c):
        return {"weights": 1e-5}

    def flops(self, c):
        return 0

    def bytes(self, c):
        return 4 * (c["M"] * c["E"] + c["E"] + 2 * c["M"] * c["TOPK"])


class MoeDownCombine(_RoutedExperts):
    name = "moe_down_combine"
    kernel_file = "moe_down_combine.py"
    libs = ("mxfp4_lib.py", "moe_lib.py")
    doc = ("MXFP4 down of the selected experts grouped by expert (mma.sync, tokens as N) + routing-weighted "
           "combine in shared memory (deterministic, no atomics)")

    def constants(self, *, bucket: int, n_experts: int, top_k: int, latent: int, inter: int,
                  renormalize: bool = True, scaling_factor: float = 1.0, beta: float = 1.0,
                  linear_beta: float = 1.0) -> list:
        _check_common(self.name, bucket, n_experts, top_k, latent, inter)
        need(latent % 16 == 0, f"{self.name}: latent={latent} must be a multiple of 16 (MMA tiles of 16 output "
                               f"rows); pad the latent size")
        # the cp.async ring: up to 4 of a warp's experts in flight, as far as 2 CTAs per SM leave shared memory
        # (a stage: 32 lanes x per k-step two 16-byte weight chunks and, when I/32 % 4 == 0, 8 quads x per k-step
        # two scale words); DOWN_WARPS warps per CTA while that leaves 2 stages each, else 4, else 2 (sPart takes
        # 32 KB at K3 batch 64; the grouping comes from moe_gate_up, in global memory). A stage holds a warp's
        # whole expert tile (16 rows x I): at TP 1 (I = 3072) 104 KB with 4 warps, which from batch 16 leaves no
        # room beside sPart at 2 CTAs per SM; 2 warps fit one stage each.
        nb = inter // 32
        steps, p, maxa = -(-nb // 4), bucket * top_k, min(n_experts, bucket * top_k)
        fixed = 2 * p * 16 + 4 * (1 + 3 * maxa + p) + 1024  # sPart, the grouping, padding
        rooms = {}
        for warps in (DOWN_WARPS, 4, 2):
            per_stage = warps * 32 * steps * 2 * 16 + (warps * 8 * steps * 2 * 4 if nb % 4 == 0 else 0)  # + scales
            rooms[warps] = (SMEM_PER_SM // 2 - 1024 - fixed) // per_stage
        # DOWN_WARPS or 4 with 2 stages each, else 4; 2 only where 4 leave no room for one stage
        warps = next((w for w in (DOWN_WARPS, 4) if rooms[w] >= 2), 4)
        warps = 2 if rooms[warps] < 1 else warps
        room = rooms[warps]
        need(room >= 1, f"{self.name}: bucket {bucket} x top_k {top_k} leaves no shared memory for the weight ring; "
                        f"use a smaller bucket")
        stages = min(4, room, -(-maxa // warps))
        return [const("M", bucket, "tokens (the batch bucket)"), const("E", n_experts, "experts (n_experts)"),
                const("TOPK", top_k, "experts per token"), const("L", latent, "latent size (rows of W2, outputs)"),
                const("I", inter, "intermediate size (reduction length of down on this rank)"),
                const("WARPS", warps, "warps per CTA (they take the active experts in turn)"),
                const("STAGES", stages, "experts' weights in flight per warp (cp.async ring in shared memory)")]

    def examples(self):
        ex = super().examples()
        # K3 at TP 1 (I = 3072) from batch 16: 2 warps per CTA, one expert tile in flight each (the smem limit)
        ex["k3tp1_b16"] = {"bucket": 16, **_K3TP8, "inter": 3072, **_ROUTING, **_SITU}
        return ex

    def args(self, c):
        m, e, k, l, i = c["M"], c["E"], c["TOPK"], c["L"], c["I"]
        return [Arg("h", "bf16", (m, k, i), "act"), Arg("groups", "i32", (group_len(c),), "act"),
                Arg("weights", "f32", (m, k), "act"),
                Arg("w2_packed", "u8", (e, l, i // 2), "weight", layout="mxfp4_prepacked"),
                Arg("w2_scale", "u8", (e, l, i // 32), "weight"),
                Arg("y", "bf16", (m, l), "out")]

    def random_inputs(self, c, gen):
        m, e, k, l, i = c["M"], c["E"], c["TOPK"], c["L"], c["I"]
        logits = torch.randn(m, e, generator=gen)
        weights, ids = select_reference(logits, 0.1 * torch.randn(e, generator=gen), k, True, 2.5)
        w2, s2 = _random_mx(gen, e, l, i)
        return {"h": (0.5 * torch.randn(m, k, i, generator=gen)).to(torch.bfloat16), "groups": ref_groups(ids, e),
                "weights": weights.float(), "w2_packed": w2, "w2_scale": s2}

    def torch_baseline(self, c, d):
        from k3compile.models.mxfp4 import dequantize

        def run():
            ids = ids_from_groups(d["groups"], c)
            w2 = dequantize(d["w2_packed"][ids], d["w2_scale"][ids])  # [M, K, L, I] bf16
            y = torch.matmul(d["h"][..., None, :], w2.transpose(-1, -2))[..., 0, :]
            d["y"].copy_((y.float() * d["weights"][..., None]).sum(1))
        return run

    def reference(self, c, inputs):
        ids = ids_from_groups(inputs["groups"], c)
        y = _bf16(_per_expert(ids, inputs["h"].double(), inputs["w2_packed"], inputs["w2_scale"], c["L"]))
        # ^ per-expert result rounded to bf16, as the eager matmul returns it
        return {"y": (y * inputs["weights"].double()[..., None]).sum(1)}

    def flops(self, c):
        return 2 * c["M"] * c["TOPK"] * c["L"] * c["I"]

    def bytes(self, c):
        per_expert = c["L"] * (c["I"] // 2 + c["I"] // 32)
        acts = c["M"] * c["TOPK"] * (2 * c["I"] + 4) + 4 * group_len(c)  # h, weights, groups
        return int(round(per_expert * _expected_experts(c))) + acts + c["M"] * c["L"] * 2
