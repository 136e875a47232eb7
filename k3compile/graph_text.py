"""Readable, deterministic text of an FX graph: the form of golden files, pass dumps and diffs.

One line per node: ``name = op(args)  # dtype[shape]``. Graph inputs are shown by role and by the
model name they carry (``W[layers.0.input_layernorm.weight]``, ``S[layers.3.mla_latent_cache]``), taken
from ``gm.meta["k3_inputs"]`` when capture put it there.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32", torch.float64: "f64", torch.float16: "f16",
           torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8", torch.bool: "b8"}


_SYM_TEXT: dict = {}  # sympy expression -> its text (printing one costs ~25 us; graphs repeat a few sizes)


def _size_str(s) -> str:
    if not isinstance(s, torch.SymInt):
        return str(s)
    expr = s.node.expr
    text = _SYM_TEXT.get(expr)
    if text is None:
        text = _SYM_TEXT[expr] = str(s)
    return text


def _val_str(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{_DTYPES.get(v.dtype, str(v.dtype))}[{', '.join(_size_str(s) for s in v.shape)}]"
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_val_str(x) for x in v) + ")"
    return str(v) if v is not None else ""


def node_value(node: torch.fx.Node):
    return node.meta.get("val", node.meta.get("example_value"))


def target_str(node: torch.fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return f".{t}"
    if node.op == "call_module":
        return f"module:{t}"
    if isinstance(t, torch._ops.OpOverload):
        ns = t.namespace
        base = t.__name__.split(".")[0]
        return f"{ns}.{base}"
    if isinstance(t, torch._ops.OpOverloadPacket):
        return str(t).replace("torch.ops.", "")
    if t is operator.getitem:
        return "getitem"
    if getattr(t, "__module__", None) == "_operator":
        return f"operator.{t.__name__}"
    mod = getattr(t, "__module__", None) or ""
    name = getattr(t, "__name__", str(t))
    if mod.startswith("torch"):
        return f"torch.{name}"
    if mod:
        return f"{mod.rsplit('.', 1)[-1]}.{name}"
    return name


def _arg_str(a, labels: dict[str, str]) -> str:
    if isinstance(a, torch.fx.Node):
        return labels.get(a.name, a.name)
    if isinstance(a, (tuple, list)):
        inner = ", ".join(_arg_str(x, labels) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, slice):
        return f"{_arg_str(a.start, labels) if a.start is not None else ''}:{_arg_str(a.stop, labels) if a.stop is not None else ''}"
    if isinstance(a, float):
        return repr(a)
    if isinstance(a, torch.dtype):
        return _DTYPES.get(a, str(a))
    return repr(a) if isinstance(a, str) else str(a)


def input_labels(gm: torch.fx.GraphModule) -> dict[str, str]:
    labels = {}
    for info in gm.meta.get("k3_inputs", []):
        prefix = {"weight": "W", "state": "S", "token_ids": "", "symint": ""}[info.kind]
        labels[info.name] = f"{prefix}[{info.label}]" if prefix else info.label
    return labels


def graph_lines(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """(line, provenance) per line of :func:`graph_text`; provenance lists the captured nodes a node
    stands for (empty for lines that are not nodes or were never rewritten)."""
    labels = input_labels(gm)
    n_inputs = {"weight": 0, "state": 0}
    for info in gm.meta.get("k3_inputs", []):
        if info.kind in n_inputs:
            n_inputs[info.kind] += 1
    out = [(f"# inputs: token_ids, {n_inputs['state']} state tensors, {n_inputs['weight']} weights", "")]
    syms = [n.name for n in gm.graph.nodes if n.op == "placeholder" and not isinstance(node_value(n), torch.Tensor)]
    if syms:
        out.append((f"# symbolic sizes: {', '.join(syms)}", ""))
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.name in syms or labels.get(node.name, "").startswith(("W[", "S[")):
                continue  # sizes are listed above; weights and state are named where they are used
            out.append((f"input {labels.get(node.name, node.name)}: {_val_str(node_value(node))}", ""))
            continue
        if node.op == "output":
            out.append((f"return {_arg_str(node.args[0], labels)}", ""))
            continue
        args = [_arg_str(a, labels) for a in node.args]
        args += [f"{k}={_arg_str(v, labels)}" for k, v in node.kwargs.items()]
        shape = _val_str(node_value(node))
        extra = [f"@{node.meta['k3_kernel']}"] if "k3_kernel" in node.meta else []
        if node.meta.get("k3_stream", "main") != "main":
            extra.append(f"stream={node.meta['k3_stream']}")
        comment = " ".join([shape] + extra).strip()
        line = f"{node.name} = {target_str(node)}({', '.join(args)})" + (f"  # {comment}" if comment else "")
        prov = node.meta.get("k3_provenance")
        by = node.meta.get("k3_created_by")
        out.append((line, (f"{by}: " if by else "") + " <- ".join(prov) if prov else ""))
    return out


def graph_text(gm: torch.fx.GraphModule) -> str:
    return "\n".join(line for line, _ in graph_lines(gm)) + "\n"
