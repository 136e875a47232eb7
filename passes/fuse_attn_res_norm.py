"""fuse_attn_res_norm: an AttnRes read whose only consumer is an RMSNorm becomes one op.

Every layer reads the residual stream twice (before attention, before the FFN), and each read is
consumed only by the RMSNorm that follows, so the mixed hidden never needs to reach memory::

    before                                              after
    ------                                              -----
    h = k3.attn_res(P, blocks, W[res_norm], W[res_proj], eps)
    x = k3.rms_norm(h, W[input_layernorm], eps)   ->    x = k3.attn_res_rms_norm(P, blocks, W[res_norm],
                                                               W[res_proj], eps, W[input_layernorm], eps)
"""

from __future__ import annotations

import torch.fx

from k3compile import dialect
from k3compile.pipeline import K3Pass, PassContext, PassResult, Stage, register_pass

from .common import record_provenance, replace_node


@register_pass
class FuseAttnResNorm(K3Pass):
    name = "fuse_attn_res_norm"
    stage = Stage.FUSE

    def requires(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        if not any(dialect.is_k3(n, "attn_res") for n in gm.graph.nodes):
            raise self.fail("requires", "no k3.attn_res in the graph: run lift_dialect first")

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        fused_op = dialect.k3_ops()["attn_res_rms_norm"]
        count = 0
        for node in list(gm.graph.nodes):
            if not dialect.is_k3(node, "attn_res") or len(node.users) != 1:
                continue
            (norm,) = node.users
            if not dialect.is_k3(norm, "rms_norm") or norm.args[0] is not node:
                continue
            prefix, blocks, nw, pw, eps = node.args
            _, out_w, out_eps = norm.args
            with gm.graph.inserting_before(norm):
                new = gm.graph.call_function(fused_op, (prefix, blocks, nw, pw, eps, out_w, out_eps))
            new.meta.update(norm.meta)
            record_provenance(new, [node, norm], self.name)
            replace_node(norm, new)
            gm.graph.erase_node(node)
            count += 1
        return PassResult(match_count=count, changed=count > 0)

    def ensures(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        for node in gm.graph.nodes:
            if dialect.is_k3(node, "attn_res") and len(node.users) == 1:
                (u,) = node.users
                if dialect.is_k3(u, "rms_norm") and u.args[0] is node:
                    raise self.fail("ensures", f"{node.name} -> {u.name} is still an unfused attn_res -> rms_norm")
