"""The kernel plan: the lowered graph of one (bucket, TP) point as an ordered list of kernel launches per
layer, with streams, events, prefetches, bytes moved and FLOPs, and the per-layer HBM floor.

Bytes and FLOPs are sympy expressions in the batch ``B`` (evaluated per bucket). Routed-expert bytes
use the expected number of distinct experts a batch touches, ``E * (1 - (1 - k/E)**B)``: the floor
grows with the distinct experts hit. The dependency DAG (networkx) turns every edge between streams
into an event record/wait.

What is *not* a launch: views and tuple unpacking (``getitem``), the AttnRes block bank (``stack`` is a
view of a preallocated bank that the producing kernel writes), decode-state writes (``copy_``,
``index_put_`` of a kernel's new state: the kernel writes the state in place), ``prefetch`` (issued by
the kernel it precedes while that kernel waits for its peers). Every other remaining torch op is listed
as an unfused ``torch.*`` launch, so a fusion that did not happen shows up in the count.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import re
from dataclasses import dataclass, field

import networkx as nx
import sympy
import torch
import torch.fx

from . import dialect
from .capture import capture_config
from .compiler import Options, check_tp, lower
from .graph_text import node_value, target_str

B = sympy.Symbol("B", positive=True, integer=True)
DEFAULT_BANDWIDTH = 4.2e12  # bytes/s: the H200's measured copy bandwidth
MLA_OPS = ("mla_decode", "mla_decode_latent")  # the ops that read the latent cache up to the context

_FREE_TORCH = {"getitem", "torch.stack", "torch.arange", ".copy_", ".index_put_", "torch.chunk"}
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class Launch:
    name: str
    op: str
    node: str
    kernel: str
    stream: str = "main"
    inputs: list = field(default_factory=list)
    weight_bytes: sympy.Expr = sympy.Integer(0)
    act_bytes: sympy.Expr = sympy.Integer(0)
    state_bytes: sympy.Expr = sympy.Integer(0)
    flops: sympy.Expr = sympy.Integer(0)
    prefetch_bytes: int = 0
    waits: list = field(default_factory=list)
    records: list = field(default_factory=list)
    fx: object = field(default=None, repr=False, compare=False)  # the lowered graph's node (codegen reads it)

    def bytes(self, b: int) -> int:
        return int(sympy.ceiling((self.weight_bytes + self.act_bytes + self.state_bytes).subs(B, b)))

    def as_dict(self, b: int) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("weight_bytes", "act_bytes", "state_bytes", "flops", "fx")}
        d = {k: list(v) if isinstance(v, list) else v for k, v in d.items()}
        for k in ("weight_bytes", "act_bytes", "state_bytes", "flops"):
            d[k] = int(sympy.ceiling(getattr(self, k).subs(B, b)))
        return d


@dataclass
class LayerPlan:
    layer: int  # -1: model level (embedding, check, output AttnRes, lm_head)
    kind: str
    launches: list[Launch]

    def bytes(self, b: int) -> int:
        return sum(l.bytes(b) for l in self.launches)


@dataclass
class KernelPlan:
    config: str
    tp: int
    bucket: int
    context: int
    layers: list[LayerPlan]
    layer_counts: dict  # kind -> number of such layers in the full config
    note: str = ""

    def by_kind(self) -> dict[str, LayerPlan]:
        out = {}
        for lp in self.layers:
            out.setdefault(lp.kind, lp)
        return out

    def floor_us(self, lp: LayerPlan, bandwidth: float) -> float:
        return lp.bytes(self.bucket) / bandwidth * 1e6

    def to_json(self, bandwidth: float = DEFAULT_BANDWIDTH) -> dict:
        b = self.bucket
        kinds = {}
        for kind, lp in self.by_kind().items():
            kinds[kind] = {"layer": lp.layer, "launches": [l.as_dict(b) for l in lp.launches],
                           "n_launches": len(lp.launches), "bytes": lp.bytes(b),
                           "floor_us": self.floor_us(lp, bandwidth), "count_in_model": self.layer_counts.get(kind, 1)}
        total = sum(v["bytes"] * v["count_in_model"] for v in kinds.values())
        return {"config": self.config, "tp": self.tp, "bucket": b, "context": self.context, "bandwidth": bandwidth,
                "layer_types": kinds, "model_bytes_per_step": total, "model_floor_us": total / bandwidth * 1e6,
                "note": self.note}

    def text(self, bandwidth: float = DEFAULT_BANDWIDTH) -> str:
        b = self.bucket
        lines = [f"k3compile plan: {self.config}, TP{self.tp}, bucket {b}, context {self.context}, "
                 f"floor at {bandwidth / 1e12:.2f} TB/s"]
        if self.note:
            lines.append(self.note)
        for kind, lp in self.by_kind().items():
            mb = lp.bytes(b) / 1e6
            lines.append(f"\n== {kind} (layer {lp.layer}; {self.layer_counts.get(kind, 1)} in the model): "
                         f"{len(lp.launches)} launches, {mb:.2f} MB, floor {self.floor_us(lp, bandwidth):.1f} us")
            lines.append(f"   {'#':>2} {'kernel launch':<34} {'stream':<13} {'family':<28} {'weights MB':>10} "
                         f"{'act+state MB':>12} {'GFLOP':>8}  sync")
            for i, l in enumerate(lp.launches, 1):
                w = float(l.weight_bytes.subs(B, b)) / 1e6
                a = float((l.act_bytes + l.state_bytes).subs(B, b)) / 1e6
                fl = float(l.flops.subs(B, b)) / 1e9
                sync = " ".join([f"wait:{e}" for e in l.waits] + [f"record:{e}" for e in l.records]
                                + ([f"prefetch:{l.prefetch_bytes / 1e6:.1f}MB"] if l.prefetch_bytes else []))
                lines.append(f"   {i:>2} {l.name:<34} {l.stream:<13} {l.kernel[:28]:<28} {w:>10.3f} {a:>12.4f} "
                             f"{fl:>8.3f}  {sync}")
        js = self.to_json(bandwidth)
        lines.append(f"\nwhole model per step: {js['model_bytes_per_step'] / 1e9:.2f} GB, floor "
                     f"{js['model_floor_us'] / 1e3:.2f} ms")
        return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ bytes
def _nbytes_static(node: torch.fx.Node) -> int:
    v = node_value(node)
    return v.numel() * v.element_size()


def _rows_bytes(v) -> sympy.Expr:
    """Bytes of an activation/state slice whose first dim is the batch: B * (bytes per row)."""
    per_row = 1
    for d in v.shape[1:]:
        per_row *= int(d)
    return B * per_row * v.element_size()


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _tensors(y)]
    return []


def _flat_nodes(node):
    flat = []
    torch.fx.node.map_arg((node.args, node.kwargs), flat.append)
    return flat


def _distinct_experts(E: int, k: int) -> sympy.Expr:
    return E * (1 - (1 - sympy.Rational(k, E)) ** B)


class _Costs:
    def __init__(self, gm: torch.fx.GraphModule, weights: set[str], state: set[str], tp: int, context: int):
        self.gm, self.weights, self.state, self.tp, self.context = gm, weights, state, tp, context

    def is_weight(self, n) -> bool:
        return n.op == "placeholder" and n.name in self.weights

    def state_root(self, n):
        """The decode-state input a node is a view of (through slicing getitems), else None."""
        while n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node):
            n = n.args[0]
        return n if n.op == "placeholder" and n.name in self.state else None

    def written_outputs(self, node) -> list:
        """Output tensors that go to memory as activations. New decode state is excluded: the kernel
        updates the state in place, counted once as state read + write."""
        outs = node_value(node)
        if not isinstance(outs, (tuple, list)):
            return _tensors(outs)
        keep = []
        for i, t in enumerate(outs):
            users = [u for u in node.users if u.target is operator.getitem and u.args[1] == i]
            to_state = users and all(w.op == "call_method" and w.target in ("copy_", "index_put_")
                                     and w.args[0] is not g and self.state_root(w.args[0]) is not None
                                     for g in users for w in g.users)
            if not to_state:
                keep.extend(_tensors(t))
        return keep

    def launch_costs(self, node) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr]:
        op = dialect.op_name(node)
        weight = sympy.Integer(0)
        act = sympy.Integer(0)
        state = sympy.Integer(0)
        flops = sympy.Integer(0)
        args = _flat_nodes(node)
        if op == "front_gemm" or op == "linear_gather":
            ws = node.args[1] if op == "front_gemm" else [node.args[1]]
            gather = node.args[3] if op == "front_gemm" else [True]
            for w, g in zip(ws, gather):
                nb = sympy.Integer(_nbytes_static(w)) / (self.tp if g else 1)
                weight += nb
                flops += 2 * B * node_value(w).numel() / (self.tp if g else 1)
        elif op in ("routed_experts", "latent_moe_experts"):
            k = node.args[3] if op == "routed_experts" else node.args[2].meta["example_value"].shape[-1]
            wargs = node.args[6:12] if op == "routed_experts" else node.args[3:9]
            E = node_value(wargs[0]).shape[0]
            per_expert = sum(_nbytes_static(w) for w in wargs) / E
            weight += per_expert * _distinct_experts(E, int(k))
            logical = sum(node_value(w).numel() * 2 for w in wargs[0::2]) / E  # packed: 2 weights per byte
            flops += 2 * B * int(k) * logical
        else:
            for a in args:
                if self.is_weight(a):
                    weight += _nbytes_static(a)
                    if len(node_value(a).shape) == 2 and op not in ("attn_res", "attn_res_rms_norm"):
                        flops += 2 * B * node_value(a).numel()
        for a in args:
            if self.is_weight(a):
                continue
            root = self.state_root(a)
            v = node_value(a)
            if root is not None and isinstance(v, torch.Tensor):
                if op in MLA_OPS:  # the latent cache: read `context` rows per sequence (not written here)
                    state += B * self.context * v.shape[-1] * v.element_size()
                else:
                    state += 2 * _rows_bytes(v)  # read + written back in place
            elif isinstance(v, torch.Tensor) and v.dim() >= 1 and a.op != "placeholder":
                act += _rows_bytes(v)
        for t in self.written_outputs(node):
            if t.dim() >= 1:
                act += _rows_bytes(t)
        if op in ("kda_decode", "kda_decode_fb"):
            s = node_value(node.args[10] if op == "kda_decode_fb" else node.args[9])
            H, K, V = s.shape[1:]
            flops += B * H * 6 * K * V
        if op in MLA_OPS:
            k = 5 if op == "mla_decode" else 7  # mla_decode_latent takes kv_norm_weight, kv_eps before
            kv_b = node_value(node.args[k])
            nope, vdim = node.args[k + 1], node.args[k + 2]
            H, C = kv_b.shape[0] // (nope + vdim), kv_b.shape[1]
            R = node_value(node.args[1]).shape[1] - C
            # scores over C+R, values over C, at `context` cached positions; plus the two absorptions
            flops += 2 * B * H * (self.context + 1) * (2 * C + R) + 2 * B * H * C * (nope + vdim)
        return weight, act, state, flops


# ------------------------------------------------------------------------------------------------ plan
def _layer_of(node, labels: dict[str, str], assigned: dict) -> int:
    """The layer a launch belongs to: that of the weights it computes with (-1 for model-level weights:
    embedding, final norm, output AttnRes, lm_head); without such weights, that of its latest producer.

    An FFN tail also reads the *next* layer's AttnRes/norm weights (it runs that layer's pre-attention
    read in its epilogue); those do not make it part of the next layer."""
    args = node.args[:8] if dialect.is_k3(node, "ffn_tail_norm") else node.args
    flat = []
    torch.fx.node.map_arg(args, flat.append)
    names = [labels[a.name] for a in flat if a.name in labels]
    if names:
        layers = [int(m.group(1)) for n in names for m in [_LAYER.search(n)] if m]
        return min(layers) if layers else -1
    producers = [assigned[a] for a in _flat_nodes(node) if a in assigned]
    return max(producers) if producers else -1


def build_plan(gm: torch.fx.GraphModule, *, config, tp: int, bucket: int, context: int = 0,
               layer_counts: dict | None = None, note: str = "") -> KernelPlan:
    inputs = gm.meta["k3_inputs"]
    labels = {i.name: i.label for i in inputs if i.kind == "weight"}
    costs = _Costs(gm, {i.name for i in inputs if i.kind == "weight"}, {i.name for i in inputs if i.kind == "state"},
                   tp, context)
    launches: list[tuple[int, Launch, torch.fx.Node]] = []
    assigned: dict[torch.fx.Node, int] = {}
    pending_prefetch = 0
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        current = assigned[node] = _layer_of(node, labels, assigned)
        if dialect.is_k3(node, "prefetch"):
            pending_prefetch += node.args[1]
            continue
        if dialect.is_k3(node):
            choice = node.meta.get("k3_kernel")
            names = choice.launches if choice else (dialect.op_name(node),)
            kernel = str(choice) if choice else "unselected"
            w, a, s, f = costs.launch_costs(node)
            inputs_desc = [labels.get(x.name, x.name) for x in _flat_nodes(node)]
            for j, name in enumerate(names):
                share = sympy.Rational(1, len(names))
                la = Launch(name=name, op=dialect.op_name(node), node=node.name, kernel=kernel,
                            stream=node.meta.get("k3_stream", "main"), inputs=inputs_desc, fx=node,
                            weight_bytes=w * share, act_bytes=a * share, state_bytes=s * share, flops=f * share)
                if j == 0 and pending_prefetch:
                    la.prefetch_bytes, pending_prefetch = pending_prefetch, 0
                launches.append((current, la, node))
            continue
        t = target_str(node)
        gather = t == "getitem" and isinstance(node.args[1], torch.fx.Node)  # table lookup: a real kernel
        if t in _FREE_TORCH and not gather:
            continue
        if t == ".to" and isinstance(node.args[0], torch.fx.Node) and \
                getattr(node_value(node.args[0]), "dtype", None) == getattr(node_value(node), "dtype", 0):
            continue  # a cast to the same dtype returns its input
        if gather:
            t = "embedding_gather"
        v = node_value(node)
        act = sum((_rows_bytes(x) for x in _tensors(v) if x.dim() >= 1), sympy.Integer(0))
        launches.append((current, Launch(name=t, op=t, node=node.name, kernel="unfused torch op", act_bytes=act),
                         node))
    _assign_events(launches)
    by_layer: dict[int, list[Launch]] = {}
    for layer, la, _ in launches:
        by_layer.setdefault(layer, []).append(la)
    layers = []
    for layer in sorted(by_layer):
        if layer < 0:
            kind = "model (embedding, output AttnRes, lm_head)"
        else:
            kind = ("mla" if config.is_mla_layer(layer) else "kda") + "+" + (
                "moe" if config.is_moe_layer(layer) else "dense")
        layers.append(LayerPlan(layer, kind, by_layer[layer]))
    counts = dict(layer_counts or {})
    return KernelPlan(config.name, tp, bucket, context, layers, counts, note)


def _assign_events(launches) -> None:
    """networkx DAG of the launches; every dependency edge between streams becomes an event."""
    dag = nx.DiGraph()
    owner: dict[torch.fx.Node, int] = {}
    for i, (_, la, node) in enumerate(launches):
        dag.add_node(i)
        owner[node] = i
    for i, (_, la, node) in enumerate(launches):
        for a in _flat_nodes(node):
            src = a
            while src not in owner and src.op == "call_function" and src.target is operator.getitem:
                src = src.args[0]
            if src in owner and owner[src] != i:
                dag.add_edge(owner[src], i)
    assert nx.is_directed_acyclic_graph(dag)
    for u, v in dag.edges:
        lu, lv = launches[u][1], launches[v][1]
        if lu.stream != lv.stream:
            ev = f"ev_{lu.node}"
            if ev not in lu.records:
                lu.records.append(ev)
            lv.waits.append(ev)


def layer_counts(config) -> dict[str, int]:
    out: dict[str, int] = {"model (embedding, output AttnRes, lm_head)": 1}
    for i in range(config.num_hidden_layers):
        kind = ("mla" if config.is_mla_layer(i) else "kda") + "+" + ("moe" if config.is_moe_layer(i) else "dense")
        out[kind] = out.get(kind, 0) + 1
    return out


def representative(config):
    """The smallest prefix of the schedule that contains every layer type (per-layer plans do not depend
    on depth except for the AttnRes block count): K3's first 4 layers are K(dense) K K M."""
    seen, n = set(), 0
    for i in range(config.num_hidden_layers):
        kind = (config.is_mla_layer(i), config.is_moe_layer(i))
        n = i + 1
        seen.add(kind)
        if len(seen) == len({(config.is_mla_layer(j), config.is_moe_layer(j))
                             for j in range(config.num_hidden_layers)}):
            break
    n = min(n + 1, config.num_hidden_layers)  # one more, so that no representative layer is the last one
    if n == config.num_hidden_layers:
        return config, ""
    full = tuple(x for x in config.full_attn_layers if x <= n)
    kda = tuple(x for x in config.kda_layers if x <= n)
    rep = dataclasses.replace(config, num_hidden_layers=n, full_attn_layers=full, kda_layers=kda)
    return rep.validate(), (f"per-layer plans from the first {n} layers of {config.name} (every layer type); "
                            f"whole-model totals weight each type by its count in all {config.num_hidden_layers} layers")


def plans_for(config, *, tp: int, buckets, context: int = 0, every_layer: bool = False,
              max_context: int = 16) -> dict[int, KernelPlan]:
    """One capture, one lowering and one plan per bucket (of the representative prefix of the layers, or
    of ``every_layer``: codegen needs every layer, since e.g. the AttnRes block count grows with depth).
    ``max_context`` is the captured cache capacity (codegen bakes it into the MLA kernels)."""
    check_tp(tp)
    config.check_tp(tp)
    rep, note = (config, "") if every_layer else representative(config)
    cap = capture_config(rep, tp_size=tp, max_context=max_context)
    out = {}
    for b in buckets:
        gm = lower(cap.graph_module, cap.inputs, tp_size=tp, bucket=b, options=Options.make(buckets=(b,)),
                   batch_symbol=cap.batch_symbol)
        out[b] = build_plan(gm, config=rep, tp=tp, bucket=b, context=context, layer_counts=layer_counts(config),
                            note=note)
    return out


def plan_for(config, *, tp: int, bucket: int, context: int = 0) -> KernelPlan:
    return plans_for(config, tp=tp, buckets=(bucket,), context=context)[bucket]


def dumps(plan: KernelPlan, bandwidth: float) -> str:
    return json.dumps(plan.to_json(bandwidth), indent=1)
