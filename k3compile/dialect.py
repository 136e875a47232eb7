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
import torch.fx
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


# ------------------------------------------------------------------------------------------------------
# Fused and distributed ops produced by the passes (issue: fusion and communication overlap). Each eager
# implementation composes the reference ops above in exactly the eager model's order and dtypes, so a
# graph is bit-identical to eager on the CPU after every pass; kernels are checked per template on a GPU.
# ``group``/``tp`` name the tensor-parallel group; with tp == 1 every reduction/gather is the identity.


def _all_reduce(x: Tensor, group: str, tp: int) -> Tensor:
    return tp_all_reduce_impl(x, group, tp)


def _all_gather_last(x: Tensor, group: str, tp: int) -> Tensor:
    if tp == 1:
        return x.clone()
    g = torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), tp, group))
    return torch.cat(torch.chunk(g, tp, dim=0), dim=-1)


def _gemm(x: Tensor, w: Tensor, fp32: bool) -> Tensor:
    return torch.nn.functional.linear(x.float(), w.float()) if fp32 else torch.nn.functional.linear(x, w)


def tp_all_gather_impl(x: Tensor, group: str, tp: int) -> Tensor:
    return _all_gather_last(x, group, tp)


tp_all_gather = _op("tp_all_gather", "concatenate the ranks' shards along the last dim", tp_all_gather_impl,
                    fake=lambda x, group, tp: x.new_empty((*x.shape[:-1], x.shape[-1] * tp)))


def _sharded_gemm(x: Tensor, w: Tensor, fp32: bool, group: str, tp: int, rank: int) -> Tensor:
    """Rows [rank*N/tp, (rank+1)*N/tp) of x @ W.T, then gathered from every rank.

    The kernel reads only its rows. The CPU reference computes the product over all rows and keeps its
    own: a row's dot products must not depend on how many other rows one GEMM call computes (BLAS
    picks different code paths for tiny N), and this keeps the pass bit-exact against eager."""
    n = w.shape[0] // tp
    local = _gemm(x, w, fp32)[:, rank * n:(rank + 1) * n]
    return _all_gather_last(local, group, tp)


def linear_gather_impl(x: Tensor, weight: Tensor, fp32: bool, group: str, tp: int, rank: int) -> Tensor:
    return _sharded_gemm(x, weight, fp32, group, tp, rank)


def _linear_gather_fake(x, weight, fp32, group, tp, rank):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32 if fp32 else x.dtype)


linear_gather = _op("linear_gather", "row-sharded GEMM (this rank's rows) + all-gather of the shards",
                    linear_gather_impl, fake=_linear_gather_fake)


def front_gemm_impl(x: Tensor, weights: list[Tensor], fp32: list[bool], gather: list[bool], group: str, tp: int,
                    rank: int) -> list[Tensor]:
    out = []
    for w, f, g in zip(weights, fp32, gather):
        out.append(_sharded_gemm(x, w, f, group, tp, rank) if g and tp > 1 else _gemm(x, w, f))
    return out


def _front_gemm_fake(x, weights, fp32, gather, group, tp, rank):
    return [x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32 if f else x.dtype)
            for w, f in zip(weights, fp32)]


front_gemm = _op("front_gemm", "several GEMMs of one input in one pass over it (fp32 and gathered outputs "
                 "per entry)", front_gemm_impl, fake=_front_gemm_fake)


def _select(logits: Tensor, bias: Tensor, top_k: int, renormalize: bool, scaling_factor: float):
    # exactly ref.moe_route after its fp32 GEMM
    scores = torch.sigmoid(logits)
    ids = torch.topk(scores + bias.float(), top_k, dim=-1, sorted=True).indices
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids


def moe_select_impl(logits: Tensor, score_bias: Tensor, top_k: int, renormalize: bool,
                    scaling_factor: float) -> tuple[Tensor, Tensor]:
    return _select(logits, score_bias, top_k, renormalize, scaling_factor)


moe_select = _op("moe_select", "sigmoid + biased top-k + renormalised weights from fp32 router logits",
                 moe_select_impl)


def routed_experts_impl(z: Tensor, logits: Tensor, score_bias: Tensor, top_k: int, renormalize: bool,
                        scaling_factor: float, w1_packed: Tensor, w1_scale: Tensor, w3_packed: Tensor,
                        w3_scale: Tensor, w2_packed: Tensor, w2_scale: Tensor, beta: float,
                        linear_beta: float) -> Tensor:
    weights, ids = _select(logits, score_bias, top_k, renormalize, scaling_factor)
    return ref.latent_moe_experts(z, weights, ids, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                                  beta, linear_beta)


routed_experts = _op("routed_experts", "expert selection folded into the MXFP4 expert GEMMs (gate/up + SiTU, "
                     "down + weighted combine)", routed_experts_impl)


def situ_linear_impl(gate: Tensor, up: Tensor, weight: Tensor, beta: float, linear_beta: float) -> Tensor:
    return torch.nn.functional.linear(ref.situ_glu(gate, up, beta, linear_beta), weight)


situ_linear = _op("situ_linear", "SiTU-GLU folded into the down-projection's prologue", situ_linear_impl)


def rms_norm_linear_impl(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor) -> Tensor:
    return torch.nn.functional.linear(ref.rms_norm(x, norm_weight, eps), weight)


rms_norm_linear = _op("rms_norm_linear", "RMSNorm folded into the following GEMM's prologue", rms_norm_linear_impl)


def kda_decode_fb_impl(q: Tensor, k: Tensor, v: Tensor, f_a: Tensor, f_b_weight: Tensor, beta_logits: Tensor,
                       g: Tensor, conv_q: Tensor, conv_k: Tensor, conv_v: Tensor, recurrent_state: Tensor,
                       q_conv_weight: Tensor, k_conv_weight: Tensor, v_conv_weight: Tensor, a_log: Tensor,
                       dt_bias: Tensor, o_norm_weight: Tensor, head_dim: int, lower_bound: float,
                       eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    f = torch.nn.functional.linear(f_a, f_b_weight)
    return ref.kda_decode(q, k, v, f, beta_logits, g, conv_q, conv_k, conv_v, recurrent_state, q_conv_weight,
                          k_conv_weight, v_conv_weight, a_log, dt_bias, o_norm_weight, head_dim, lower_bound, eps)


kda_decode_fb = _op("kda_decode_fb", "KDA step with the low-rank decay up-projection (f_b) folded in",
                    kda_decode_fb_impl)


def mla_decode_latent_impl(q: Tensor, kv: Tensor, kv_norm_weight: Tensor, kv_eps: float, gate: Tensor,
                           cache: Tensor, lengths: Tensor, kv_b_weight: Tensor, nope_dim: int, v_dim: int,
                           scale: float) -> tuple[Tensor, Tensor]:
    c_dim = kv_b_weight.shape[1]
    latent = torch.cat([ref.rms_norm(kv[:, :c_dim], kv_norm_weight, kv_eps), kv[:, c_dim:]], dim=-1)
    return ref.mla_decode(q, latent, gate, cache, lengths, kv_b_weight, nope_dim, v_dim, scale), latent


mla_decode_latent = _op("mla_decode_latent", "MLA decode with the kv_a RMSNorm and latent-row assembly folded in; "
                        "returns (gated output, latent row for the cache)", mla_decode_latent_impl)


def _residual_norm(new_prefix: Tensor, blocks: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float,
                   out_norm_weight: Tensor, out_eps: float) -> Tensor:
    return ref.rms_norm(ref.attn_res(new_prefix, blocks, norm_weight, proj_weight, eps), out_norm_weight, out_eps)


def oproj_residual_norm_impl(y: Tensor, weight: Tensor, group: str, tp: int, prefix: Optional[Tensor],
                             blocks: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float,
                             out_norm_weight: Tensor, out_eps: float) -> tuple[Tensor, Tensor]:
    a = _all_reduce(torch.nn.functional.linear(y, weight), group, tp)
    new_prefix = a if prefix is None else prefix + a
    return _residual_norm(new_prefix, blocks, norm_weight, proj_weight, eps, out_norm_weight, out_eps), new_prefix


oproj_residual_norm = _op(
    "oproj_residual_norm", "attention o_proj GEMM -> all-reduce (epilogue writes the communication buffer) -> "
    "residual add -> pre-FFN AttnRes -> post-attention RMSNorm; returns (normed, new prefix)",
    oproj_residual_norm_impl)


def allreduce_rms_norm_impl(x: Tensor, group: str, tp: int, weight: Tensor, eps: float) -> Tensor:
    return ref.rms_norm(_all_reduce(x, group, tp), weight, eps)


allreduce_rms_norm = _op("allreduce_rms_norm", "all-reduce of a partial sum fused with the RMSNorm that follows",
                         allreduce_rms_norm_impl)


def _ffn_out(latent_partial: Optional[Tensor], latent_norm_weight: Optional[Tensor], latent_eps: float,
             up_weight: Optional[Tensor], partial: Tensor, group: str, tp: int, up_rank: int) -> Tensor:
    """[all-reduce the routed-expert latent partial, RMSNorm it, up-project it, and add] the all-reduced
    partial (shared expert / dense MLP), in the eager model's order. ``up_rank`` >= 0: the up-projection is
    row-sharded (shard_routing): this rank computes its 1/tp of the rows and the shards are all-gathered, the
    same values as the replicated product (each output is one rank's whole dot product)."""
    if latent_partial is None:
        return _all_reduce(partial, group, tp)
    latent = ref.rms_norm(_all_reduce(latent_partial, group, tp), latent_norm_weight, latent_eps)
    if up_rank >= 0:
        r = _sharded_gemm(latent, up_weight, False, group, tp, up_rank)
    else:
        r = torch.nn.functional.linear(latent, up_weight)
    return r + _all_reduce(partial, group, tp)


def ffn_tail_impl(latent_partial: Optional[Tensor], latent_norm_weight: Optional[Tensor], latent_eps: float,
                  up_weight: Optional[Tensor], partial: Tensor, group: str, tp: int, prefix: Tensor,
                  up_rank: int = -1) -> Tensor:
    return prefix + _ffn_out(latent_partial, latent_norm_weight, latent_eps, up_weight, partial, group, tp, up_rank)


ffn_tail = _op("ffn_tail", "FFN tail: [latent all-reduce + RMSNorm + up-projection (row-sharded + all-gathered "
               "with up_rank >= 0) +] all-reduce of the partial + residual add; returns the new prefix", ffn_tail_impl)


def ffn_tail_norm_impl(latent_partial: Optional[Tensor], latent_norm_weight: Optional[Tensor], latent_eps: float,
                       up_weight: Optional[Tensor], partial: Tensor, group: str, tp: int, prefix: Tensor,
                       blocks: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float, out_norm_weight: Tensor,
                       out_eps: float, up_rank: int = -1) -> tuple[Tensor, Tensor]:
    new_prefix = prefix + _ffn_out(latent_partial, latent_norm_weight, latent_eps, up_weight, partial, group, tp,
                                   up_rank)
    return _residual_norm(new_prefix, blocks, norm_weight, proj_weight, eps, out_norm_weight, out_eps), new_prefix


ffn_tail_norm = _op("ffn_tail_norm", "FFN tail fused with the next layer's pre-attention AttnRes + RMSNorm; "
                    "returns (normed, new prefix)", ffn_tail_norm_impl)


def prefetch_impl(weights: list[Tensor], nbytes: int) -> None:
    return None


prefetch = _op("prefetch", "prefetch static weights into L2 while a collective waits (no-op on the CPU)",
               prefetch_impl, fake=lambda weights, nbytes: None)

# Ops that communicate across the TP group (must stay on the main stream).
COLLECTIVE_OPS = frozenset({"tp_all_reduce", "tp_all_gather", "linear_gather", "oproj_residual_norm",
                            "allreduce_rms_norm", "ffn_tail", "ffn_tail_norm"})


def communicates(node) -> bool:
    """Whether a dialect node performs a collective (front_gemm does when one of its entries gathers)."""
    if not is_k3(node):
        return False
    name = node.target.__name__.split(".")[0]
    if name == "front_gemm":
        return any(node.args[3]) and node.args[5] > 1
    return name in COLLECTIVE_OPS and _tp_of(node) > 1


def _tp_of(node) -> int:
    schema = node.target._schema
    names = [a.name for a in schema.arguments]
    key = "tp_size" if "tp_size" in names else "tp"
    i = names.index(key)
    return node.args[i] if i < len(node.args) else node.kwargs[key]


def k3_ops() -> dict[str, torch._ops.OpOverload]:
    """name -> OpOverload for every dialect op."""
    return {name: getattr(torch.ops.k3, name).default for name in OPS}


def op_name(node) -> str:
    """The dialect op name of a node ("" if it is not a dialect op)."""
    return node.target.__name__.split(".")[0] if is_k3(node) else ""


def is_k3(node, name: Optional[str] = None) -> bool:
    """Whether an FX node calls a dialect op (optionally a given one)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    t = node.target
    ns = getattr(t, "namespace", None)
    if ns != LIB:
        return False
    return name is None or t.__name__.split(".")[0] == name
