"""Generate text with k3-mini from a random checkpoint on the CPU (the README's first command).

Writes a random k3-mini checkpoint in the released Kimi K3 format, loads it back, and decodes a
greedy and a sampled continuation of two prompts of different lengths.
"""

import argparse
import os
import tempfile
import time

import torch

from k3compile.models import k3_mini, load_pretrained, save_random_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--checkpoint", help="checkpoint folder (default: write a random k3-mini to a temp dir)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or save_random_checkpoint(os.path.join(tmp, "k3-mini"), k3_mini(), seed=args.seed)
        model = load_pretrained(path)
        cfg = model.config
        print(f"k3-mini: {cfg.num_hidden_layers} layers ({' '.join(t.upper()[0] for t in cfg.layer_types)}), "
              f"hidden {cfg.hidden_size}, {cfg.num_experts} MXFP4 experts top-{cfg.num_experts_per_token}")
        prompts = [[1, 17, 42, 99, 7], [5, 300]]
        t0 = time.perf_counter()
        greedy = model.generate(prompts, args.new_tokens)
        dt = time.perf_counter() - t0
        sampled = model.generate(prompts, args.new_tokens, temperature=0.8, top_p=0.9, seed=args.seed)
        for p, g, s in zip(prompts, greedy, sampled):
            print(f"prompt {p}\n  greedy  -> {g}\n  sampled -> {s}")
        steps = max(map(len, prompts)) + args.new_tokens - 1
        print(f"greedy decode: {steps} steps in {dt:.2f} s ({1e3 * dt / steps:.1f} ms/step, batch {len(prompts)}, CPU eager)")


if __name__ == "__main__":
    main()
