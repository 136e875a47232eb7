"""Shared machinery of the pass tests: capture k3-mini once per TP size, lower it with the pipeline cut
after any pass, and run the lowered graph against the eager model (gloo processes for TP > 1)."""

from __future__ import annotations

import operator
import os

import torch
import torch.distributed as dist

import k3compile.compiler as compiler
from k3compile.compiler import Options, lower
from k3compile.pipeline_table import default_passes

PASSES = [p.name for p in default_passes()]
BUCKETS = (1, 8, 64)


def only(name: str) -> dict:
    """Pass options that disable every pass but ``name``."""
    return {p: {"enabled": False} for p in PASSES if p != name}


class CutRunner:
    """One Dynamo capture of ``model.decode``; ``run(cut, ids, state)`` executes the graph lowered with the
    pipeline cut after pass ``cut``. Cut after pass i = the cut after pass i-1 lowered with only pass i
    enabled (one pass run per cut, not i); the last cut is checked against lowering the capture whole."""

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
            i = PASSES.index(cut)
            before = self.graph(PASSES[i - 1], bucket) if i else self.captured[0]
            self.lowered[key] = self.lower(before, bucket, only(cut))
            if i == len(PASSES) - 1:  # the chain ends on what one whole-pipeline lowering gives
                assert same_program(self.lowered[key], self.lower(self.captured[0], bucket, {})), "chain != whole"
        return self.lowered[key]

    def lower(self, gm, bucket: int, passes: dict):
        return lower(gm, self.captured[1], tp_size=self.model.tp.size, tp_rank=self.model.tp.rank, bucket=bucket,
                     options=Options.make(passes=passes))

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


def same_program(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> bool:
    """Whether two lowered graphs execute the same thing: the same generated code over the same attributes.
    Under TP every rank must agree (else their collectives would not pair up): true only if true on all."""
    def attrs(gm):
        return [id(operator.attrgetter(n.target)(gm)) for n in gm.graph.nodes if n.op == "get_attr"]
    same = torch.tensor(int(a.code == b.code and attrs(a) == attrs(b)))
    if dist.is_initialized():
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same)


def check_every_cut(model, steps: int = 2) -> dict:
    """For every pass and bucket: max |compiled - eager| over ``steps`` decode steps, and whether the state
    advanced identically. Returns {(pass, bucket): (max_abs_diff, state_equal)}. A cut whose lowered graph is
    the same program as the previous cut's (the pass changed nothing at this bucket and TP size) has that
    cut's result: running the same code on the same inputs again would compute it again."""
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
        for i, name in enumerate(PASSES):
            if i and same_program(runner.graph(name, bucket), runner.graph(PASSES[i - 1], bucket)):
                results[(name, bucket)] = results[(PASSES[i - 1], bucket)]
                continue
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
