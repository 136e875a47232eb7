"""shard_routing: split the MoE router scoring and the latent down- and up-projections across TP ranks.

In the eager TP layout all three are replicated: every rank reads the whole [E, hidden] router and the
[latent, hidden] down- and [hidden, latent] up-projections (115.6 MB per rank per K3 layer). Here each
rank computes its 1/tp of the rows and the shards are all-gathered, so every rank ends with the same
fp32 logits and therefore the same routing (ties included: one tensor, one selection), and the same
latent and up-projected rows (each output is one rank's whole dot product, as in the replicated GEMM)::

    before                                           after
    ------                                           -----
    r = k3.moe_route(y, W[gate], bias, k, ...)       lg = k3.linear_gather(y, W[gate], fp32=True, g, tp, rank)
    w, ids = r[0], r[1]                              r  = k3.moe_select(lg, bias, k, ...)
    z = k3.linear(y, W[down])                        z  = k3.linear_gather(y, W[down], fp32=False, g, tp, rank)
    e = k3.latent_moe_experts(z, w, ids, ...)        e  = k3.latent_moe_experts(z, w, ids, ...)
    l = k3.tp_all_reduce(e)                          l  = k3.tp_all_reduce(e)
    n = k3.rms_norm(l, W[routed_expert_norm])        n  = k3.rms_norm(l, W[routed_expert_norm])
    u = k3.linear(n, W[up])                          u  = k3.linear_gather(n, W[up], fp32=False, g, tp, rank)

The up-projection's shard saves (tp - 1) / tp of its 51.4 MB per rank and K3 MoE layer for one all-gather of
[B, 7168 / tp] per rank (fuse_oproj_allreduce carries it into the FFN tail as ``up_rank``).

At TP 1 the same form is produced with a group of one (the gather is the identity), so later passes
(front_gemm) see one shape of graph for every TP size.
"""

from __future__ import annotations

import torch.fx

from k3compile import dialect
from k3compile.pipeline import K3Pass, PassContext, PassResult, Stage, register_pass

from .common import new_op, replace_node, tp_group


def _up_projection(experts: torch.fx.Node):
    """The k3.linear that up-projects the experts' combined latent (through its all-reduce and RMSNorm, each the
    only user of what it reads), or None."""
    node = experts
    while len(node.users) == 1:
        (user,) = node.users
        if dialect.is_k3(user, "tp_all_reduce") or dialect.is_k3(user, "rms_norm"):
            node = user
            continue
        return user if dialect.is_k3(user, "linear") and user.args[0] is node and node is not experts else None
    return None


@register_pass
class ShardRouting(K3Pass):
    name = "shard_routing"
    stage = Stage.SHARD

    def requires(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        if ctx.tp_size > 1 and not tp_group(gm):
            raise self.fail("requires", f"TP {ctx.tp_size} graph without tp_all_reduce: run lift_dialect first")

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        group, tp, rank = tp_group(gm), ctx.tp_size, ctx.tp_rank
        count = 0
        for route in [n for n in gm.graph.nodes if dialect.is_k3(n, "moe_route")]:
            x, w_router, bias, k, renorm, scale = route.args
            logits = new_op(gm, route, "linear_gather", (x, w_router, True, group, tp, rank), [route], self.name)
            ev = route.meta["example_value"][0]
            logits.meta["example_value"] = ev.new_empty((ev.shape[0], w_router.meta["example_value"].shape[0]))
            select = new_op(gm, route, "moe_select", (logits, bias, k, renorm, scale), [route], self.name, route)
            replace_node(route, select)
            count += 1
        for experts in [n for n in gm.graph.nodes if dialect.is_k3(n, "latent_moe_experts")]:
            z = experts.args[0]
            if not dialect.is_k3(z, "linear"):
                raise self.fail("apply", f"the latent input of {experts.name} is not a k3.linear ({z.name})")
            x, w_down = z.args
            gathered = new_op(gm, z, "linear_gather", (x, w_down, False, group, tp, rank), [z], self.name, z)
            replace_node(z, gathered)
            count += 1
            up = _up_projection(experts)
            if up is not None:
                ln, w_up = up.args
                sharded = new_op(gm, up, "linear_gather", (ln, w_up, False, group, tp, rank), [up], self.name, up)
                replace_node(up, sharded)
                count += 1
        return PassResult(match_count=count, changed=count > 0)

    def ensures(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        for n in gm.graph.nodes:
            if dialect.is_k3(n, "moe_route"):
                raise self.fail("ensures", f"{n.name}: replicated moe_route left")
            if dialect.is_k3(n, "latent_moe_experts") and not dialect.is_k3(n.args[0], "linear_gather"):
                raise self.fail("ensures", f"{n.name}: latent down-projection is not sharded")
            if dialect.is_k3(n, "latent_moe_experts") and _up_projection(n) is not None:
                raise self.fail("ensures", f"{n.name}: latent up-projection is not sharded")
