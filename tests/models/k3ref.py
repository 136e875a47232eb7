"""An independent float64 reference of one K3 decode step, written straight from k3-architecture.md.

It deliberately imports nothing from ``k3compile.models``: the config is read from the raw
``config.json`` dict, the weights by their checkpoint names (§7) from the safetensors tensors, the
MXFP4 experts are decoded with its own bit arithmetic (§1.5), and every operation follows the §2
pseudo-code and §1.7-§1.14 in float64:

* KDA keeps the *whole* pre-conv history and recomputes the causal short conv from scratch with
  zero left padding each step (no rolling conv state), then runs the chunk-free delta recurrence.
* MLA keeps every token's ``[kv_a_layernorm(c) | k_pe]`` and recomputes full causal attention in the
  non-absorbed form (k = [W_UK c | k_pe], v = W_UV c per head, scale 192^-0.5, no rotation).

Keyword ``mutations`` switch on one wrong variant each (the bugs of §5), so that a test can show the
model matches the right form *and* that the wrong form would be measurably different.
"""

from __future__ import annotations


import torch


P = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"

MUTATIONS = {
    "seal_before_read",  # §5.6: seal P before the pre-attention read (which then sees P_old twice)
    "attnres_norm_values",  # §5.6: mix the normalised keys instead of the raw values
    "attnres_proj_only",  # §5.6: drop the norm weight (the weights do not fold)
    "output_skip_attnres",  # §5.7: final norm on P directly, no output AttnRes
    "output_norm_first",  # §5.7: final norm before the output AttnRes
    "softplus_gate",  # §5.3: Kimi-Linear's -exp(A)*softplus(f+dt_bias) decay gate
    "a_log_padding",  # §5.2: take the A_log entries from the padded tail
    "rope",  # §5.4: rotate q_pe / k_pe (theta 10000) as a RoPE port would
    "mla_eps_1e5",  # §5.5: q_a / kv_a layernorm with eps 1e-5
    "route_bias_in_weights",  # §5.8: routing weights from the biased scores
    "early_routing_weights",  # §5.8: the routing weight multiplies the expert input
    "no_renorm",  # §5.8: no renormalisation of the top-k weights
    "latent_norm_per_expert",  # §5.9: latent norm on each expert output, before the combine
    "no_latent_norm",  # §5.9
    "shared_reads_up_output",  # §5.10: shared expert on the up-projected latent instead of the input
    "beta_head0",  # §5.12: one beta for all heads
    "kda_gate_silu",  # §5.12: SiLU instead of sigmoid on the output gate
    "kda_gate_normed",  # §5.12: sigmoid of the RMS-normed gate
    "o_norm_over_heads",  # §5.12: output norm over all heads at once instead of per head
}


# ------------------------------------------------------------------------------------------ MXFP4
def e2m1_value(code: torch.Tensor) -> torch.Tensor:
    """E2M1: bit 3 sign, bits 1-2 exponent (bias 1), bit 0 mantissa; exponent 0 is subnormal."""
    code = code.long()
    sign = 1.0 - 2.0 * (code >> 3).double()
    e = ((code >> 1) & 3).double()
    m = (code & 1).double()
    mag = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * torch.pow(2.0, e - 1.0))
    return sign * mag


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2] + uint8 E8M0 [out, in/32] -> float64 [out, in]."""
    p = packed.long()
    out, half = p.shape
    codes = torch.empty(out, half * 2, dtype=torch.long)
    codes[:, 0::2] = p & 0xF  # low nibble = even element
    codes[:, 1::2] = p >> 4
    mult = torch.pow(2.0, scale.double() - 127.0)
    return e2m1_value(codes) * mult.repeat_interleave(32, dim=1)


# ------------------------------------------------------------------------------------------ pieces
def rmsnorm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def situ(gate, up, beta=4.0, lin_beta=25.0):
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (lin_beta * torch.tanh(up / lin_beta))


def attn_res(values: list, w_norm, w_proj, eps, mut=frozenset()):
    """values: list of [D] candidates (sealed blocks..., prefix)."""
    V = torch.stack(values)  # [n, D]
    keys = V / torch.sqrt((V * V).mean(-1, keepdim=True) + eps)
    w = w_proj.reshape(-1) if "attnres_proj_only" in mut else w_norm * w_proj.reshape(-1)
    alpha = torch.softmax(keys @ w, dim=0)
    mixed = keys if "attnres_norm_values" in mut else V
    return alpha @ mixed


def rope(x, pos, theta=10000.0):
    """Rotate-half RoPE of the last dim of x [..., R] at integer position pos."""
    R = x.shape[-1]
    inv = theta ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    ang = pos * inv
    cos, sin = torch.cos(ang).repeat(2), torch.sin(ang).repeat(2)
    x1, x2 = x[..., : R // 2], x[..., R // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Reference:
    """Float64 K3 decode, one independent sequence per row id."""

    def __init__(self, config: dict, tensors: dict, mutations=(), cache: dict | None = None):
        bad = set(mutations) - MUTATIONS
        assert not bad, bad
        self.mut = frozenset(mutations)
        t = config["text_config"]
        la = t["linear_attn_config"]
        self.t = t
        self.L = t["num_hidden_layers"]
        self.mla_layers = {i - 1 for i in la["full_attn_layers"]}  # the file's lists are 1-based
        self.eps = float(t["rms_norm_eps"])
        self.block = t["attn_res_block_size"]
        self.H_kda, self.D_kda = la["num_heads"], la["head_dim"]
        self.conv_w = la["short_conv_kernel_size"]
        self.lower = float(la["gate_lower_bound"])
        self.H_mla = t["num_attention_heads"]
        self.nope, self.rope_d, self.vdim = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
        self.kv_lora = t["kv_lora_rank"]
        self.top_k = t["num_experts_per_token"]
        self.rsf = float(t["routed_scaling_factor"])
        self.beta, self.lin_beta = float(t["activation_situ_beta"]), float(t["activation_situ_linear_beta"])
        self.first_dense = t["first_k_dense_replace"]
        self.raw = tensors
        self._cache: dict = {} if cache is None else cache  # float64 weights; shareable, mutations never edit them
        self.seqs: dict = {}

    # weights as float64, cached
    def w(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            self._cache[name] = self.raw[name].double()
        return self._cache[name]

    def expert(self, i: int, e: int, which: str) -> torch.Tensor:
        key = (i, e, which)
        if key not in self._cache:
            b = f"{P}layers.{i}.block_sparse_moe.experts.{e}.{which}."
            self._cache[key] = dequant_mxfp4(self.raw[b + "weight_packed"], self.raw[b + "weight_scale"])
        return self._cache[key]

    def _new_seq(self):
        st = []
        for i in range(self.L):
            if i in self.mla_layers:
                st.append({"c": [], "kpe": []})
            else:
                S = torch.zeros(self.H_kda, self.D_kda, self.D_kda, dtype=torch.float64)
                st.append({"q": [], "k": [], "v": [], "S": S})
        return st

    # ------------------------------------------------------------------ KDA (§1.12, §2)
    def _conv_full(self, hist: list, weight: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv over the whole history, zero left padding; returns the last output."""
        X = torch.stack(hist)  # [T, C]
        W = self.conv_w
        Xp = torch.cat([torch.zeros(W - 1, X.shape[1], dtype=X.dtype), X])  # zero left padding
        T = X.shape[0]
        w = weight[:, 0, :]  # [C, W]; w[:, j] multiplies x_{t-W+1+j}
        y = sum(w[:, j] * Xp[T - 1 + j] for j in range(W))
        return torch.nn.functional.silu(y)

    def kda(self, i: int, x: torch.Tensor, st: dict) -> torch.Tensor:
        p = f"{P}layers.{i}.self_attn."
        H, D = self.H_kda, self.D_kda
        st["q"].append(self.w(p + "q_proj.weight") @ x)
        st["k"].append(self.w(p + "k_proj.weight") @ x)
        st["v"].append(self.w(p + "v_proj.weight") @ x)
        q = self._conv_full(st["q"], self.w(p + "q_conv1d.weight")).view(H, D)
        k = self._conv_full(st["k"], self.w(p + "k_conv1d.weight")).view(H, D)
        v = self._conv_full(st["v"], self.w(p + "v_conv1d.weight")).view(H, D)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * D ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        f = (self.w(p + "f_b_proj.weight") @ (self.w(p + "f_a_proj.weight") @ x)).view(H, D)
        a_log_full = self.w(p + "A_log").reshape(-1)
        A = a_log_full[-H:] if "a_log_padding" in self.mut else a_log_full[:H]
        dt = self.w(p + "dt_bias").view(H, D)
        if "softplus_gate" in self.mut:
            g = -torch.exp(A)[:, None] * torch.nn.functional.softplus(f + dt)
        else:
            g = self.lower * torch.sigmoid(torch.exp(A)[:, None] * (f + dt))
        beta = torch.sigmoid(self.w(p + "b_proj.weight") @ x)  # [H]
        if "beta_head0" in self.mut:
            beta = beta[:1].expand(H)
        S = st["S"] * torch.exp(g)[:, :, None]  # decay the key rows first
        u = v - torch.einsum("hkv,hk->hv", S, k)
        S = S + beta[:, None, None] * k[:, :, None] * u[:, None, :]
        st["S"] = S
        o = torch.einsum("hkv,hk->hv", S, q)  # [H, D]
        gg = (self.w(p + "g_proj.weight") @ x).view(H, D)
        wn = self.w(p + "o_norm.weight")
        if "o_norm_over_heads" in self.mut:
            on = (o / torch.sqrt((o * o).mean() + self.eps)) * wn
        else:
            on = rmsnorm(o, wn, self.eps)
        if "kda_gate_silu" in self.mut:
            gate = torch.nn.functional.silu(gg)
        elif "kda_gate_normed" in self.mut:
            gate = torch.sigmoid(gg / torch.sqrt((gg * gg).mean(-1, keepdim=True) + self.eps))
        else:
            gate = torch.sigmoid(gg)
        return self.w(p + "o_proj.weight") @ (on * gate).reshape(-1)

    # ------------------------------------------------------------------ MLA (§1.13, non-absorbed)
    def mla(self, i: int, x: torch.Tensor, st: dict) -> torch.Tensor:
        p = f"{P}layers.{i}.self_attn."
        H, n, r, vd, C = self.H_mla, self.nope, self.rope_d, self.vdim, self.kv_lora
        eps = 1e-5 if "mla_eps_1e5" in self.mut else 1e-6
        cq = rmsnorm(self.w(p + "q_a_proj.weight") @ x, self.w(p + "q_a_layernorm.weight"), eps)
        q = (self.w(p + "q_b_proj.weight") @ cq).view(H, n + r)
        kv = self.w(p + "kv_a_proj_with_mqa.weight") @ x
        st["c"].append(rmsnorm(kv[:C], self.w(p + "kv_a_layernorm.weight"), eps))
        st["kpe"].append(kv[C:])
        T = len(st["c"])
        Cm = torch.stack(st["c"])  # [T, C]
        Kpe = torch.stack(st["kpe"])  # [T, r]
        q_pe = q[:, n:]
        if "rope" in self.mut:
            q_pe = rope(q_pe, T - 1)
            Kpe = torch.stack([rope(Kpe[t], t) for t in range(T)])
        Wkvb = self.w(p + "kv_b_proj.weight").view(H, n + vd, C)
        W_UK, W_UV = Wkvb[:, :n], Wkvb[:, n:]
        k_nope = torch.einsum("hnc,tc->htn", W_UK, Cm)  # [H, T, n]
        K = torch.cat([k_nope, Kpe[None].expand(H, T, r)], -1)  # k_pe shared by all heads
        V = torch.einsum("hvc,tc->htv", W_UV, Cm)
        Q = torch.cat([q[:, :n], q_pe], -1)
        s = torch.einsum("hd,htd->ht", Q, K) * (n + r) ** -0.5
        pr = torch.softmax(s, -1)  # causal: all cached tokens + the current one
        o = torch.einsum("ht,htv->hv", pr, V).reshape(-1)
        o = o * torch.sigmoid(self.w(p + "g_proj.weight") @ x)
        return self.w(p + "o_proj.weight") @ o

    # ------------------------------------------------------------------ FFNs (§1.7-§1.9)
    def dense(self, i: int, y: torch.Tensor) -> torch.Tensor:
        p = f"{P}layers.{i}.mlp."
        h = situ(self.w(p + "gate_proj.weight") @ y, self.w(p + "up_proj.weight") @ y, self.beta, self.lin_beta)
        return self.w(p + "down_proj.weight") @ h

    def route(self, i: int, y: torch.Tensor):
        p = f"{P}layers.{i}.block_sparse_moe.gate."
        s = torch.sigmoid(self.w(p + "weight") @ y)
        biased = s + self.w(p + "e_score_correction_bias")
        sel = torch.topk(biased, self.top_k).indices
        wts = (biased if "route_bias_in_weights" in self.mut else s)[sel]
        if "no_renorm" not in self.mut:
            wts = wts / (wts.sum() + 1e-20)
        return sel, wts * self.rsf

    def moe(self, i: int, y: torch.Tensor, record=None) -> torch.Tensor:
        p = f"{P}layers.{i}.block_sparse_moe."
        sel, wts = self.route(i, y)
        if record is not None:
            record.append(sel)
        z = self.w(p + "routed_expert_down_proj.weight") @ y
        nw = self.w(p + "routed_expert_norm.weight")
        lat = torch.zeros_like(z)
        for e, we in zip(sel.tolist(), wts):
            zin = z * we if "early_routing_weights" in self.mut else z
            ye = self.expert(i, e, "w2") @ situ(self.expert(i, e, "w1") @ zin, self.expert(i, e, "w3") @ zin,
                                                self.beta, self.lin_beta)
            if "latent_norm_per_expert" in self.mut:
                ye = rmsnorm(ye, nw, self.eps)
            lat = lat + (ye if "early_routing_weights" in self.mut else we * ye)
        if not ({"no_latent_norm", "latent_norm_per_expert"} & self.mut):
            lat = rmsnorm(lat, nw, self.eps)  # after the combine, before up_proj
        r = self.w(p + "routed_expert_up_proj.weight") @ lat
        sx = r if "shared_reads_up_output" in self.mut else y  # shared expert reads the pre-down input
        sh = self.w(p + "shared_experts.down_proj.weight") @ situ(
            self.w(p + "shared_experts.gate_proj.weight") @ sx, self.w(p + "shared_experts.up_proj.weight") @ sx,
            self.beta, self.lin_beta)
        return r + sh

    # ------------------------------------------------------------------ one token (§2)
    def token(self, seq, tok: int, record: dict | None = None) -> torch.Tensor:
        if seq not in self.seqs:
            self.seqs[seq] = self._new_seq()
        st = self.seqs[seq]
        eps, m = self.eps, self.mut
        lw = lambda i, n: self.w(f"{P}layers.{i}.{n}")  # noqa: E731
        prefix = self.w(P + "embed_tokens.weight")[tok]
        blocks: list = []
        for i in range(self.L):
            write = i % self.block == 0
            if write and "seal_before_read" in m:
                blocks.append(prefix)  # sealed too early: the read sees P_old twice
                h = attn_res(blocks + [prefix], lw(i, "self_attention_res_norm.weight"),
                             lw(i, "self_attention_res_proj.weight"), eps, m)
                prefix = None
            else:
                h = prefix if not blocks else attn_res(
                    blocks + [prefix], lw(i, "self_attention_res_norm.weight"),
                    lw(i, "self_attention_res_proj.weight"), eps, m)
                if write:  # seal *after* the pre-attention read
                    blocks.append(prefix)
                    prefix = None
            x = rmsnorm(h, lw(i, "input_layernorm.weight"), eps)
            a = self.mla(i, x, st[i]) if i in self.mla_layers else self.kda(i, x, st[i])
            prefix = a if prefix is None else prefix + a
            h2 = attn_res(blocks + [prefix], lw(i, "mlp_res_norm.weight"), lw(i, "mlp_res_proj.weight"), eps, m)
            y = rmsnorm(h2, lw(i, "post_attention_layernorm.weight"), eps)
            routes = None if record is None else record.setdefault(("route", i), [])
            f = self.dense(i, y) if i < self.first_dense else self.moe(i, y, routes)
            prefix = prefix + f
            if record is not None:
                record.setdefault(("hidden", i), []).append(prefix)
        normw = self.w(P + "norm.weight")
        if "output_skip_attnres" in m:
            h = prefix
        elif "output_norm_first" in m:
            cand = [rmsnorm(v, normw, eps) for v in blocks + [prefix]]
            h = attn_res(cand, self.w(P + "output_attn_res_norm.weight"),
                         self.w(P + "output_attn_res_proj.weight"), eps, m)
            return self.w(LM_HEAD) @ h
        else:
            h = attn_res(blocks + [prefix], self.w(P + "output_attn_res_norm.weight"),
                         self.w(P + "output_attn_res_proj.weight"), eps, m)
        return self.w(LM_HEAD) @ rmsnorm(h, normw, eps)

    def step(self, token_ids, record=None) -> torch.Tensor:
        """Row b of ``token_ids`` continues sequence b; returns float64 logits [B, vocab]."""
        return torch.stack([self.token(b, int(t), record) for b, t in enumerate(token_ids)])

    def run(self, plan) -> list:
        return [self.step(ids) for ids in plan]


# A decode plan with sequences of different lengths: batch 1 first, then batch 2 (row 0 one ahead).
PLAN = [[5], [17, 900], [3, 1023], [0, 42], [512, 7]]


def run_model(model, plan=PLAN, batch=None, max_context=16):
    state = model.new_state(batch or max(len(p) for p in plan), max_context)
    with torch.no_grad():
        out = [model.decode(torch.tensor(ids, dtype=torch.long), state) for ids in plan]
    return out, state


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def max_rel_err(xs, ys) -> float:
    return max(rel_err(a, b) for a, b in zip(xs, ys))



# ------------------------------------------------------------------------------------------ op-level
def kda_sequence_ref(q, k, v, f, beta_logits, g, wq, wk, wv, a_log, dt_bias, o_norm_w, lower=-5.0, eps=1e-5):
    """Chunk-free float64 KDA over a whole sequence of one row (§1.12 / §2 pseudo-code).

    q, k, v, f, g: [T, H*D] raw projections; beta_logits [T, H]; conv weights [H*D, 1, W];
    a_log [H]; dt_bias [H*D]; o_norm_w [D]. The short conv is recomputed over the full history with
    zero left padding. Returns (outputs [T, H*D], final state [H, K, V]).
    """
    d = lambda t: t.double()  # noqa: E731
    T = q.shape[0]
    H = a_log.shape[0]
    D = q.shape[1] // H
    W = wq.shape[-1]

    def conv(x, w):  # x [T, C] -> [T, C]
        xp = torch.cat([torch.zeros(W - 1, x.shape[1], dtype=torch.float64), d(x)])
        w = d(w)[:, 0, :]
        return torch.nn.functional.silu(torch.stack([(w * xp[t:t + W].T).sum(-1) for t in range(T)]))

    Q, K, Vv = conv(q, wq).view(T, H, D), conv(k, wk).view(T, H, D), conv(v, wv).view(T, H, D)
    S = torch.zeros(H, D, D, dtype=torch.float64)
    outs = []
    for t in range(T):
        qt = Q[t] / torch.sqrt((Q[t] ** 2).sum(-1, keepdim=True) + 1e-6) * D ** -0.5
        kt = K[t] / torch.sqrt((K[t] ** 2).sum(-1, keepdim=True) + 1e-6)
        gate = lower * torch.sigmoid(torch.exp(d(a_log))[:, None] * (d(f[t]).view(H, D) + d(dt_bias).view(H, D)))
        beta = torch.sigmoid(d(beta_logits[t]))
        S = S * torch.exp(gate)[:, :, None]
        u = Vv[t] - torch.einsum("hkv,hk->hv", S, kt)
        S = S + beta[:, None, None] * kt[:, :, None] * u[:, None, :]
        o = torch.einsum("hkv,hk->hv", S, qt)
        y = rmsnorm(o, d(o_norm_w), eps) * torch.sigmoid(d(g[t]).view(H, D))
        outs.append(y.reshape(-1))
    return torch.stack(outs), S


def mla_full_ref(q, C, Kpe, gate, kv_b, nope, vdim, scale=None):
    """Non-absorbed float64 attention of one query over T cached tokens (all visible).

    q [H*(nope+rope)]; C [T, kv_lora] (already kv_a-normed); Kpe [T, rope] raw (no rotation, shared
    by all heads); gate [H*vdim]; kv_b [H*(nope+vdim), kv_lora]. k = [W_UK c | k_pe], v = W_UV c.
    """
    d = lambda t: t.double()  # noqa: E731
    Cl = C.shape[1]
    R = Kpe.shape[1]
    H = kv_b.shape[0] // (nope + vdim)
    T = C.shape[0]
    Wkv = d(kv_b).view(H, nope + vdim, Cl)
    K = torch.cat([torch.einsum("hnc,tc->htn", Wkv[:, :nope], d(C)), d(Kpe)[None].expand(H, T, R)], -1)
    V = torch.einsum("hvc,tc->htv", Wkv[:, nope:], d(C))
    s = torch.einsum("hd,htd->ht", d(q).view(H, nope + R), K) * (scale or (nope + R) ** -0.5)
    o = torch.einsum("ht,htv->hv", torch.softmax(s, -1), V).reshape(-1)
    return o * torch.sigmoid(d(gate))


def rewrite_safetensors(ckpt: str, edit) -> None:
    """Apply ``edit(dict of tensors) -> dict of tensors`` to a single-file checkpoint, in place."""
    import os

    from safetensors.torch import load_file, save_file

    f = os.path.join(ckpt, "model.safetensors")
    tensors = edit(dict(load_file(f)))
    save_file(tensors, f, metadata={"format": "pt"})
