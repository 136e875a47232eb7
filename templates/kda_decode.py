"""Template ``kda_decode``: one KDA decode step (dialect op ``kda_decode_fb``) for H local heads: short conv +
SiLU, q/k L2 norms, the lower-bound decay gate with the f_b up-projection folded in, the delta-rule update of
the fp32 state (in place) and the gated per-head RMSNorm (kernel: kernels/kda_decode.py)."""

from __future__ import annotations

import math

import torch

from .base import Arg, Template, const, need

HEAD_DIM = 128  # the kernel's thread layout (2*D threads, two per prologue channel) is written for this
SMS = 132  # H100 / H200 SMs: the default cluster keeps heads x tokens x CTAs per head within one wave
CLUSTERS = (1, 2, 4, 8)  # CTAs per (head, token): a portable thread-block cluster, D / CL value columns each
CLUSTER_MAX_HEADS = 32  # heads x tokens up to which the default splits a head over a cluster
MAX_RANK = 256  # f_b slices live in registers (R/2 bf16 per thread)
L2_EPS = 1e-6  # inside the rsqrt of the q/k L2 norms (FLA use_qk_l2norm_in_kernel)


def default_cluster(bucket: int, heads: int) -> int:
    """CTAs per (head, token). Up to CLUSTER_MAX_HEADS heads x tokens, the most (up to 8) that keep the grid
    within one wave of SMs: at K3 TP8 (12 heads) batch 1 8 CTAs of 8 KB of state per head instead of one of
    64 KB, batch 2 four; from 48 heads x tokens (batch 4) one. On the H100 (BENCHMARKS.md, thirty-eighth
    entry) the KDA + MoE layer's kda_decode went 4.5 -> 1.8 us exposed at batch 1 and 8.0 -> 4.1 at batch 2;
    at batch 4 two CTAs per head measured no faster (7.0 -> 6.8 in the layer, 6.7 -> 7.3 alone)."""
    if bucket * heads > CLUSTER_MAX_HEADS:
        return 1
    return max(cl for cl in CLUSTERS if cl == 1 or bucket * heads * cl <= SMS)


class KdaDecode(Template):
    name = "kda_decode"
    kernel_file = "kda_decode.py"
    libs = ("dsmem_lib.py",)  # st_dsmem_f32
    doc = ("KDA decode step: a cluster of CTAs per (head, token) splitting the value columns, the 64 KB fp32 state "
           "read and written once from registers")

    def constants(self, *, bucket: int, heads: int, head_dim: int, rank: int, conv_width: int, lower_bound: float,
                  eps: float, cluster: int | None = None) -> list:
        # cluster: None (default_cluster) unless an experiment or a baseline fixes it
        need(isinstance(bucket, int) and 1 <= bucket <= 65535,
             f"kda_decode: bucket {bucket!r} must be an int in 1..65535 (grid.y is the token); use a smaller bucket")
        need(isinstance(heads, int) and 1 <= heads <= 65535,
             f"kda_decode: heads {heads!r} must be a positive int (local KDA heads = kda_num_heads / TP)")
        need(head_dim == HEAD_DIM,
             f"kda_decode: head_dim {head_dim} is not supported: the kernel's thread layout is written for "
             f"head_dim {HEAD_DIM} (K = V = {HEAD_DIM}); use the eager reference for other head sizes")
        need(isinstance(rank, int) and rank % 16 == 0 and 16 <= rank <= MAX_RANK,
             f"kda_decode: f_a rank {rank!r} must be a multiple of 16 in 16..{MAX_RANK} (two threads per channel "
             f"each hold rank/2 bf16 weights in registers, loaded 8 at a time); pad f_a/f_b_weight or extend "
             f"the kernel with a loop over rank chunks")
        need(isinstance(conv_width, int) and 2 <= conv_width <= 8,
             f"kda_decode: conv_width {conv_width!r} must be in 2..8 (short_conv_kernel_size; K3 uses 4)")
        need(math.isfinite(lower_bound) and lower_bound < 0,
             f"kda_decode: lower_bound {lower_bound!r} must be finite and negative (K3: -5.0)")
        need(math.isfinite(eps) and eps > 0, f"kda_decode: eps {eps!r} must be a positive finite float")
        need(cluster is None or cluster in CLUSTERS,
             f"kda_decode: cluster {cluster!r} must be one of {CLUSTERS} (CTAs per head, each D / cluster value "
             f"columns) or None (chosen from the bucket and heads)")
        cl = default_cluster(bucket, heads) if cluster is None else cluster
        return [const("M", bucket, "tokens (the batch bucket)"), const("H", heads, "local KDA heads"),
                const("D", head_dim, "head dim (K = V = D)"), const("R", rank, "rank of the low-rank decay input f_a"),
                const("W", conv_width, "short conv kernel size"),
                const("LOWER_BOUND", float(lower_bound), "gate lower bound"),
                const("EPS", float(eps), "RMSNorm epsilon of the output norm"),
                const("CL", cl, "CTAs per (head, token): a thread-block cluster, each owning D / CL value columns of "
                                "the state")]

    def examples(self):
        ex = {f"{cfg}_b{b}": {"bucket": b, "heads": heads, "head_dim": 128, "rank": 128, "conv_width": 4,
                              "lower_bound": -5.0, "eps": 1e-5}
              for cfg, heads in (("mini", 8), ("k3tp8", 12)) for b in (1, 2, 4, 8, 64)}
        # every cluster size at K3 TP8's batch 1 and 4 (the defaults are 8 and 1; 1 is the kernel before clusters)
        for b, cls in ((1, (1, 2, 4)), (4, (2, 4))):
            for cl in cls:
                ex[f"k3tp8_b{b}_cl{cl}"] = {**ex[f"k3tp8_b{b}"], "cluster": cl}
        return ex

    def args(self, c):
        M, H, D, R, W = c["M"], c["H"], c["D"], c["R"], c["W"]
        C = H * D
        return [Arg("q", "bf16", (M, C), "act", 2), Arg("k", "bf16", (M, C), "act", 2),
                Arg("v", "bf16", (M, C), "act", 2), Arg("f_a", "bf16", (M, R), "act"),
                Arg("f_b_weight", "bf16", (C, R), "weight"), Arg("beta_logits", "bf16", (M, H), "act", 2),
                Arg("g", "bf16", (M, C), "act", 8),
                Arg("conv_q", "bf16", (M, C, W - 1), "state", 2), Arg("conv_k", "bf16", (M, C, W - 1), "state", 2),
                Arg("conv_v", "bf16", (M, C, W - 1), "state", 2),
                Arg("recurrent_state", "f32", (M, H, D, D), "state"),
                Arg("q_conv_weight", "bf16", (C, 1, W), "weight", 2),
                Arg("k_conv_weight", "bf16", (C, 1, W), "weight", 2),
                Arg("v_conv_weight", "bf16", (C, 1, W), "weight", 2),
                Arg("a_log", "f32", (H,), "weight", 4), Arg("dt_bias", "f32", (C,), "weight", 4),
                Arg("o_norm_weight", "bf16", (D,), "weight", 8),
                Arg("y", "bf16", (M, C), "out")]

    def random_inputs(self, c, gen):
        M, H, D, R, W = c["M"], c["H"], c["D"], c["R"], c["W"]
        C = H * D
        bf = torch.bfloat16
        rn = lambda *shape, std=1.0: (std * torch.randn(*shape, generator=gen))  # noqa: E731
        return {
            "q": rn(M, C).to(bf), "k": rn(M, C).to(bf), "v": rn(M, C).to(bf),
            "f_a": rn(M, R).to(bf), "f_b_weight": rn(C, R, std=R ** -0.5).to(bf),  # f ~ N(0, 1)
            "beta_logits": rn(M, H).to(bf), "g": rn(M, C).to(bf),
            "conv_q": rn(M, C, W - 1).to(bf), "conv_k": rn(M, C, W - 1).to(bf), "conv_v": rn(M, C, W - 1).to(bf),
            "recurrent_state": rn(M, H, D, D, std=0.1),
            "q_conv_weight": rn(C, 1, W, std=0.5).to(bf), "k_conv_weight": rn(C, 1, W, std=0.5).to(bf),
            "v_conv_weight": rn(C, 1, W, std=0.5).to(bf),
            "a_log": torch.log(torch.empty(H).uniform_(1.0, 16.0, generator=gen)),
            "dt_bias": rn(C, std=0.5) - 3.0,
            "o_norm_weight": (1.0 + rn(D, std=0.1)).to(bf),
        }

    def torch_baseline(self, c, d):
        from k3compile.models import ops

        F = torch.nn.functional

        def run():
            f = F.linear(d["f_a"], d["f_b_weight"])
            y, cq, ck, cv, st = ops.kda_decode(
                d["q"], d["k"], d["v"], f, d["beta_logits"], d["g"], d["conv_q"], d["conv_k"], d["conv_v"],
                d["recurrent_state"], d["q_conv_weight"], d["k_conv_weight"], d["v_conv_weight"], d["a_log"],
                d["dt_bias"], d["o_norm_weight"], c["D"], c["LOWER_BOUND"], c["EPS"])
            d["y"].copy_(y)
            for name, new in (("conv_q", cq), ("conv_k", ck), ("conv_v", cv), ("recurrent_state", st)):
                d[name].copy_(new)
        return run

    def reference(self, c, inputs):
        """float64, following models/ops.py kda_decode (f = f_a @ f_b_weight^T rounded to bf16 first)."""
        M, H, D = c["M"], c["H"], c["D"]
        x = {k: t.double() for k, t in inputs.items()}
        f = (x["f_a"] @ x["f_b_weight"].T).to(torch.bfloat16).double().view(M, H, D)

        def conv(name):
            window = torch.cat([x[f"conv_{name}"], x[name][..., None]], dim=-1)  # [M, C, W]
            y = (window * x[f"{name}_conv_weight"][:, 0, :]).sum(-1)
            return (y * torch.sigmoid(y)).view(M, H, D), window[..., 1:]

        qc, new_cq = conv("q")
        kc, new_ck = conv("k")
        vc, new_cv = conv("v")
        qn = qc / torch.sqrt((qc * qc).sum(-1, keepdim=True) + L2_EPS) * D ** -0.5
        kn = kc / torch.sqrt((kc * kc).sum(-1, keepdim=True) + L2_EPS)
        gate = c["LOWER_BOUND"] * torch.sigmoid(
            torch.exp(x["a_log"])[None, :, None] * (f + x["dt_bias"].view(1, H, D)))
        beta = torch.sigmoid(x["beta_logits"])  # [M, H]
        s = x["recurrent_state"] * torch.exp(gate)[..., None]  # rows = key index
        u = vc - torch.einsum("mhij,mhi->mhj", s, kn)
        s = s + beta[..., None, None] * kn[..., :, None] * u[..., None, :]
        o = torch.einsum("mhij,mhi->mhj", s, qn)
        o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + c["EPS"]) * x["o_norm_weight"]
        y = o * torch.sigmoid(x["g"].view(M, H, D))
        return {"y": y.reshape(M, H * D), "conv_q": new_cq, "conv_k": new_ck, "conv_v": new_cv,
                "recurrent_state": s}

    def tolerance(self, c) -> dict:
        """Relative error bound per output. The bf16 output y: 1e-2. The fp32 recurrent state: 1e-4 (fp32 math
        gives ~1e-7; the rest of the margin is for the rare f whose fp32 sum rounds to the neighbouring bf16
        value of the float64 one, seen at ~1e-6). The conv states are exact copies of bf16 values."""
        return {"y": 1e-2, "recurrent_state": 1e-4, "conv_q": 1e-6, "conv_k": 1e-6, "conv_v": 1e-6}

    def flops(self, c):
        M, H, D, R, W = c["M"], c["H"], c["D"], c["R"], c["W"]
        per_head = 2 * D * R + 3 * 2 * D * W + 7 * D * D  # f dot, convs, decay + S^T k + update + S^T q
        return M * H * per_head

    def bytes(self, c):
        """Every argument once, the states read and written (the fp32 recurrent state dominates: 128 KB per
        (token, head))."""
        return sum(a.nbytes * (2 if a.role == "state" else 1) for a in self.args(c))
