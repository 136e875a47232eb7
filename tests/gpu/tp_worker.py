"""Rank body of the multi-GPU checks: ``torchrun --nproc-per-node N tests/gpu/tp_worker.py CHECK ...``.

Every rank runs the same program on its own GPU (NCCL process group; NVLink multicast off). Rank 0 writes
``--out`` (JSON); the test (tests/gpu/test_tp_gpu.py) reads it. Checks:

* ``allreduce --package DIR``: every fused residual kernel of the package whose TP is the world size
  (``residual_attn_res``, TP > 1), at every bucket it was built for, on fresh random inputs per rank:
  one-shot in-kernel all-reduce against the same kernel after NCCL's all-reduce (bit for bit) and against
  the float64 reference over the gathered partials; then ``--replays`` CUDA-graph replays of the fused
  kernel with new inputs before each (a stale flag or buffer shows as a wrong sum), and the time of the
  fused kernel against NCCL all-reduce + the kernel in CUDA graphs.
* ``logits --package DIR --package1 DIR1 --checkpoint CKPT``: the compiled TP-N model against the compiled
  TP-1 model over ``--steps`` teacher-forced steps (TP 1's greedy tokens), at batch 1 and 3 (bucket 4):
  logit error and top-1 agreement; the ranks' logits bit for bit identical; every step through the
  one-shot kernels (launch counters), coverage clean, no eager fallback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from k3compile import comm


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _graph_us(fn, replays: int = 200) -> float:
    """Median µs of one call of ``fn`` captured in a CUDA graph (ranks replay in lockstep)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    times = []
    for _ in range(replays):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / 10)
    times.sort()
    return times[len(times) // 2]


def check_allreduce(args, rank: int, world: int) -> dict:
    from k3compile import runtime
    from k3compile.package import KernelPackage

    pkg = KernelPackage(args.package)
    group = dist.group.WORLD.group_name
    points = [pkg.point(n) for n, e in sorted(pkg.kernels.items()) if e["template"] == "residual_attn_res"]
    points = [p for p in points if p.c["TP"] == world]
    if not points:
        raise SystemExit(f"{args.package} has no residual_attn_res kernel with TP {world}: build it with "
                         f"`k3compile codegen ... --tp {world} --package`")
    rows = []
    for p in points:
        k = runtime.Kernel(p, pkg.function(p.name), "cuda")
        gen = torch.Generator().manual_seed(1000 * rank + p.c["M"])
        x = {n: v.cuda() for n, v in p.template.random_inputs(p.c, gen).items() if n in
             {a.name for a in p.args() if a.role in ("act", "weight")}}
        shared = {n: v for n, v in x.items() if n != "a"}  # the same prefix, blocks, weights on every rank
        for n, v in shared.items():
            dist.broadcast(v, 0)
        runtime.reset_launch_counts()
        fused = k(**{n: v for n, v in x.items() if n != "a"},
                  **comm.wire(p, x["a"], group, world, count=runtime._count))
        assert runtime.launch_counts().get("collective:one_shot") == 1, "the one-shot path was not taken"
        nccl = k(**{n: v for n, v in x.items() if n != "a"},
                 **comm.wire(p, x["a"], group, world, oneshot_max_bytes=0))
        ref_in = {n: v.cpu() for n, v in x.items()}
        ref_in.update({f"peer{q}": t.cpu() for q, t in enumerate(_gather(x["a"]))})
        ref_in["signal"] = torch.zeros(2, p.c["M"], dtype=torch.int32)  # the flags are not part of the math
        ref = p.template.reference(p.c, ref_in)
        row = {"kernel": p.name, "bucket": p.c["M"], "d": p.c["D"], "nb": p.c["NB"],
               "out_norm": p.c["OUT_NORM"]}
        for out in ("y", "new_prefix"):
            row[f"{out}_bit_equal_nccl"] = bool(torch.equal(fused[out], nccl[out]))
            row[f"{out}_rel_vs_float64"] = _rel(fused[out].cpu(), ref[out])
        row["ranks_identical"] = all(torch.equal(t, fused["new_prefix"]) for t in _gather(fused["new_prefix"]))
        rows.append(row)
    # CUDA-graph replays with fresh inputs each time: the largest and the smallest bucket
    replay = []
    for p in (max(points, key=lambda q: q.c["M"]), min(points, key=lambda q: q.c["M"])):
        k = runtime.Kernel(p, pkg.function(p.name), "cuda")
        gen = torch.Generator().manual_seed(7 + rank)
        x = {n: v.cuda() for n, v in p.template.random_inputs(p.c, gen).items() if n in
             {a.name for a in p.args() if a.role in ("act", "weight")}}
        for n, v in x.items():
            if n != "a":
                dist.broadcast(v, 0)
        wired = comm.wire(p, x["a"], group, world)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            k(**{n: v for n, v in x.items() if n != "a"}, **wired)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = k(**{n: v for n, v in x.items() if n != "a"}, **wired)
        g_dev = torch.Generator(device="cuda").manual_seed(99 + rank)
        worst, mismatched = 0.0, 0
        for i in range(args.replays):
            x["a"].copy_(torch.randn(x["a"].shape, generator=g_dev, device="cuda").to(torch.bfloat16))
            g.replay()
            summed = x["a"].clone()
            dist.all_reduce(summed)
            expect = (x["prefix"].float() + summed.float()).to(torch.bfloat16) if "prefix" in x else summed
            err = _rel(out["new_prefix"], expect)
            worst = max(worst, err)
            mismatched += int(not torch.equal(out["new_prefix"], expect))
        replay.append({"kernel": p.name, "bucket": p.c["M"], "replays": args.replays, "worst_rel": worst,
                       "replays_not_bit_equal": mismatched})
    # time: fused one-shot kernel vs NCCL all-reduce + the same kernel (local wiring) vs NCCL alone
    timing = []
    for p in points:
        k = runtime.Kernel(p, pkg.function(p.name), "cuda")
        x = {n: v.cuda() for n, v in p.template.random_inputs(p.c, torch.Generator().manual_seed(rank)).items()
             if n in {a.name for a in p.args() if a.role in ("act", "weight")}}
        rest = {n: v for n, v in x.items() if n != "a"}
        wired = comm.wire(p, x["a"], group, world)
        buf = x["a"].clone()
        local = comm._local("cuda").args(buf, world)

        def fused():
            k(**rest, **wired)

        def unfused():
            dist.all_reduce(buf)
            k(**rest, **local)

        def nccl_only():
            dist.all_reduce(buf)

        timing.append({"kernel": p.name, "bucket": p.c["M"], "d": p.c["D"], "nb": p.c["NB"],
                       "fused_us": _graph_us(fused), "nccl_plus_kernel_us": _graph_us(unfused),
                       "nccl_allreduce_us": _graph_us(nccl_only),
                       "message_bytes": p.c["M"] * p.c["D"] * 2})
    return {"world": world, "checks": rows, "replay": replay, "timing": timing}


def check_logits(args, rank: int, world: int) -> dict:
    import k3compile
    from k3compile import runtime
    from k3compile.models import load_pretrained

    cap = json.load(open(os.path.join(args.package, "manifest.json")))["max_context"]
    tp1 = load_pretrained(args.checkpoint, device="cuda")
    tpn = load_pretrained(args.checkpoint, device="cuda", tp_rank=rank, tp_size=world)
    out = {"world": world, "runs": []}
    for batch, bucket in ((1, 1), (3, 4)):
        torch._dynamo.reset()
        one = k3compile.compile(tp1, buckets=(bucket,), options={"kernels": f"package:{args.package1}"})
        torch._dynamo.reset()
        runtime.reset_launch_counts()
        print(f"[rank {rank}] compiling TP {world}, bucket {bucket}", file=sys.stderr, flush=True)
        many = k3compile.compile(tpn, buckets=(bucket,), options={"kernels": f"package:{args.package}"})
        s1, sn, se = tp1.new_state(bucket, cap), tpn.new_state(bucket, cap), tpn.new_state(bucket, cap)
        ids = torch.arange(batch, device="cuda") * 7 % tp1.config.vocab_size
        errs, eager_errs, top1, differ_ranks = [], [], [], 0
        for i in range(args.steps):
            if i % 64 == 0:
                print(f"[rank {rank}] batch {batch} step {i}", file=sys.stderr, flush=True)
            a = one(ids, s1)
            b = many(ids, sn)
            e = tpn.decode(ids, se)  # eager TP-N (NCCL collectives)
            errs.append(_rel(b, a))
            eager_errs.append(_rel(e, a))
            top1.append(float((a.argmax(-1) == b.argmax(-1)).float().mean()))
            differ_ranks += int(not all(torch.equal(t, b) for t in _gather(b)))
            ids = a.argmax(-1)
        counts = runtime.launch_counts()
        cov = many.dispatchers[-1].coverage()
        errs_t, eager_t = torch.tensor(errs), torch.tensor(eager_errs)
        out["runs"].append({
            "batch": batch, "bucket": bucket, "steps": args.steps,
            "rel_p50": errs_t.median().item(), "rel_p99": errs_t.quantile(0.99).item(), "rel_max": errs_t.max().item(),
            "eager_tp_rel_p50": eager_t.median().item(), "eager_tp_rel_max": eager_t.max().item(),
            "top1": sum(top1) / len(top1), "steps_ranks_differ": differ_ranks,
            "one_shot_exchanges": counts.get("collective:one_shot", 0),
            "nccl_all_reduces": counts.get("collective:all_reduce", 0),
            "nccl_all_gathers": counts.get("collective:all_gather", 0),
            "coverage_problems": cov["problems"], "eager_fallbacks": runtime.eager_fallbacks()})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("check", choices=("allreduce", "logits"))
    ap.add_argument("--package", required=True)
    ap.add_argument("--package1")
    ap.add_argument("--checkpoint")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--replays", type=int, default=1000)
    ap.add_argument("--out", required=True)
    ap.add_argument("--watchdog", type=float, default=0, help="seconds before stacks are dumped and it exits")
    args = ap.parse_args()
    rank, world = comm.init_ranks(), comm.torchrun_world()  # NCCL, NVLink multicast off
    t0 = time.time()
    if args.watchdog:  # a hang (a collective or flag wait that never completes) prints every thread's stack
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    try:
        res = (check_allreduce if args.check == "allreduce" else check_logits)(args, rank, world)
        res["seconds"] = round(time.time() - t0, 1)
        if rank == 0:
            with open(args.out, "w") as fh:
                json.dump(res, fh, indent=1)
            print(json.dumps(res, indent=1)[:6000])
        comm.leave(0)  # no destroy_process_group (it hangs on torch 2.11: see k3compile.comm.leave)
    except BaseException:
        import traceback

        msg = traceback.format_exc()
        with open(f"{args.out}.rank{rank}.err", "w") as fh:  # the test shows it (torchrun's summary does not)
            fh.write(msg)
        print(f"[rank {rank}] {msg}", file=sys.stderr, flush=True)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
