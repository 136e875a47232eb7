"""The ``k3compile`` command line."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="k3compile",
        description="Compile the Kimi K3 decode step into fused, specialised kernels per batch bucket and TP size.")
    p.add_argument("--version", action="version", version=f"k3compile {__version__}")
    p.add_subparsers(dest="command", metavar="COMMAND")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
