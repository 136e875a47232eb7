"""The ``k3compile`` command line: ``diff`` (what every pass did); more subcommands arrive with the plan,
codegen, bench and verify stages."""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__


def _add_point_args(p: argparse.ArgumentParser, *, bucket: bool = True) -> None:
    p.add_argument("--config", default="k3_mini",
                   help="k3_mini, kimi_k3, slice[:N] (real dims, first N layers) or a path to a config.json")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (1, 2, 4, 8, 16)")
    if bucket:
        p.add_argument("--bucket", type=int, default=1, help="batch bucket to compile for")


def _note_bucket(bucket: int) -> None:
    """A --bucket that no kernel template compiles for still plans and lowers (the passes take any batch), but
    nothing would run it: say so, and which bucket the runtime would pad that batch to."""
    from .compiler import DEFAULT_BUCKETS, bucket_for

    if bucket < 1:
        raise ValueError(f"--bucket {bucket}: a bucket is a positive batch size, one of {DEFAULT_BUCKETS}")
    if bucket not in DEFAULT_BUCKETS:
        pad = bucket_for(bucket, DEFAULT_BUCKETS)
        to = f"a batch of {bucket} runs padded to bucket {pad}: use --bucket {pad}" if pad else (
            f"a batch above {DEFAULT_BUCKETS[-1]} is refused at run time, or runs eager with eager_fallback")
        print(f"note: bucket {bucket} is not one of the kernel buckets {DEFAULT_BUCKETS}, so its launches have no "
              f"kernels ('uncovered'); {to}", file=sys.stderr)


def cmd_diff(args) -> int:
    from k3compile.models import get_config

    from .capture import capture_config
    from .compiler import Options, check_tp, lower
    from .diff_view import html_report, text_report

    check_tp(args.tp)
    _note_bucket(args.bucket)
    cfg = get_config(args.config)
    cap = capture_config(cfg, tp_size=args.tp)
    opts = Options.make(buckets=(args.bucket,), dump_dir=args.dump_dir)
    gm = lower(cap.graph_module, cap.inputs, tp_size=args.tp, bucket=args.bucket, options=opts,
               batch_symbol=cap.batch_symbol)
    records = gm.meta["k3_records"]
    if args.pass_name and args.pass_name not in {r.name for r in records}:
        print(f"error: no pass named {args.pass_name!r}; passes: {[r.name for r in records]}", file=sys.stderr)
        return 2
    print(text_report(records, only=args.pass_name), end="")
    if args.html:
        title = f"k3compile diff - {cfg.name}, TP{args.tp}, bucket {args.bucket}"
        with open(args.html, "w") as fh:
            fh.write(html_report(records, title))
        print(f"wrote {args.html}", file=sys.stderr)
    return 0


def cmd_plan(args) -> int:
    from k3compile.models import get_config

    from .memory import rank_memory
    from .plan import dumps, plan_for

    cfg = get_config(args.config)
    cfg.check_tp(args.tp)
    _note_bucket(args.bucket)
    plan = plan_for(cfg, tp=args.tp, bucket=args.bucket, context=args.context)
    cap = args.max_context or cfg.max_position_embeddings
    if not args.context < cap <= cfg.max_position_embeddings:
        raise ValueError(f"--max-context {cap} must be above --context {args.context} and at most {cfg.name}'s "
                         f"max_position_embeddings {cfg.max_position_embeddings}")
    mem = rank_memory(cfg, tp=args.tp, bucket=args.bucket, max_context=cap, relay_in_place=args.relay_in_place)
    if args.json:
        print(json.dumps({**json.loads(dumps(plan, args.bandwidth)), "memory": mem.to_json()}, indent=1))
    else:
        print(plan.text(args.bandwidth) + mem.text())
    return 0


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def cmd_codegen(args) -> int:
    from pathlib import Path

    from k3compile.models import get_config

    from .codegen import example_points, plan_points, summary, write
    from .compiler import check_buckets, check_tp

    if args.examples is not None:
        labels = [x for x in args.examples.split(",") if x] or None
        cg = example_points(args.templates.split(",") if args.templates else None, labels, arch=args.arch)
    else:
        cfg = get_config(args.config)
        for tp in args.tp:
            check_tp(tp)
            cfg.check_tp(tp)
        cg = plan_points(cfg, tps=args.tp, buckets=check_buckets(args.buckets), arch=args.arch,
                         max_context=args.max_context, batch_invariant=args.batch_invariant,
                         l2_prefetch=args.l2_prefetch << 20)
    if args.templates and args.examples is None:
        try:
            gone = cg.keep_templates(args.templates.split(","))
        except ValueError as e:
            print(f"k3compile codegen: error: --templates: {e}", file=sys.stderr)
            return 2
        print(f"left out {gone} kernels of other templates: {len(cg.points)} kernels of {args.templates} (a package "
              f"for a GPU check, not for serving)")
    if args.skip_passed:
        from .bench_kernels import passed_in

        gone = cg.skip_passed(passed_in(args.skip_passed))
        print(f"left out {gone} kernels that passed in {', '.join(args.skip_passed)}: {len(cg.points)} kernels to "
              f"check (a package for a GPU check, not for serving)")
    manifest = write(cg, Path(args.out), compile=not args.no_compile, package=args.package, workers=args.jobs)
    print(summary(manifest))
    print(f"wrote {args.out}/manifest.json and {len(manifest['kernels'])} kernel sources"
          + (" with .so packages" if manifest["packaged"] else ""))
    if args.strict and manifest["coverage"]["uncovered"]:
        print("k3compile codegen: error: --strict and some plan launches have no kernel (listed above)",
              file=sys.stderr)
        return 1
    return 0


def cmd_bench_kernels(args) -> int:
    from .bench_kernels import run

    return run(args.package, out_json=args.json, seeds=args.seeds, only=args.only, timing=not args.check_only,
               seed=args.seed, shard=args.shard, skip_passed=args.skip_passed)


def cmd_bench(args) -> int:
    from .bench import main

    return main(args)


def cmd_bench_plot(args) -> int:
    import os

    from .bench import layer_kernels_table, per_layer, plot, refloor, rows_of, table

    with open(args.json) as fh:
        res = json.load(fh)
    if args.refloor:
        refloor(res)
    res["per_layer"] = per_layer(rows_of(res))  # recomputed: a JSON from an older bench gets the GPU busy column
    if args.save:
        with open(args.save, "w") as fh:
            json.dump(res, fh, indent=1)
        print(f"wrote {args.save}")
    print(table(res))
    if args.by_kernel:
        manifest = None
        if args.package:
            with open(os.path.join(args.package, "manifest.json")) as fh:
                manifest = json.load(fh)
        print("\nper layer, per kernel (T(n layers) - T(n-1 layers)):\n" + layer_kernels_table(res, manifest))
    plot(res, args.png, layers=args.layers, context=args.context)
    print(f"wrote {args.png}")
    return 0


def cmd_ptx_diff(args) -> int:
    from .ptx_diff import main

    return main(args)


def cmd_verify(args) -> int:
    from .verify import main

    return main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="k3compile",
        description="Compile the Kimi K3 decode step into fused, specialised kernels per batch bucket and TP size.")
    p.add_argument("--version", action="version", version=f"k3compile {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    d = sub.add_parser("diff", help="show what every compiler pass did to the decode graph",
                       description="Capture the decode step, run the pass pipeline for one (bucket, TP) point and "
                                   "print each pass's unified graph diff with its match count.")
    _add_point_args(d)
    d.add_argument("--pass", dest="pass_name", help="only this pass's diff")
    d.add_argument("--html", help="also write a self-contained HTML page (pass list, side-by-side graphs)")
    d.add_argument("--dump-dir", help="also write NN_<pass>.before.py/.after.py/.diff files here")
    d.set_defaults(func=cmd_diff)
    pl = sub.add_parser("plan", help="the kernel launches per layer type for one (bucket, TP) point",
                        description="Ordered kernel launches per layer type (stream, inputs, bytes of weights and "
                                    "activations, FLOPs) and the per-layer HBM floor (bytes / bandwidth).")
    _add_point_args(pl)
    pl.add_argument("--context", type=int, default=0, help="tokens already in each sequence (MLA cache bytes read)")
    pl.add_argument("--max-context", type=int, default=None,
                    help="positions the decode state has room for (the memory per rank; default: the config's "
                         "max_position_embeddings)")
    pl.add_argument("--relay-in-place", action="store_true",
                    help="the memory as compiled with options={'relay_in_place': True}: the routed experts' codes "
                         "rewritten into the kernels' layout in their own memory, no relaid copy")
    pl.add_argument("--bandwidth", type=float, default=4.2e12, help="HBM bandwidth in bytes/s for the floor")
    pl.add_argument("--json", action="store_true", help="print JSON instead of the table")
    pl.set_defaults(func=cmd_plan)
    cg = sub.add_parser("codegen", help="render (and compile/package) the CuTe DSL kernels of the plan",
                        description="Map every plan launch at every (TP, bucket) to kernel template instances, write "
                                    "one readable .py per distinct kernel plus manifest.json, compile them for the "
                                    "arch in parallel processes (disk-cached) and, with --package, link TVM-FFI .so "
                                    "files loadable on a GPU host without the compiler. No GPU needed.")
    cg.add_argument("--config", default="k3_mini", help="k3_mini, kimi_k3, slice[:N] or a config.json path")
    cg.add_argument("--tp", type=_int_list, default=(1,), help="TP sizes, e.g. 1,2,4,8")
    cg.add_argument("--buckets", type=_int_list, default=(1, 2, 4, 8, 16, 32, 64), help="batch buckets")
    cg.add_argument("--arch", default="sm_90a", help="GPU arch to compile for (sm_90a)")
    cg.add_argument("--max-context", type=int, default=None,
                    help="MLA cache capacity the kernels serve (default: the config's max_position_embeddings)")
    cg.add_argument("-o", "--out", required=True, help="output directory")
    cg.add_argument("--package", action="store_true", help="also export and link .so files + the CuTe runtime")
    cg.add_argument("--no-compile", action="store_true", help="only render the sources and the manifest")
    cg.add_argument("--jobs", type=int, default=None, help="parallel compile processes (default: CPU count)")
    cg.add_argument("--strict", action="store_true", help="fail when a plan launch has no kernel")
    cg.add_argument("--batch-invariant", action="store_true",
                    help="kernels for compile(..., options={'batch_invariant': True}): every bucket reduces a row in "
                         "bucket 1's order (the MLA decode keeps bucket 1's context splits)")
    cg.add_argument("--examples", nargs="?", const="", default=None, metavar="PREFIXES",
                    help="instead of a plan: every template's example points (k3-mini and real K3 TP8-shard "
                         "shapes), optionally only labels starting with PREFIXES (e.g. mini_,k3tp8_b1)")
    cg.add_argument("--templates", help="only these templates (comma-separated): of the examples, or of the plan's "
                                        "kernels (a package for a GPU check of a template's change)")
    cg.add_argument("--l2-prefetch", type=int, default=0, metavar="MIB",
                    help="weights a GEMV may pull into L2 while the kernel before it runs, at most (MiB; what fits "
                         "beside the previous kernel's bytes in 40 of the H200's 60 MB L2). Default 0: only its "
                         "first vectors (24 measured no faster on the H200)")
    cg.add_argument("--skip-passed", metavar="JSON", nargs="+",
                    help="leave out the kernels that passed in these bench-kernels JSONs (e.g. the shard files of "
                         "check_package.sh): a package of only the kernels a change made, for the GPU check")
    cg.set_defaults(func=cmd_codegen)
    bk = sub.add_parser("bench-kernels", help="check and time every kernel of a package on the GPU",
                        description="For every kernel of a prebuilt package (codegen --package, e.g. --examples): "
                                    "correctness against the template's float64 reference on fresh random inputs "
                                    "with NaN-poisoned outputs, then its time inside a CUDA graph (inputs rotated "
                                    "past the L2), its byte floor and %% of the copy bandwidth measured in the same "
                                    "run, beside torch doing the same math. Prints a table, writes JSON.")
    bk.add_argument("--package", required=True, help="package directory (codegen --package output)")
    bk.add_argument("--json", default="bench_kernels.json", help="where to write the results")
    bk.add_argument("--seeds", type=int, default=2, help="correctness checks per kernel (fresh inputs each)")
    bk.add_argument("--only", help="only kernels whose example label or name contains this (comma-separated: "
                                   "any of these)")
    bk.add_argument("--seed", type=int, help="draw check i's inputs from seed SEED + i for every kernel (default: "
                                            "fresh): two packages' kernels of one example checked on the same inputs")
    bk.add_argument("--check-only", action="store_true", help="correctness only, no timing")
    bk.add_argument("--shard", metavar="I/N", help="run only the I-th of N equal parts of the selected kernels "
                                                   "(split by input bytes, the same split in every process): N "
                                                   "processes check a whole package side by side on one GPU")
    bk.add_argument("--skip-passed", metavar="JSON", nargs="+", help="skip the kernels that passed in these earlier "
                                                                     "bench-kernels JSONs (go on with a check that "
                                                                     "was cut off; failed ones run again)")
    bk.set_defaults(func=cmd_bench_kernels)
    bp = sub.add_parser("bench-plot", help="table and plot of a `k3compile bench` JSON (no GPU needed)")
    bp.add_argument("json", help="bench JSON")
    bp.add_argument("png", help="output PNG")
    bp.add_argument("--layers", type=int, help="depth to plot (default: the deepest)")
    bp.add_argument("--context", type=int, help="context to plot (default: the first)")
    bp.add_argument("--refloor", action="store_true",
                    help="recompute every row's floor with this checkout's kernel plan (same bandwidth): for a JSON "
                         "whose floors came from an older byte model")
    bp.add_argument("--save", help="also write the (recomputed) results to this JSON")
    bp.add_argument("--by-kernel", action="store_true",
                    help="also print what each kernel adds to every k3compile layer (exposed µs, calls)")
    bp.add_argument("--package", help="with --by-kernel: the package the run used (its manifest names each "
                                      "kernel's point and bytes: a floor per kernel); the deepest slice's package")
    bp.set_defaults(func=cmd_bench_plot)
    from . import bench  # its system names (imports torch; the CLI does already)

    be = sub.add_parser("bench", help="time the whole decode step: eager vs Inductor vs k3compile (GPU)",
                        description="One process, one GPU, the same model, state and tokens for every system: "
                                    "µs per step, kernel launches, the HBM floor (plan bytes / copy bandwidth "
                                    "measured in the same run), extra GPU memory; per layer type by differencing "
                                    "depths (--layers). TP > 1: rank 0's shard, collectives as no-ops (per-rank "
                                    "compute, communication excluded). Prints a table, writes JSON.")
    be.add_argument("--config", default="k3_mini", choices=("k3_mini", "slice"),
                    help="k3_mini, or slice: real K3 dimensions, the first --layers layers")
    be.add_argument("--layers", type=_int_list, default=None,
                    help="depths to run (e.g. 1,2,4: layer n's time = T(n) - T(n-1))")
    be.add_argument("--tp", type=int, default=1, help="TP size: emulated on this GPU (rank 0's shard, no "
                                                      "communication), or real under torchrun --nproc-per-node TP")
    be.add_argument("--buckets", type=_int_list, default=(1, 8, 64), help="batch sizes (= buckets)")
    be.add_argument("--context", type=_int_list, default=(1024,), help="tokens already in each sequence")
    be.add_argument("--package", help="kernel package (codegen --package; its --max-context is the state's "
                                      "capacity); '{layers}' in it is replaced by the depth (--layers)")
    be.add_argument("--systems", type=lambda s: s.split(","), default=list(bench.DEFAULT_SYSTEMS),
                    help=bench.SYSTEMS_HELP)
    be.add_argument("--steps", type=int, default=20, help="decode steps timed per figure")
    be.add_argument("--json", default="bench.json", help="where to write the results")
    be.add_argument("--png", default="bench.png", help="plot: µs per step vs batch per system, floor dashed")
    be.set_defaults(func=cmd_bench)
    px = sub.add_parser("ptx-diff", help="which kernels a source change changed: PTX of two codegen outputs",
                        description="Pair the kernels of two codegen outputs (compiled, not pruned) by template, "
                                    "constants and arch and compare their PTX, the kernel names (source hashes) "
                                    "aside: a refactor that renames kernels proves it changed none. Exit 1 when a "
                                    "pair differs, a kernel has no partner, or (--passed) a kernel of NEW is not "
                                    "covered by a passed GPU check.")
    px.add_argument("old", help="codegen -o directory of the old commit")
    px.add_argument("new", help="codegen -o directory of the new commit")
    px.add_argument("--passed", metavar="JSON", nargs="+",
                    help="bench-kernels JSONs (e.g. check_package.sh's shard files): list NEW's kernels that "
                         "neither passed by name nor have the PTX of a kernel that passed")
    px.add_argument("--json", help="also write the pairs as JSON here")
    px.set_defaults(func=cmd_ptx_diff)
    ve = sub.add_parser("verify", help="evidence that the compiled path is right and was taken (report)",
                        description="Coverage proof from the launch counters, kernel checks (GPU: float64 on "
                                    "fresh poisoned inputs; CPU: compile + bit logic + per-node references), long "
                                    "greedy generation vs eager, cross-bucket consistency, the PTX memory-ordering "
                                    "audit, the scope, and (GPU, --bench) the performance sweep. Exit 1 on any "
                                    "failed check; GPU-only checks are listed as skipped on a CPU.")
    ve.add_argument("--config", default="k3_mini", choices=("k3_mini",),
                    help="k3_mini: the trained checkpoint (checkpoints/k3_mini_text) unless --checkpoint")
    ve.add_argument("--checkpoint", help="a k3-mini-class checkpoint directory")
    ve.add_argument("--tp", type=int, default=1,
                    help="TP size; > 1 runs on real ranks: torchrun --nproc-per-node TP -m k3compile.cli verify --tp TP")
    ve.add_argument("--buckets", type=_int_list, default=(1, 4, 8), help="buckets to compile and check")
    ve.add_argument("--steps", type=int, default=1000, help="generated tokens per prompt (long generation)")
    ve.add_argument("--kernels", default=None, help="package:DIR, jit or reference (default: $K3_KERNEL_PACKAGE "
                                                    "on a GPU, reference on a CPU)")
    ve.add_argument("--batch-invariant", action="store_true",
                    help="compile with batch_invariant=True (the package must be built with --batch-invariant)")
    ve.add_argument("--disable", help="comma-separated ops/kernels forced onto eager (shows the proof failing)")
    ve.add_argument("--no-compile-check", action="store_true", help="skip compiling the kernels (and the audit)")
    ve.add_argument("--bench", action="store_true", help="GPU: add the k3compile bench rows")
    ve.add_argument("--report", help="write the Markdown report here")
    ve.add_argument("--json", help="write the JSON report here")
    ve.set_defaults(func=cmd_verify)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from .build import BuildError
    from .package import PackageError

    try:
        return args.func(args)
    except (ValueError, KeyError, TypeError, OSError, BuildError, PackageError) as e:  # one clear line, no traceback
        print(f"k3compile {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
