"""The K3 op dialect: functional ``torch.library`` custom ops (namespace ``k3``) for the decode step.

Passes match these ops, never aten decompositions (which change between PyTorch versions). Every op
has

* an **eager implementation** that is the reference semantics (it calls :mod:`k3compile.models.ops`,
  the same functions the eager model runs, or composes them for fused ops), so a graph after any
  pass runs on the CPU and is checked numerically against the eager model;
* a **fake (meta) implementation** giving output shapes/dtypes for any symbolic batch.

Ops never mutate their inputs; state updates stay explicit ``copy_`` / ``index_put_`` nodes in the
graph. ``OPS`` lists every op with a one-line description (used by docs and tests).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from k3compile.models import ops as ref
from k3compile.models.mxfp4 import dequantize

LIB = "k3"
OPS: dict[str, str] = {}


def _op(name: str, doc: str, schema_fn, fake=None):
    """Define ``k3::<name>`` from a typed Python function; its fake impl defaults to running the eager
    impl under FakeTensorMode (all our ops have static-shape, data-independent outputs)."""
    op = torch.library.custom_op(f"{LIB}::{name}", mutates_args=())(schema_fn)
    if fake is not None:
        op.register_fake(fake)
    else:
        op.register_fake(schema_fn)
    OPS[name] = doc
    return op


def rms_norm_impl(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return ref.rms_norm(x, weight, eps)


rms_norm = _op("rms_norm", "KimiRMSNorm over the last dim (fp32 inside)", rms_norm_impl)


def add_rms_norm_impl(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    s = x + residual
    return ref.rms_norm(s, weight, eps), s


add_rms_norm = _op("add_rms_norm", "residual add then RMSNorm; returns (normed, sum)", add_rms_norm_impl)


def attn_res_impl(prefix: Tensor, blocks: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float) -> Tensor:
    return ref.attn_res(prefix, blocks, norm_weight, proj_weight, eps)


attn_res = _op("attn_res", "attention-residual read over [sealed blocks, prefix]", attn_res_impl)


def attn_res_rms_norm_impl(prefix: Tensor, blocks: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float,
                           out_norm_weight: Tensor, out_eps: float) -> Tensor:
    return ref.rms_norm(ref.attn_res(prefix, blocks, norm_weight, proj_weight, eps), out_norm_weight, out_eps)


attn_res_rms_norm = _op("attn_res_rms_norm", "attention-residual read followed by the RMSNorm that consumes it",
                        attn_res_rms_norm_impl)


def linear_impl(x: Tensor, weight: Tensor) -> Tensor:
    return torch.nn.functional.linear(x, weight)


linear = _op("linear", "x @ W.T with a bf16/fp weight", linear_impl)


def linear_mxfp4_impl(x: Tensor, weight_packed: Tensor, weight_scale: Tensor) -> Tensor:
    return torch.nn.functional.linear(x, dequantize(weight_packed, weight_scale, x.dtype))


linear_mxfp4 = _op("linear_mxfp4", "x @ W.T with W in MXFP4 (packed codes + E8M0 scales)", linear_mxfp4_impl)


def tp_all_reduce_impl(x: Tensor, group_name: str, tp_size: int) -> Tensor:
    if tp_size == 1:
        return x.clone()
    t = torch.ops._c10d_functional.all_reduce(x, "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(t)


tp_all_reduce = _op("tp_all_reduce", "sum over the tensor-parallel group (blocking)", tp_all_reduce_impl,
                    fake=lambda x, group_name, tp_size: torch.empty_like(x))


def moe_route_impl(x: Tensor, router_weight: Tensor, score_bias: Tensor, top_k: int, renormalize: bool,
                   scaling_factor: float) -> tuple[Tensor, Tensor]:
    return ref.moe_route(x, router_weight, score_bias, top_k, renormalize, scaling_factor)


moe_route = _op("moe_route", "fp32 sigmoid router, biased top-k selection, renormalised weights", moe_route_impl)


def latent_moe_experts_impl(z: Tensor, weights: Tensor, ids: Tensor, w1_packed: Tensor, w1_scale: Tensor,
                            w3_packed: Tensor, w3_scale: Tensor, w2_packed: Tensor, w2_scale: Tensor,
                            beta: float, linear_beta: float) -> Tensor:
    return ref.latent_moe_experts(z, weights, ids, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                                  beta, linear_beta)


latent_moe_experts = _op("latent_moe_experts",
                         "routed MXFP4 experts in the latent space, late routing weights, fp32 combine",
                         latent_moe_experts_impl)


def situ_glu_impl(gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor:
    return ref.situ_glu(gate, up, beta, linear_beta)


situ_glu = _op("situ_glu", "SiTU-GLU activation (fp32 inside)", situ_glu_impl)


def kda_decode_impl(q: Tensor, k: Tensor, v: Tensor, f: Tensor, beta_logits: Tensor, g: Tensor, conv_q: Tensor,
                    conv_k: Tensor, conv_v: Tensor, recurrent_state: Tensor, q_conv_weight: Tensor,
                    k_conv_weight: Tensor, v_conv_weight: Tensor, a_log: Tensor, dt_bias: Tensor,
                    o_norm_weight: Tensor, head_dim: int, lower_bound: float,
                    eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return ref.kda_decode(q, k, v, f, beta_logits, g, conv_q, conv_k, conv_v, recurrent_state, q_conv_weight,
                          k_conv_weight, v_conv_weight, a_log, dt_bias, o_norm_weight, head_dim, lower_bound, eps)


kda_decode = _op("kda_decode", "KDA step: short conv, L2 norms, gate, beta, delta rule, gated norm; "
                 "returns (y, new conv q/k/v state, new recurrent state)", kda_decode_impl)


def mla_decode_impl(q: Tensor, latent: Tensor, gate: Tensor, cache: Tensor, lengths: Tensor, kv_b_weight: Tensor,
                    nope_dim: int, v_dim: int, scale: float) -> Tensor:
    return ref.mla_decode(q, latent, gate, cache, lengths, kv_b_weight, nope_dim, v_dim, scale)


mla_decode = _op("mla_decode", "absorbed NoPE MLA over the latent cache + current token, output-gated",
                 mla_decode_impl)


def lm_head_impl(h: Tensor, norm_weight: Tensor, weight: Tensor, eps: float) -> Tensor:
    return ref.lm_head(h, norm_weight, weight, eps)


lm_head = _op("lm_head", "final RMSNorm + vocab projection, fp32 logits", lm_head_impl)


def k3_ops() -> dict[str, torch._ops.OpOverload]:
    """name -> OpOverload for every dialect op."""
    return {name: getattr(torch.ops.k3, name).default for name in OPS}


def is_k3(node, name: Optional[str] = None) -> bool:
    """Whether an FX node calls a dialect op (optionally a given one)."""
    if node.op != "call_function":
        return False
    t = node.target
    ns = getattr(t, "namespace", None)
    if ns != LIB:
        return False
    return name is None or t.__name__.split(".")[0] == name
