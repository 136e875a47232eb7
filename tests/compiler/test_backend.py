"""torch.compile backend and k3compile.compile(): eager-identical logits for every batch size in the
buckets, no recompiles across batch sizes, TP=2 through gloo, clear errors for bad input.

Tolerance: on the CPU the lowered graph runs the dialect's eager implementations, which compute
exactly what the eager model computes, so logits and state must match bit for bit (atol=rtol=0).
"""

import logging
import os

import pytest
import torch
from torch._dynamo.utils import counters

import k3compile
from k3compile.compiler import BucketError
from cpu import one_thread, run_gloo

BATCHES = list(range(1, 17)) + [64]
# TP 2 over gloo (two CPU processes, several times the cost per step): every bucket exactly, and batches
# padded into 4, 8 and 16
TP_BATCHES = [1, 2, 3, 4, 7, 8, 13, 16, 32, 64]
# Greedy steps per batch: twice the short-conv window (4), so every conv-state slot is rewritten by decoded
# tokens and the last step reads a latent cache filled to max_context (= STEPS). More steps only repeat that.
STEPS = 8


def _decode_both(model, step, batch, steps, seed, capacity=None):
    """Greedy-decode `steps` tokens from the same random start with eager and compiled; return max diff.
    Both use a state of ``capacity`` rows (one serving-process state for every batch size)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch,), generator=g)
    cap = capacity or batch
    ref_state, state = model.new_state(cap, steps), model.new_state(cap, steps)
    worst = 0.0
    for _ in range(steps):
        ref = model.decode(ids, ref_state)
        out = step(ids, state)
        worst = max(worst, (ref - out).abs().max().item())
        ids = ref.argmax(-1)
    for a, b in zip(ref_state.tensors(), state.tensors()):
        assert torch.equal(a, b), "compiled step advanced the state differently from eager"
    return worst


def test_every_batch_size_matches_eager_without_recompiles(mini_model):
    compiled = k3compile.compile(mini_model)
    for batch in BATCHES:
        assert _decode_both(mini_model, compiled, batch, STEPS, seed=batch, capacity=64) == 0.0, f"batch {batch}"
        if batch == 1:
            first = (counters["stats"]["unique_graphs"], counters["frames"]["total"])
    assert counters["stats"]["unique_graphs"] == first[0] == 1
    calls = compiled.dispatchers[-1].calls
    assert len(compiled.dispatchers) == 1  # one backend compile for every batch size
    assert calls[1] == STEPS and calls[16] == 8 * STEPS and calls[64] == STEPS  # dispatch by bucket


def test_backend_by_name(mini_model, caplog):
    assert "k3compile" in torch._dynamo.list_backends()
    step = torch.compile(mini_model.decode, backend="k3compile")
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        assert _decode_both(mini_model, step, 3, 4, seed=7) == 0.0
    assert any("running the lowered graph through the K3 dialect's eager implementations" in r.getMessage()
               for r in caplog.records)


def test_backend_by_name_with_options(mini_model, tmp_path):
    step = torch.compile(mini_model.decode, backend="k3compile",
                         options={"buckets": (4,), "dump_dir": str(tmp_path)})
    assert _decode_both(mini_model, step, 2, 2, seed=3) == 0.0
    assert (tmp_path / "tp1_bucket4" / "04_fuse_attn_res_norm.diff").exists()


def test_backend_by_name_refuses_a_symbolic_state_geometry_for_the_kernels(mini_model):
    """By name, Dynamo's automatic dynamic shapes make the state's sizes symbolic when a second geometry comes;
    the kernel runtime refuses that graph naming the fix (the MLA template's 'lmax=s79' error before). The
    eager dialect ops take it."""
    step = torch.compile(mini_model.decode, backend="k3compile", options={"kernels": "reference", "buckets": (1,)})
    with one_thread():
        step(torch.tensor([1]), mini_model.new_state(1, 16))
        with pytest.raises(Exception, match=r"(?s)state input .* has a symbolic size.*Fix: step = k3compile.compile"):
            step(torch.tensor([1]), mini_model.new_state(2, 8))
    torch._dynamo.reset()
    eager = torch.compile(mini_model.decode, backend="k3compile", options={"kernels": "eager", "buckets": (1,)})
    with one_thread():
        for st in (mini_model.new_state(1, 16), mini_model.new_state(2, 8)):
            want = mini_model.decode(torch.tensor([1]), st.clone())
            assert torch.equal(eager(torch.tensor([1]), st), want)


def test_batch_above_largest_bucket(mini_model, caplog):
    compiled = k3compile.compile(mini_model, buckets=(1, 2, 4))
    state = mini_model.new_state(5, 4)
    with pytest.raises(BucketError, match="batch 5 is above the largest compiled bucket 4"):
        compiled(torch.arange(5), state)
    assert int(state.lengths.sum()) == 0
    fallback = k3compile.compile(mini_model, buckets=(1, 2, 4), options={"eager_fallback": True})
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        assert _decode_both(mini_model, fallback, 5, 2, seed=1) == 0.0
    assert any("running eager" in r.message for r in caplog.records)


def test_bad_options(mini_model):
    with pytest.raises(ValueError, match="tp=2 but the model was built for tp_size=1"):
        k3compile.compile(mini_model, tp=2)
    with pytest.raises(ValueError, match="unsupported arch 'sm_80'"):
        k3compile.compile(mini_model, arch="sm_80")
    with pytest.raises(TypeError, match="unknown k3compile option"):
        k3compile.compile(mini_model, options={"bucket": 3})
    with pytest.raises(BucketError, match="positive"):
        k3compile.compile(mini_model, buckets=(0, 4))


def _tp_worker(rank, world, ckpt, out_dir):
    from k3compile.models import load_pretrained

    model = load_pretrained(ckpt, tp_rank=rank, tp_size=world)
    compiled = k3compile.compile(model, tp=world)
    worst = {}
    for batch in TP_BATCHES:
        worst[batch] = _decode_both(model, compiled, batch, STEPS, seed=batch, capacity=64)
    torch.save({"worst": worst, "graphs": counters["stats"]["unique_graphs"],
                "backend_compiles": len(compiled.dispatchers)}, os.path.join(out_dir, f"rank{rank}.pt"))


def test_tp2_gloo_matches_eager(mini_ckpt, tmp_path):
    run_gloo(_tp_worker, 2, mini_ckpt, str(tmp_path))
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        assert res["worst"] == {b: 0.0 for b in TP_BATCHES}, res["worst"]
        assert res["graphs"] == 1 and res["backend_compiles"] == 1
