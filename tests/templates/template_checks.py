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


def rendered_constants(template, params: dict) -> dict:
    """Render a point twice and check what every template's rendering owes: identical text and key, no
    example marker or constants block left, every constant in the file with its value, and a committed
    kernel file with exactly one constants block. Returns the rendered file's constants."""
    from k3compile.templates.base import BEGIN, END

    p1, p2 = template.point(**params), template.point(**params)
    src = p1.render()
    assert src == p2.render() and p1.key() == p2.key()
    assert src.count(BEGIN) == 0 and "example values" not in src
    env = module_constants(src)
    for k, v in p1.c.items():
        assert env[k] == v, k
    text = template.source()
    assert text.count(BEGIN) == 1 and text.count(END) == 1 and "# (example values" in text
    return env


def compile_examples(template, out_dir) -> dict:
    """Compile every example point of ``template`` for sm_90a into ``out_dir`` (through the K3COMPILE_CACHE
    in effect); returns label -> (point, ptxas report, PTX text)."""
    from k3compile import build

    points = {label: template.point(**p) for label, p in template.examples().items()}
    jobs = {label: build.job_for(p) for label, p in points.items()}
    reports = build.build(list(jobs.values()), out_dir, workers=2)
    return {label: (points[label], reports[job.name], (out_dir / job.name / "kernel.ptx").read_text())
            for label, job in jobs.items()}
