"""lift_dialect: the captured torch-level graph -> the K3 op dialect.

Capture keeps each semantic function of the eager model as one call node, so lifting is a table
lookup, not aten pattern matching (it does not depend on a PyTorch version's decompositions)::

    before                                             after
    ------                                             -----
    rms_norm_3 = ops.rms_norm(h, W[..], 1e-05)         rms_norm_3 = k3.rms_norm(h, W[..], 1e-05)
    linear_7 = torch.linear(x, W[..q_proj.weight])     linear_7 = k3.linear(x, W[..q_proj.weight])
    kda = ops.kda_decode(q, k, v, ...)                 kda = k3.kda_decode(q, k, v, ...)
    t = _c10d_functional.all_reduce(y, 'sum', '0')     t = k3.tp_all_reduce(y, '0', 2)
    w = _c10d_functional.wait_tensor(t)

Every lifted node keeps provenance (``meta["k3_provenance"]``) to the nodes it replaced.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from k3compile import dialect
from k3compile.capture import SEMANTIC_FUNCTIONS
from k3compile.pipeline import K3Pass, PassContext, PassResult, Stage, register_pass

from .common import record_provenance, replace_node

_LINEAR_TARGETS = {F.linear, torch._C._nn.linear}


def _is_all_reduce(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and n.target in (torch.ops._c10d_functional.all_reduce.default,
                                                    torch.ops._c10d_functional.all_reduce)


def _is_wait(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and n.target in (torch.ops._c10d_functional.wait_tensor.default,
                                                    torch.ops._c10d_functional.wait_tensor)


@register_pass
class LiftDialect(K3Pass):
    name = "lift_dialect"
    stage = Stage.LIFT

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        ops = dialect.k3_ops()
        count = 0
        g = gm.graph
        for node in list(g.nodes):
            if node.op != "call_function":
                continue
            if node.target in SEMANTIC_FUNCTIONS or (node.target in _LINEAR_TARGETS and not node.kwargs
                                                     and len(node.args) == 2):
                op_name = SEMANTIC_FUNCTIONS.get(node.target, "linear")
                record_provenance(node, [node], self.name)
                node.target = ops[op_name]
                count += 1
            elif _is_all_reduce(node):
                x, reduce_op, group = node.args[:3]
                if reduce_op != "sum":
                    raise self.fail("apply", f"all_reduce {node.name} uses {reduce_op!r}; only 'sum' is lifted")
                waits = [u for u in node.users if _is_wait(u)]
                if len(waits) != 1 or len(node.users) != 1:
                    raise self.fail("apply", f"all_reduce {node.name} must feed exactly one wait_tensor")
                with g.inserting_before(node):
                    new = g.call_function(ops["tp_all_reduce"], (x, group, ctx.tp_size))
                new.meta.update(waits[0].meta)
                record_provenance(new, [node, waits[0]], self.name)
                replace_node(waits[0], new)
                g.erase_node(node)
                count += 1
        return PassResult(match_count=count, changed=count > 0)

    def ensures(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target in SEMANTIC_FUNCTIONS or node.target in _LINEAR_TARGETS:
                raise self.fail("ensures", f"{node.name} ({node.target.__name__}) was not lifted to the dialect")
            if _is_all_reduce(node):
                raise self.fail("ensures", f"{node.name} is an all_reduce outside the dialect (tp_all_reduce)")
            if dialect.is_k3(node) and "k3_provenance" not in node.meta:
                raise self.fail("ensures", f"{node.name} has no provenance")
