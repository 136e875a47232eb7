"""Compile the k3-mini decode step with k3compile and check it against eager (CPU).

Shows the two ways in: ``torch.compile(model.decode, backend="k3compile")`` and the explicit
``k3compile.compile`` (one graph for every bucket, no recompiles), then what each pass did.
"""

import argparse
import os
import tempfile

import torch

import k3compile
from k3compile.compiler import describe
from k3compile.models import k3_mini, load_pretrained, save_random_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = load_pretrained(save_random_checkpoint(os.path.join(tmp, "k3-mini"), k3_mini()))
        by_name = torch.compile(model.decode, backend="k3compile")
        explicit = k3compile.compile(model, buckets=(1, 2, 4, 8))
        rows = explicit.state_rows(args.batch)  # the bucket the batch is padded to (the kernel runtime needs them)
        states = {name: model.new_state(rows, args.steps) for name in ("eager", "by_name", "explicit")}
        ids = {name: torch.arange(args.batch) for name in states}
        worst = {"by_name": 0.0, "explicit": 0.0}
        for _ in range(args.steps):
            ref = model.decode(ids["eager"], states["eager"])
            ids["eager"] = ref.argmax(-1)
            for name, step in (("by_name", by_name), ("explicit", explicit)):
                out = step(ids[name], states[name])
                worst[name] = max(worst[name], (out - ref).abs().max().item())
                ids[name] = out.argmax(-1)
        print(f"{args.steps} steps at batch {args.batch}: max |logits - eager| = {worst}")
        print(f"calls per bucket: {explicit.dispatchers[-1].calls}")
        print(describe(explicit.graphs[4].meta["k3_records"]))
        if any(worst.values()):
            raise SystemExit("compiled logits differ from eager")


if __name__ == "__main__":
    main()
