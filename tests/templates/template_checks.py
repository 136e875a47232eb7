"""Helpers shared by the template tests (CPU: no cutlass import)."""

import ast

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def module_constants(src: str) -> dict:
    """Evaluate a (rendered) kernel file's upper-case constants: the constants block and the plain-Python
    derived constants after it, without importing cutlass."""
    env: dict = {}
    for node in ast.parse(src).body:
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets):
            exec(compile(ast.Module([node], []), "<constants>", "exec"), env)
    return {k: v for k, v in env.items() if k.isupper()}
