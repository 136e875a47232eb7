"""eliminate_dead_code: drop nodes whose results nothing uses, keeping every side effect.

In-place state writes (``copy_``, ``index_put_``, any ``*_`` method or op), collectives and the
model's input check are side effects and always stay::

    before                                  after
    ------                                  -----
    t = torch.arange(s0)    (unused)        (gone)
    c = S[conv].copy_(new)  (unused)        c = S[conv].copy_(new)     (kept: writes state)
"""

from __future__ import annotations

import torch.fx

from k3compile import dialect
from k3compile.pipeline import K3Pass, PassContext, PassResult, Stage, register_pass


def is_side_effect(node: torch.fx.Node) -> bool:
    if node.op in ("placeholder", "output"):
        return True
    if dialect.is_k3(node, "tp_all_reduce"):
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    base = name.split(".")[0]
    if base.endswith("_") and not base.startswith("_"):
        return True  # in-place method or op (copy_, index_put_, setitem-like)
    if "check_decode_inputs" in str(node.target) or "setitem" in base:
        return True
    return "c10d" in str(node.target)


@register_pass
class EliminateDeadCode(K3Pass):
    name = "eliminate_dead_code"
    stage = Stage.CLEANUP

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        removed = 0
        for node in reversed(list(gm.graph.nodes)):
            if not node.users and not is_side_effect(node):
                gm.graph.erase_node(node)
                removed += 1
        return PassResult(match_count=removed, changed=removed > 0)
