"""``k3compile bench``: the whole decode step, eager vs Inductor vs k3compile, in one process on one GPU.

For every (context, bucket) the same model, state and tokens run through each system; each figure is the
mean over ``--steps`` consecutive decode steps (the state advances, as in serving) between CUDA events,
after warm-up. Beside it: the HBM floor of the step (bytes the plan says must move -- weights, the
experts the batch selects, the state read and written -- over the copy bandwidth measured in the same
run), kernel launches per step (counted by the profiler), and GPU memory beyond weights and state.

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

import dataclasses
import gc
import json
import os
import sys
import time

import torch

from .comm import leave, torchrun_world
from .kernel_check import measure_copy_bandwidth

SYSTEMS = ("eager", "inductor", "k3compile", "k3compile-nccl")


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
    extra_mem_mb: float = float("nan")
    note: str = ""

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
    import k3compile
    from .plan import build_plan

    if lowered is None:
        step = k3compile.compile(model, buckets=(bucket,), options={"kernels": "eager"})
        step(ids, state)
        lowered = step.graphs[bucket]
        torch._dynamo.reset()
    plan = build_plan(lowered, config=model.config, tp=tp, bucket=bucket, context=context)
    return sum(lp.bytes(bucket) for lp in plan.layers) / bandwidth * 1e6


def _time_steps(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(steps):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3 / steps


def _count_kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "Memcpy" not in e.name and "Memset" not in e.name)


def run(config_name: str, *, layers: list[int] | None, tp: int, buckets: list[int], contexts: list[int],
        package: str | None, systems: tuple = SYSTEMS, steps: int = 20, log=print, partial=None) -> dict:
    """``partial(result)`` is called after every row (the JSON survives a crash half-way)."""
    from .models import k3_mini, k3_slice

    if not torch.cuda.is_available():
        raise SystemExit("k3compile bench needs a CUDA GPU (it times kernels); run it on the GPU host")
    bw = measure_copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rows: list[Row] = []
    for n in layers or [None]:
        if config_name == "k3_mini":
            config = k3_mini() if n is None else _prefix(k3_mini(), n)
        elif config_name == "slice":
            config = k3_slice(n or 4)
        else:
            raise SystemExit(f"--config {config_name}: bench runs k3_mini or slice (real dimensions)")
        model = build_model(config, tp)
        pkg = package.format(layers=config.num_hidden_layers) if package else None
        run_model(model, tp=tp, buckets=buckets, contexts=contexts, package=pkg, systems=systems, steps=steps,
                  bandwidth=bw, rows=rows, log=log, partial=partial)
        del model
        torch.cuda.empty_cache()
    return _result(bw, rows)


def run_model(model, *, tp: int, buckets, contexts, package: str | None, systems, steps: int, bandwidth: float,
              rows: list, log=print, partial=None) -> list:
    """Rows for one model (appended to ``rows``): every system x context x bucket."""
    config, bw = model.config, bandwidth
    nl = config.num_hidden_layers
    # k3compile first (its lowered graph gives the floor), Inductor last: on torch 2.11 a Dynamo capture with
    # a dynamic batch after an Inductor compile of the same function can fail to trace
    order = [s for s in ("k3compile", "k3compile-nccl", "eager", "inductor") if s in systems] + [s for s in systems if s not in SYSTEMS]
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
                mem0 = torch.cuda.memory_allocated()
                row = Row(config.name, nl, tp, ctx, b, system)
                fn = lowered = None
                try:
                    fn, lowered = _system(system, model, state, ids, b, package)
                    fn()  # compiles (k3compile, Inductor), warms up
                    if (ctx, b) not in floors:
                        floors[ctx, b] = _floor_us(lowered() if lowered else None, model, state, ids, tp, b, ctx, bw)
                    row.floor_us = floors[ctx, b]
                    state.lengths.fill_(ctx)
                    row.us_per_step = _time_steps(fn, steps)
                    row.launches = _count_kernels(fn)
                    row.extra_mem_mb = (torch.cuda.memory_allocated() - mem0) / 2**20
                except Exception as e:  # a baseline that cannot run is reported, not hidden
                    row.note = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                if tp > 1:
                    row.note = (row.note + "; " if row.note else "") + (
                        f"real TP over {tp} GPUs, communication included" if torchrun_world() > 1
                        else "per-rank compute, communication excluded")
                rows.append(row)
                log(_fmt(row))
                if partial:
                    partial(_result(bw, rows))
                fn = lowered = state = None  # the closures hold the state: drop both before the next row
                gc.collect()
                torch.cuda.empty_cache()
    return rows


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


def _system(system: str, model, state, ids, bucket: int, package: str | None):
    import k3compile

    if system == "eager":
        return (lambda: model.decode(ids, state)), None
    if system == "inductor":
        torch._dynamo.reset()
        f = torch.compile(model.decode, dynamic=False)
        return (lambda: f(ids, state)), None
    if system in ("k3compile", "k3compile-nccl"):
        if not package:
            raise RuntimeError("no --package: k3compile's kernels come from a prebuilt package on the GPU host")
        torch._dynamo.reset()
        opts = {"kernels": f"package:{package}", "check_inputs": False}
        if system == "k3compile-nccl":  # NCCL all-reduces before the residual kernels instead of one-shot
            opts["oneshot_max_bytes"] = 0
        step = k3compile.compile(model, buckets=(bucket,), options=opts)
        return (lambda: step(ids, state)), lambda: step.dispatchers[-1].lowered[bucket]
    raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")


def per_layer(rows: list[Row]) -> list[dict]:
    """n-th layer time = T(first n layers) - T(first n-1 layers), same system, bucket, context."""
    by = {(r.layers, r.context, r.bucket, r.system): r for r in rows}
    out = []
    for (n, ctx, b, s), r in sorted(by.items()):
        prev = by.get((n - 1, ctx, b, s))
        if prev is None:
            continue
        out.append({"layer": n, "context": ctx, "bucket": b, "system": s,
                    "us": r.us_per_step - prev.us_per_step, "floor_us": r.floor_us - prev.floor_us,
                    "launches": r.launches - prev.launches})
    return out


def _fmt(r: Row) -> str:
    return (f"{r.config:<10} L{r.layers:<3} tp{r.tp} ctx {r.context:>6} b{r.bucket:<3} {r.system:<10} "
            f"{r.us_per_step:>10.1f} us  floor {r.floor_us:>8.1f} us  x{r.x_floor:>6.2f}  launches {r.launches:>5}  "
            f"+mem {r.extra_mem_mb:>8.1f} MB  {r.note}")


def table(result: dict) -> str:
    lines = [f"{'config':<10} {'L':<4} tp ctx        bucket system        us/step       floor      x floor  "
             f"launches  extra memory"]
    for r in result["rows"]:
        lines.append(_fmt(Row(**{k: v for k, v in r.items() if k != "x_floor"})))
    if result["per_layer"]:
        lines.append("\nper layer (T(n layers) - T(n-1 layers)):")
        for p in result["per_layer"]:
            lines.append(f"  layer {p['layer']} ctx {p['context']} b{p['bucket']} {p['system']:<10} {p['us']:8.1f} us "
                         f"floor {p['floor_us']:7.1f} us  x{p['us'] / p['floor_us']:5.2f}  launches {p['launches']}")
    return "\n".join(lines)


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
    if rank0:
        print(table(res))
        if args.png:
            plot(res, args.png)
    if torchrun_world() > 1 and dist.is_initialized():
        leave(0)
    return 0


COLORS = {"eager": (214, 39, 40), "inductor": (255, 127, 14), "k3compile": (31, 119, 180),
          "k3compile-nccl": (44, 160, 44)}


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
    lx = L + 10
    for s, pts in series.items():
        col = COLORS.get(s, (44, 160, 44))
        line([(x_of[b], y_of(v)) for b, v in sorted(pts.items())], col)
        for b, v in pts.items():
            cv.rect(x_of[b] - 3, y_of(v) - 3, x_of[b] + 4, y_of(v) + 4, col)
        cv.rect(lx, 34, lx + 14, 42, col)
        cv.text(lx + 18, 34, s.upper(), scale=2)
        lx += 18 + 8 * len(s) + 20
    cv.text(lx, 34, "- - HBM FLOOR", scale=2)
    with open(path, "wb") as fh:
        fh.write(cv.png())
