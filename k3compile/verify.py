"""``k3compile verify``: the evidence that a compiled decode path is right and was actually taken.

One command, one report (Markdown + JSON) a reviewer can accept or reject without reading kernels:

1. coverage proof -- every planned kernel's launch count over the run against what the steps need; a
   planned kernel that never ran, or any eager fallback, fails (a green run that skipped the fast path is
   impossible: the counters are incremented by the kernel calls themselves, and by every graph replay);
2. kernel checks -- GPU: every kernel instance the run used against its float64 reference on fresh random
   inputs with NaN-poisoned outputs; CPU: every instance compiled for the arch (ptxas: registers, spills),
   the MXFP4 decode bit logic for every code and scale byte, and per node the kernels' float64 references
   against the dialect's eager op on the run's own inputs (shadow mode: the runtime's bindings);
   both: the pass pipeline with the dialect's eager ops equals the eager model bit for bit;
3. long generation -- compiled vs eager: greedy decoding from prompts of different lengths (first
   divergence), and the same steps teacher-forced on eager's tokens (per-step logit error percentiles,
   top-1 agreement);
4. cross-bucket consistency -- a sequence alone (bucket 1) and padded into every larger bucket;
5. memory-ordering audit -- every kernel's PTX: only weights read (nothing written) before
   ``griddepcontrol.wait``;
6. scope -- buckets, TP, arch, what runs as torch glue or eagerly, and why;
7. performance -- ``k3compile bench`` rows, when a GPU is present.

On a CPU the kernels run as their float64 template references (``kernels="reference"``): the GPU-only
checks are listed as skipped, by name.

TP > 1 runs on real ranks, one process each (``torchrun --nproc-per-node T -m k3compile.cli verify --tp T``;
NCCL on GPUs, gloo on CPUs): every rank runs the same checks on its shard, compiled against eager with the
same collectives, and the long generation also checks that the ranks' logits are identical at every step;
rank 0 writes the report. Single-device TP emulation is refused: it replaces the collectives with the
identity, which computes another function than the model, so there is nothing to verify it against.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field

import torch

from . import comm, runtime

# Acceptance thresholds (stated in the report).
SHADOW_TOL = 2e-2  # per node: kernels (or their references) vs the eager op on the same inputs
TOP1_MIN = 0.95  # teacher-forced top-1 agreement with eager
P50_MAX = 2e-2  # teacher-forced median per-step logit relative error
CROSS_BUCKET_TOL = 2e-2  # bucket 1 vs padded into a larger bucket, max relative logit difference


@dataclass
class Check:
    name: str
    status: str = "pass"  # pass | fail | skipped
    summary: str = ""
    details: list = field(default_factory=list)
    data: dict = field(default_factory=dict)

    def fail(self, why: str) -> None:
        self.status = "fail"
        self.details.append(why)


_OPTIONS: dict = {}  # options every compile of this verify run shares (batch_invariant)


def _compile(model, buckets, **options):
    """A fresh compile of ``model.decode``. Dynamo is reset first: on torch 2.11, recompiling the same
    ``decode`` for states of other capacities in one process can mark the capacity dynamic and then fail to
    trace ``state[:B]`` (each section here compiles anew, like the pytest fixtures do)."""
    import k3compile

    torch._dynamo.reset()
    return k3compile.compile(model, buckets=buckets, options={**_OPTIONS, **options})


def _rank(tp: int) -> int:
    """This process's rank in a TP > 1 verify run (real ranks only: see the module docstring)."""
    import torch.distributed as dist

    if tp == 1:
        return 0
    how = (f"launch it as `torchrun --nproc-per-node {tp} -m k3compile.cli verify --tp {tp} ...` (one GPU per "
           f"rank; gloo on CPUs). Single-device TP emulation replaces the collectives with the identity, which "
           f"computes another function than the model, so there is nothing to verify it against")
    if not dist.is_initialized():
        if comm.torchrun_world() != tp:
            raise SystemExit(f"verify --tp {tp} runs on {tp} real ranks: {how}")
        comm.init_ranks()
    if dist.get_backend() == "fake" or dist.get_world_size() != tp:
        raise SystemExit(f"verify --tp {tp}: the process group is {dist.get_backend()} with "
                         f"{dist.get_world_size()} ranks; {how}")
    return dist.get_rank()


def _model(checkpoint: str | None, device: str, tp: int = 1, rank: int = 0):
    from .models import k3_mini, load_pretrained, save_random_checkpoint
    from .models.train import trained_checkpoint

    if checkpoint is None:
        try:
            checkpoint = trained_checkpoint()
        except FileNotFoundError:
            checkpoint = None
    if checkpoint is None:  # no trained model in this checkout: a random k3-mini (chaotic: see the README)
        checkpoint = save_random_checkpoint(tempfile.mkdtemp(prefix="k3verify_"), k3_mini(), seed=0)
    return load_pretrained(checkpoint, device=device, tp_rank=rank, tp_size=tp), checkpoint


def verify(*, checkpoint: str | None = None, buckets=(1, 4), steps: int = 1000, kernels: str | None = None,
           disable: tuple = (), compile_check: bool = True, bench: bool = False, batch_invariant: bool = False,
           tp: int = 1, log=print) -> dict:
    """Run every check; returns the report (``markdown(report)`` renders it). See the module docstring."""
    gpu = torch.cuda.is_available() and kernels not in ("reference",)
    device = "cuda" if gpu else "cpu"
    kernels = kernels or ("reference" if not gpu else None)
    if gpu and not kernels:
        pkg = os.environ.get("K3_KERNEL_PACKAGE")
        kernels = f"package:{pkg}" if pkg else "jit"
    rank = _rank(tp)
    model, ckpt = _model(checkpoint, device, tp, rank)
    _OPTIONS.clear()
    _OPTIONS["batch_invariant"] = batch_invariant
    cap = _capacity(kernels, steps)
    buckets = tuple(sorted(buckets))
    t0 = time.time()
    checks: list[Check] = []

    log(f"verify: {ckpt} on {device}, kernels {kernels}, buckets {list(buckets)}, TP {tp}")
    # 1 + 2 (shadow): run every bucket, full and padded, with the eager op beside every node
    runtime.reset_launch_counts()
    step = _compile(model, buckets, kernels=kernels, shadow=True, disable_kernels=tuple(disable))
    state = model.new_state(buckets[-1], cap)
    gen = torch.Generator().manual_seed(0)
    batches = [x for b in buckets for x in ((b, b - 1) if b > 1 else (b,))]
    for batch in batches:
        ids = torch.randint(0, model.config.vocab_size, (batch,), generator=gen).to(device)
        step(ids, state)
    d = step.dispatchers[-1]
    cov = d.coverage()
    c = Check("coverage proof", data={"kernels": cov["kernels"], "calls": cov["calls"]})
    for p in cov["problems"]:
        c.fail(p)
    copies = runtime.input_copies()
    c.data["input_copies"] = copies
    c.summary = (f"{len(cov['kernels'])} distinct kernels, {sum(r['launched'] for r in cov['kernels'])} launches "
                 f"over {len(batches)} steps (batches {batches}); {len(cov['problems'])} problems; "
                 f"{sum(copies.values())} input copies")
    c.details.append("input copies (torch copies of strided kernel inputs, not kernels; a cost, not an error): "
                     + (", ".join(f"{k} x{v}" for k, v in sorted(copies.items())) if copies else "none"))
    checks.append(c)

    log(f"verify: coverage {c.status} ({time.time() - t0:.0f} s)")
    c = Check("kernel checks")
    errors = runtime.shadow_errors()
    worst = max(errors, key=errors.get) if errors else None
    c.data["shadow"] = errors
    c.details.append(f"shadow: {len(errors)} nodes, worst {worst} at {errors.get(worst, 0):.3g} (tolerance "
                     f"{SHADOW_TOL:g}); kernels: {d.source.describe()}")
    if worst and errors[worst] > SHADOW_TOL:
        c.fail(f"{worst}: kernels differ from the eager op by {errors[worst]:.3g}")
    kern = {k.name: k for bg in d.bound.values() for k in bg.kernels.values()}
    if gpu and kernels.startswith("package:"):
        from .kernel_check import check as kcheck

        bad = 0
        for name, k in sorted(kern.items()):
            res = kcheck(k.point, k.fn, seed=int.from_bytes(os.urandom(4), "little"))
            if not res["ok"]:
                bad += 1
                c.fail(f"{name}: {res['problems']}")
        c.details.append(f"GPU: {len(kern)} kernels against float64 on fresh inputs, NaN-poisoned outputs: "
                         f"{len(kern) - bad} pass")
    else:
        c.details.append("skipped on this machine: the kernels against float64 on the GPU (no GPU / "
                         "reference kernels)")
        c.data["skipped"] = ["gpu kernel checks"]
    from .mxfp4_mirror import every_byte_every_scale

    mx = every_byte_every_scale()
    c.details.append(f"MXFP4 decode bit logic: {mx['values']} values, {mx['mismatches']} mismatches")
    if not mx["ok"]:
        c.fail("MXFP4 decode mirror differs from models.mxfp4.dequantize")
    c.data["passes_bit_exact"] = _passes_exact(model, buckets, cap, device)
    if not c.data["passes_bit_exact"]["ok"]:
        c.fail(f"pass pipeline with eager ops differs from eager: {c.data['passes_bit_exact']}")
    c.details.append(f"pass pipeline (dialect eager ops) vs eager: {c.data['passes_bit_exact']['steps']} steps, "
                     f"max |diff| {c.data['passes_bit_exact']['max_abs']}")
    audit = Check("memory-ordering audit")
    if kernels.startswith("package:"):  # the package was compiled and audited when it was built
        _package_audit(kernels.removeprefix("package:"), kern, c, audit)
    elif compile_check and rank == 0:  # TP > 1: every rank compiles the same kernels; rank 0 does it once
        _compile_and_audit(kern, c, audit)
    elif compile_check:
        audit.status, audit.summary = "skipped", f"rank {rank}: compiled and audited on rank 0"
    else:
        audit.status = "skipped"
        audit.summary = "skipped (--no-compile-check)"
        c.details.append("compile check skipped (--no-compile-check)")
    c.summary = "; ".join(c.details[:1])
    checks.append(c)

    log(f"verify: kernel checks {c.status} ({time.time() - t0:.0f} s)")
    # 3 long generation, 4 cross-bucket
    checks.append(_long_generation(model, kernels, buckets, steps, cap, device, tp))
    log(f"verify: long generation {checks[-1].status} ({time.time() - t0:.0f} s)")
    checks.append(_cross_bucket(model, kernels, buckets, cap, device))
    log(f"verify: cross-bucket {checks[-1].status} ({time.time() - t0:.0f} s)")
    checks.append(audit)
    checks.append(_scope(d, kernels, buckets, gpu, tp))
    perf = Check("performance sweep")
    if gpu and bench and kernels.startswith("package:"):
        from .bench import measure_copy_bandwidth, run_model

        rows: list = []
        top = min(cap, model.config.max_position_embeddings) - 32  # room for the timed steps
        contexts = sorted({min(c, top) for c in (128, 1024, top)})  # short, 1k, the full capacity
        run_model(model, tp=tp, buckets=list(buckets), contexts=contexts,
                  package=kernels.removeprefix("package:"), systems=("k3compile", "eager"), steps=10,
                  bandwidth=measure_copy_bandwidth(), rows=rows, log=lambda s: None)
        perf.data = {"rows": [r.__dict__ for r in rows]}
        ours = [r for r in rows if r.system == "k3compile"]
        perf.summary = (f"TP {tp}, contexts {contexts}, batches {list(buckets)}: k3compile "
                        + ", ".join(f"ctx {r.context} b{r.bucket} {r.us_per_step:.0f} us (x{r.x_floor:.1f})"
                                    for r in ours) + "; eager beside it in the table below")
        perf.data["table"] = ["| TP | context | batch | system | us/step | floor us | x floor | launches |",
                              "|---|---|---|---|---|---|---|---|"]
        perf.data["table"] += [f"| {r.tp} | {r.context} | {r.bucket} | {r.system} | {r.us_per_step:.1f} | "
                               f"{r.floor_us:.1f} | {r.x_floor:.1f} | {r.launches} |" for r in rows]
    else:
        perf.status = "skipped"
        perf.summary = "skipped: needs a GPU and a package (pass --bench on the GPU host)"
    checks.append(perf)
    ok = all(ch.status != "fail" for ch in checks)
    return {"verdict": "VERIFIED" if ok else "FAILED", "ok": ok, "checkpoint": ckpt, "device": device,
            "kernels": kernels, "buckets": list(buckets), "steps": steps, "batch_invariant": batch_invariant, "tp": tp,
            "seconds": round(time.time() - t0, 1),
            "thresholds": {"shadow": SHADOW_TOL, "top1_min": TOP1_MIN, "p50_max": P50_MAX,
                           "cross_bucket": CROSS_BUCKET_TOL},
            "checks": [ch.__dict__ for ch in checks]}


def _capacity(kernels: str, steps: int) -> int:
    if kernels.startswith("package:"):
        with open(os.path.join(kernels.removeprefix("package:"), "manifest.json")) as fh:
            return json.load(fh)["max_context"]
    return steps + 64


def _passes_exact(model, buckets, cap, device, n: int = 4) -> dict:
    step = _compile(model, buckets, kernels="eager")
    b = buckets[-1]
    s1, s2 = model.new_state(b, cap), model.new_state(b, cap)
    ids = torch.arange(b, device=device)
    worst = 0.0
    for _ in range(n):
        ref, out = model.decode(ids, s1), step(ids, s2)
        worst = max(worst, float((ref - out).abs().max()))
        ids = ref.argmax(-1)
    return {"ok": worst == 0.0, "steps": n, "max_abs": worst}


def _compile_and_audit(kern: dict, c: Check, audit: Check) -> None:
    from . import codegen

    try:
        import cutlass  # noqa: F401
    except ImportError:
        c.details.append("compile check skipped: the CuTe DSL compiler is not installed here")
        audit.status, audit.summary = "skipped", "needs the CuTe DSL compiler (PTX)"
        return
    cg = codegen.Codegen("verify", next(iter(kern.values())).point.arch, (), ())
    for name, k in kern.items():
        cg.points[name] = k.point
        cg.params[name] = {x.name: x.value for x in k.point.constants}
    with tempfile.TemporaryDirectory() as out:
        man = codegen.write(cg, __import__("pathlib").Path(out), quiet=True)
    spills = [n for n, k in man["kernels"].items() if k["ptxas"]["stack_bytes"]]
    regs = max(k["ptxas"]["registers"] for k in man["kernels"].values())
    c.details.append(f"compiled for {cg.arch}: {len(man['kernels'])} kernels, max {regs} registers, local memory "
                     f"(spills or a local array) in {len(spills)}")
    for n in spills:
        c.fail(f"{n} uses local memory (a stack frame: register spills or a local array)")
    bad = {n: k["audit"]["problems"] for n, k in man["kernels"].items() if not k["audit"]["ok"]}
    audit.data = {n: k["audit"] for n, k in man["kernels"].items()}
    audit.summary = f"{len(man['kernels']) - len(bad)} of {len(man['kernels'])} kernels pass (PTX read)"
    for n, problems in bad.items():
        audit.fail(f"{n}: {problems}")


def _package_audit(root: str, kern: dict, c: Check, audit: Check) -> None:
    with open(os.path.join(root, "manifest.json")) as fh:
        man = json.load(fh)["kernels"]
    used = {n: man[n] for n in kern}
    spills = [n for n, k in used.items() if k["ptxas"]["stack_bytes"]]
    c.details.append(f"package build (ptxas, {len(used)} kernels used): max "
                     f"{max(k['ptxas']['registers'] for k in used.values())} registers, local memory in {len(spills)}")
    for n in spills:
        c.fail(f"{n} uses local memory (a stack frame: register spills or a local array)")
    bad = {n: k["audit"]["problems"] for n, k in used.items() if not k["audit"]["ok"]}
    audit.data = {n: k["audit"] for n, k in used.items()}
    audit.summary = f"{len(used) - len(bad)} of {len(used)} kernels pass (PTX audited at package build)"
    for n, problems in bad.items():
        audit.fail(f"{n}: {problems}")


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _long_generation(model, kernels, buckets, steps, cap, device, tp: int = 1) -> Check:

    prompts = [[1, 2, 3], [7] * 9, list(range(20, 45)), [3]]
    batch = min(len(prompts), buckets[-1])
    prompts = prompts[:batch]
    c = Check("long generation")
    step = _compile(model, buckets, kernels=kernels)
    free_ref, free_k3 = model.new_state(buckets[-1], cap), model.new_state(buckets[-1], cap)
    tf_ref, tf_k3 = model.new_state(buckets[-1], cap), model.new_state(buckets[-1], cap)
    longest = max(len(p) for p in prompts)
    first_div, errs, agree, digests = None, [], [], []
    last_ref = last_k3 = None
    for i in range(longest + steps):
        feed = [p[i] if i < len(p) else None for p in prompts]
        ids_ref = torch.tensor([f if f is not None else int(last_ref[r]) for r, f in enumerate(feed)], device=device)
        ids_k3 = torch.tensor([f if f is not None else int(last_k3[r]) for r, f in enumerate(feed)], device=device)
        # free-running greedy: each system on its own tokens
        last_ref = model.decode(ids_ref, free_ref).argmax(-1)
        last_k3 = step(ids_k3, free_k3).argmax(-1)
        generating = torch.tensor([i >= len(p) - 1 for p in prompts], device=device)  # output is fed back
        if first_div is None and bool(((last_ref != last_k3) & generating).any()):
            first_div = i
        # teacher-forced: both on eager's tokens
        ref, out = model.decode(ids_ref, tf_ref), step(ids_ref, tf_k3)
        errs.append(float((out - ref).norm() / ref.norm()))
        digests.append(out.double().sum().item())  # TP > 1: compared across the ranks below
        agree.append(float((out.argmax(-1) == ref.argmax(-1)).float().mean()))
    top1 = sum(agree) / len(agree)
    c.data = {"prompt_lengths": [len(p) for p in prompts], "steps": steps, "first_divergence": first_div,
              "rel_err": {"max": max(errs), "p50": _pct(errs, .5), "p90": _pct(errs, .9), "p99": _pct(errs, .99)},
              "top1_agreement": top1}
    if tp > 1:  # every rank must produce the same logits (same routing, same sums) at every step
        import torch.distributed as dist

        every: list = [None] * tp
        dist.all_gather_object(every, digests)
        differ = sum(any(d[i] != every[0][i] for d in every) for i in range(len(digests)))
        c.data["steps_ranks_differ"] = differ
        c.details.append(f"TP {tp}: the ranks' logits differ at {differ} of {len(digests)} steps")
        if differ:
            c.fail(f"the {tp} ranks' compiled logits differ at {differ} steps (they must be identical)")
    c.summary = (f"{batch} prompts (lengths {c.data['prompt_lengths']}), {steps} generated steps: first greedy "
                 f"divergence {'none' if first_div is None else f'at step {first_div}'}; teacher-forced logit "
                 f"error p50 {_pct(errs, .5):.3g} p99 {_pct(errs, .99):.3g} max {max(errs):.3g}; top-1 "
                 f"agreement {top1:.3f}")
    if top1 < TOP1_MIN:
        c.fail(f"top-1 agreement {top1:.3f} < {TOP1_MIN}")
    if _pct(errs, .5) > P50_MAX:
        c.fail(f"median logit error {_pct(errs, .5):.3g} > {P50_MAX}")
    return c


def _cross_bucket(model, kernels, buckets, cap, device, n: int = 8) -> Check:

    c = Check("cross-bucket consistency")
    seq = torch.tensor([5], device=device)
    alone = _compile(model, (1,), kernels=kernels)
    s1 = model.new_state(1, cap)
    ref = []
    ids = seq
    for _ in range(n):
        out = alone(ids, s1)
        ref.append(out[0])
        ids = out.argmax(-1)
    for b in buckets:
        if b == 1:
            continue
        step = _compile(model, (b,), kernels=kernels)
        s = model.new_state(b, cap)
        others = torch.arange(100, 100 + b - 1, device=device)
        tok, worst = seq, 0.0
        for i in range(n):
            out = step(torch.cat([tok, others]), s)
            worst = max(worst, float((out[0] - ref[i]).norm() / ref[i].norm()))
            tok = ref[i].argmax(-1, keepdim=True)  # same token sequence as alone
        c.data[f"bucket{b}"] = worst
        if worst > CROSS_BUCKET_TOL:
            c.fail(f"bucket {b}: row 0 differs from bucket 1 by {worst:.3g} > {CROSS_BUCKET_TOL}")
    c.summary = ", ".join(f"{k}: max rel diff {v:.3g}" for k, v in c.data.items()) or "one bucket only"
    return c


def _scope(d, kernels, buckets, gpu, tp: int = 1) -> Check:
    import collections

    glue: collections.Counter = collections.Counter()
    eager = []
    for b, bg in d.bound.items():
        for n in bg.gm.graph.nodes:
            if n.op in ("call_function", "call_method") and not isinstance(n.target, (runtime.Binding, runtime.EagerOp,
                                                                                     runtime.Collective)):
                t = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
                if t not in ("getitem", "_positions", "_noop"):
                    glue[t] += 1
        eager += [f"bucket {b}: {e.node} ({e.op}): {e.why}" for e in bg.bindings if isinstance(e, runtime.EagerOp)]
    c = Check("scope", status="pass")
    c.data = {"buckets": list(buckets), "tp": [tp], "arch": "sm_90a", "kernels": kernels, "torch_glue": dict(glue),
              "eager_ops": eager}
    where = (f"TP {tp} on {tp} real ranks (this report: rank 0; o_proj/FFN all-reduces inside the residual "
             f"kernels)" if tp > 1 else "TP 1 (other TP sizes: --tp under torchrun)")
    c.summary = (f"buckets {list(buckets)}, {where}, sm_90a; kernels: {kernels}; features kept: full context (MLA cache of "
                 f"the package's capacity, split-context decode), per-sequence lengths, padding rows preserved, "
                 f"the state advanced in place; sampling runs on the logits outside the step")
    c.details = [f"torch glue, summed over the buckets' graphs (not kernels: the lengths update; the AttnRes block "
                 f"stacks, the MLA cache writes and the KDA state copies are done by the kernels): {dict(glue)}",
                 f"eager ops: {eager or 'none'}"]
    if not gpu:
        c.details.append("this run: CPU, kernels = float64 template references (bindings checked, not kernels)")
    return c


def markdown(res: dict) -> str:
    lines = [f"# k3compile verify: **{res['verdict']}**", "",
             f"checkpoint `{res['checkpoint']}`, device {res['device']}, kernels `{res['kernels']}`, buckets "
             f"{res['buckets']}, {res['steps']} generated steps, {res['seconds']} s", "",
             "Thresholds: " + ", ".join(f"{k} {v}" for k, v in res["thresholds"].items()), "",
             "| check | status | summary |", "|---|---|---|"]
    for ch in res["checks"]:
        lines.append(f"| {ch['name']} | {ch['status']} | {ch['summary']} |")
    for ch in res["checks"]:
        lines += ["", f"## {ch['name']}: {ch['status']}", ""] + [f"- {x}" for x in ch["details"]]
        if ch["name"] == "performance sweep" and ch["data"].get("table"):
            lines += [""] + ch["data"]["table"]
        if ch["name"] == "coverage proof":
            lines += ["", "| kernel | required | launched |", "|---|---|---|"]
            lines += [f"| {r['kernel']} | {r['required']} | {r['launched']} |" for r in ch["data"]["kernels"]]
    return "\n".join(lines) + "\n"


def main(args) -> int:
    import sys

    import torch.distributed as dist

    rank0 = int(os.environ.get("RANK", "0")) == 0  # under torchrun rank 0 reports
    res = verify(checkpoint=args.checkpoint, buckets=args.buckets, steps=args.steps, kernels=args.kernels,
                 disable=tuple(args.disable.split(",")) if args.disable else (),
                 compile_check=not args.no_compile_check, bench=args.bench, batch_invariant=args.batch_invariant,
                 tp=args.tp, log=(lambda s: print(s, file=sys.stderr, flush=True)) if rank0 else (lambda s: None))
    if rank0:
        md = markdown(res)
        print(md)
        if args.report:
            with open(args.report, "w") as fh:
                fh.write(md)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=1,
                          default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
    rc = 0 if res["ok"] else 1
    if args.tp > 1 and dist.is_initialized():
        comm.leave(rc)
    return rc
