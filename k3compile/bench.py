"""``k3compile bench``: the whole decode step, eager vs Inductor vs k3compile, in one process on one GPU.

The baselines (issue #6): ``eager`` (the reference model: MXFP4 experts dequantised on the fly),
``eager-bf16`` (the same model with the routed experts served from bf16 copies dequantised once, for the
bench only), both also captured once into a CUDA graph and replayed per step (``eager-graph``,
``eager-bf16-graph``), and Inductor (``torch.compile`` of the same decode: ``inductor``, default mode;
``inductor-graph``, the same replayed from one CUDA graph, as the issue asks; ``inductor-autotune-graph``, mode
``max-autotune-no-cudagraphs`` in one CUDA graph, minutes of autotuning per row). The eager decode validates its
inputs with a host sync (``check_decode_inputs`` in models/model.py), which a CUDA graph cannot capture: the
warm-up steps run the real check, the capture a sync-free one (``_unchecked_inputs``), as k3compile's rows run
with ``check_inputs=False``; the Inductor graph rows trace the sync-free one (Dynamo inlines it) and run under
it throughout. A row that cannot run carries the failure (and the line that raised it) as its note.

For every (context, bucket) the same model, state and tokens run through each system; each figure comes
from ``--steps`` consecutive decode steps (the state advances, as in serving) after WARMUP_S seconds of
warm-up steps (the state's context reset after them), timed between CUDA events in ROUNDS rounds: the median
round's mean (one slow round, e.g. host gaps, would otherwise move a per-layer difference T(n) - T(n-1) by up
to 100 us). Each k3compile row also carries its kernel profile; its GPU busy time (the kernels' exposed
times added up) gives a second per-layer figure, the one that counts where a step is host-bound (its wall
time more than HOST_BOUND x its busy time: the 1-layer slice at batch 1 and 8 in 2026-11-30's runs). Beside it: the HBM floor of the step (bytes the plan
says must move -- weights, the experts the batch selects, the state read and written -- over the copy
bandwidth measured in the same run), kernel launches per step (counted by the profiler), and GPU memory
beyond weights and state.

A time is only a result if the step computed something: every k3compile row checks the logits of one more step
after the timing (``output_problem``: all finite), and a row that fails is marked INVALID in the table, the JSON
(``invalid``) and the exit status (1). A kernel that writes NaN can make a step *faster* (at batch 8 NaN router
logits collapse the selection onto a few experts: a broken moe_down_combine measured 0.98 x the floor, 2026-12-03),
so a per-layer figure below its floor is flagged BELOW THE FLOOR as well.

Per layer type: the step time of a model with the first ``n`` layers minus that with ``n - 1`` layers is
the n-th layer's time (``--layers 1,2,4`` on a slice: layer 2 is KDA + MoE, layer 4 gated MLA + MoE).

A TP size above 1 runs rank 0's shard on this one GPU with the collectives as no-ops (a fake process
group): per-rank compute, communication excluded -- said so in the table and the JSON. Launched by
``torchrun --nproc-per-node N`` (N = ``--tp``) it runs the real thing: every rank its shard on its own
GPU, NCCL for the model's collectives and the fused residual kernels' one-shot all-reduce over symmetric
memory (system ``k3compile``), or NCCL all-reduces before the same kernels (``k3compile-nccl``); rank 0
reports its own times (the ranks run in lockstep).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import json
import math
import os
import re
import sys
import time
import traceback

import torch

from .build import MODULE_PREFIX
from .comm import leave, torchrun_world
from .kernel_check import measure_copy_bandwidth

# Every system, in the order run_model runs them: k3compile first (its lowered graph gives the floor),
# Inductor last (see run_model)
SYSTEMS = ("k3compile", "k3compile-nccl", "k3compile-one-stream", "eager", "eager-bf16", "eager-graph",
           "eager-bf16-graph", "inductor", "inductor-graph", "inductor-autotune-graph")
# Every single-GPU baseline beside k3compile (k3compile-nccl only differs under torchrun): run()'s default, and
# the CLI's --systems default
DEFAULT_SYSTEMS = ("eager", "eager-bf16", "eager-graph", "eager-bf16-graph", "inductor-graph", "k3compile")
SYSTEMS_HELP = ("comma-separated: eager (MXFP4 experts dequantised on the fly), eager-bf16 (experts pre-dequantised "
                "to bf16), eager-graph and eager-bf16-graph (the same inside one CUDA graph), inductor (torch.compile, default "
                "mode), inductor-graph (the same replayed from one CUDA graph), inductor-autotune-graph (mode "
                "max-autotune-no-cudagraphs, in one CUDA graph: minutes of autotuning per row), k3compile, "
                "k3compile-nccl (TP > 1: NCCL all-reduce before the residual kernels instead of their one-shot "
                "all-reduce), k3compile-one-stream (every kernel on one CUDA stream, side_streams=False; k3compile "
                "runs the plan's side-stream kernels on a second stream)")


def check_systems(systems) -> tuple:
    """``systems`` as a tuple, or a ValueError naming the unknown ones (before any model is built)."""
    systems = tuple(systems)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise ValueError(f"unknown bench system(s) {unknown}; choose from {', '.join(SYSTEMS)}" if unknown
                         else f"no bench systems given; choose from {', '.join(SYSTEMS)}")
    return systems


@dataclasses.dataclass
class Row:
    config: str
    layers: int
    tp: int
    context: int
    bucket: int
    system: str
    us_per_step: float = float("nan")
    launches: int = -1
    floor_us: float = float("nan")
    extra_mem_mb: float = float("nan")  # beyond weights and state (k3compile: relaid expert weights excluded)
    relaid_mb: float = 0.0  # k3compile: this model's weights kept in a kernel's own layout (runtime.relaid_bytes)
    note: str = ""
    kernels: list = dataclasses.field(default_factory=list)  # [{"name", "calls", "us", "exposed_us"}] per step
    planned_kernels: list = dataclasses.field(default_factory=list)  # k3compile: per layer, the plan's kernels
    input_copies: int = -1  # k3compile: torch copies of strided kernel inputs per step (runtime.input_copies)
    invalid: str = ""  # k3compile: why the step's output is not a result (output_problem), else ""

    @property
    def x_floor(self) -> float:
        return self.us_per_step / self.floor_us


def _init_tp(tp: int) -> int:
    """This process's rank: real ranks under torchrun (NCCL, one GPU each), else rank 0 of a fake group."""
    import torch.distributed as dist

    from .comm import init_ranks, torchrun_world

    world = torchrun_world()
    if world > 1:
        if world != tp:
            raise SystemExit(f"torchrun started {world} processes but --tp is {tp}: pass --tp {world} (one GPU "
                             f"per rank), or run without torchrun for single-GPU emulation")
        return init_ranks()
    if tp == 1 or dist.is_initialized():
        return 0
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    return 0


def build_model(config, tp: int, device: str = "cuda", seed: int = 0):
    from .models.random_init import random_model

    rank = _init_tp(tp)
    return random_model(config, tp_rank=rank, tp_size=tp, device=device, seed=seed)


def _floor_us(lowered, model, state, ids, tp: int, bucket: int, context: int, bandwidth: float) -> float:
    """µs to move the bytes one step must move (the kernel plan of this very model's lowered graph, from
    the k3compile run, else from a compile with eager kernels) at the measured bandwidth."""
    return _plan_figures(lowered, model, state, ids, tp, bucket, context, bandwidth)[0]


def _plan_figures(lowered, model, state, ids, tp: int, bucket: int, context: int, bandwidth: float,
                  emulated: bool = False) -> tuple[float, list]:
    """``_floor_us``, and the GPU kernels the plan expects per decoder layer (``planned_kernels``)."""
    import k3compile
    from .plan import build_plan

    if lowered is None:
        # a fresh capture (see verify._compile): after k3compile rows of other buckets, one of them failed, the
        # floor's recompile of the same decode failed to trace (H100, TP 2 slice, 2026-12-05: "Could not guard
        # on data-dependent expression")
        torch._dynamo.reset()
        step = k3compile.compile(model, buckets=(bucket,), options={"kernels": "eager"})
        step(ids, state)
        lowered = step.graphs[bucket]
        torch._dynamo.reset()
    plan = build_plan(lowered, config=model.config, tp=tp, bucket=bucket, context=context)
    return sum(lp.bytes(bucket) for lp in plan.layers) / bandwidth * 1e6, planned_kernels(plan, emulated)


def planned_kernels(plan, emulated: bool) -> list:
    """Per decoder layer (index = layer), the GPU kernels the plan says the profiler will count for a k3compile
    row: the templates' kernels, a torch op's kernel, and in one-GPU TP emulation one copy per all-gather the
    kernel before it did not write in the gathered layout (the runtime repeats this rank's shard; the
    all-reduce is the identity there). Empty under real TP: NCCL's kernels are not modelled."""
    if plan.tp > 1 and not emulated:
        return []
    out = []
    for lp in sorted((lp for lp in plan.layers if lp.layer >= 0), key=lambda lp: lp.layer):
        c = lp.counts()
        out.append(c["gpu_kernels"] + c["torch_ops"] + (c["emulated_copies"] if emulated else 0))
    return out


ROUNDS = 5  # timing rounds per figure (the median round counts)
WARMUP_S = 0.2  # busy warm-up before a figure's rounds, seconds of steps (at least 3 steps)


def _time_steps(fn, steps: int, reset=None, room: int = 3) -> float:
    """µs per step: ``steps`` steps in ROUNDS rounds of about steps / ROUNDS, the median round's mean, after a
    warm-up of WARMUP_S seconds of steps (at least 3, at most ``room``: the state's free context) and then
    ``reset()`` (the state back to its context), so the figure does not start cold. A step whose host work
    (Python, the graph launch) takes longer than its kernels stays slower than its kernels however long the
    warm-up: such rows are flagged (host_bound) and per_layer's ``busy_us`` measures the layer instead."""
    t0, n = time.perf_counter(), 0
    while n < 3 or (n < room and time.perf_counter() - t0 < WARMUP_S):
        fn()
        n += 1
        if n % 8 == 0:
            torch.cuda.synchronize()  # wall time counts GPU work, not queued launches
    torch.cuda.synchronize()
    if reset:
        reset()
    per_round = [steps // ROUNDS + (i < steps % ROUNDS) for i in range(min(ROUNDS, steps))]
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(per_round) + 1)]
    events[0].record()
    for n, ev in zip(per_round, events[1:]):
        for _ in range(n):
            fn()
        ev.record()
    events[-1].synchronize()
    means = sorted(a.elapsed_time(b) * 1e3 / n for n, a, b in zip(per_round, events, events[1:]))
    return means[len(means) // 2]


def _profile_kernels(fn, steps: int = 3) -> tuple[int, list[dict]]:
    """Kernel launches per step and the per-kernel GPU time per step (profiler, ``steps`` steps averaged):
    [{"name", "calls", "us", "exposed_us"}], largest exposed time first. Copies and memsets are not kernels and
    are not counted. The generated kernels are launched with PDL: a kernel starts while its predecessor still
    runs and waits for it inside (griddepcontrol.wait), so ``us`` (start to end) includes that overlap and the
    sum exceeds the step. ``exposed_us`` is what the kernel adds to the timeline: its end minus the latest end
    of the kernels that started before it (0 when it ends earlier); the exposed times sum to the busy time of
    the step, so they say where the step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    calls: dict = {}
    us: dict = {}
    exposed: dict = {}
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                     and "Memcpy" not in e.name and "Memset" not in e.name), key=lambda e: e.time_range.start)
    last_end = float("-inf")
    for e in events:
        calls[e.name] = calls.get(e.name, 0) + 1
        us[e.name] = us.get(e.name, 0.0) + e.device_time
        end = e.time_range.end
        exposed[e.name] = exposed.get(e.name, 0.0) + max(0.0, end - max(last_end, e.time_range.start))
        last_end = max(last_end, end)
    per = [{"name": n, "calls": calls[n] / steps, "us": us[n] / steps, "exposed_us": exposed[n] / steps}
           for n in calls]
    per.sort(key=lambda k: -k["exposed_us"])
    return round(sum(calls.values()) / steps), per


def run(config_name: str, *, layers: list[int] | None, tp: int, buckets: list[int], contexts: list[int],
        package: str | None, systems: tuple = DEFAULT_SYSTEMS, steps: int = 20, log=print, partial=None) -> dict:
    """``partial(result)`` is called after every row (the JSON survives a crash half-way)."""
    from .models import k3_mini, k3_slice

    systems = check_systems(systems)  # a typo fails here, not as a note on every row after the model is built
    if not torch.cuda.is_available():
        raise SystemExit("k3compile bench needs a CUDA GPU (it times kernels); run it on the GPU host")
    bw = measure_copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    # the profiler's one-time setup, outside every row: in 2026-11-30's runs the first profiled row (and no
    # other) carried 12 memcpy32_post kernels per step, 12 µs of its busy time
    _profile_kernels(lambda: torch.ones(1, device="cuda").add_(1), steps=1)
    rows: list[Row] = []
    for n in layers or [None]:
        if config_name == "k3_mini":
            config = k3_mini() if n is None else _prefix(k3_mini(), n)
        elif config_name == "slice":
            config = k3_slice(n or 4)
        else:
            raise SystemExit(f"--config {config_name}: bench runs k3_mini or slice (real dimensions)")
        pkg = package.format(layers=config.num_hidden_layers) if package else None
        cap = _package_context(pkg) if pkg else max(contexts) + steps + 16
        log(memory_note(config, tp, max(buckets), cap, torch.cuda.mem_get_info()[0]))
        model = build_model(config, tp)
        run_model(model, tp=tp, buckets=buckets, contexts=contexts, package=pkg, systems=systems, steps=steps,
                  bandwidth=bw, rows=rows, log=log, partial=partial)
        del model
        free_models()
    return _result(bw, rows)


def memory_note(config, tp: int, bucket: int, cap: int, free: int) -> str:
    """One line before a model is built: what a k3compile row needs on this rank (``k3compile.memory``: weights,
    the experts' relaid copy, the largest bucket's state) against the GPU's free bytes, and a warning when it
    does not fit (its rows would end as out-of-memory notes)."""
    from .memory import rank_memory

    mem = rank_memory(config, tp=tp, bucket=bucket, max_context=cap)
    line = (f"{config.name} TP{tp}: a k3compile row needs about {mem.total / 1e9:.1f} GB on this rank (weights "
            f"{(mem.bf16 + mem.experts) / 1e9:.1f}, relaid experts {mem.relaid / 1e9:.1f}, state of bucket {bucket} "
            f"{mem.state / 1e9:.1f}); {free / 1e9:.1f} GB free")
    if mem.total > free:
        line += ("\n  WARNING: more than is free: its rows will run out of memory; use a larger --tp, fewer --layers "
                 "or a GPU with more memory")
    return line


def free_models() -> None:
    """Free the models nothing references any more. A model that ``k3compile.compile`` (or Inductor) compiled stays
    alive through Dynamo's caches after ``del``, weights and relaid experts included, until ``torch._dynamo.reset()``:
    the next depth's model then came on top of it (a TP 2 slice, 2026-12-05: the 4-layer model ran out of an 80 GB
    card with the 3-layer one still held)."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_model(model, *, tp: int, buckets, contexts, package: str | None, systems, steps: int, bandwidth: float,
              rows: list, log=print, partial=None) -> list:
    """Rows for one model (appended to ``rows``): every system x context x bucket."""
    config, bw = model.config, bandwidth
    nl = config.num_hidden_layers
    # k3compile first (its lowered graph gives the floor), Inductor last: on torch 2.11 a Dynamo capture with
    # a dynamic batch after an Inductor compile of the same function can fail to trace
    order = [s for s in SYSTEMS if s in check_systems(systems)]
    floors: dict = {}
    for system in order:
        for ctx in contexts:
            if ctx + steps + 8 > config.max_position_embeddings:
                raise SystemExit(f"--context {ctx} leaves no room for {steps} steps below {config.name}'s "
                                 f"max_position_embeddings {config.max_position_embeddings}")
            for b in buckets:
                cap = _package_context(package) if package else ctx + steps + 16
                if ctx + steps + 8 > cap:
                    raise SystemExit(f"--context {ctx} + {steps} steps does not fit the package's state capacity "
                                     f"{cap} (its --max-context); pass a context below {cap - steps - 8}")
                state = model.new_state(b, cap)
                gen = torch.Generator().manual_seed(1000 * b + ctx)  # the same tokens on every rank
                ids = torch.randint(0, config.vocab_size // tp, (b,), generator=gen).cuda()
                state.lengths.fill_(ctx)
                row = Row(config.name, nl, tp, ctx, b, system)
                fn = lowered = None
                # the row's patches (eager-bf16's expert copies) live exactly as long as the row
                with contextlib.ExitStack() as stack:
                    try:
                        if (ctx, b) not in floors and not system.startswith("k3compile"):
                            # no k3compile row gave the floor: compile with eager kernels now, before this
                            # system patches the model (eager-bf16) or captures it, outside its extra memory
                            floors[ctx, b] = _floor_us(None, model, state, ids, tp, b, ctx, bw)
                            state.lengths.fill_(ctx)
                        from . import runtime

                        mem0, relaid0 = torch.cuda.memory_allocated(), runtime.relaid_bytes()
                        fn, lowered = _system(system, model, state, ids, b, package, stack)
                        fn()  # compiles (k3compile, Inductor), warms up
                        if system.startswith("k3compile") and (ctx, b, "planned") not in floors:
                            # the plan of the graph this row runs (a baseline row before it may have set the floor)
                            floor, floors[ctx, b, "planned"] = _plan_figures(
                                lowered(), model, state, ids, tp, b, ctx, bw, emulated=tp > 1 and torchrun_world() == 1)
                            floors.setdefault((ctx, b), floor)
                        row.floor_us = floors[ctx, b]
                        if system.startswith("k3compile"):
                            row.planned_kernels = floors[ctx, b, "planned"]
                        state.lengths.fill_(ctx)
                        row.us_per_step = _time_steps(fn, steps, reset=lambda: state.lengths.fill_(ctx),
                                                      room=cap - ctx - 8)
                        row.launches, row.kernels = _profile_kernels(fn)
                        relaid = runtime.relaid_bytes() - relaid0  # made by this row (kept with the weights)
                        if system.startswith("k3compile"):
                            runtime.reset_launch_counts()
                            row.invalid = output_problem(fn())
                            row.input_copies = sum(runtime.input_copies().values())
                            row.relaid_mb = runtime.relaid_bytes(model) / 2**20
                        row.extra_mem_mb = (torch.cuda.memory_allocated() - mem0 - relaid) / 2**20
                    except Exception as e:  # a baseline that cannot run is reported, not hidden
                        row.note = _note(e)
                if tp > 1:
                    row.note = (row.note + "; " if row.note else "") + (
                        f"real TP over {tp} GPUs, communication included" if torchrun_world() > 1
                        else "per-rank compute, communication excluded")
                rows.append(row)
                log(_fmt(row))
                if row.kernels and system.startswith("k3compile"):
                    log(_fmt_kernels(row.kernels) + f"\n    input copies per step (torch, strided kernel inputs): "
                                                    f"{row.input_copies}")
                if partial:
                    partial(_result(bw, rows))
                fn = lowered = state = None  # the closures hold the state: drop both before the next row
                gc.collect()
                torch.cuda.empty_cache()
    return rows


def output_problem(logits) -> str:
    """Why a step's logits are not a result (non-finite values), else ""."""
    if not isinstance(logits, torch.Tensor):
        return f"the step returned {type(logits).__name__}, not logits"
    bad = int((~torch.isfinite(logits)).sum())
    return f"{bad} of {logits.numel()} logits not finite (a kernel wrote NaN/Inf)" if bad else ""


def _note(e: BaseException) -> str:
    """One line for a row that could not run: the exception, what it interrupted if it was raised while
    handling another (a failed CUDA graph capture raises again when the capture is closed), and the line
    outside torch that raised the first one (for a capture: the host sync that is not capturable)."""
    def line(x):
        return f"{type(x).__name__}: {(str(x).splitlines() or [''])[0][:160]}"

    note, first = line(e), e
    while first.__cause__ or first.__context__:
        first = first.__cause__ or first.__context__
    if first is not e:
        note += f" (after {line(first)})"
    ours = [f for f in traceback.extract_tb(first.__traceback__)
            if f"{os.sep}torch{os.sep}" not in f.filename and not f.filename.endswith(f"{os.sep}bench.py")]
    if ours:
        note += f" at {os.path.basename(ours[-1].filename)}:{ours[-1].lineno} {ours[-1].name}"
    return note


def _result(bw: float, rows: list[Row]) -> dict:
    return {"bandwidth": bw, "rows": [dataclasses.asdict(r) | {"x_floor": r.x_floor} for r in rows],
            "per_layer": per_layer(rows), "gpu": torch.cuda.get_device_name(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__}


def _prefix(config, n: int):
    """The first ``n`` layers of ``config`` (the layer lists are 1-based layer numbers)."""
    full = tuple(x for x in config.full_attn_layers if x <= n)
    kda = tuple(x for x in config.kda_layers if x <= n)
    return dataclasses.replace(config, num_hidden_layers=n, full_attn_layers=full, kda_layers=kda).validate()


def _package_context(package: str) -> int:
    with open(f"{package}/manifest.json") as fh:
        return json.load(fh)["max_context"]


def _system(system: str, model, state, ids, bucket: int, package: str | None, stack: contextlib.ExitStack):
    """(one decode step, the lowered graph or None) for ``system``; what must be undone after the row (the
    bf16 expert patch) is entered into ``stack``."""
    import k3compile

    if system.startswith("eager"):
        if "bf16" in system:
            stack.enter_context(bf16_experts(model))
        fn = lambda: model.decode(ids, state)  # noqa: E731
        return (_cuda_graph(fn) if system.endswith("-graph") else fn), None
    if system.startswith("inductor"):
        torch._dynamo.reset()
        mode = "max-autotune-no-cudagraphs" if "autotune" in system else None
        f = torch.compile(model.decode, dynamic=False, mode=mode)
        if not system.endswith("-graph"):
            return (lambda: f(ids, state)), None
        # traced without the input check's host sync (a CUDA graph cannot capture it), every call of the row
        # under the same patch: Dynamo guards on the op it traced, and the real one would recompile
        stack.enter_context(_unchecked_inputs())
        return _cuda_graph(lambda: f(ids, state)), None
    if system in ("k3compile", "k3compile-nccl", "k3compile-one-stream"):
        if not package:
            raise RuntimeError("no --package: k3compile's kernels come from a prebuilt package on the GPU host")
        torch._dynamo.reset()
        opts = {"kernels": f"package:{package}", "check_inputs": False}
        if system == "k3compile-nccl":  # NCCL all-reduces before the residual kernels instead of one-shot
            opts["oneshot_max_bytes"] = 0
        if system == "k3compile-one-stream":
            opts["side_streams"] = False
        step = k3compile.compile(model, buckets=(bucket,), options=opts)
        return (lambda: step(ids, state)), lambda: step.dispatchers[-1].lowered[bucket]
    raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")


@contextlib.contextmanager
def _unchecked_inputs():
    """The decode's input check (``k3model::check_decode_inputs``) without its host synchronisation, which a
    CUDA graph cannot capture: it only returns the write positions. The warm-up steps before the capture ran
    the real check on the same tensors; k3compile's rows skip it the same way (``check_inputs=False``)."""
    ns = torch.ops.k3model
    outer = vars(ns).get("check_decode_inputs")  # an enclosing patch (inductor-graph's), or the cached op
    ns.check_decode_inputs = lambda token_ids, lengths, vocab_size, max_context: lengths.clone()
    try:
        yield
    finally:
        if outer is None:
            del ns.check_decode_inputs  # the namespace looks the real op up again on next access
        else:
            ns.check_decode_inputs = outer


def _cuda_graph(fn, warmup: int = 3):
    """``fn`` captured once into a CUDA graph; returns its replay. Warmed up on a side stream first, as
    torch.cuda.graph requires (lazy initialisation, cuBLAS workspaces and first allocations stay out of the
    capture). The replay reads and writes the tensors the capture saw: the state advances in place."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    rng = torch.cuda.default_generators[torch.cuda.current_device()]
    clean = rng.clone_state()
    try:
        with torch.cuda.graph(graph), _unchecked_inputs():
            fn()
    except BaseException:
        # a capture that fails (a host sync in fn) never reaches the capture's epilogue: the device's default
        # generator stays in capture mode and every later random op (Inductor's compile, torch.randint for the
        # next row's tokens) raises "Offset increment outside graph capture"; put back its state from before
        rng.graphsafe_set_state(clean)
        raise
    return graph.replay  # the bound method keeps the graph (and its memory pool) alive as long as the row


def _dequantize_experts(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, chunk: int = 32) -> torch.Tensor:
    """Stacked MXFP4 experts ``[E, out, in/2]`` -> ``[E, out, in]`` in ``dtype``, ``chunk`` experts at a time:
    dequantize's fp32/int64 temporaries for a whole layer at real shapes would be several times its bf16."""
    from .models.mxfp4 import checkpoint_codes, dequantize

    out = torch.empty(*packed.shape[:-1], 2 * packed.shape[-1], dtype=dtype, device=packed.device)
    for e in range(0, packed.shape[0], chunk):
        out[e:e + chunk] = dequantize(checkpoint_codes(packed, slice(e, e + chunk)), scale[e:e + chunk], dtype)
    return out


@contextlib.contextmanager
def bf16_experts(model):
    """For the bench only: every LatentMoE's routed experts run from bf16 copies of their MXFP4 weights,
    dequantised once on entry, instead of dequantising the selected experts every step.

    The experts are computed as ops.latent_moe_experts' per-token path without its dequantize: gather the
    selected experts' bf16 weights, matmul, SiTU-GLU, matmul, late routing weights summed in fp32 (so the
    result is that path's, bit for bit). The model is not modified: ``ops.latent_moe_experts`` (looked up
    at call time by LatentMoE.forward) is swapped for a function that serves these modules' expert tensors
    and passes any other call through; restored, and the copies dropped, on exit. At real shapes the copies
    are ~7.4 GB per layer (TP 8 shard), counted in the row's extra memory.
    """
    from .models.layers import LatentMoE

    copies: dict = {}  # id(experts_w1_packed) -> (experts_w1_packed, w1, w3, w2)
    ops_modules: dict = {}  # id -> the ops module each LatentMoE class calls (one, unless imported twice)
    for m in model.modules():
        if isinstance(m, LatentMoE):
            ops_mod = inspect.getmodule(type(m)).ops
            ops_modules[id(ops_mod)] = ops_mod
            w1, w3, w2 = (_dequantize_experts(getattr(m, f"experts_{w}_packed"), getattr(m, f"experts_{w}_scale"),
                                              model.dtype) for w in ("w1", "w3", "w2"))
            copies[id(m.experts_w1_packed)] = (m.experts_w1_packed, w1, w3, w2)
    originals = {k: mod.latent_moe_experts for k, mod in ops_modules.items()}

    def patched(original, situ_glu):
        def latent_moe_experts(z, weights, ids, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                               beta, linear_beta):
            hit = copies.get(id(w1_packed))
            if hit is None or hit[0] is not w1_packed or hit[1].dtype != z.dtype:  # not ours: the model's op
                return original(z, weights, ids, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                                beta, linear_beta)
            _, w1, w3, w2 = hit
            zb = z[:, None, None, :]  # [B, 1, 1, L]
            gate = torch.matmul(zb, w1[ids].transpose(-1, -2))[..., 0, :]  # [B, k, I]
            up = torch.matmul(zb, w3[ids].transpose(-1, -2))[..., 0, :]
            h = situ_glu(gate, up, beta, linear_beta)
            y = torch.matmul(h[..., None, :], w2[ids].transpose(-1, -2))[..., 0, :]  # [B, k, L]
            return (y.float() * weights[..., None].float()).sum(1).to(z.dtype)

        return latent_moe_experts

    for k, mod in ops_modules.items():
        mod.latent_moe_experts = patched(originals[k], mod.situ_glu)
    try:
        yield copies
    finally:
        for k, mod in ops_modules.items():
            mod.latent_moe_experts = originals[k]
        copies.clear()


HOST_BOUND = 1.15  # a row whose step takes this much longer than its kernels keep the GPU busy is host-bound


def busy_us(r: Row) -> float | None:
    """GPU busy µs per step: the sum of the kernels' exposed times (the profiler's timeline without the gaps
    between kernels); None for a row without a kernel profile."""
    return sum(k["exposed_us"] for k in r.kernels) if r.kernels else None


def host_bound(r: Row) -> bool:
    """The step's wall time exceeds its GPU busy time by more than HOST_BOUND: the GPU waited for the host
    (Python, graph launches) between steps, so the wall time measures the host, not the kernels."""
    b = busy_us(r)
    return b is not None and r.us_per_step > HOST_BOUND * b


def refloor(result: dict) -> None:
    """Every row's ``floor_us`` (and ``x_floor``) recomputed in place from this checkout's kernel plan for its
    config, TP size, bucket and context, at the result's measured bandwidth (``bench-plot --refloor``); the
    result records it under ``floor_source``."""
    from .models import get_config
    from .plan import plan_for

    cache: dict = {}
    for r in result["rows"]:
        key = (r["config"], r["tp"], r["bucket"], r["context"])
        if key not in cache:
            name = re.sub(r"^slice(\d+)$", r"slice:\1", r["config"])
            plan = plan_for(get_config(name), tp=r["tp"], bucket=r["bucket"], context=r["context"])
            cache[key] = sum(lp.bytes(r["bucket"]) for lp in plan.layers) / result["bandwidth"] * 1e6
        r["floor_us"] = cache[key]
        r["x_floor"] = r["us_per_step"] / r["floor_us"]
    result["floor_source"] = "recomputed with k3compile bench-plot --refloor (this checkout's kernel plan)"


def per_layer(rows: list[Row]) -> list[dict]:
    """n-th layer time = T(first n layers) - T(first n-1 layers), same system, bucket, context: ``us`` from the
    steps' wall times, ``busy_us`` from their GPU busy times (both rows profiled), and ``host_bound`` when
    either row's wall time is host-bound, where only ``busy_us`` measures the layer."""
    by = {(r.layers, r.context, r.bucket, r.system): r for r in rows}
    out = []
    for (n, ctx, b, s), r in sorted(by.items()):
        prev = by.get((n - 1, ctx, b, s))
        if prev is None or math.isnan(r.us_per_step) or math.isnan(prev.us_per_step):
            continue  # no shallower row, or one of the two did not run (NaN time, its note says why)
        busy = (busy_us(r) - busy_us(prev)) if r.kernels and prev.kernels else None
        out.append({"layer": n, "context": ctx, "bucket": b, "system": s,
                    "us": r.us_per_step - prev.us_per_step, "busy_us": busy,
                    "host_bound": host_bound(r) or host_bound(prev), "floor_us": r.floor_us - prev.floor_us,
                    "invalid": r.invalid or prev.invalid,
                    "launches": r.launches - prev.launches,
                    "planned": r.planned_kernels[n - 1] if len(r.planned_kernels) >= n else None})
    return out


CONTEXT_BYTES = ("mla_decode_",)  # kernels whose manifest bytes assume the package's full context
KERNEL_NAME = re.compile(MODULE_PREFIX + r"([a-z][a-z0-9_]*?)_([0-9a-f]{10})")


OUR_KERNEL = re.compile(r"[a-z][a-z0-9_]*_[0-9a-f]{10}")  # kernel_id of one of our kernels


ENTRY_NAME = re.compile(r"kernel_cutlass_([a-z][a-z0-9_]*?)_" + MODULE_PREFIX)  # the PTX entry of a profiled kernel


def kernel_entry(name: str) -> str:
    """The PTX entry (``@cute.kernel`` method) a profiler kernel name comes from (``kernel``, ``combine_kernel``,
    ``kernel_mma``, ...), or "" for a kernel that is not ours."""
    m = ENTRY_NAME.search(name)
    return m[1] if m else ""


def kernel_id(name: str) -> str:
    """A profiler kernel name as its package kernel name (template and source hash, ``gemv_ea74823ffa``: the
    key of the package's ``manifest.json``), or the first 60 characters of a kernel that is not ours."""
    m = KERNEL_NAME.search(name)
    return f"{m[1]}_{m[2]}" if m else name[:60]


def layer_kernels(rows: list[Row], layer: int, context: int, bucket: int, system: str,
                  manifest: dict | None = None, bandwidth: float | None = None) -> list[dict]:
    """What each kernel adds to the ``layer``-th layer: T(first n layers) - T(first n-1) of its exposed µs,
    start-to-end µs and calls per step (profiled rows of the same context, bucket and system), largest exposed
    first; the exposed µs add up to the layer's GPU busy time but for the kernels left out (those whose calls do
    not change and whose exposed time moves by less than 0.05 µs). With the package's ``manifest`` (a dict) each
    of our kernels also gets its constants (``point``: M, N, K where it has them), the bytes its calls in the
    layer move and their floor at ``bandwidth`` (bytes / s). A template of several PTX entries also gets
    ``entries``, the same three figures per entry (the MLA decode's absorb, attention and combine kernels)."""
    by = {(r.layers, r.context, r.bucket, r.system): r for r in rows if r.kernels}
    cur, prev = by.get((layer, context, bucket, system)), by.get((layer - 1, context, bucket, system))
    if cur is None or prev is None:
        have = sorted({(r.layers, r.context, r.bucket, r.system) for r in rows if r.kernels})
        raise ValueError(f"layer {layer} at context {context}, batch {bucket}, {system}: needs profiled rows of "
                         f"{layer - 1} and {layer} layers (this JSON has {have}); run `k3compile bench --layers "
                         f"{layer - 1},{layer}`")
    acc: dict = {}
    parts: dict = {}  # kernel id -> PTX entry -> the same three sums
    for sign, r in ((1.0, cur), (-1.0, prev)):
        for k in r.kernels:
            kid = kernel_id(k["name"])
            e = acc.setdefault(kid, {"exposed_us": 0.0, "us": 0.0, "calls": 0.0})
            p = parts.setdefault(kid, {}).setdefault(kernel_entry(k["name"]), {"exposed_us": 0.0, "us": 0.0,
                                                                               "calls": 0.0})
            for f in e:
                e[f] += sign * k[f]
                p[f] += sign * k[f]
    kernels = manifest.get("kernels", {}) if manifest else {}
    out = []
    for name, e in acc.items():
        if abs(e["calls"]) < 1e-9 and abs(e["exposed_us"]) < 0.05:
            continue
        row = {"kernel": name, **e}
        if len(parts[name]) > 1:  # a template of several PTX entries (the MLA decode's absorb, attention, combine)
            row["entries"] = sorted(({"entry": n, **v} for n, v in parts[name].items()),
                                    key=lambda v: -v["exposed_us"])
        k = kernels.get(name)
        if k is not None:
            c = k.get("constants", {})
            row["point"] = " ".join(f"{x}={c[x]}" for x in ("M", "N", "K") if x in c)
            # a call of the template launches one GPU kernel per PTX entry (the MLA decode: three), each counted
            # by the profiler; the manifest's bytes are per call. The MLA decode's count the cache at the
            # package's capacity, not the run's context: no floor for it here (the plan has it)
            ops = e["calls"] / max(1, len(k.get("audit", {}).get("entries", [])))
            if ops > 0 and not name.startswith(CONTEXT_BYTES):
                row["bytes"] = k["bytes"] * ops
                if bandwidth:
                    row["floor_us"] = row["bytes"] / bandwidth * 1e6
        out.append(row)
    out.sort(key=lambda k: -k["exposed_us"])
    return out


def layer_kernels_table(result: dict, manifest: dict | None = None) -> str:
    """``layer_kernels`` of every per-layer entry of a k3compile system, as text; with a manifest, a last line
    names our kernels it lacks (their rows have no point, MB or floor: the package is not the run's)."""
    rows, bw = rows_of(result), result.get("bandwidth")
    lines, missing = [], set()
    for p in result.get("per_layer", []):
        if not p["system"].startswith("k3compile") or p.get("busy_us") is None:
            continue
        lines.append(f"layer {p['layer']} ctx {p['context']} b{p['bucket']} {p['system']}: GPU busy "
                     f"{p['busy_us']:.1f} us, floor {p['floor_us']:.1f} us (exposed us; start-to-end us; calls; "
                     f"and with --package the kernel's point, MB and floor)")
        for k in layer_kernels(rows, p["layer"], p["context"], p["bucket"], p["system"], manifest, bw):
            extra = f"  {k['point']:<22}" if "point" in k else ""
            if "bytes" in k:
                extra += f" {k['bytes'] / 1e6:8.2f} MB"
            if k.get("floor_us", 0) >= 0.5:  # (below that the ratio only says the kernel is latency-bound)
                extra += f"  floor {k['floor_us']:7.1f} us  x{k['exposed_us'] / k['floor_us']:5.2f}"
            line = f"  {k['exposed_us']:8.1f} {k['us']:8.1f}  x{k['calls']:<3g} {k['kernel']:<44}{extra}"
            lines.append(line.rstrip())
            for v in k.get("entries", ()):
                lines.append(f"  {v['exposed_us']:8.1f} {v['us']:8.1f}  x{v['calls']:<3g}   {v['entry']}")
            if manifest is not None and OUR_KERNEL.fullmatch(k["kernel"]) and k["kernel"] not in manifest.get(
                    "kernels", {}):
                missing.add(k["kernel"])
    if missing:
        lines.append(f"not in the package's manifest, so without point, MB and floor ({len(missing)}; built from other "
                     f"template sources or points than the run's package?): " + ", ".join(sorted(missing)))
    return "\n".join(lines)


def _fmt(r: Row) -> str:
    return (f"{r.config:<10} L{r.layers:<3} tp{r.tp} ctx {r.context:>6} b{r.bucket:<3} {r.system:<16} "
            f"{r.us_per_step:>10.1f} us  floor {r.floor_us:>8.1f} us  x{r.x_floor:>6.2f}  launches {r.launches:>5}  "
            f"+mem {r.extra_mem_mb:>8.1f} MB  " + (f"(+{r.relaid_mb:.0f} MB relaid weights) " if r.relaid_mb else "")
            + r.note + (f"  INVALID: {r.invalid}" if r.invalid else ""))


def _fmt_kernels(kernels: list[dict], top: int = 12) -> str:
    """The kernels adding the most to one step (exposed µs per step; start-to-end µs; calls per step), and what
    the rest add up to."""
    total = sum(k["exposed_us"] for k in kernels)
    lines = ["      exposed     start-to-end  (exposed: end minus the latest end before it; PDL overlaps the rest)"]
    lines += [f"    {k['exposed_us']:9.1f} us {100 * k['exposed_us'] / total:5.1f} % {k['us']:9.1f} us  "
              f"x{k['calls']:<5g} {k['name'][:80]}" for k in kernels[:top]]
    rest = kernels[top:]
    if rest:
        lines.append(f"    {sum(k['exposed_us'] for k in rest):9.1f} us in {len(rest)} more kernels")
    return "\n".join(lines)


def table(result: dict) -> str:
    lines = [f"{'config':<10} {'L':<4} tp ctx        bucket system              us/step       floor      x floor  "
             f"launches  extra memory"]
    lines += [_fmt(r) for r in rows_of(result)]
    if result["per_layer"]:
        lines.append("\nper layer (T(n layers) - T(n-1 layers); wall, and GPU busy: the kernels' exposed time):")
        for p in result["per_layer"]:
            busy = p.get("busy_us")
            gpu = (f"  GPU busy {busy:8.1f} us x{busy / p['floor_us']:5.2f}" if busy is not None else "")
            flag = "  HOST-BOUND: the wall difference measures the host; use GPU busy" if p.get("host_bound") else ""
            # the layer's own figure: GPU busy, else the wall difference unless the host set it
            layer_us = busy if busy is not None else None if p.get("host_bound") else p["us"]
            if layer_us is not None and layer_us < p["floor_us"]:
                flag += "  BELOW THE FLOOR: faster than its bytes allow; check the outputs"
            if p.get("invalid"):
                flag += f"  INVALID: {p['invalid']}"
            planned = p.get("planned")
            if planned is not None:  # the profiler's count against the plan's (k3compile plan)
                flag = (f" (plan {planned})" if planned == p["launches"] else
                        f" (plan {planned}: MISMATCH, a kernel the plan does not know ran or a planned one did not)"
                        ) + flag
            lines.append(f"  layer {p['layer']} ctx {p['context']} b{p['bucket']} {p['system']:<16} {p['us']:8.1f} us "
                         f"floor {p['floor_us']:7.1f} us  x{p['us'] / p['floor_us']:5.2f}{gpu}  launches "
                         f"{p['launches']}{flag}")
    return "\n".join(lines)


def rows_of(result: dict) -> list[Row]:
    """The Row objects of a bench JSON (the inverse of _result's rows)."""
    names = {f.name for f in dataclasses.fields(Row)}
    return [Row(**{k: v for k, v in r.items() if k in names}) for r in result["rows"]]


def main(args) -> int:
    import torch.distributed as dist

    rank0 = int(os.environ.get("RANK", "0")) == 0  # under torchrun rank 0 reports

    def save(res):
        if args.json and rank0:
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=1)

    res = run(args.config, layers=args.layers, tp=args.tp, buckets=args.buckets, contexts=args.context,
              package=args.package, systems=tuple(args.systems), steps=args.steps,
              log=(lambda s: print(s, file=sys.stderr, flush=True)) if rank0 else (lambda s: None), partial=save)
    save(res)
    invalid = sorted({r["invalid"] for r in res["rows"] if r.get("invalid")})
    if rank0:
        print(table(res))
        if args.png:
            plot(res, args.png)
        if invalid:
            print(f"k3compile bench: INVALID rows (their times are not results): {'; '.join(invalid)}",
                  file=sys.stderr)
    if torchrun_world() > 1 and dist.is_initialized():
        leave(1 if invalid else 0)
    return 1 if invalid else 0


COLORS = {"eager": (214, 39, 40), "eager-bf16": (148, 103, 189), "eager-graph": (227, 119, 194),
          "eager-bf16-graph": (140, 86, 75), "inductor": (255, 127, 14), "k3compile": (31, 119, 180),
          "k3compile-nccl": (44, 160, 44), "k3compile-one-stream": (23, 190, 207),
          "inductor-graph": (188, 189, 34), "inductor-autotune-graph": (127, 127, 127)}


def plot(result: dict, path: str, *, layers: int | None = None, context: int | None = None) -> None:
    """PNG: µs per step against the batch (log-log), one line per system, the HBM floor dashed; for one
    depth and context of the result (default: the deepest model, the first context)."""
    import math

    from .models.train import Canvas

    rows = [r for r in result["rows"] if r["us_per_step"] == r["us_per_step"]]  # measured (not NaN) rows
    if not rows:
        raise ValueError("no measured rows to plot")
    layers = layers or max(r["layers"] for r in rows)
    context = context or rows[0]["context"]
    rows = [r for r in rows if r["layers"] == layers and r["context"] == context]
    buckets = sorted({r["bucket"] for r in rows})
    series = {s: {r["bucket"]: r["us_per_step"] for r in rows if r["system"] == s}
              for s in dict.fromkeys(r["system"] for r in rows)}
    floor = {r["bucket"]: r["floor_us"] for r in rows}
    values = [v for s in series.values() for v in s.values()] + list(floor.values())
    lo, hi = math.log10(min(values)) - 0.1, math.log10(max(values)) + 0.1
    W, H, L, T, B = 720, 420, 70, 60, 50
    cv = Canvas(W, H)
    black = (0, 0, 0)
    cfg = rows[0]["config"]
    cv.text(10, 8, f"{cfg} ({layers} LAYERS, TP{rows[0]['tp']}), CONTEXT {context}: US PER DECODE STEP", scale=2)
    x_of = {b: L + int(i * (W - L - 30) / max(1, len(buckets) - 1)) for i, b in enumerate(buckets)}

    def y_of(v: float) -> int:
        return T + int((hi - math.log10(v)) / (hi - lo) * (H - T - B))

    cv.rect(L, T, L + 1, H - B, black)
    cv.rect(L, H - B, W - 20, H - B + 1, black)
    for p in range(math.floor(lo), math.ceil(hi) + 1):
        if lo <= p <= hi:
            y = y_of(10 ** p)
            cv.rect(L - 5, y, L, y + 1, black)
            cv.text(8, y - 5, f"{10 ** p:g}", scale=2)
    for b, x in x_of.items():
        cv.rect(x, H - B, x + 1, H - B + 5, black)
        cv.text(x - 4, H - B + 10, str(b), scale=2)
    cv.text(W // 2 - 40, H - 18, "BATCH", scale=2)

    def line(pts, color, dashed=False):
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            n = max(abs(x1 - x0), abs(y1 - y0), 1)
            for i in range(n + 1):
                if dashed and (i // 6) % 2:
                    continue
                x, y = x0 + (x1 - x0) * i // n, y0 + (y1 - y0) * i // n
                cv.rect(x - 1, y - 1, x + 2, y + 2, color)

    line([(x_of[b], y_of(floor[b])) for b in buckets], black, dashed=True)
    lx, ly = L + 10, 30
    for s, pts in [*series.items(), ("- - HBM FLOOR", None)]:
        if lx + 18 + 8 * len(s) > W - 10:  # seven systems do not fit one legend line: wrap
            lx, ly = L + 10, ly + 13
        if pts is None:
            cv.text(lx, ly, s, scale=2)
            break
        col = COLORS.get(s, (44, 160, 44))
        line([(x_of[b], y_of(v)) for b, v in sorted(pts.items())], col)
        for b, v in pts.items():
            cv.rect(x_of[b] - 3, y_of(v) - 3, x_of[b] + 4, y_of(v) + 4, col)
        cv.rect(lx, ly, lx + 14, ly + 8, col)
        cv.text(lx + 18, ly, s.upper(), scale=2)
        lx += 18 + 8 * len(s) + 20
    with open(path, "wb") as fh:
        fh.write(cv.png())
