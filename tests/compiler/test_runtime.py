"""The kernel runtime on the CPU, with every kernel replaced by its float64 template reference.

This checks everything of the runtime except the kernels themselves (tests/gpu checks those): that each
dialect node's binding feeds its kernels the right tensors and returns what the dialect op returns
(shadow mode: kernels vs the eager op on the same inputs, per node, every step), that the planned
kernels all ran (launch counters, the coverage proof), padding to the bucket, the graph rewrites that drop
state writes a kernel already made, and the errors. Also the comparison the GPU kernel checks use
(``kernel_check.compare``), on small CPU tensors.

Tolerance: 1e-2 relative per node (bf16 outputs of a float64 reference against the eager op's bf16
arithmetic; measured at most ~4e-3). Whole-model logits are not compared: on a random-weight k3-mini a
0.3 % perturbation of one input changes the logits by ~10 % (tested below), so per-node shadow checks
are the precise test and end-to-end agreement is checked on the GPU with the real kernels.
"""

import contextlib
import gc
import logging

import pytest
import torch

import k3compile
from k3compile import kernel_check, runtime
from k3compile.templates.base import Arg, Point, Template, const
from cpu import one_thread

SHADOW_TOL = 1e-2


def _compile(model, buckets, **options):
    return k3compile.compile(model, buckets=buckets, options={"kernels": "reference", **options})


def test_reference_runtime_matches_eager_op_per_node_and_runs_every_planned_kernel(mini_model):
    runtime.reset_launch_counts()
    step = _compile(mini_model, (1, 4), shadow=True)
    state = mini_model.new_state(4, 16)
    batches = (1, 3, 4, 3)
    with one_thread():
        for i, batch in enumerate(batches):
            before = [t.clone() for t in state.tensors()]
            logits = step(torch.arange(1 + i, 1 + i + batch), state)
            assert logits.shape == (batch, mini_model.config.vocab_size) and logits.dtype == torch.float32
            assert torch.isfinite(logits).all()
            for old, new in zip(before, state.tensors()):  # rows past the batch: exactly as they were
                assert torch.equal(old[batch:], new[batch:]), "a padding row's state changed"
    d = step.dispatchers[-1]
    errors = runtime.shadow_errors()
    bound = sum(len(d.bound[b].bindings) for b in (1, 4))
    assert len(errors) == bound, "every dialect node of both buckets was shadow-checked"
    worst = max(errors, key=errors.get)
    assert errors[worst] <= SHADOW_TOL, f"{worst}: kernels differ from the eager op by {errors[worst]:.3g}"
    assert state.lengths.tolist() == [4, 3, 3, 1]
    cov = d.coverage()
    assert cov["problems"] == [] and cov["calls"] == {1: 1, 4: 3}
    counts = runtime.launch_counts()
    planned = d.bound[1].planned() + d.bound[4].planned() + d.bound[4].planned() + d.bound[4].planned()
    assert counts == dict(planned), "launch counters = planned launches per step x steps"
    templates = {k.split("_")[0] for k in counts}
    assert templates >= {"gemv", "moe", "kda", "mla", "residual", "rms"}
    assert runtime.eager_fallbacks() == {}


def test_router_selection_gets_its_own_kernel_from_bucket_16(mini_model):
    """From ROUTE_MIN_BUCKET the routed experts are moe_route -> moe_gate_up (ids in) -> moe_down_combine: the
    binding feeds them what the eager op gets (shadow check) and the counters show all three ran per layer."""
    from k3compile.templates.moe_experts import ROUTE_MIN_BUCKET

    runtime.reset_launch_counts()
    step = _compile(mini_model, (ROUTE_MIN_BUCKET,), shadow=True)
    with one_thread():
        step(torch.arange(1, 1 + 10), mini_model.new_state(ROUTE_MIN_BUCKET, 16))  # 10 rows, padded to the bucket
    d = step.dispatchers[-1]
    table = d.bound[ROUTE_MIN_BUCKET].table()
    assert "Binding[routed_experts -> moe_route_" in table, table
    errors = runtime.shadow_errors()
    worst = max(errors, key=errors.get)
    assert errors[worst] <= SHADOW_TOL, f"{worst}: kernels differ from the eager op by {errors[worst]:.3g}"
    counts = runtime.launch_counts()
    assert counts == dict(d.bound[ROUTE_MIN_BUCKET].planned()) and d.coverage()["problems"] == []
    per_kind = {kind: sum(n for k, n in counts.items() if k.startswith(kind + "_"))
                for kind in ("moe_route", "moe_gate_up", "moe_down_combine")}
    assert len(set(per_kind.values())) == 1 and per_kind["moe_route"] > 0, per_kind


def test_bindings_name_their_kernels(mini_model):
    step = _compile(mini_model, (2,))
    with one_thread():
        step(torch.tensor([1, 2]), mini_model.new_state(2, 16))
    table = step.dispatchers[-1].bound[2].table()
    assert "Binding[routed_experts -> moe_gate_up_" in table and "moe_down_combine_" in table
    assert "Binding[kda_decode_fb -> kda_decode_" in table and "Binding[mla_decode_latent -> mla_decode_" in table
    code = step.graphs[2].code
    assert "check_decode_inputs" not in code, "the input check runs before the step, outside the graph"
    # the KDA kernel updates the state in place: the graph's copy of the new state onto itself is gone
    assert "recurrent" not in "".join(line for line in code.splitlines() if ".copy_(" in line)


def test_attn_res_blocks_reach_the_kernels_unstacked(mini_model):
    """The residual kernels take each sealed block as its own [M, D] tensor: the bound graph keeps no
    ``torch.stack`` of blocks (one copy launch per residual op in the lowered graph), every residual binding gets
    a list, and a disabled (eager) op still gets the stacked tensor its eager implementation takes."""
    lowered = _compile(mini_model, (2,))
    with one_thread():
        lowered(torch.tensor([1, 2]), mini_model.new_state(2, 16))
    d = lowered.dispatchers[-1]
    stacks = [n for n in d.lowered[2].graph.nodes if n.target is torch.stack]
    assert len(stacks) >= 24, "the lowered k3-mini graph stacks the AttnRes blocks before each residual op"
    nodes = list(d.bound[2].gm.graph.nodes)
    assert not [n for n in nodes if n.target is torch.stack]
    fed = [n for n in nodes if isinstance(n.target, runtime.Binding)
           and "blocks" in [a.name for a in n.target.target._schema.arguments]]
    assert len(fed) == len(stacks) and all(isinstance(runtime._named(n.target.target, n.args, n.kwargs)["blocks"],
                                                      list) for n in fed)
    eager = _compile(mini_model, (2,), disable_kernels=("ffn_tail_norm",))
    with one_thread():
        eager(torch.tensor([1, 2]), mini_model.new_state(2, 16))
    kept = [n for n in eager.dispatchers[-1].bound[2].gm.graph.nodes if n.target is torch.stack]
    assert kept and all(isinstance(u.target, runtime.EagerOp) for n in kept for u in n.users)


def test_disabled_kernel_fails_the_coverage_proof_naming_it(mini_model):
    runtime.reset_launch_counts()
    step = _compile(mini_model, (1,), disable_kernels=("routed_experts",))
    with one_thread():
        step(torch.tensor([5]), mini_model.new_state(1, 16))
    d = step.dispatchers[-1]
    problems = "\n".join(d.coverage()["problems"])
    missing = [p for p in d.bound[1].planned() if p.startswith("moe_gate_up_")]
    assert missing and all(f"kernel {m} launched 0 times" in problems for m in missing)
    assert "(routed_experts) ran eagerly instead of moe_gate_up_" in problems
    assert "eager fallback routed_experts: 12 times" in problems  # 12 MoE layers in k3-mini
    assert runtime.eager_fallbacks() == {"routed_experts": 12}


def test_state_smaller_than_the_bucket_is_a_clear_error(mini_model):
    step = _compile(mini_model, (4,))
    with pytest.raises(runtime.RuntimeError_, match=r"bucket 4, but the state holds only 3 rows.*new_state\(4"):
        step(torch.tensor([1, 2, 3]), mini_model.new_state(3, 16))


def test_bad_inputs_are_checked_before_the_step(mini_model):
    step = _compile(mini_model, (2,))
    state = mini_model.new_state(2, 2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        step(torch.tensor([1, 10**6]), state)
    assert state.lengths.tolist() == [0, 0], "nothing ran"
    with one_thread():
        step(torch.tensor([1, 2]), state)
        step(torch.tensor([1, 2]), state)
    with pytest.raises(ValueError, match="max_context"):
        step(torch.tensor([1, 2]), state)


def test_bad_arguments_get_eagers_errors(mini_model, model_f32):
    """A wrong argument gets from the compiled step the error eager decode gives (before Dynamo, which would
    report it as a graph break), and the compiled step runs nothing: the token ids' rank, dtype and count,
    and a state of another model's dtype (which reached a kernel as 'a binding bug' before)."""
    runtime.reset_launch_counts()
    step = _compile(mini_model, (1, 4))
    state = mini_model.new_state(4, 16)
    bad = {"1-D LongTensor": (torch.tensor([[1, 2]]), state),
           "integer tensor": (torch.tensor([1.0, 2.0]), state),
           "token_ids is empty": (torch.tensor([], dtype=torch.long), state),
           "exceeds the state's batch size 4": (torch.arange(5), state),
           "state was made for a torch.float32 model on cpu; this model computes in torch.bfloat16":
               (torch.tensor([1]), model_f32.new_state(4, 16))}
    for message, (ids, st) in bad.items():
        for fn in (step, mini_model.decode):
            with pytest.raises((ValueError, TypeError), match=message):
                fn(ids, st)
    assert state.lengths.tolist() == [0, 0, 0, 0] and runtime.launch_counts() == {}


def test_generate_with_a_compiled_step_gives_the_state_the_buckets_rows(mini_model):
    """model.generate(decode=step) on the kernel runtime with three prompts: the batch runs padded into bucket
    4, so the state gets 4 rows (step.state_rows), where it got one per prompt and the step refused it."""
    step = _compile(mini_model, (1, 4))
    assert [step.state_rows(b) for b in (1, 2, 3, 4, 9)] == [1, 4, 4, 4, 9]  # 9: above the largest bucket
    prompts = [[1, 2], [3], [4, 5, 6]]
    with one_thread():
        out = mini_model.generate(prompts, 2, decode=step)
    assert [len(o) for o in out] == [2, 2, 2]
    assert all(0 <= t < mini_model.config.vocab_size for o in out for t in o)
    assert step.dispatchers[-1].calls[4] == 4  # 3 prompt steps + 1: every step in bucket 4


def test_kernel_options_errors(mini_model):
    with pytest.raises(ValueError, match="kernels='bogus'.*package:DIR"):
        k3compile.compile(mini_model, options={"kernels": "bogus"})
    # a bucket no template is built for: refused before Dynamo runs (the eager dialect ops take it)
    with pytest.raises(k3compile.BucketError, match=r"buckets \[3\] have no kernels.*Fix: compile with buckets"):
        _compile(mini_model, (1, 3))(torch.tensor([1]), mini_model.new_state(3, 4))
    with one_thread():
        k3compile.compile(mini_model, buckets=(3,), options={"kernels": "eager"})(
            torch.tensor([1, 2]), mini_model.new_state(3, 4))
    step = k3compile.compile(mini_model, buckets=(1,), options={"kernels": "jit"})
    with pytest.raises(Exception, match="needs a CUDA device.*kernels='eager' or 'reference'"):
        step(torch.tensor([1]), mini_model.new_state(1, 4))


def test_package_without_the_kernel_names_the_fix(tmp_path):
    from k3compile.templates import get

    (tmp_path / "manifest.json").write_text('{"packaged": true, "kernels": {}}')
    point = get("rms_norm").point(bucket=1, n=256, eps=1e-5)
    with pytest.raises(runtime.RuntimeError_, match=f"kernel {point.name} .* is not in the package.*--max-context"):
        runtime.PackageKernels(tmp_path).function(point)


def test_random_k3_mini_is_too_chaotic_for_end_to_end_logit_checks(mini_ckpt):
    """Why the CPU test compares per node: a 0.3 % change of the embedding moves the logits by > 1 %."""
    from k3compile.models import load_pretrained

    with one_thread():
        a, b = load_pretrained(mini_ckpt), load_pretrained(mini_ckpt)
        with torch.no_grad():
            w = b.embed_tokens.weight
            w.add_(w * 0.003 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)).to(w.dtype))
        x, y = a.decode(torch.tensor([1]), a.new_state(1, 4)), b.decode(torch.tensor([1]), b.new_state(1, 4))
    assert float((x - y).norm() / x.norm()) > 0.01


def test_front_gemm_weights_are_concatenated_in_place_not_copied(mini_ckpt):
    """The runtime concatenates each front GEMM's weights once and points the model's parameters at their
    rows of the result: one copy of the weights in memory, the eager model unchanged, no recompile."""
    from torch._dynamo.utils import counters

    from k3compile.models import load_pretrained

    model, untouched = load_pretrained(mini_ckpt), load_pretrained(mini_ckpt)
    attn = model.layers[1].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() != attn.k_proj.weight.untyped_storage().data_ptr()
    step = _compile(model, (2,))
    graphs = []
    with one_thread():
        for _ in range(2):
            step(torch.tensor([3, 4]), model.new_state(2, 8))
            graphs.append(counters["stats"]["unique_graphs"])
    names = ("f_a_proj", "q_proj", "k_proj", "v_proj", "b_proj", "g_proj")  # the KDA front GEMM's entries
    storages = {getattr(attn, n).weight.untyped_storage().data_ptr() for n in names}
    assert len(storages) == 1, "the six weights now live in one buffer"
    assert graphs[1] == graphs[0], "re-pointing the weights did not recompile"
    with one_thread():
        a = model.decode(torch.tensor([5]), model.new_state(1, 4))
        b = untouched.decode(torch.tensor([5]), untouched.new_state(1, 4))
    assert torch.equal(a, b)


def _tp_runtime_worker(rank, world, ckpt, out_dir):
    import os

    from k3compile.models import load_pretrained

    model = load_pretrained(ckpt, tp_rank=rank, tp_size=world)
    step = k3compile.compile(model, tp=world, buckets=(1, 4), options={"kernels": "reference", "shadow": True})
    state = model.new_state(4, 16)
    logits = [step(torch.arange(1 + i, 1 + i + b), state) for i, b in enumerate((1, 3, 4))]
    torch.save({"logits": logits, "shadow": runtime.shadow_errors(), "counts": runtime.launch_counts(),
                "problems": step.dispatchers[-1].coverage()["problems"], "fallbacks": runtime.eager_fallbacks(),
                "table": step.dispatchers[-1].bound[4].table(),
                "residual_tps": sorted({k.point.c["TP"] for k in step.dispatchers[-1].bound[4].kernels.values()
                                        if k.point.template.name == "residual_attn_res"})},
               os.path.join(out_dir, f"rank{rank}.pt"))


def test_tp2_gloo_bindings_issue_the_collectives(mini_ckpt, tmp_path):
    """TP 2 through gloo, kernels as float64 references: every node's binding (GEMV shards, all-gathers of
    the router/latent rows, all-reduces in the o_proj and FFN tails, the model-level collectives) matches
    the dialect op on each rank, both ranks produce the same logits, every planned kernel ran, and the
    collectives were issued. The o_proj/FFN residual kernels are the TP 2 ones that all-reduce in-kernel;
    without symmetric memory (CPU) they take gloo's all-reduce through the local wiring, the path NCCL
    takes on GPUs above ``oneshot_max_bytes`` (tests/gpu/test_tp_gpu.py runs the one-shot exchange)."""
    from cpu import run_gloo

    from k3compile.models import load_pretrained
    from k3compile.plan import plans_for

    run_gloo(_tp_runtime_worker, 2, mini_ckpt, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    # the plan's all-gathers (k3compile plan) are the ones the runtime issued: 3 steps, at buckets 1, 4, 4
    plans = plans_for(load_pretrained(mini_ckpt).config, tp=2, buckets=(1, 4), every_layer=True)
    gathers = {b: sum(lp.counts()["collectives"].get("all_gather", 0) for lp in p.layers) for b, p in plans.items()}
    assert gathers[1] > 0 and r0["counts"]["collective:all_gather"] == gathers[1] + 2 * gathers[4]
    for a, b in zip(r0["logits"], r1["logits"]):
        assert torch.equal(a, b), "ranks disagree on the logits"
    for res in (r0, r1):
        worst = max(res["shadow"], key=res["shadow"].get)
        assert res["shadow"][worst] <= SHADOW_TOL, f"{worst}: {res['shadow'][worst]:.3g}"
        assert res["problems"] == [] and res["fallbacks"] == {}
        assert res["counts"]["collective:all_reduce"] > 0 and res["counts"]["collective:all_gather"] > 0
        assert "Collective[tp_all_reduce]" in res["table"]
        assert res["residual_tps"] == [1, 2]  # fused all-reduce kernels, and the AttnRes-only ones


def test_batch_invariant_keeps_bucket_1_reduction_order(mini_model):
    """Without the option the MLA decode of bucket 64 uses fewer context splits than bucket 1 and another combine
    tiling (a different summation order for rows longer than one split); with it every bucket uses bucket 1's. Every other kernel's
    per-row reduction never depends on the bucket (one row's dot products and norms are computed the same
    way whatever the other rows)."""
    def mla_splits(**options):
        step = _compile(mini_model, (1, 64), **options)
        with one_thread():
            step(torch.tensor([1]), mini_model.new_state(64, 2048))
        d = step.dispatchers[-1]
        return {b: {(k.point.c["NSPLIT"], k.point.c["COMBINE_SPLIT"], k.point.c["RB"])
                    for k in d.bound[b].kernels.values() if k.point.template.name == "mla_decode"} for b in (1, 64)}

    plain = mla_splits()
    inv = mla_splits(batch_invariant=True)
    assert inv[1] == inv[64] == plain[1]


def test_batch_invariant_specs_take_bucket_1s_splits_and_clusters():
    """At K3 width and context the MLA decode (context splits, the combine kernel's rows per CTA and column split)
    and the residual kernel tile a row differently per bucket (k3-mini's 256-wide rows and short caches do not show
    it); the batch-invariant lowering gives every bucket bucket 1's."""
    from k3compile.codegen import batch_invariant_specs
    from k3compile.templates import get

    def specs(b):
        return [("mla_decode", dict(bucket=b, heads=12, nope=128, rope=64, v=128, kv_lora=512, lmax=32768,
                                    kv_eps=1e-6, scale=192 ** -0.5)),
                ("residual_attn_res", dict(bucket=b, d=7168, nb=4))]

    def tiling(sp):
        pts = [get(t).point(**p).c for t, p in sp]
        return pts[0]["NSPLIT"], pts[0]["COMBINE_SPLIT"], pts[0]["RB"], pts[1]["CL"]

    assert tiling(specs(1)) != tiling(specs(64))
    assert tiling(batch_invariant_specs(specs(64))) == tiling(specs(1)) == (132, 4, 1, 7)  # one wave of splits


def test_front_gemm_outputs_need_no_input_copies_and_copies_are_counted(mini_model):
    """From batch 2 the fused front GEMV writes each entry as its own compact [M, rows] block (SEGMENTS), so the
    KDA and MoE kernels take them without the copies a column slice of one [M, n] output needed; a strided
    input that does reach a kernel is still copied before the launch and counted by kernel and argument."""
    with one_thread():
        for bucket in (1, 4):
            runtime.reset_launch_counts()
            step = _compile(mini_model, (bucket,))
            step(torch.arange(bucket), mini_model.new_state(bucket, 4))
            assert runtime.input_copies() == {}, runtime.input_copies()
            fronts = [k for k in step.dispatchers[-1].bound[bucket].kernels.values()
                      if k.point.template.name == "gemv" and k.point.c["SEGMENTS"]]
            assert bool(fronts) == (bucket > 1), "front GEMVs write segmented outputs exactly when M > 1"
        kernel = next(k for k in step.dispatchers[-1].bound[4].kernels.values()
                      if k.point.template.name == "gemv" and k.point.c["PRO"] == "none")
        n, kk = kernel.point.c["N"], kernel.point.c["K"]
        x = torch.randn(4, 2 * kk).to(torch.bfloat16)[:, ::2]  # a strided view
        kernel(w=torch.randn(n, kk).to(torch.bfloat16), x=x)
        assert runtime.input_copies() == {f"{kernel.name}:x": 1}
        assert "copy" not in str(runtime.launch_counts())


def _mla_caches(model, state) -> list:
    return [t for layer, t in zip(model.layers, state.layers) if layer.is_mla]


def _graph_count(graph, what: str) -> int:
    """Nodes of ``graph`` that are ``index_put_`` / ``.to`` calls or ``torch.arange``."""
    if what == "arange":
        return sum(n.op == "call_function" and n.target is torch.arange for n in graph.nodes)
    return sum(n.op == "call_method" and n.target == what for n in graph.nodes)


def test_mla_kernel_writes_the_cache_and_the_graph_drops_its_index_put(mini_model):
    """The mla_decode kernel writes the current token's latent row into the cache itself, so the bound graph has
    no ``index_put_`` left for the MLA layers, nor the ``arange`` and ``.to`` that fed it. With the op disabled
    (run eagerly: the eager op does not write the cache) they stay. Either way the cache holds the new rows."""
    n_mla = sum(layer.is_mla for layer in mini_model.layers)
    assert n_mla == 4
    for disable, kept in (((), 0), (("mla_decode_latent",), n_mla)):
        step = _compile(mini_model, (2,), disable_kernels=disable)
        state = mini_model.new_state(2, 16)
        with one_thread():
            step(torch.tensor([1, 2]), state)
        d = step.dispatchers[-1]
        lowered, bound = d.lowered[2].graph, d.bound[2].gm.graph
        assert [_graph_count(lowered, w) for w in ("index_put_", "arange", "to")] == [n_mla] * 3  # the model's
        assert [_graph_count(bound, w) for w in ("index_put_", "arange", "to")] == [kept] * 3, disable
        eager = [b for b in d.bound[2].bindings if isinstance(b, runtime.EagerOp)]
        assert len(eager) == (n_mla if disable else 0)
        for cache in _mla_caches(mini_model, state):
            assert (cache != 0).any(-1).nonzero().tolist() == [[0, 0], [1, 0]], disable  # position 0 of both rows


def test_dropped_cache_writes_change_nothing(mini_model, monkeypatch):
    """The bound graph without the MLA ``index_put_`` nodes gives bit for bit the logits and the whole state of
    the same graph with them (kernels as float64 references: deterministic), step after step, batches below the
    bucket included (their padding rows write position 0 of their caches, restored after the step). The caches
    hold rows at exactly the positions eager decoding writes (eager's values differ: see the last test)."""
    batches = (1, 3, 4, 2)

    def run(drop: bool):
        with monkeypatch.context() as m:
            if not drop:
                m.setattr(runtime, "_drop_cache_writes", lambda graph: None)
            step = _compile(mini_model, (4,))
            state = mini_model.new_state(4, 16)
            with one_thread():
                logits = [step(torch.arange(1 + i, 1 + i + b), state) for i, b in enumerate(batches)]
        return step.dispatchers[-1].bound[4].gm.graph, logits, state

    graph, logits, state = run(drop=True)
    kept_graph, kept_logits, kept_state = run(drop=False)
    assert _graph_count(graph, "index_put_") == 0 and _graph_count(kept_graph, "index_put_") == 4
    for a, b in zip(logits, kept_logits):
        assert torch.equal(a, b)
    for a, b in zip(state.tensors(), kept_state.tensors()):
        assert torch.equal(a, b)
    eager = mini_model.new_state(4, 16)
    with one_thread():
        for i, b in enumerate(batches):
            mini_model.decode(torch.arange(1 + i, 1 + i + b), eager)
    assert torch.equal(state.lengths, eager.lengths)
    for got, want in zip(_mla_caches(mini_model, state), _mla_caches(mini_model, eager)):
        written = (got != 0).any(-1)
        assert torch.equal(written, (want != 0).any(-1))
        assert written.sum() == sum(batches)  # one row per token: the padding rows' writes were undone


class _StateCopy(Template):
    """A tiny template for kernel_check.compare: y = 2 x (out), x written into position 0 of each state row."""
    name = "state_copy"
    kernel_file = "none.py"

    def args(self, c):
        return [Arg("x", "bf16", (c["M"], 8), "act"), Arg("state", "bf16", (c["M"], c["L"], 8), "state"),
                Arg("y", "f32", (c["M"], 8), "out")]

    def reference(self, c, inputs):
        state = inputs["state"].clone()
        state[:, 0] = inputs["x"]
        return {"y": 2 * inputs["x"].double(), "state": state}

    def tolerance(self, c):
        return {"y": 1e-2, "state": 0.0}


def test_kernel_check_compares_in_slices_exactly_when_asked(monkeypatch):
    """``kernel_check.compare`` sums the float64 error over slices of the leading dimension (a large state is
    never one float64 copy) and gets the same error as the whole-tensor formula; a bf16 reference is compared
    in float64; with a tolerance of 0 one wrong row of the state fails, naming how many values differ; NaNs are
    reported."""
    point = Point(_StateCopy(), (const("M", 4, "rows"), const("L", 16, "positions")))
    gen = torch.Generator().manual_seed(0)
    inputs = {"x": torch.randn(4, 8, generator=gen).to(torch.bfloat16),
              "state": torch.randn(4, 16, 8, generator=gen).to(torch.bfloat16)}
    ref = _StateCopy().reference(point.c, inputs)
    got = {"x": inputs["x"], "y": ref["y"].float() * (1 + 1e-3 * torch.randn(4, 8, generator=gen)),
           "state": ref["state"].clone()}
    whole = float((got["y"].double() - ref["y"]).norm() / ref["y"].norm())
    for chunk in (1, 8, 24, 1 << 24):  # a row per slice, three rows, all at once
        rel, nans, differ = kernel_check.relative_error(got["y"], ref["y"], chunk)
        assert rel == pytest.approx(whole, rel=1e-12) and nans == 0 and differ == 32
    monkeypatch.setattr(kernel_check, "CHUNK", 8)  # compare: one state row per slice
    res = kernel_check.compare(point, inputs, got)
    assert res["ok"] and res["errors"]["state"] == 0.0 and res["errors"]["y"] == pytest.approx(whole, rel=1e-12)
    wrong = got["state"].clone()
    wrong[2, 5] += 1  # one wrong row of 64: a relative error of ~0.1, far below anything but exactness
    res = kernel_check.compare(point, inputs, {**got, "state": wrong})
    assert res["problems"] == ["state: 8 of 512 values differ (exact comparison)"]
    assert 0 < res["errors"]["state"] < 0.2
    nan = got["y"].clone()
    nan[1, 3] = float("nan")
    res = kernel_check.compare(point, inputs, {**got, "y": nan})
    assert res["problems"] == ["y: 1 of 32 values NaN (unwritten or invalid)"] and res["errors"]["y"] == float("inf")


def test_weights_in_a_kernel_layout_are_converted_once_and_kept_with_the_weight():
    """The routed experts read their MXFP4 codes prepacked (Arg.layout): the runtime converts a weight once,
    keeps the copy on the weight (so the graph captures it and a step converts nothing), remakes it when the
    weight is written in place, and counts a weight that arrives as a new view each call as an input copy."""
    from k3compile.mxfp4_mirror import prepack
    from k3compile.templates import get

    t = get("moe_down_combine")
    a = next(x for x in t.point(**t.examples()["mini_b1"]).args() if x.layout)
    assert a.name == "w2_packed" and a.layout == "mxfp4_prepacked"
    holder = torch.nn.Module()
    holder.register_buffer("w", torch.randint(0, 256, a.shape, dtype=torch.uint8,
                                              generator=torch.Generator().manual_seed(0)))
    w = holder.w
    runtime.reset_launch_counts()
    before = runtime.relaid_bytes()
    r1, r2 = runtime._relaid("k", a, w), runtime._relaid("k", a, w)
    assert r1 is r2 and torch.equal(r1, prepack(w)) and runtime.relaid_bytes() - before == w.numel()
    assert runtime.relaid_bytes(holder) == w.numel()  # the copies kept on one model's weights
    assert runtime.input_copies() == {}
    w.add_(1)  # written in place: the kept copy is stale, made again
    r3 = runtime._relaid("k", a, w)
    assert r3 is not r1 and torch.equal(r3, prepack(w)) and runtime.input_copies() == {}
    for _ in range(2):  # a new view of the same weight each call: converted again, and counted
        assert torch.equal(runtime._relaid("k", a, w[:]), r3)
    assert runtime.input_copies() == {"k:w2_packed": 2}
    del r1, r2, r3, holder
    w = None
    gc.collect()
    assert runtime.relaid_bytes() == before  # the copies live and die with their weight


def test_a_second_state_geometry_is_one_more_specialisation(mini_model):
    """A state of another capacity and max_context compiles once more (its geometry static, the batch still
    symbolic) and gives what a step compiled for it alone gives; Dynamo's automatic dynamic shapes made the
    second geometry symbolic before, which the MLA kernels refused (lmax=s79)."""
    from torch._dynamo.utils import counters

    step = _compile(mini_model, (1, 4))
    with one_thread():
        for b in (1, 3):
            step(torch.arange(b), mini_model.new_state(4, 16))
        got = step(torch.tensor([5]), mini_model.new_state(1, 8))
        assert counters["stats"]["unique_graphs"] == 2 and len(step.dispatchers) == 2
        torch._dynamo.reset()
        want = _compile(mini_model, (1, 4))(torch.tensor([5]), mini_model.new_state(1, 8))
    assert torch.equal(got, want)


def test_relay_in_place_keeps_one_copy_of_the_experts_and_the_model_reads_them_back(mini_ckpt, tmp_path,
                                                                                    monkeypatch, caplog):
    """Option relay_in_place: the first step rewrites the routed experts' codes in their own memory (no copy
    kept: relaid_bytes 0) and the steps give bit for bit the logits and state of the copying runtime. The model
    still reads its codes as the checkpoint's: its eager decode (both expert paths), save_checkpoint. A write
    to the codes afterwards is refused by the runtime and the eager op, naming the fix; so is a graph traced by
    another compiler (it cannot see which layout the codes are in) and the backend by name (it traces again).
    A model whose codes already have a copy (compiled before without the option) keeps it, with a warning."""
    from k3compile.models import load_pretrained, mxfp4, ops, save_checkpoint

    copying, in_place = load_pretrained(mini_ckpt), load_pretrained(mini_ckpt)
    with pytest.raises(Exception, match="relay_in_place=True needs k3compile.compile"):
        torch.compile(in_place.decode, backend="k3compile", options={"relay_in_place": True})(
            torch.tensor([1]), in_place.new_state(1, 4))
    torch._dynamo.reset()
    codes = {n: t for n, t in in_place.named_buffers() if n.endswith("_packed")}
    originals = {n: t.clone() for n, t in codes.items()}
    ptrs = {n: t.data_ptr() for n, t in codes.items()}
    steps = {m: _compile(m, (1, 4), relay_in_place=m is in_place) for m in (copying, in_place)}
    states = {m: m.new_state(4, 16) for m in steps}
    with one_thread():
        for i, batch in enumerate((1, 3, 4)):
            got = {m: steps[m](torch.arange(1 + i, 1 + i + batch), states[m]) for m in steps}
            assert torch.equal(got[copying], got[in_place])
    for a, b in zip(states[copying].tensors(), states[in_place].tensors()):
        assert torch.equal(a, b)
    assert runtime.relaid_bytes(in_place) == 0
    assert runtime.relaid_bytes(copying) == sum(t.numel() for t in originals.values())
    with caplog.at_level(logging.WARNING, logger="k3compile"), one_thread():  # the copy made before stays in use
        _compile(copying, (1,), relay_in_place=True)(torch.tensor([1]), copying.new_state(1, 4))
    assert runtime.relaid_bytes(copying) == sum(t.numel() for t in originals.values())
    warned = [r for r in caplog.records if "no memory is saved. Fix: load the model afresh" in r.getMessage()]
    assert len(warned) == len(originals)
    for n, t in codes.items():  # rewritten where they lie; read back as the checkpoint's
        assert t.data_ptr() == ptrs[n] and not torch.equal(t, originals[n]), n
        assert mxfp4.relaid_layout(t) == "mxfp4_prepacked" and torch.equal(mxfp4.checkpoint_codes(t), originals[n])
    with one_thread():
        for dense in (True, False):  # the all-experts path (k3-mini's size) and the per-token gather
            if not dense:
                monkeypatch.setattr(ops, "DENSE_EXPERTS_MAX_WEIGHTS", 0)
            eager = [m.decode(torch.tensor([7, 8]), m.new_state(2, 4)) for m in (copying, in_place)]
            assert torch.equal(eager[0], eager[1]), f"dense={dense}"
    save_checkpoint(in_place, tmp_path / "ckpt")
    reloaded = dict(load_pretrained(str(tmp_path / "ckpt")).named_buffers())
    for n, t in originals.items():
        assert torch.equal(reloaded[n], t), n
    with one_thread():  # a new state capacity: Dynamo traces again, for this backend (allowed)
        got = {m: steps[m](torch.tensor([4]), m.new_state(1, 8)) for m in steps}
    assert torch.equal(got[copying], got[in_place])
    torch._dynamo.reset()
    with pytest.raises(Exception, match="(?s)RelaidCodesError.*tracing a read of MXFP4 codes.*Fix: trace"):
        torch.compile(in_place.decode, backend="aot_eager")(torch.tensor([1]), in_place.new_state(1, 4))
    next(iter(codes.values()))[0, 0, 0] += 0  # a write after the conversion: the layout is unknown now
    with pytest.raises(mxfp4.RelaidCodesError, match="written again.*Fix: load the weights"):
        steps[in_place](torch.tensor([1]), states[in_place])
    with pytest.raises(mxfp4.RelaidCodesError, match="written again"):
        in_place.decode(torch.tensor([1]), in_place.new_state(1, 4))


class _FakeStreams:
    """runtime.StreamOps on the CPU: streams are names, and every fork / switch / join is logged in order."""

    class Stream:
        def __init__(self, name, log):
            self.name, self.log = name, log

        def wait_stream(self, other):
            self.log.append(("wait", self.name, other.name))

    def __init__(self):
        self.log, self.side = [], {}
        self.main = self.Stream("main", self.log)
        self.now = self.main

    def stream(self, name):
        return self.side.setdefault(name, self.Stream(name, self.log))

    def current(self):
        return self.now

    @contextlib.contextmanager
    def use(self, stream):
        before, self.now = self.now, stream
        self.log.append(("launch on", stream.name))
        try:
            yield
        finally:
            self.now = before


def test_side_stream_nodes_fork_after_their_inputs_and_join_before_their_consumer(mini_model):
    """runtime.route_streams (options.side_streams, CUDA only): the shared expert's down-projection (the plan's
    side stream) moves up to just after the MoE front GEMM, so the routed experts queue after it; it runs after
    a fork from the main stream and the main stream joins it before the FFN tail reads it. Same logits."""
    step = _compile(mini_model, (1,))
    with one_thread():
        want = step(torch.tensor([7]), mini_model.new_state(1, 16))
    bg = step.dispatchers[-1].bound[1]
    streams = _FakeStreams()
    routed = runtime.route_streams(bg.gm.graph, streams)
    bg.gm.recompile()
    moe_layers = sum(mini_model.config.is_moe_layer(i) for i in range(mini_model.config.num_hidden_layers))
    assert len(routed) == moe_layers
    nodes = list(bg.gm.graph.nodes)
    for name in routed:
        side = next(n for n in nodes if n.name == name)
        assert isinstance(side.target, runtime.OnStream) and side.target.binding.op == "situ_linear"
        assert nodes.index(side) == 1 + max(nodes.index(i) for i in side.all_input_nodes)  # right after its input
        after = nodes[nodes.index(side):]
        # the layer's routed experts are now queued after it; a Join precedes its consumer, the FFN tail
        experts = next(n for n in after if isinstance(n.target, runtime.Binding) and n.target.op == "routed_experts")
        join = next(n for n in after if isinstance(n.target, runtime.Join))
        tail = next(n for n in after if isinstance(n.target, runtime.Binding) and n.target.op.startswith("ffn_tail"))
        assert nodes.index(experts) < nodes.index(join) < nodes.index(tail)
        assert side in tail.all_input_nodes or any(side in i.all_input_nodes for i in tail.all_input_nodes)
    with one_thread():
        got = step(torch.tensor([7]), mini_model.new_state(1, 16))
    assert torch.equal(got, want)
    per_layer = [("wait", "shared_expert", "main"), ("launch on", "shared_expert"), ("wait", "main", "shared_expert")]
    assert streams.log == per_layer * moe_layers


def test_side_streams_off_the_gpu_is_a_clear_error(mini_model):
    with pytest.raises(RuntimeError, match="side_streams=True runs the plan's side-stream kernels on CUDA"):
        _compile(mini_model, (1,), side_streams=True)(torch.tensor([7]), mini_model.new_state(1, 16))
    # the default (None) is a second stream on CUDA only: off the GPU every kernel runs in graph order
    assert k3compile.compiler.Options().side_streams is None
    step = _compile(mini_model, (1,))
    step(torch.tensor([7]), mini_model.new_state(1, 16))
    assert step.dispatchers[-1].side_streams == {}


def test_tp_emulation_takes_the_front_gemv_gathered_outputs_without_a_copy(monkeypatch):
    """One-GPU TP emulation (a fake process group of 2): the MoE front GEMV writes its router logits and latent
    rows into both ranks' slots (F32_REPLICAS, REPLICAS), as the FFN tail's up-projection its rows (REPLICAS),
    and the bindings hand that layout on as the all-gather: per node the kernels equal the eager ops (whose all-gather repeats rank 0's shard),
    at batch 1 (one row) and 4 (compact blocks), with no all-gather copy and no input copy."""
    from k3compile.capture import tp_world
    from k3compile.models import k3_mini
    from k3compile.models.random_init import random_model

    gathers = []
    real_gather = runtime._gather
    monkeypatch.setattr(runtime, "_gather", lambda x, group, tp: gathers.append(x.shape) or real_gather(x, group, tp))
    with tp_world(2), one_thread():
        model = random_model(k3_mini(), tp_rank=0, tp_size=2, device="cpu", seed=3)
        runtime.reset_launch_counts()
        step = _compile(model, (1, 4), shadow=True)
        state = model.new_state(4, 16)
        for batch in (1, 4):
            assert torch.isfinite(step(torch.arange(batch) % (model.config.vocab_size // 2), state)).all()
        d = step.dispatchers[-1]
        fronts = [k.point.c for b in (1, 4) for k in d.bound[b].kernels.values()
                  if k.point.template.name == "gemv" and k.point.c["F32_REPLICAS"] > 1]
        assert len(fronts) == 2, fronts  # the MoE front GEMV of each bucket (one kernel for every MoE layer)
        assert all(c["F32_REPLICAS"] == 2 and c["REPLICAS"][0] == 2 for c in fronts)
        # the FFN tail's row-sharded up-projection (shard_routing) writes its rows into both slots as well
        ups = [k.point.c for b in (1, 4) for k in d.bound[b].kernels.values()
               if k.point.template.name == "gemv" and k.point.c["REPLICAS"] == (2,)]
        hid = model.config.hidden_size
        assert len(ups) == 2 and all(c["SEGMENTS"] == (hid // 2,) and c["N"] == hid // 2 for c in ups), ups
        errors = runtime.shadow_errors()
        worst = max(errors, key=errors.get)
        assert errors[worst] <= SHADOW_TOL, f"{worst}: kernels differ from the eager op by {errors[worst]:.3g}"
        assert d.coverage()["problems"] == [] and runtime.eager_fallbacks() == {}
    assert gathers == [], f"front GEMV outputs went through the all-gather copy: {gathers}"
    assert runtime.input_copies() == {}, runtime.input_copies()
