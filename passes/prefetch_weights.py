"""prefetch_weights: while a collective waits, prefetch the next kernels' static weights into L2.

Before every kernel that communicates, a ``k3.prefetch`` node names the weights of the kernels that
follow it on the main stream, up to a byte budget (default 40 MiB of the H200's 60 MB L2)::

    before                                         after
    ------                                         -----
    n, P = k3.oproj_residual_norm(y, W[o], ...)    k3.prefetch([W[gate], W[down], W[sg], W[su]], 14680064)
    fg = k3.front_gemm(n, [W[gate], ...])          n, P = k3.oproj_residual_norm(y, W[o], ...)
                                                   fg = k3.front_gemm(n, [W[gate], ...])

Only weights are prefetched, never activations or decode state: an activation read hoisted above a
synchronisation wait is exactly the bug a compiler once introduced. ``ensures`` checks every
prefetch argument is a static weight input.

What runs of it today: nothing. The node is a plan-level hint: ``k3compile plan`` shows it on the launch it
precedes (``prefetch-hint:``), and the kernel runtime drops it (no kernel issues it yet). The form that is
implemented is the GEMVs' own L2 prefetch before their PDL wait (``codegen --l2-prefetch``), off by default:
on the H200 it did not pay (BENCHMARKS.md, thirteenth entry).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from k3compile import dialect
from k3compile.pipeline import K3Pass, PassConfig, PassContext, PassResult, Stage, register_pass

from .common import val


@dataclass(frozen=True)
class PrefetchConfig(PassConfig):
    l2_budget_bytes: int = 40 << 20
    lookahead_kernels: int = 2


def _weight_args(node: torch.fx.Node, weights: set[str]) -> list[torch.fx.Node]:
    out, flat = [], []
    torch.fx.node.map_arg((node.args, node.kwargs), flat.append)
    for a in flat:
        if a.op == "placeholder" and a.name in weights and a not in out:
            out.append(a)
    return out


def nbytes(node: torch.fx.Node) -> int:
    v = val(node)
    return v.numel() * v.element_size()


@register_pass
class PrefetchWeights(K3Pass):
    name = "prefetch_weights"
    stage = Stage.SCHEDULE
    config_cls = PrefetchConfig

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        weights = ctx.weight_names()
        nodes = list(gm.graph.nodes)
        kernels = [n for n in nodes if dialect.is_k3(n) and n.meta.get("k3_stream", "main") == "main"
                   and not dialect.is_k3(n, "prefetch")]
        count = 0
        for i, n in enumerate(kernels):
            if not dialect.communicates(n):
                continue
            chosen, budget = [], self.config.l2_budget_bytes
            for nxt in kernels[i + 1:i + 1 + self.config.lookahead_kernels]:
                for w in _weight_args(nxt, weights):
                    b = nbytes(w)
                    if w not in chosen and b <= budget:
                        chosen.append(w)
                        budget -= b
            if not chosen:
                continue
            with gm.graph.inserting_before(n):
                p = gm.graph.call_function(dialect.k3_ops()["prefetch"],
                                           (chosen, self.config.l2_budget_bytes - budget))
            p.meta["k3_created_by"] = self.name
            p.meta["k3_provenance"] = [f"before {n.name}"]
            count += 1
        return PassResult(match_count=count, changed=count > 0,
                          notes="" if ctx.tp_size > 1 else "TP 1: no collective to hide a prefetch behind")

    def ensures(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        weights = ctx.weight_names()
        for n in gm.graph.nodes:
            if not dialect.is_k3(n, "prefetch"):
                continue
            for a in n.args[0]:
                if not (isinstance(a, torch.fx.Node) and a.op == "placeholder" and a.name in weights):
                    raise self.fail("ensures", f"{n.name} prefetches {getattr(a, 'name', a)}, which is not a static "
                                               "weight (activations and state may only be read after the wait)")
            nxt = n.next
            if not dialect.communicates(nxt):
                raise self.fail("ensures", f"{n.name} is not placed right before a collective ({nxt.name})")
