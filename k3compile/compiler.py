"""The driver: a captured decode graph -> one lowered graph per batch bucket -> a dispatcher.

Used by the ``torch.compile`` backend (``backend.py``), the explicit :func:`compile` API and the CLI.
Buckets are the compile key, not Dynamo guards: one capture with a symbolic batch, one pipeline run
per declared bucket, dispatch by a dict lookup at call time.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Sequence

import torch
import torch.fx

from .capture import InputInfo, classify_inputs, mark_batch_dynamic, symbolic_batch
from .models.mxfp4 import relaid_traces_allowed
from .pipeline import PassContext, copy_graph_module
from .pipeline_table import build_pipeline
from .templates.base import BUCKETS as DEFAULT_BUCKETS  # the batch buckets the kernel templates compile for

log = logging.getLogger("k3compile")

SUPPORTED_TP = (1, 2, 4, 8, 16)
SUPPORTED_ARCHS = ("sm_90a", "sm_100a")


class BucketError(ValueError):
    """A batch that no declared bucket holds (and eager fallback was not asked for)."""


@dataclasses.dataclass(frozen=True)
class Options:
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    dump_dir: str | None = None  # write NN_<pass>.{before.py,after.py,diff} per bucket
    passes: dict = dataclasses.field(default_factory=dict)  # per-pass config overrides
    eager_fallback: bool = False  # batch above the largest bucket: run eager (logged) instead of raising
    arch: str | None = None
    # Where the kernels come from: None (CUDA: $K3_KERNEL_PACKAGE if set, else "jit"; CPU: "eager"),
    # "package:DIR", "jit" (CuTe DSL compiler, disk-cached), "reference" (float64 template references:
    # checks the runtime's bindings on any device) or "eager" (the dialect's eager implementations).
    kernels: str | None = None
    cuda_graphs: bool = True  # one CUDA graph per bucket (CUDA only)
    check_inputs: bool = True  # validate token ids and lengths before each step (synchronises)
    disable_kernels: tuple = ()  # dialect ops / kernel names forced onto their eager op (coverage tests)
    shadow: bool = False  # also run every dialect op eagerly on the same inputs: runtime.shadow_errors()
    batch_invariant: bool = False  # every bucket reduces a row in bucket 1's order (codegen --batch-invariant)
    # TP > 1 on real ranks: the residual kernels all-reduce in-kernel (one-shot over symmetric memory) when
    # one rank's message is at most this many bytes; above it (or with 0) NCCL all-reduces before them
    oneshot_max_bytes: int = 1 << 20
    # run the kernels the plan puts on a side stream (the shared expert's down-projection) on a second CUDA
    # stream, forked after their inputs and joined before their first consumer (runtime.route_streams).
    # None: on for a CUDA step (not in shadow mode, which compares every node on one stream), off elsewhere;
    # False: every kernel on one stream in graph order; True: on, and an error off CUDA
    side_streams: bool | None = None
    # the routed experts' MXFP4 codes are rewritten into the kernels' layout in the weights' own memory at the
    # first step instead of into a copy kept beside them (the copy is 170 GB per rank of the real config at TP 8):
    # one copy of the experts, as a deployment holds them. The model's eager ops still read them (through
    # models.mxfp4.checkpoint_codes, undoing the layout of the experts they gather, so eager steps are slower);
    # a write to those weights afterwards is an error (reload the model instead)
    relay_in_place: bool = False

    @classmethod
    def make(cls, options: "Options | dict | None" = None, **kw) -> "Options":
        if isinstance(options, Options):
            base = dataclasses.asdict(options)
        else:
            base = dict(options or {})
        base.update({k: v for k, v in kw.items() if v is not None})
        unknown = set(base) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown k3compile option(s) {sorted(unknown)}; "
                            f"known: {[f.name for f in dataclasses.fields(cls)]}")
        if "buckets" in base:
            base["buckets"] = check_buckets(base["buckets"])
        if base.get("arch") not in (None, *SUPPORTED_ARCHS):
            raise ValueError(f"unsupported arch {base['arch']!r}; k3compile targets {list(SUPPORTED_ARCHS)}")
        k = base.get("kernels")
        if k is not None and k not in ("jit", "reference", "eager") and not str(k).startswith("package:"):
            raise ValueError(f"kernels={k!r}: pass 'package:DIR' (a prebuilt package), 'jit', 'reference' or "
                             f"'eager'")
        if "disable_kernels" in base:
            base["disable_kernels"] = tuple(base["disable_kernels"])
        return cls(**base)


def check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    b = tuple(sorted({int(x) for x in buckets}))
    if not b or b[0] < 1:
        raise BucketError(f"buckets must be positive batch sizes, got {list(buckets)}")
    return b


def bucket_for(batch: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``batch`` (None if above the largest)."""
    for b in buckets:
        if batch <= b:
            return b
    return None


def check_tp(tp_size: int) -> None:
    if tp_size not in SUPPORTED_TP:
        raise ValueError(f"unsupported TP size {tp_size}; k3compile supports {list(SUPPORTED_TP)}")


def lower(gm: torch.fx.GraphModule, inputs: list[InputInfo], *, tp_size: int, bucket: int,
          options: Options, batch_symbol=None, tp_rank: int = 0) -> torch.fx.GraphModule:
    """Run the pipeline on a copy of the captured graph for one (bucket, TP) point."""
    work = copy_graph_module(gm)
    work.meta["k3_inputs"] = inputs
    dump = None
    if options.dump_dir:
        import os
        dump = os.path.join(options.dump_dir, f"tp{tp_size}_bucket{bucket}")
    ctx = PassContext(bucket=bucket, tp_size=tp_size, inputs=inputs, batch_symbol=batch_symbol, dump_dir=dump,
                      tp_rank=tp_rank)
    build_pipeline(options.passes).run(work, ctx)
    return work


class BucketDispatcher:
    """What the backend hands back to Dynamo with ``kernels="eager"`` (the CPU default): picks the lowered
    graph of the batch's bucket and runs it through the dialect's eager implementations (bit-identical to
    the eager model). With kernels, :class:`k3compile.runtime.KernelDispatcher` takes its place.
    """

    def __init__(self, graphs: dict[int, torch.fx.GraphModule], token_index: int, options: Options,
                 fallback=None):
        self.graphs = graphs
        self.buckets = tuple(sorted(graphs))
        self.token_index = token_index
        self.options = options
        self.fallback = fallback
        self.calls: dict[int, int] = {b: 0 for b in self.buckets}

    def __call__(self, *args):
        batch = args[self.token_index].shape[0]
        bucket = bucket_for(batch, self.buckets)
        if bucket is None:
            above_largest_bucket(batch, self.buckets, self.options)
            return self.fallback(*args)
        self.calls[bucket] += 1
        return self.graphs[bucket](*args)


def above_largest_bucket(batch: int, buckets: Sequence[int], options: Options) -> None:
    """A batch above every bucket: raise, or (eager_fallback) log that eager runs instead."""
    if not options.eager_fallback:
        raise BucketError(f"batch {batch} is above the largest compiled bucket {buckets[-1]}; compile with "
                          f"buckets=(..., {max(batch, 2 * buckets[-1])}) or options eager_fallback=True")
    log.warning("k3compile: batch %d is above the largest bucket %d; running eager (eager_fallback)", batch,
                buckets[-1])


def compile_graph(gm: torch.fx.GraphModule, example_inputs, options: Options, tp_size: int | None = None,
                  tp_rank: int | None = None):
    """Backend entry: classify the inputs, lower for every bucket, return the dispatcher."""
    inputs = classify_inputs(gm, example_inputs)
    if tp_size is None:
        tp_size = _infer_tp(gm)
    if tp_rank is None:
        import torch.distributed as dist

        tp_rank = dist.get_rank() if tp_size > 1 else 0
    check_tp(tp_size)
    token_index = next(i for i, info in enumerate(inputs) if info.kind == "token_ids")
    tok = example_inputs[token_index]
    sym = None
    tok_node = [n for n in gm.graph.nodes if n.op == "placeholder"][token_index]
    ev = tok_node.meta.get("example_value")
    if ev is not None and isinstance(ev.shape[0], torch.SymInt):
        sym = ev.shape[0].node.expr
    buckets = options.buckets
    if sym is None:
        # Dynamo specialised the batch: this graph only ever sees this one batch size.
        b = bucket_for(tok.shape[0], buckets)
        if b is None:
            raise BucketError(f"batch {tok.shape[0]} is above the largest bucket {buckets[-1]}")
        log.info("k3compile: batch specialised to %d by Dynamo; use k3compile.compile(model) (or "
                 "torch._dynamo.mark_dynamic(token_ids, 0)) for one graph serving every bucket", tok.shape[0])
        buckets = (b,)
    kernels = kernels_for(options, tok.device)
    if kernels != "eager":
        check_kernel_buckets(buckets)
    graphs = {b: lower(gm, inputs, tp_size=tp_size, bucket=b, options=options, batch_symbol=sym, tp_rank=tp_rank)
              for b in buckets}
    if kernels == "eager":
        log.warning("k3compile: %s; running the lowered graph through the K3 dialect's eager implementations",
                    "no CUDA device" if tok.device.type != "cuda" else "kernels='eager' was asked for")
        return BucketDispatcher(graphs, token_index, options, fallback=gm.forward)
    _check_static_geometry(gm, inputs, sym)
    return _kernel_dispatcher(graphs, inputs, kernels, tok.device, tp_size, options, gm.forward)


def kernels_for(options: Options, device) -> str:
    """Where a step on ``device`` takes its kernels from: ``options.kernels``, else on CUDA the package named by
    ``$K3_KERNEL_PACKAGE`` or "jit", elsewhere "eager"."""
    if options.kernels is not None:
        return options.kernels
    if torch.device(device).type == "cuda":
        pkg = os.environ.get("K3_KERNEL_PACKAGE")
        return f"package:{pkg}" if pkg else "jit"
    return "eager"


def check_kernel_buckets(buckets: Sequence[int]) -> None:
    """The kernel templates are built for DEFAULT_BUCKETS only (the eager dialect ops take any bucket)."""
    bad = [b for b in buckets if b not in DEFAULT_BUCKETS]
    if bad:
        raise BucketError(f"buckets {bad} have no kernels: the templates are built for buckets {DEFAULT_BUCKETS}, "
                          f"and a batch in between runs padded to the next one. Fix: compile with buckets from "
                          f"those, or kernels='eager'")


def _check_static_geometry(gm: torch.fx.GraphModule, inputs, batch_symbol) -> None:
    """The kernels are specialised to every size but the batch: refuse a graph in which Dynamo made another size
    symbolic (by name, its automatic dynamic shapes do so when a state of another capacity or max_context comes)."""
    for node, info in zip((n for n in gm.graph.nodes if n.op == "placeholder"), inputs):
        ev = node.meta.get("example_value")
        if not isinstance(ev, torch.Tensor):  # (a size input: its symbol is some tensor's size too)
            continue
        loose = sorted({str(s) for d in ev.shape if isinstance(d, torch.SymInt)
                        for s in d.node.expr.free_symbols if s != batch_symbol})
        if loose:
            raise BucketError(
                f"{info.kind} input {info.label} has a symbolic size ({', '.join(loose)}): Dynamo's automatic "
                f"dynamic shapes made it so when a state of another capacity or max_context came; the kernels take "
                f"every size but the batch as a constant. Fix: step = k3compile.compile(model, ...): one graph for every batch, and "
                f"each state geometry one more compile")


def _kernel_dispatcher(graphs, inputs, kernels: str, device, tp_size: int, options: Options, fallback):
    from . import runtime

    if runtime.emulating(tp_size):
        log.warning("k3compile: TP %d on one device: collectives are the identity (per-rank compute, "
                    "communication excluded)", tp_size)
    arch = options.arch or "sm_90a"
    if kernels == "reference":
        source = runtime.ReferenceKernels()
    else:
        if device.type != "cuda":
            raise RuntimeError(f"kernels={kernels!r} needs a CUDA device, but the model is on {device}. Fix: move "
                               f"the model to CUDA (load_pretrained(..., device='cuda')), or use kernels='eager' "
                               f"or 'reference' on the CPU")
        if options.arch is None:
            major, minor = torch.cuda.get_device_capability(device)
            arch = f"sm_{major}{minor}a"
            if arch not in SUPPORTED_ARCHS:
                raise RuntimeError(f"the GPU is {arch}; k3compile's kernels target {list(SUPPORTED_ARCHS)}")
        if kernels == "jit":
            points = {}
            for b, g in graphs.items():
                points.update(runtime.graph_points(g, bucket=b, tp=tp_size, arch=arch,
                                                   batch_invariant=options.batch_invariant))
            from .build import cache_root

            source = runtime.jit_package(points, cache_root().parent / "jit" / arch)
        else:
            source = runtime.PackageKernels(kernels.removeprefix("package:"))
    d = runtime.KernelDispatcher(graphs, inputs, tp=tp_size, source=source, arch=arch, device=device,
                                 options=options, fallback=fallback)
    log.warning("k3compile: kernel runtime on %s: %s, buckets %s%s", device, source.describe(), list(d.buckets),
                ", CUDA graphs" if d.use_graphs else "")
    return d


def _infer_tp(gm: torch.fx.GraphModule) -> int:
    has_collective = any("c10d" in str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    if not has_collective:
        return 1
    import torch.distributed as dist

    return dist.get_world_size()


def mark_dynamic_inputs(token_ids: torch.Tensor, state) -> None:
    """The batch is symbolic. The state's geometry (capacity, max_context) stays static: it is fixed for
    a serving process, and a symbolic capacity makes ``state[:B]`` data-dependent on torch 2.11."""
    mark_batch_dynamic(token_ids)


class CompiledDecode:
    """``k3compile.compile(model)``: call it like ``model.decode(token_ids, state)``.

    Every batch size up to the largest bucket runs without Dynamo recompiling: the batch dimension is
    marked dynamic and sizes 0/1 are not specialised. A state of another capacity or ``max_context``
    is another specialisation (one compile each); a serving process allocates its state once.
    """

    def __init__(self, model, options: Options):
        self.model = model
        self.options = options
        self.dispatchers: list[BucketDispatcher] = []

        def backend(gm, example_inputs, **_):
            d = compile_graph(gm, example_inputs, options, tp_size=model.tp.size, tp_rank=model.tp.rank)
            self.dispatchers.append(d)
            return d

        # dynamic=False: nothing but the marked batch is symbolic (Dynamo's automatic dynamic shapes would make a
        # second state geometry symbolic, max_context included, which the kernels cannot take)
        self._compiled = torch.compile(model.decode, backend=backend, fullgraph=True, dynamic=False)

    def __call__(self, token_ids: torch.Tensor, state) -> torch.Tensor:
        # eager's argument errors and the buckets, before Dynamo (which would report a raise while tracing as a
        # graph break)
        self.model.check_decode_args(token_ids, state)
        if kernels_for(self.options, token_ids.device) != "eager":
            check_kernel_buckets(self.options.buckets)
        B = token_ids.shape[0]
        if bucket_for(B, self.options.buckets) is None:
            above_largest_bucket(B, self.options.buckets, self.options)
            return self.model.decode(token_ids, state)
        mark_dynamic_inputs(token_ids, state)
        # (a retrace goes to this backend, whose kernels take relaid codes: relay_in_place's tensors may live)
        with symbolic_batch(), relaid_traces_allowed():
            return self._compiled(token_ids, state)

    def state_rows(self, batch: int) -> int:
        """Rows a decode state needs for ``batch`` sequences here: the bucket the batch is padded to (the kernel
        runtime keeps the padding rows' state as it found it), or the batch itself above the largest bucket
        (eager fallback). ``K3Model.generate`` allocates its state with it."""
        return bucket_for(batch, self.options.buckets) or batch

    @property
    def graphs(self) -> dict[int, torch.fx.GraphModule]:
        if not self.dispatchers:
            raise RuntimeError("nothing compiled yet: call the compiled decode once")
        return self.dispatchers[-1].graphs


def compile(model, *, tp: int | None = None, buckets: Sequence[int] = DEFAULT_BUCKETS, arch: str | None = None,
            options: dict | Options | None = None) -> CompiledDecode:
    """Compile ``model.decode`` for the given buckets. ``tp`` must match the model's TP size."""
    tp_size = model.tp.size
    if tp is not None and tp != tp_size:
        raise ValueError(f"tp={tp} but the model was built for tp_size={tp_size}; load it with "
                         f"load_pretrained(..., tp_rank=r, tp_size={tp})")
    check_tp(tp_size)
    model.config.check_tp(tp_size)
    opts = Options.make(options, buckets=tuple(buckets), arch=arch)
    return CompiledDecode(model, opts)


def describe(records) -> str:
    return "\n".join(r.summary() for r in records)

