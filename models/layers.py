"""The K3 layers as small modules holding (a TP shard of) the released weights.

Submodule and parameter names follow the checkpoint (k3-architecture.md §7) so that
``layers.{i}.self_attn.q_proj.weight`` is ``language_model.model.layers.{i}.self_attn.q_proj.weight``.
Routed experts are stored stacked (``experts_w1_packed [E, I, L/2]`` ...) instead of one module per
expert. The math lives in :mod:`models.ops`; these modules only wire weights, state and collectives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .config import K3Config
from .mxfp4 import GROUP
from .tp import TPInfo, all_reduce


class Weight(nn.Module):
    """A holder with one ``weight`` tensor (no bias anywhere in K3)."""

    def __init__(self, *shape: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class KDAAttention(nn.Module):
    """Kimi Delta Attention, decode form (§1.12): projections, short conv state, delta rule, gated norm, o_proj."""

    def __init__(self, cfg: K3Config, tp: TPInfo, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        H = cfg.kda_num_heads // tp.size
        D = cfg.kda_head_dim
        hid = cfg.hidden_size
        self.local_heads = H
        for name in ("q_proj", "k_proj", "v_proj", "g_proj"):
            setattr(self, name, Weight(H * D, hid, dtype=dtype))
        self.f_a_proj = Weight(D, hid, dtype=dtype)  # replicated low-rank decay input
        self.f_b_proj = Weight(H * D, D, dtype=dtype)
        self.b_proj = Weight(H, hid, dtype=dtype)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            setattr(self, name, Weight(H * D, 1, cfg.short_conv_kernel_size, dtype=dtype))
        # The loader stores A_log[:heads] (then this rank's heads), never the zero padding (pitfall 2).
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(H * D, dtype=torch.float32), requires_grad=False)
        self.o_norm = Weight(D, dtype=dtype)  # shared by all heads
        self.o_proj = Weight(hid, H * D, dtype=dtype)

    def forward(self, x: torch.Tensor, st: "KDAState", B: int) -> torch.Tensor:
        cfg = self.cfg
        f = self.f_b_proj(self.f_a_proj(x))
        y, cq, ck, cv, s = ops.kda_decode(
            self.q_proj(x), self.k_proj(x), self.v_proj(x), f, self.b_proj(x), self.g_proj(x),
            st.conv_q[:B], st.conv_k[:B], st.conv_v[:B], st.recurrent[:B],
            self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight, self.A_log, self.dt_bias,
            self.o_norm.weight, cfg.kda_head_dim, cfg.gate_lower_bound, cfg.rms_norm_eps)
        # State writes are explicit, in place, at the end of the layer's attention.
        st.conv_q[:B].copy_(cq)
        st.conv_k[:B].copy_(ck)
        st.conv_v[:B].copy_(cv)
        st.recurrent[:B].copy_(s)
        return all_reduce(self.o_proj(y), self.tp)


class MLAAttention(nn.Module):
    """Gated NoPE MLA over a latent cache, absorbed decode form (§1.13)."""

    def __init__(self, cfg: K3Config, tp: TPInfo, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        H = cfg.num_attention_heads // tp.size
        hid = cfg.hidden_size
        self.local_heads = H
        self.q_a_proj = Weight(cfg.q_lora_rank, hid, dtype=dtype)
        self.q_a_layernorm = Weight(cfg.q_lora_rank, dtype=dtype)
        self.q_b_proj = Weight(H * cfg.qk_head_dim, cfg.q_lora_rank, dtype=dtype)
        self.kv_a_proj_with_mqa = Weight(cfg.kv_lora_rank + cfg.qk_rope_head_dim, hid, dtype=dtype)
        self.kv_a_layernorm = Weight(cfg.kv_lora_rank, dtype=dtype)
        self.kv_b_proj = Weight(H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, dtype=dtype)
        self.g_proj = Weight(H * cfg.v_head_dim, hid, dtype=dtype)
        self.o_proj = Weight(hid, H * cfg.v_head_dim, dtype=dtype)

    # HF builds these norms without passing eps, so they keep KimiRMSNorm's default (pitfall 5).
    LATENT_NORM_EPS = 1e-6

    def forward(self, x: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B = x.shape[0]
        q = self.q_b_proj(ops.rms_norm(self.q_a_proj(x), self.q_a_layernorm.weight, self.LATENT_NORM_EPS))
        kv = self.kv_a_proj_with_mqa(x)
        c = ops.rms_norm(kv[:, :cfg.kv_lora_rank], self.kv_a_layernorm.weight, self.LATENT_NORM_EPS)
        latent = torch.cat([c, kv[:, cfg.kv_lora_rank:]], dim=-1)  # k_pe stays unrotated (pitfall 4)
        o = ops.mla_decode(q, latent, self.g_proj(x), cache[:B], positions, self.kv_b_proj.weight,
                           cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.mla_scale)
        cache.index_put_((torch.arange(B, device=x.device), positions), latent.to(cache.dtype))
        return all_reduce(self.o_proj(o), self.tp)


class DenseMLP(nn.Module):
    """Layer 0's SiTU-GLU MLP (column/row parallel under TP)."""

    def __init__(self, cfg: K3Config, tp: TPInfo, dtype: torch.dtype, width: int):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        w = width // tp.size
        self.gate_proj = Weight(w, cfg.hidden_size, dtype=dtype)
        self.up_proj = Weight(w, cfg.hidden_size, dtype=dtype)
        self.down_proj = Weight(cfg.hidden_size, w, dtype=dtype)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the output (no reduction)."""
        cfg = self.cfg
        h = ops.situ_glu(self.gate_proj(x), self.up_proj(x), cfg.activation_situ_beta,
                         cfg.activation_situ_linear_beta)
        return self.down_proj(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.partial(x), self.tp)


class MoEGate(nn.Module):
    """Router weights: ``weight`` [E, hidden] and the selection-only fp32 bias."""

    def __init__(self, cfg: K3Config, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32),
                                                    requires_grad=False)


class LatentMoE(nn.Module):
    """Stable LatentMoE (§1.9): fp32 sigmoid router on the 7168-wide input, MXFP4 experts in the latent
    space with late routing weights, latent RMSNorm after the combine, up-projection, plus the shared
    MLP on the pre-down input."""

    def __init__(self, cfg: K3Config, tp: TPInfo, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        E, L, hid = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.hidden_size
        I = cfg.moe_intermediate_size // tp.size
        self.gate = MoEGate(cfg, dtype)
        self.routed_expert_down_proj = Weight(L, hid, dtype=dtype)
        self.routed_expert_norm = Weight(L, dtype=dtype)
        self.routed_expert_up_proj = Weight(hid, L, dtype=dtype)
        self.shared_experts = DenseMLP(cfg, tp, dtype, cfg.shared_intermediate_size)
        u8 = torch.uint8
        self.register_buffer("experts_w1_packed", torch.zeros(E, I, L // 2, dtype=u8))
        self.register_buffer("experts_w1_scale", torch.zeros(E, I, L // GROUP, dtype=u8))
        self.register_buffer("experts_w3_packed", torch.zeros(E, I, L // 2, dtype=u8))
        self.register_buffer("experts_w3_scale", torch.zeros(E, I, L // GROUP, dtype=u8))
        self.register_buffer("experts_w2_packed", torch.zeros(E, L, I // 2, dtype=u8))
        self.register_buffer("experts_w2_scale", torch.zeros(E, L, I // GROUP, dtype=u8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        weights, ids = ops.moe_route(x, self.gate.weight, self.gate.e_score_correction_bias,
                                     cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor)
        z = self.routed_expert_down_proj(x)
        y = ops.latent_moe_experts(z, weights, ids, self.experts_w1_packed, self.experts_w1_scale,
                                   self.experts_w3_packed, self.experts_w3_scale, self.experts_w2_packed,
                                   self.experts_w2_scale, cfg.activation_situ_beta,
                                   cfg.activation_situ_linear_beta)
        # Reduce the latent partial *before* its norm (pitfall 9).
        y = all_reduce(y, self.tp)
        if cfg.latent_moe_use_norm:
            y = ops.rms_norm(y, self.routed_expert_norm.weight, cfg.rms_norm_eps)
        r = self.routed_expert_up_proj(y)
        return r + self.shared_experts(x)  # the shared MLP reads the pre-down input (pitfall 10)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, tp: TPInfo, index: int, dtype: torch.dtype):
        super().__init__()
        self.index = index
        self.is_mla = cfg.is_mla_layer(index)
        self.is_moe = cfg.is_moe_layer(index)
        self.is_block_write = cfg.is_block_write_layer(index)
        hid = cfg.hidden_size
        for name in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            setattr(self, name, Weight(hid, dtype=dtype))
        self.self_attention_res_proj = Weight(1, hid, dtype=dtype)
        self.mlp_res_proj = Weight(1, hid, dtype=dtype)
        self.self_attn = MLAAttention(cfg, tp, dtype) if self.is_mla else KDAAttention(cfg, tp, dtype)
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(cfg, tp, dtype)
        else:
            self.mlp = DenseMLP(cfg, tp, dtype, cfg.intermediate_size)


class KDAState:
    """Per-layer KDA decode state: the last W-1 pre-conv inputs of q, k, v and the fp32 recurrent state."""

    def __init__(self, batch: int, channels: int, heads: int, head_dim: int, conv_width: int,
                 dtype: torch.dtype, device):
        self.conv_q = torch.zeros(batch, channels, conv_width - 1, dtype=dtype, device=device)
        self.conv_k = torch.zeros_like(self.conv_q)
        self.conv_v = torch.zeros_like(self.conv_q)
        self.recurrent = torch.zeros(batch, heads, head_dim, head_dim, dtype=torch.float32, device=device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.conv_q, self.conv_k, self.conv_v, self.recurrent]
