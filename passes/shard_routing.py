"""shard_routing: split the MoE router scoring and the latent down-projection across TP ranks.

In the eager TP layout both are replicated: every rank reads the whole [E, hidden] router and
[latent, hidden] down-projection (115.6 MB per rank per K3 layer with the up-projection). Here each
rank computes its 1/tp of the rows and the shards are all-gathered, so every rank ends with the same
fp32 logits and therefore the same routing (ties included: one tensor, one selection)::

    before                                           after
    ------                                           -----
    r = k3.moe_route(y, W[gate], bias, k, ...)       lg = k3.linear_gather(y, W[gate], fp32=True, g, tp, rank)
    w, ids = r[0], r[1]                              r  = k3.moe_select(lg, bias, k, ...)
    z = k3.linear(y, W[down])                        z  = k3.linear_gather(y, W[down], fp32=False, g, tp, rank)
    e = k3.latent_moe_experts(z, w, ids, ...)        e  = k3.latent_moe_experts(z, w, ids, ...)

At TP 1 the same form is produced with a group of one (the gather is the identity), so later passes
(front_gemm) see one shape of graph for every TP size.
"""

from __future__ import annotations

import torch.fx

from k3compile import dialect
from k3compile.pipeline import K3Pass, PassContext, PassResult, Stage, register_pass

from .common import new_op, replace_node, tp_group


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
        return PassResult(match_count=count, changed=count > 0)

    def ensures(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        for n in gm.graph.nodes:
            if dialect.is_k3(n, "moe_route"):
                raise self.fail("ensures", f"{n.name}: replicated moe_route left")
            if dialect.is_k3(n, "latent_moe_experts") and not dialect.is_k3(n.args[0], "linear_gather"):
                raise self.fail("ensures", f"{n.name}: latent down-projection is not sharded")
