"""fuse_oproj_allreduce: GEMM -> all-reduce -> residual -> AttnRes -> RMSNorm chains become one op each.

Attention output (every layer)::

    before                                                after
    ------                                                -----
    o  = k3.linear(y, W[o_proj])                          n, P1 = k3.oproj_residual_norm(y, W[o_proj], g, tp,
    a  = k3.tp_all_reduce(o)          (absent at TP 1)             P0 | None, blocks, W[mlp_res_*], eps,
    P1 = P0 + a                       (P1 = a at block writes)     W[post_attention_layernorm], eps)
    n  = k3.attn_res_rms_norm(P1, blocks, ...)

FFN tail (MoE layers; the dense layer 0 has no latent part, so its latent arguments are None)::

    l  = k3.tp_all_reduce(experts)                        n2, P2 = k3.ffn_tail_norm(experts, W[routed_expert_norm],
    ln = k3.rms_norm(l, W[routed_expert_norm])                     eps, W[up], shared, g, tp, P1, blocks',
    r  = k3.linear_gather(ln, W[up], False, g, tp, rank)           W[next res], eps, W[next ln], eps, rank)
    s  = k3.tp_all_reduce(shared)
    P2 = P1 + (r + s)
    n2 = k3.attn_res_rms_norm(P2, blocks', ...)   (next layer; k3.ffn_tail without it after the last layer)

The latent all-reduce is reduced *before* its norm (pitfall 9) inside the tail kernel; it becomes its own
``k3.allreduce_rms_norm`` only where no up-projection follows.

The GEMM epilogue writes straight into the communication buffer; the residual, the AttnRes read and
the norm run on the reduced rows in the same kernel. Requires fuse_attn_res_norm.
"""

from __future__ import annotations

import torch.fx

from k3compile import dialect
from k3compile.pipeline import K3Pass, PassContext, PassResult, Stage, register_pass

from .common import is_add, new_op, only_user, replace_node, tp_group, tuple_outputs, val


def _unreduce(node):
    """(partial, reduce node or None): look through a tp_all_reduce."""
    if dialect.is_k3(node, "tp_all_reduce"):
        return node.args[0], node
    return node, None


def _attention_output(node) -> bool:
    """Whether ``node`` is an attention core's output (KDA getitem 0, or MLA)."""
    if dialect.is_k3(node, "mla_decode"):
        return True
    return (node.op == "call_function" and node.args and dialect.is_k3(node.args[0], "kda_decode")
            and node.args[1] == 0)


def _is_new_prefix(node) -> bool:
    return (isinstance(node, torch.fx.Node) and node.op == "call_function" and len(node.args) == 2
            and dialect.is_k3(node.args[0], "oproj_residual_norm") and node.args[1] == 1)


def _next_norm(prefix_node):
    """The attn_res_rms_norm that reads ``prefix_node`` as its prefix, if any."""
    for u in prefix_node.users:
        if dialect.is_k3(u, "attn_res_rms_norm") and u.args[0] is prefix_node:
            return u
    return None


@register_pass
class FuseOprojAllreduce(K3Pass):
    name = "fuse_oproj_allreduce"
    stage = Stage.FUSE

    def requires(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        if any(dialect.is_k3(n, "attn_res") and only_user(n) is not None and dialect.is_k3(only_user(n), "rms_norm")
               for n in gm.graph.nodes):
            raise self.fail("requires", "unfused attn_res -> rms_norm: run fuse_attn_res_norm first")

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        group, tp = tp_group(gm), ctx.tp_size
        count = 0
        g = gm.graph
        # --- attention o_proj chains
        for lin in [n for n in g.nodes if dialect.is_k3(n, "linear") and _attention_output(n.args[0])]:
            y, w_o = lin.args
            red = only_user(lin) if dialect.is_k3(only_user(lin), "tp_all_reduce") else None
            a = red or lin
            add = only_user(a)
            prefix = None
            new_prefix = a
            if is_add(add):
                prefix = add.args[0] if add.args[1] is a else add.args[1]
                new_prefix = add
            norm = _next_norm(new_prefix)
            if norm is None:
                continue
            _, blocks, nw, pw, eps, ow, oeps = norm.args
            fused = new_op(gm, norm, "oproj_residual_norm", (y, w_o, group, tp, prefix, blocks, nw, pw, eps, ow, oeps),
                           [n for n in (lin, red, add if prefix is not None else None, norm) if n is not None],
                           self.name)
            normed, p1 = tuple_outputs(gm, fused, [val(norm), val(new_prefix)])
            norm.replace_all_uses_with(normed)
            g.erase_node(norm)
            new_prefix.replace_all_uses_with(p1)
            for n in (add if prefix is not None else None, red, lin):
                if n is not None:
                    g.erase_node(n)
            count += 1
        # --- latent all-reduce + norm (absorbed into the FFN tail below when the up-projection follows)
        for norm in [n for n in g.nodes if dialect.is_k3(n, "rms_norm")]:
            partial, red = _unreduce(norm.args[0])
            if not dialect.is_k3(partial, "latent_moe_experts"):
                continue
            fused = new_op(gm, norm, "allreduce_rms_norm", (partial, group, tp, norm.args[1], norm.args[2]),
                           [n for n in (red, norm) if n is not None], self.name, norm)
            replace_node(norm, fused)
            if red is not None:
                g.erase_node(red)
            count += 1
        # --- FFN tails: P2 = P1 + f, where P1 is the prefix the fused attention chain produced
        for add in [n for n in g.nodes if is_add(n)]:
            p1, f = add.args
            if not _is_new_prefix(p1):
                continue
            latent = latent_w = up_w = None
            latent_eps, up_rank = 0.0, -1
            drop = [add]
            if is_add(f) and (dialect.is_k3(f.args[0], "linear") or dialect.is_k3(f.args[0], "linear_gather")) \
                    and dialect.is_k3(f.args[0].args[0], "allreduce_rms_norm"):
                r, s = f.args
                ln, up_w = r.args[:2]
                if dialect.is_k3(r, "linear_gather"):  # row-sharded by shard_routing: this rank's rows, gathered
                    up_rank = r.args[5]
                latent, _, _, latent_w, latent_eps = ln.args
                partial, red = _unreduce(s)
                drop += [f, r] + ([red] if red else []) + ([ln] if len(ln.users) == 1 else [])
            else:
                partial, red = _unreduce(f)
                if not (dialect.is_k3(partial, "linear") and dialect.is_k3(partial.args[0], "situ_glu")):
                    continue
                drop += [red] if red else []
            tail = (latent, latent_w, latent_eps, up_w, partial, group, tp, p1)
            norm = _next_norm(add)
            if norm is not None:
                _, blocks, nw, pw, eps, ow, oeps = norm.args
                fused = new_op(gm, norm, "ffn_tail_norm", tail + (blocks, nw, pw, eps, ow, oeps, up_rank),
                               drop + [norm], self.name)
                normed, p2 = tuple_outputs(gm, fused, [val(norm), val(add)])
                norm.replace_all_uses_with(normed)
                g.erase_node(norm)
                add.replace_all_uses_with(p2)
            else:
                fused = new_op(gm, add, "ffn_tail", tail + (up_rank,), drop, self.name, add)
                add.replace_all_uses_with(fused)
            for n in drop:
                if not n.users:
                    g.erase_node(n)
            count += 1
        return PassResult(match_count=count, changed=count > 0)

    def ensures(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        for n in gm.graph.nodes:
            if dialect.is_k3(n, "tp_all_reduce") and (dialect.is_k3(n.args[0], "linear") and
                                                     _attention_output(n.args[0].args[0])):
                raise self.fail("ensures", f"{n.name}: attention o_proj all-reduce left unfused")
