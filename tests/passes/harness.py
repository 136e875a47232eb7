"""Shared machinery of the pass tests: capture k3-mini once per TP size, lower it with the pipeline cut
after any pass, and run the lowered graph against the eager model (gloo processes for TP > 1)."""

from __future__ import annotations

import os

import torch

import k3compile.compiler as compiler
from k3compile.compiler import Options, lower
from k3compile.pipeline_table import default_passes

PASSES = [p.name for p in default_passes()]
BUCKETS = (1, 8, 64)


def cut_after(name: str) -> dict:
    """Pass options that disable every pass after ``name``."""
    i = PASSES.index(name)
    return {p: {"enabled": False} for p in PASSES[i + 1:]}


class CutRunner:
    """One Dynamo capture of ``model.decode``; ``run(cut, ids, state)`` executes the graph lowered with the
    pipeline cut after pass ``cut`` (lowered once per cut and bucket)."""

    def __init__(self, model):
        self.model = model
        self.current = None
        self.lowered = {}
        self.captured = None

        def backend(gm, example_inputs, **_):
            self.captured = (gm, compiler.classify_inputs(gm, example_inputs))
            return lambda *args: self.current(*args)

        self.compiled = torch.compile(model.decode, backend=backend, fullgraph=True)

    def graph(self, cut: str, bucket: int):
        key = (cut, bucket)
        if key not in self.lowered:
            gm, inputs = self.captured
            self.lowered[key] = lower(gm, inputs, tp_size=self.model.tp.size, tp_rank=self.model.tp.rank,
                                      bucket=bucket, options=Options.make(passes=cut_after(cut)))
        return self.lowered[key]

    def run(self, cut: str, ids, state):
        bucket = compiler.bucket_for(ids.shape[0], BUCKETS)
        if self.captured is None:  # first call: capture with a no-op graph, then run for real
            self.current = lambda *args: self.captured[0](*args)  # the captured graph, on a throwaway state
            throwaway = state.clone()
            compiler.mark_dynamic_inputs(ids, throwaway)
            with compiler.symbolic_batch():
                self.compiled(ids, throwaway)
        self.current = self.graph(cut, bucket)
        compiler.mark_dynamic_inputs(ids, state)
        with compiler.symbolic_batch():
            return self.compiled(ids, state)


def check_every_cut(model, steps: int = 2) -> dict:
    """For every pass and bucket: max |compiled - eager| over ``steps`` decode steps, and whether the state
    advanced identically. Returns {(pass, bucket): (max_abs_diff, state_equal)}."""
    runner = CutRunner(model)
    results = {}
    for bucket in BUCKETS:
        g = torch.Generator().manual_seed(bucket)
        ids0 = torch.randint(0, model.config.vocab_size, (bucket,), generator=g)
        ref_state = model.new_state(max(BUCKETS), steps + 1)  # one state geometry: one capture
        ref_logits, ids = [], ids0
        for _ in range(steps):
            out = model.decode(ids, ref_state)
            ref_logits.append(out)
            ids = out.argmax(-1)
        for name in PASSES:
            state = model.new_state(max(BUCKETS), steps + 1)
            ids, worst = ids0, 0.0
            for ref in ref_logits:
                out = runner.run(name, ids, state)
                worst = max(worst, (out - ref).abs().max().item())
                ids = ref.argmax(-1)
            same = all(torch.equal(a, b) for a, b in zip(state.tensors(), ref_state.tensors()))
            results[(name, bucket)] = (worst, same)
    return results


def tp_worker(rank, world, ckpt, out_dir):
    from k3compile.models import load_pretrained

    model = load_pretrained(ckpt, tp_rank=rank, tp_size=world)
    torch.save(check_every_cut(model), os.path.join(out_dir, f"rank{rank}.pt"))
