"""The ``k3compile`` command line: ``diff`` (what every pass did); more subcommands arrive with the plan,
codegen, bench and verify stages."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def _add_point_args(p: argparse.ArgumentParser, *, bucket: bool = True) -> None:
    p.add_argument("--config", default="k3_mini",
                   help="k3_mini, kimi_k3, slice[:N] (real dims, first N layers) or a path to a config.json")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (1, 2, 4, 8, 16)")
    if bucket:
        p.add_argument("--bucket", type=int, default=1, help="batch bucket to compile for")


def cmd_diff(args) -> int:
    from k3compile.models import get_config

    from .capture import capture_config
    from .compiler import Options, check_tp, lower
    from .diff_view import html_report, text_report

    check_tp(args.tp)
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

    from .plan import dumps, plan_for

    cfg = get_config(args.config)
    cfg.check_tp(args.tp)
    plan = plan_for(cfg, tp=args.tp, bucket=args.bucket, context=args.context)
    print(dumps(plan, args.bandwidth) if args.json else plan.text(args.bandwidth), end="" if not args.json else "\n")
    return 0


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
    pl.add_argument("--bandwidth", type=float, default=4.2e12, help="HBM bandwidth in bytes/s for the floor")
    pl.add_argument("--json", action="store_true", help="print JSON instead of the table")
    pl.set_defaults(func=cmd_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (ValueError, KeyError, TypeError) as e:  # bad input: one clear line, no traceback
        print(f"k3compile {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
