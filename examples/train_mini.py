"""Train the k3-mini-text model (every K3 quirk, byte-level) on the Python standard library's sources.

Writes config.json + model.safetensors (released tensor names), report.json, expert_load.png and
heldout_sample.txt to --out. The committed checkpoints/k3_mini_text was made with the defaults:

    python examples/train_mini.py --out checkpoints/k3_mini_text --plot docs/expert_load.png

(one CPU thread, under 40 minutes including the evaluation; see k3compile.models.train for what is
trained and how). --report-only re-runs the evaluation of an existing --out folder.
"""

import argparse
import dataclasses
import json
import os
import shutil

from k3compile.models.train import TrainArgs, train, write_report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = TrainArgs(out="")
    for f in dataclasses.fields(TrainArgs):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "out":
            ap.add_argument(flag, required=True, help="output folder (the checkpoint)")
        elif isinstance(getattr(defaults, f.name), bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=getattr(defaults, f.name))
        else:
            ap.add_argument(flag, type=type(getattr(defaults, f.name)), default=getattr(defaults, f.name),
                            help=f"default: {getattr(defaults, f.name)}")
    ap.add_argument("--plot", help="also copy expert_load.png here (e.g. docs/expert_load.png)")
    ap.add_argument("--report-only", action="store_true",
                    help="evaluate the checkpoint already in --out again (keeps report.json's training section)")
    args = vars(ap.parse_args())
    plot, report_only = args.pop("plot"), args.pop("report_only")
    if report_only:
        with open(os.path.join(args["out"], "report.json")) as fh:
            report = write_report(args["out"], json.load(fh)["training"])
    else:
        report = train(TrainArgs(**args))
    if plot:
        shutil.copy(os.path.join(args["out"], "expert_load.png"), plot)
    print(f"done: held-out nats/byte {report['heldout_nats_per_byte']}")


if __name__ == "__main__":
    main()
