"""Capture: the eager decode step as one FX graph with a symbolic batch size.

TorchDynamo traces ``model.decode`` (``fullgraph=True``: a graph break is an error that names the
source line, never a silent split). The batch dimension of ``token_ids`` is a sympy symbol, and
size-oblivious reasoning keeps batch 1 from being specialised, so one capture serves every bucket.

The semantic functions of :mod:`k3compile.models.ops` are kept as single call nodes
(``allow_in_graph``), so lifting maps whole K3 operations instead of pattern-matching aten
decompositions. Weights and the decode state become graph inputs; every in-place state update
(``copy_``, ``index_put_``) is an explicit node.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import traceback
from typing import Any

import torch
import torch.fx

from k3compile.models import ops as ref
from k3compile.models.mxfp4 import relaid_traces_allowed
from k3compile.models.model import K3Model

# Model function -> dialect op name. The only place that knows how the eager model names its operations.
SEMANTIC_FUNCTIONS = {
    ref.rms_norm: "rms_norm",
    ref.attn_res: "attn_res",
    ref.situ_glu: "situ_glu",
    ref.mxfp4_linear: "linear_mxfp4",
    ref.moe_route: "moe_route",
    ref.latent_moe_experts: "latent_moe_experts",
    ref.kda_decode: "kda_decode",
    ref.mla_decode: "mla_decode",
    ref.lm_head: "lm_head",
}
for _fn in SEMANTIC_FUNCTIONS:
    torch._dynamo.allow_in_graph(_fn)


class CaptureError(RuntimeError):
    """The decode step could not be traced as one graph; the message names the source location."""


@dataclasses.dataclass
class InputInfo:
    """What one placeholder of the captured graph is."""

    kind: str  # "token_ids" | "state" | "weight" | "symint"
    name: str  # placeholder name
    label: str  # readable: parameter name, state slot, ...


@dataclasses.dataclass
class Captured:
    graph_module: torch.fx.GraphModule
    inputs: list[InputInfo]
    batch_symbol: Any  # sympy.Symbol of the batch dimension
    tp_size: int

    def weight_inputs(self) -> set[str]:
        return {i.name for i in self.inputs if i.kind == "weight"}


@contextlib.contextmanager
def symbolic_batch():
    """Treat sizes 0/1 like any other size (no specialisation of batch 1)."""
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(backed_size_oblivious=True):
        yield


def mark_batch_dynamic(token_ids: torch.Tensor) -> None:
    torch._dynamo.mark_dynamic(token_ids, 0)


def _weight_label(name: str) -> str:
    body = name[len("l_self_"):] if name.startswith("l_self_") else name
    for sep in ("modules_", "_modules_", "_parameters_", "_buffers_"):
        body = body.replace(sep, ".") if sep != "modules_" else (body[len(sep):] if body.startswith(sep) else body)
    return body.rstrip("_")


def classify_inputs(gm: torch.fx.GraphModule, example_inputs) -> list[InputInfo]:
    """Role of every placeholder, from Dynamo's source-derived names: module parameters/buffers are
    static weights, ``token_ids`` is the step input, every other tensor is decode state."""
    out = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, val in zip(placeholders, example_inputs):
        name = node.name
        if not isinstance(val, torch.Tensor):
            out.append(InputInfo("symint", name, str(val)))
        elif "_parameters_" in name or "_buffers_" in name:
            out.append(InputInfo("weight", name, _weight_label(name)))
        elif "token_ids" in name:
            out.append(InputInfo("token_ids", name, "token_ids"))
        else:
            out.append(InputInfo("state", name, name.removeprefix("l_state_").rstrip("_")))
    if sum(i.kind == "token_ids" for i in out) != 1:
        raise CaptureError("the captured graph has no single token_ids input; was model.decode(token_ids, state) "
                           "the function compiled?")
    return out


def _location(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/models/" in f.filename.replace("\\", "/")]
    real = getattr(exc, "real_stack", None)
    if real:
        frames = list(real) + frames
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename}:{f.lineno} ({f.name}): {f.line}"


class _Captured(Exception):
    """Raised by the capturing backend instead of running the graph: capture never executes the step."""


def capture(model: K3Model, *, example_batch: int = 2, max_context: int = 16) -> Captured:
    """Trace ``model.decode`` once with a symbolic batch size; return the Dynamo FX graph and input roles.

    The step is traced, not run: ``model`` may live on the ``meta`` device (no weights in memory).
    """
    state = model.new_state(max(example_batch, 1), max_context)
    token_ids = torch.zeros(example_batch, dtype=torch.long, device=model.device)
    holder: dict[str, Any] = {}

    def grab(gm, example_inputs):
        holder["gm"], holder["inputs"] = gm, example_inputs

        def do_not_run(*args):
            raise _Captured

        return do_not_run

    mark_batch_dynamic(token_ids)
    compiled = torch.compile(model.decode, backend=grab, fullgraph=True)
    try:  # (relaid codes: the runtime's kernels read them in their layout, its eager fallbacks on real tensors)
        with symbolic_batch(), torch.no_grad(), relaid_traces_allowed():
            compiled(token_ids, state)
    except _Captured:
        pass
    except Exception as e:  # Dynamo's Unsupported/UserError/TorchRuntimeError and friends
        loc = _location(e)
        msg = str(e).strip().splitlines()
        raise CaptureError(f"cannot capture model.decode as one graph (graph break or untraceable construct)"
                           f"{' at ' + loc if loc else ''}: {msg[0] if msg else type(e).__name__}\n"
                           + "\n".join(msg[1:20])) from e
    finally:
        torch._dynamo.reset()
    if "gm" not in holder:
        raise CaptureError("Dynamo produced no graph for model.decode")
    gm = holder["gm"]
    inputs = classify_inputs(gm, holder["inputs"])
    gm.meta["k3_inputs"] = inputs
    tok = next(n for n, i in zip(gm.graph.nodes, inputs) if i.kind == "token_ids")
    batch = tok.meta["example_value"].shape[0]
    sym = batch.node.expr if isinstance(batch, torch.SymInt) else None
    if sym is None:
        raise CaptureError("the batch dimension was specialised during capture; k3compile needs it symbolic")
    return Captured(gm, inputs, sym, model.tp.size)


@contextlib.contextmanager
def tp_world(tp_size: int):
    """A process group for tracing a TP model in one process: the real one if initialised (its size must
    match), otherwise PyTorch's fake process group (collectives are traced, never executed)."""
    import torch.distributed as dist

    if tp_size == 1:
        yield
        return
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != tp_size:
            raise ValueError(f"torch.distributed world size {dist.get_world_size()} != tp_size {tp_size}")
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


_CAPTURES: collections.OrderedDict = collections.OrderedDict()  # capture_config's memo, most recent last
_CAPTURES_KEPT = 8


def capture_config(config, *, tp_size: int = 1, tp_rank: int = 0, example_batch: int = 2,
                   max_context: int = 16) -> Captured:
    """Capture the decode step of ``config`` at TP ``tp_size`` with weights on the meta device.

    ``max_context`` is the MLA latent cache capacity of the state the graph is captured with (static, like
    every state dimension): kernels generated from the graph serve sequences up to that length.

    A capture costs a Dynamo trace (10-20 s for k3-mini); the last few are kept per process and shared, which is
    safe because nothing changes a captured graph (``lower`` works on a copy). Not kept under a real process
    group: the graph's collectives name that group."""
    import torch.distributed as dist

    config.check_tp(tp_size)
    key = (config, tp_size, tp_rank, example_batch, max_context)
    keep = tp_size == 1 or not (dist.is_available() and dist.is_initialized())
    if keep and key in _CAPTURES:
        _CAPTURES.move_to_end(key)
        return _CAPTURES[key]
    model = K3Model(config, device="meta", tp_rank=tp_rank, tp_size=tp_size)
    with tp_world(tp_size):
        cap = capture(model, example_batch=example_batch, max_context=max_context)
    if keep:
        _CAPTURES[key] = cap
        while len(_CAPTURES) > _CAPTURES_KEPT:
            _CAPTURES.popitem(last=False)
    return cap
