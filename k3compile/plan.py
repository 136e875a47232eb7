"""The kernel plan: the lowered graph of one (bucket, TP) point as an ordered list of kernel launches per
layer, with streams, events, prefetches, bytes moved and FLOPs, and the per-layer HBM floor.

Bytes and FLOPs are sympy expressions in the batch ``B`` (evaluated per bucket). Routed-expert bytes
use the expected number of distinct experts a batch touches, ``E * (1 - (1 - k/E)**B)``: the floor
grows with the distinct experts hit. The dependency DAG (networkx) turns every edge between streams
into an event record/wait.

What is *not* a launch: views and tuple unpacking (``getitem``), the AttnRes block bank (``stack`` is a
view of a preallocated bank that the producing kernel writes), decode-state writes (``copy_``,
``index_put_`` of a kernel's new state: the kernel writes the state in place), ``prefetch`` (the
prefetch_weights pass's hint, shown as ``prefetch-hint:`` on the launch it precedes; no kernel issues it yet:
the runtime drops the node). Every other remaining torch op is listed
as an unfused ``torch.*`` launch, so a fusion that did not happen shows up in the count.

A launch is one dialect op (or one of the launches it is split into), not one GPU kernel. Each launch also
carries what it runs on the GPU: the kernel templates codegen maps it to (``codegen.lower_node``; a template
may launch several kernels: ``Point.kernels``, which the PTX audit checks against the compiled entries), and
the collectives the runtime issues through torch.distributed beside them at TP > 1 (the all-gathers of
row-sharded GEMM outputs, the latent all-reduce before an FFN tail's up-projection, model-level collectives).
So a layer's line reads, e.g. at K3 TP8 batch 1, ``mla+moe: 9 launches = 13 GPU kernels + 2 all-gathers + 1
all-reduce``. In one-GPU TP emulation the all-reduce runs no kernel and an all-gather one copy kernel, unless the
kernel before wrote the gathered layout itself (the MoE front GEMV's router and latent rows: ``emulated_copies``
counts the others); the H200 profiler counted 15 kernels for that layer when both all-gathers were copies
(BENCHMARKS.md, sixteenth entry).
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

TORCH_OP = "unfused torch op"
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
    kernels: list = field(default_factory=list)  # template of each kernel point (codegen.lower_node), in order
    gpu_kernels: int | None = None  # GPU kernels those points launch; None: no template covers it (uncovered)
    collectives: dict = field(default_factory=dict)  # kind -> count, issued by the runtime (torch.distributed)
    emulated_copies: int = 0  # all-gathers one-GPU TP emulation runs as a copy kernel (not written gathered)
    uncovered: str = ""  # why no template covers the launch
    fx: object = field(default=None, repr=False, compare=False)  # the lowered graph's node (codegen reads it)

    def bytes(self, b: int) -> int:
        return int(sympy.ceiling((self.weight_bytes + self.act_bytes + self.state_bytes).subs(B, b)))

    def kernels_text(self) -> str:
        """``2: gemv+residual_attn_res``, a torch op, a collective, or why no template covers the launch."""
        if self.kernel == TORCH_OP:
            return TORCH_OP
        if self.gpu_kernels is None:
            return "uncovered: " + self.uncovered
        return f"{self.gpu_kernels}: {'+'.join(self.kernels)}" if self.kernels else "collective"

    def as_dict(self, b: int) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("weight_bytes", "act_bytes", "state_bytes", "flops", "fx")}
        d = {k: list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v for k, v in d.items()}
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

    def counts(self) -> dict:
        """What the layer runs on the GPU: kernels from templates, unfused torch ops (one kernel each, roughly),
        launches no template covers, and the runtime's collectives by kind."""
        coll: dict = {}
        for l in self.launches:
            for k, n in l.collectives.items():
                coll[k] = coll.get(k, 0) + n
        return {"gpu_kernels": sum(l.gpu_kernels or 0 for l in self.launches),
                "torch_ops": sum(1 for l in self.launches if l.kernel == TORCH_OP),
                "uncovered": sum(1 for l in self.launches if l.uncovered), "collectives": coll,
                "emulated_copies": sum(l.emulated_copies for l in self.launches)}

    def counts_text(self) -> str:
        c = self.counts()
        parts = [f"{c['gpu_kernels']} GPU kernel{'s' * (c['gpu_kernels'] != 1)}"]
        if c["torch_ops"]:
            parts.append(f"{c['torch_ops']} torch op{'s' * (c['torch_ops'] != 1)}")
        if c["uncovered"]:
            parts.append(f"{c['uncovered']} without a template")
        parts += [f"{n} {k.replace('_', '-')}{'s' * (n != 1)}" for k, n in sorted(c["collectives"].items())]
        return " + ".join(parts)


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
                           "n_launches": len(lp.launches), **lp.counts(), "bytes": lp.bytes(b),
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
                         f"{len(lp.launches)} launches = {lp.counts_text()}, {mb:.2f} MB, floor "
                         f"{self.floor_us(lp, bandwidth):.1f} us")
            lines.append(f"   {'#':>2} {'kernel launch':<34} {'stream':<13} {'GPU kernels (templates)':<30} "
                         f"{'weights MB':>10} {'act+state MB':>12} {'GFLOP':>8}  sync")
            for i, l in enumerate(lp.launches, 1):
                w = float(l.weight_bytes.subs(B, b)) / 1e6
                a = float((l.act_bytes + l.state_bytes).subs(B, b)) / 1e6
                fl = float(l.flops.subs(B, b)) / 1e9
                sync = " ".join([f"wait:{e}" for e in l.waits] + [f"record:{e}" for e in l.records]
                                + ([f"prefetch-hint:{l.prefetch_bytes / 1e6:.1f}MB"] if l.prefetch_bytes else [])
                                + [f"{k.replace('_', '-')}:{n}" for k, n in sorted(l.collectives.items())])
                lines.append(f"   {i:>2} {l.name:<34} {l.stream:<13} {l.kernels_text()[:30]:<30} {w:>10.3f} "
                             f"{a:>12.4f} {fl:>8.3f}  {sync}")
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

    def weight_shares(self, node, names) -> list:
        """Each launch's share of a node's weight bytes and FLOPs: the routed experts' launches by the weights
        they stream (``*_gate_up``: W1 and W3, ``*_down_combine``: W2, the selection ``*_route``: none), any
        other node's launches evenly."""
        op = dialect.op_name(node)
        if op in ("routed_experts", "latent_moe_experts") and len(names) > 1:
            wargs = node.args[6:12] if op == "routed_experts" else node.args[3:9]
            w13 = sympy.Integer(sum(_nbytes_static(w) for w in wargs[:4]))
            w2 = sympy.Integer(sum(_nbytes_static(w) for w in wargs[4:]))
            part = {"gate_up": w13 / (w13 + w2), "down_combine": w2 / (w13 + w2)}
            return [next((v for k, v in part.items() if n.endswith(k)), sympy.Integer(0)) for n in names]
        return [sympy.Rational(1, len(names))] * len(names)

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
            # an FFN tail's row-sharded up-projection (shard_routing): this rank reads 1/tp of its rows
            sharded_up = node.args[3] if op.startswith("ffn_tail") and _up_rank(node) >= 0 and self.tp > 1 else None
            for a in args:
                if self.is_weight(a):
                    share = self.tp if a is sharded_up else 1
                    weight += sympy.Integer(_nbytes_static(a)) / share
                    if len(node_value(a).shape) == 2 and op not in ("attn_res", "attn_res_rms_norm"):
                        flops += 2 * B * node_value(a).numel() / share
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
            shares = costs.weight_shares(node, names)
            for j, name in enumerate(names):
                share = sympy.Rational(1, len(names))
                la = Launch(name=name, op=dialect.op_name(node), node=node.name, kernel=kernel,
                            stream=node.meta.get("k3_stream", "main"), inputs=inputs_desc, fx=node,
                            weight_bytes=w * shares[j], act_bytes=a * share, state_bytes=s * share,
                            flops=f * shares[j])
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
        launches.append((current, Launch(name=t, op=t, node=node.name, kernel=TORCH_OP, act_bytes=act), node))
    _assign_events(launches)
    _attach_kernels(launches, bucket, tp)
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


def _collectives(node, tp: int) -> dict:
    """What the runtime issues through torch.distributed for this dialect node at TP > 1 beside its kernels
    (``runtime.Binding._front_gemm`` / ``_linear_gather`` / ``_ffn_sum``, ``runtime.Collective``). The
    partial-sum all-reduces of the o_proj and FFN tails are not here: the residual kernel does them."""
    if tp == 1:
        return {}
    from .codegen import _arg

    op = dialect.op_name(node)
    if op == "front_gemm":
        n = sum(1 for g in _arg(node, "gather") if g)
        return {"all_gather": n} if n else {}
    if op in ("linear_gather", "tp_all_gather"):
        return {"all_gather": 1}
    if op == "tp_all_reduce":
        return {"all_reduce": 1}
    if op in ("ffn_tail", "ffn_tail_norm") and _arg(node, "latent_partial") is not None:
        return {"all_reduce": 1, "all_gather": 1} if _up_rank(node) >= 0 else {"all_reduce": 1}
    return {}


def _up_rank(node) -> int:
    """An FFN tail's ``up_rank``: this rank's share of the row-sharded up-projection, -1 when replicated."""
    from .codegen import _arg

    v = _arg(node, "up_rank")
    return -1 if v is None else int(v)


def _attach_kernels(launches, bucket: int, tp: int) -> None:
    """Each dialect launch's kernel templates and GPU kernel count (what codegen and the runtime bind for it:
    ``codegen.lower_node``; a node split into several launches, the routed experts: ``codegen.per_launch``), and
    its collectives."""
    from .codegen import _LOWERING, lower_node, per_launch
    from .templates import get as get_template
    from .templates.base import TemplateError
    from .templates.gemv import gathered_in_kernel

    groups: dict = {}
    for _, la, node in launches:
        if la.kernel != TORCH_OP:
            groups.setdefault(node, []).append(la)
    for node, las in groups.items():
        las[0].collectives = _collectives(node, tp)
        op, why = dialect.op_name(node), ""
        if op in ("tp_all_reduce", "tp_all_gather"):  # only the collective itself
            las[0].gpu_kernels = 0
            las[0].emulated_copies = las[0].collectives.get("all_gather", 0)
            continue
        if op not in _LOWERING:
            why = f"no template for dialect op {op}"
        else:
            try:
                specs, _ = lower_node(node, bucket, tp)
                points = [get_template(t).point(**params) for t, params in specs]
            except TemplateError as e:
                why = str(e)
        if why:
            for la in las:
                la.uncovered = why
            continue
        for la, ps in zip(las, per_launch(points, len(las))):
            la.kernels = [p.template.name for p in ps]
            la.gpu_kernels = sum(p.kernels for p in ps)
        # one-GPU emulation copies each all-gathered shard (runtime._gather) unless the kernel wrote it in the
        # gathered layout itself (a front GEMV's REPLICAS / F32_REPLICAS)
        gathers = las[0].collectives.get("all_gather", 0)
        if op in ("front_gemm", "ffn_tail", "ffn_tail_norm") and gathers:
            gathers -= sum(gathered_in_kernel(p.c) for p in points if p.template.name == "gemv")
        las[0].emulated_copies = gathers


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
    if not 0 <= context < config.max_position_embeddings:
        raise ValueError(f"context {context} must be in 0..{config.max_position_embeddings - 1}: the tokens already "
                         f"in each sequence, with room for the one being decoded ({config.name}'s "
                         f"max_position_embeddings is {config.max_position_embeddings})")
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
