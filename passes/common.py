"""Small helpers shared by passes: provenance, node replacement, graph queries."""

from __future__ import annotations

import operator

import torch.fx

from k3compile import dialect
from k3compile.graph_text import target_str


def provenance(node: torch.fx.Node) -> list[str]:
    """The chain of original nodes this node stands for ("name: op" strings, capture-level first)."""
    return list(node.meta.get("k3_provenance", [f"{node.name}: {target_str(node)}"]))


def record_provenance(new: torch.fx.Node, replaced: list[torch.fx.Node], pass_name: str) -> None:
    chain: list[str] = []
    for r in replaced:
        chain.extend(provenance(r))
    new.meta["k3_provenance"] = chain
    new.meta["k3_created_by"] = pass_name


def replace_node(old: torch.fx.Node, new: torch.fx.Node) -> None:
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)


def only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def is_add(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in (operator.add, torch.add)


def getitem_users(node: torch.fx.Node) -> dict[int, torch.fx.Node]:
    """Index -> getitem node, for a node with a tuple output (every user must be a getitem)."""
    out = {}
    for u in node.users:
        if u.op != "call_function" or u.target is not operator.getitem:
            raise ValueError(f"{node.name} has a non-getitem user {u.name}")
        out[u.args[1]] = u
    return out


def new_op(gm: torch.fx.GraphModule, before: torch.fx.Node, name: str, args: tuple, replaced: list,
           pass_name: str, meta_from: torch.fx.Node | None = None) -> torch.fx.Node:
    """Insert a call of dialect op ``name`` before ``before`` with provenance to ``replaced``."""
    with gm.graph.inserting_before(before):
        node = gm.graph.call_function(dialect.k3_ops()[name], args)
    if meta_from is not None:
        node.meta.update({k: v for k, v in meta_from.meta.items() if not k.startswith("k3_")})
    record_provenance(node, replaced, pass_name)
    return node


def tuple_outputs(gm: torch.fx.GraphModule, node: torch.fx.Node, values: list) -> list[torch.fx.Node]:
    """getitem nodes for each output of a tuple-returning node (meta 'val' from ``values``)."""
    outs = []
    anchor = node
    for i, v in enumerate(values):
        with gm.graph.inserting_after(anchor):
            anchor = gm.graph.call_function(operator.getitem, (node, i))
        if v is not None:
            anchor.meta["example_value"] = v
        outs.append(anchor)
    node.meta["example_value"] = tuple(values)
    return outs


def val(node):
    return node.meta.get("val", node.meta.get("example_value")) if isinstance(node, torch.fx.Node) else None


def tp_group(gm: torch.fx.GraphModule) -> str:
    """The TP group name used by the graph's collectives ("" at TP 1)."""
    for n in gm.graph.nodes:
        if dialect.is_k3(n, "tp_all_reduce"):
            return n.args[1]
    return ""
