"""Small helpers shared by passes: provenance and node replacement."""

from __future__ import annotations

import torch.fx

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
