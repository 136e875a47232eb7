"""front_gemm: GEMMs that read the same input become one GEMM over the concatenated weights.

The MoE router, the latent down-projection and the shared expert's gate/up all read the post-attention
normed hidden; KDA's q/k/v/g/beta/f_a projections all read the pre-attention normed hidden (MLA: q_a,
kv_a, g; the dense MLP: gate, up). One kernel reads the input once and streams every weight::

    before                                             after
    ------                                             -----
    lg = k3.linear_gather(y, W[gate], True, g, tp, r)  fg = k3.front_gemm(y, [W[gate], W[down], W[sg], W[su]],
    z  = k3.linear_gather(y, W[down], False, ...)              fp32=[T, F, F, F], gather=[T, T, F, F], g, tp, r)
    sg = k3.linear(y, W[shared gate])                  lg, z, sg, su = fg[0], fg[1], fg[2], fg[3]
    su = k3.linear(y, W[shared up])

Each entry keeps its own output dtype (the router stays fp32) and, for sharded entries, its all-gather.
"""

from __future__ import annotations

import torch.fx

from k3compile import dialect
from k3compile.pipeline import K3Pass, PassContext, PassResult, Stage, register_pass

from .common import new_op, tp_group, tuple_outputs, val


def _entry(node):
    """(weight, fp32, gather) for a GEMM node that can join a front GEMM, else None."""
    if dialect.is_k3(node, "linear"):
        return node.args[1], False, False
    if dialect.is_k3(node, "linear_gather"):
        _, w, fp32, _, _, _ = node.args
        return w, fp32, True
    return None


@register_pass
class FrontGemm(K3Pass):
    name = "front_gemm"
    stage = Stage.FUSE

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for n in gm.graph.nodes:
            if _entry(n) is not None:
                groups.setdefault(n.args[0], []).append(n)
        group, tp, rank = tp_group(gm), ctx.tp_size, ctx.tp_rank
        count = 0
        for x, gemms in groups.items():
            if len(gemms) < 2:
                continue
            entries = [_entry(n) for n in gemms]
            args = (x, [e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries], group, tp, rank)
            fused = new_op(gm, gemms[0], "front_gemm", args, gemms, self.name)
            outs = tuple_outputs(gm, fused, [val(n) for n in gemms])
            for old, new in zip(gemms, outs):
                old.replace_all_uses_with(new)
                gm.graph.erase_node(old)
            count += 1
        return PassResult(match_count=count, changed=count > 0)

    def ensures(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        seen: dict = {}
        for n in gm.graph.nodes:
            if _entry(n) is not None:
                if n.args[0] in seen:
                    raise self.fail("ensures", f"{seen[n.args[0]]} and {n.name} read the same input unfused")
                seen[n.args[0]] = n.name
