"""The K3 decode step's semantic operations as plain, functional PyTorch.

Each function here is one operation of k3-architecture.md §1-2, written for reading: no in-place
update of an argument (new state is returned, and the caller writes it back where everyone can see
it), static shapes only (no data-dependent Python), explicit dtypes. The layers in ``layers.py``
are thin modules that hold weights and call these.

Precision follows the HF reference: norms, AttnRes, the router, SiTU, KDA and attention run in
fp32 inside and return the activation dtype (bf16 for the real model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mxfp4 import checkpoint_codes, dequantize, dequantize_static


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KimiRMSNorm: normalize in fp32, cast back to the input dtype, then multiply by the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def attn_res(prefix: torch.Tensor, blocks: torch.Tensor, norm_weight: torch.Tensor, proj_weight: torch.Tensor,
             eps: float) -> torch.Tensor:
    """Attention residual read (§1.10): softmax over [sealed blocks..., prefix] of key-only RMS-normed scores.

    prefix [B, D]; blocks [B, nb, D]. The norm weight and the [1, D] projection fold into one vector;
    keys are normalized, the values mixed are raw (pitfall 6). No temperature.
    """
    values = torch.cat([blocks, prefix[:, None, :]], dim=1).float()  # [B, nb+1, D]
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
    w = norm_weight.float() * proj_weight.float().reshape(-1)
    alpha = torch.softmax((keys * w).sum(-1), dim=-1)  # [B, nb+1]
    return (alpha[..., None] * values).sum(1).to(prefix.dtype)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-GLU (§1.7): ``beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta)`` in fp32."""
    g = gate.float()
    u = up.float()
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return (act * (linear_beta * torch.tanh(u / linear_beta))).to(gate.dtype)


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` with W stored as MXFP4 (dequantized to the activation dtype first, as HF does)."""
    return F.linear(x, dequantize(packed, scale, x.dtype))


def moe_route(x: torch.Tensor, router_weight: torch.Tensor, score_bias: torch.Tensor, top_k: int,
              renormalize: bool, scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router (§1.8) on the full-width hidden, in fp32.

    The bias picks the experts only; the weights are the unbiased scores of the picked experts,
    renormalized with +1e-20 (pitfall 8). Returns (weights fp32 [B, k], expert ids int64 [B, k]).
    """
    scores = torch.sigmoid(F.linear(x.float(), router_weight.float()))
    ids = torch.topk(scores + score_bias.float(), top_k, dim=-1, sorted=True).indices
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids


# Below this many expert weights (all experts, w1+w2+w3), the routed experts are evaluated densely: every
# expert on every token, unselected ones weighted by exactly 0. It is a function of the weights' static
# shapes only (never of the batch), and much faster on a CPU for small models like k3-mini. The dense path
# multiplies in fp32 (the bf16 values widened exactly, fp32 sums, rounded to the activation dtype where the
# model stores gate, up and each expert's output): what a bf16 GEMM with fp32 accumulation computes, 6 x faster
# on a CPU without bf16 instructions, whose bf16 bmm is a scalar loop.
DENSE_EXPERTS_MAX_WEIGHTS = 1 << 24


def latent_moe_experts(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                       w1_packed: torch.Tensor, w1_scale: torch.Tensor,
                       w3_packed: torch.Tensor, w3_scale: torch.Tensor,
                       w2_packed: torch.Tensor, w2_scale: torch.Tensor,
                       beta: float, linear_beta: float) -> torch.Tensor:
    """Routed MXFP4 experts in the latent space (§1.9 steps 3-4).

    z [B, L]; expert tensors stacked [E, ...] (w1 = gate, w3 = up, w2 = down). Each selected expert's
    **output** is multiplied by its routing weight (late routing weights, pitfall 8) and summed in
    fp32, then cast to the activation dtype. Under TP the experts hold an intermediate-dim shard and
    the result is a partial sum.
    """
    dt = z.dtype
    E, I, half_l = w1_packed.shape
    if 3 * E * I * half_l * 2 <= DENSE_EXPERTS_MAX_WEIGHTS:
        f32 = torch.float32  # the dequantised weights are exact in fp32 as in bf16 (mxfp4.dequantize)
        w1 = dequantize_static(w1_packed, w1_scale, f32)  # [E, I, L]
        w3 = dequantize_static(w3_packed, w3_scale, f32)
        w2 = dequantize_static(w2_packed, w2_scale, f32)  # [E, L, I]
        zs = z.float()[None].expand(E, -1, -1)  # [E, B, L]; bmm keeps batch 1 unspecialised (matmul would not)
        gate = torch.bmm(zs, w1.transpose(1, 2)).to(dt)  # [E, B, I]
        up = torch.bmm(zs, w3.transpose(1, 2)).to(dt)
        y = torch.bmm(situ_glu(gate, up, beta, linear_beta).float(), w2.transpose(1, 2)).to(dt)  # [E, B, L]
        dense_w = torch.zeros(z.shape[0], E, dtype=torch.float32, device=z.device)
        dense_w = dense_w.scatter(1, ids, weights.float())  # [B, E]: 0 for experts a token did not pick
        return (y.float() * dense_w.t()[..., None]).sum(0).to(dt)
    # (checkpoint_codes: the selected experts' codes as the checkpoint lays them out, should a kernel runtime
    # have rewritten the stacked tensor in place into its kernels' layout)
    w1 = dequantize(checkpoint_codes(w1_packed, ids), w1_scale[ids], dt)  # [B, k, I, L]
    w3 = dequantize(checkpoint_codes(w3_packed, ids), w3_scale[ids], dt)
    w2 = dequantize(checkpoint_codes(w2_packed, ids), w2_scale[ids], dt)  # [B, k, L, I]
    zb = z[:, None, None, :]  # [B, 1, 1, L]
    gate = torch.matmul(zb, w1.transpose(-1, -2))[..., 0, :]  # [B, k, I]
    up = torch.matmul(zb, w3.transpose(-1, -2))[..., 0, :]
    h = situ_glu(gate, up, beta, linear_beta)
    y = torch.matmul(h[..., None, :], w2.transpose(-1, -2))[..., 0, :]  # [B, k, L]
    return (y.float() * weights[..., None].float()).sum(1).to(dt)


def short_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU for one step. x [B, C]; conv_state [B, C, W-1] = the last W-1 inputs;
    weight [C, 1, W] (no bias). Returns (y fp32 [B, C], new conv_state)."""
    window = torch.cat([conv_state, x[..., None]], dim=-1)  # [B, C, W]
    y = F.silu((window.float() * weight.float()[:, 0, :]).sum(-1))
    return y, window[..., 1:]


def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor,
               g: torch.Tensor, conv_q: torch.Tensor, conv_k: torch.Tensor, conv_v: torch.Tensor,
               recurrent_state: torch.Tensor, q_conv_weight: torch.Tensor, k_conv_weight: torch.Tensor,
               v_conv_weight: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
               o_norm_weight: torch.Tensor, head_dim: int, lower_bound: float, eps: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One KDA decode step for H local heads (§1.12, §2), everything between the projections and o_proj.

    q, k, v, g [B, H*D] are the raw projections; f [B, H*D] the low-rank decay input (f_b(f_a(x)));
    beta_logits [B, H]; recurrent_state [B, H, K, V] fp32; a_log [H] (already ``A_log[:heads]``);
    dt_bias [H*D]. Returns (y [B, H*D] activation dtype, new conv_q, conv_k, conv_v, new state).
    """
    B = q.shape[0]
    H = a_log.shape[0]
    D = head_dim
    qc, conv_q = short_conv(q, conv_q, q_conv_weight)
    kc, conv_k = short_conv(k, conv_k, k_conv_weight)
    vc, conv_v = short_conv(v, conv_v, v_conv_weight)
    qh = qc.view(B, H, D)
    kh = kc.view(B, H, D)
    vh = vc.view(B, H, D)
    qh = qh * torch.rsqrt(qh.pow(2).sum(-1, keepdim=True) + 1e-6) * D ** -0.5
    kh = kh * torch.rsqrt(kh.pow(2).sum(-1, keepdim=True) + 1e-6)
    # K3 lower-bound gate (pitfall 3): -5 * sigmoid(exp(A_log) * (f + dt_bias)), not the softplus form.
    gate = lower_bound * torch.sigmoid(
        torch.exp(a_log.float())[None, :, None] * (f.float().view(B, H, D) + dt_bias.float().view(H, D)))
    beta = torch.sigmoid(beta_logits.float())  # [B, H], one scalar per head
    state = recurrent_state * torch.exp(gate)[..., None]  # decay first, rows = key index
    u = vh - torch.matmul(kh[..., None, :], state)[..., 0, :]  # v - S^T k
    # S + beta k u^T, one fused multiply-add per element, into the fresh decayed state itself unless autograd keeps
    # it for u's gradient (training): no [B, H, K, V] temporaries; on a CPU this update was half of k3-mini's step
    bk, ut = (beta[..., None] * kh)[..., :, None], u[..., None, :]
    state = torch.addcmul(state, bk, ut) if state.requires_grad else state.addcmul_(bk, ut)
    o = torch.matmul(qh[..., None, :], state)[..., 0, :]  # S^T q
    # Gated per-head RMSNorm: one [D] weight shared by all heads; sigmoid of the raw g projection.
    on = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * o_norm_weight.float()
    y = on * torch.sigmoid(g.float().view(B, H, D))
    return y.reshape(B, H * D).to(q.dtype), conv_q, conv_k, conv_v, state


def mla_decode(q: torch.Tensor, latent: torch.Tensor, gate: torch.Tensor, cache: torch.Tensor,
               lengths: torch.Tensor, kv_b_weight: torch.Tensor, nope_dim: int, v_dim: int,
               scale: float) -> torch.Tensor:
    """Absorbed NoPE MLA decode (§1.13, §2) for H local heads over a latent cache.

    q [B, H*(nope+rope)] after q_b; latent [B, C+R] = [kv_a_layernorm(c_kv) | k_pe] of the current
    token; gate [B, H*v] the raw output-gate projection; cache [B, Lmax, C+R] holds earlier tokens at
    positions < lengths[b]. The current token attends to positions 0..lengths[b] (itself included).
    No rotation anywhere (pitfall 4); scale = (nope+rope)^-0.5. Returns [B, H*v] gated, before o_proj.
    """
    B = q.shape[0]
    C = kv_b_weight.shape[1]
    H = kv_b_weight.shape[0] // (nope_dim + v_dim)
    R = latent.shape[-1] - C
    qh = q.float().view(B, H, nope_dim + R)
    q_nope, q_pe = qh[..., :nope_dim], qh[..., nope_dim:]
    wkv = kv_b_weight.float().view(H, nope_dim + v_dim, C)
    w_uk, w_uv = wkv[:, :nope_dim], wkv[:, nope_dim:]
    # bmm per head: a [B, H, 1, n] x [H, n, C] matmul would copy w_uk B times (and guards a traced batch)
    ql = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # absorbed query in latent space [B, H, C]
    Lmax = cache.shape[1]
    pos = torch.arange(Lmax, device=cache.device)
    # Keys/values: the cached rows, with the current token placed at its own position.
    is_cur = pos[None, :] == lengths[:, None]  # [B, Lmax]
    kv = torch.where(is_cur[..., None], latent[:, None, :].to(cache.dtype), cache).float()
    c, k_pe = kv[..., :C], kv[..., C:]
    s = (torch.bmm(ql, c.transpose(1, 2)) + torch.bmm(q_pe, k_pe.transpose(1, 2))) * scale  # [B, H, Lmax]
    valid = pos[None, :] <= lengths[:, None]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    ol = torch.bmm(p, c)  # [B, H, C]
    o = torch.bmm(ol.transpose(0, 1), w_uv.transpose(1, 2))  # [H, B, v]
    y = o * torch.sigmoid(gate.float().view(B, H, v_dim).transpose(0, 1))
    return torch.cat(y.to(q.dtype).unbind(0), dim=-1)  # [B, H*v], heads in order (no reshape of a transpose)


def lm_head(h: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Final RMSNorm then the (vocab-shard of the) output projection; fp32 logits for sampling."""
    return F.linear(rms_norm(h, norm_weight, eps), weight).float()
