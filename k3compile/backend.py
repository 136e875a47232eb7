"""``torch.compile(model.decode, backend="k3compile")``: the backend registered by name.

Registered through the ``torch_dynamo_backends`` entry point in pyproject.toml, so it works right
after ``pip install``. Options: ``torch.compile(..., backend="k3compile", options={"buckets": (1, 8),
"dump_dir": "dumps"})``. For one graph serving every batch size without recompiles use
:func:`k3compile.compile` (it marks the batch dynamic); by name, Dynamo specialises the first batch
size it sees and recompiles once, dynamically, when the batch changes.
"""

from __future__ import annotations

from .compiler import Options, compile_graph


def k3compile_backend(gm, example_inputs, options: dict | None = None, **kwargs):
    if kwargs:
        raise TypeError(f"unexpected backend arguments {sorted(kwargs)}; pass k3compile options as options={{...}}")
    opts = Options.make(options)
    if opts.relay_in_place:
        raise ValueError("relay_in_place=True needs k3compile.compile(model, options={...}): by name, Dynamo traces "
                         "model.decode again when the batch or state changes, after the experts' codes were "
                         "rewritten in place, which a traced graph cannot read. Fix: step = k3compile.compile(model, "
                         "options={'relay_in_place': True}), or leave the option off here")
    return compile_graph(gm, example_inputs, opts)
