"""The compiled k3-mini decode step on the GPU, through the kernels of a prebuilt package.

``K3_DECODE_PACKAGE`` names a package built on a CPU machine for k3-mini at TP 1, every bucket, the full
context (``k3compile codegen --config k3_mini --tp 1 --package -o DIR``); the states here are allocated at
that capacity (``max_context`` of the manifest: the kernels serve the full context length).

* shadow: every dialect node's kernels against its eager op on the same inputs, every step, per bucket
  (1, 3 padded into 4, 8, 64), tolerance 2e-2 relative per node; the coverage proof (every planned
  kernel launched as often as the steps need, no eager fallback);
* CUDA graphs: replays after the tokens, the state and the batch changed give bit for bit what the same
  kernels give without graphs (no stale pointers or values in a captured graph);
* end-to-end: compiled vs eager, teacher-forced on the same tokens for 256 steps: logit error per step
  and top-1 agreement; greedy decoding identical for the first steps (see the tolerances below).
"""

import json
import os

import pytest
import torch

import k3compile
from k3compile import runtime

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

SHADOW_TOL = 2e-2


@pytest.fixture(scope="module")
def package():
    path = os.environ.get("K3_DECODE_PACKAGE")
    if not path:
        pytest.fail("K3_DECODE_PACKAGE is not set: build one with `k3compile codegen --config k3_mini --tp 1 "
                    "--package -o DIR` on a CPU machine")
    with open(os.path.join(path, "manifest.json")) as fh:
        return path, json.load(fh)["max_context"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from k3compile.models import k3_mini, load_pretrained, save_random_checkpoint

    trained = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "k3_mini_text")
    if os.path.exists(os.path.join(trained, "config.json")):
        return load_pretrained(trained, device="cuda")
    path = save_random_checkpoint(str(tmp_path_factory.mktemp("mini")), k3_mini(), seed=0)
    return load_pretrained(path, device="cuda")


def _compile(model, package, buckets, **options):
    return k3compile.compile(model, buckets=buckets, options={"kernels": f"package:{package[0]}", **options})


@pytest.mark.parametrize("batch,bucket", [(1, 1), (3, 4), (8, 8), (64, 64)])
def test_kernels_match_eager_ops_per_node_and_cover_the_plan(model, package, batch, bucket):
    runtime.reset_launch_counts()
    step = _compile(model, package, (bucket,), shadow=True)
    state = model.new_state(bucket, package[1])
    g = torch.Generator(device="cuda").manual_seed(batch)
    before = [t.clone() for t in state.tensors()]
    for _ in range(4):
        ids = torch.randint(0, model.config.vocab_size, (batch,), device="cuda", generator=g)
        logits = step(ids, state)
        assert torch.isfinite(logits).all()
    for old, new in zip(before, state.tensors()):
        assert torch.equal(old[batch:], new[batch:]), "a padding row's state changed"
    errors = runtime.shadow_errors()
    worst = max(errors, key=errors.get)
    assert errors[worst] <= SHADOW_TOL, f"{worst}: kernels differ from the eager op by {errors[worst]:.3g}"
    cov = step.dispatchers[-1].coverage()
    assert cov["problems"] == [], cov["problems"]
    assert runtime.eager_fallbacks() == {}


def test_graph_replay_after_inputs_state_and_batch_changed(model, package):
    graphs = _compile(model, package, (1, 4, 8))
    plain = _compile(model, package, (1, 4, 8), cuda_graphs=False)
    cap = package[1]
    sa, sb = model.new_state(8, cap), model.new_state(8, cap)
    g = torch.Generator(device="cuda").manual_seed(7)
    for i, batch in enumerate([1, 1, 1, 3, 8, 3, 3, 1, 8, 8, 2, 4, 1]):
        ids = torch.randint(0, model.config.vocab_size, (batch,), device="cuda", generator=g)
        a, b = graphs(ids, sa), plain(ids, sb)
        assert torch.equal(a, b), f"step {i} (batch {batch}): CUDA-graph replay differs from the plain run"
        for x, y in zip(sa.tensors(), sb.tensors()):
            assert torch.equal(x, y), f"step {i}: state after a replay differs"
    assert graphs.dispatchers[-1].use_graphs and len(graphs.dispatchers[-1]._graphs) == 3


@pytest.mark.parametrize("batch", [1, 3, 8, 64])
def test_long_decode_against_eager(model, package, batch):
    """256 steps, both fed the eager model's greedy tokens (teacher forcing, so one early flip of a near-tie
    does not make the rest incomparable): per-step relative logit error and top-1 agreement."""
    bucket = {1: 1, 3: 4, 8: 8, 64: 64}[batch]
    step = _compile(model, package, (bucket,))
    cap = package[1]
    s_ref, s_k3 = model.new_state(bucket, cap), model.new_state(bucket, cap)
    ids = torch.arange(batch, device="cuda") % model.config.vocab_size
    errs, agree = [], []
    for _ in range(256):
        ref = model.decode(ids, s_ref)
        out = step(ids, s_k3)
        errs.append(float((out - ref).norm() / ref.norm()))
        agree.append(float((out.argmax(-1) == ref.argmax(-1)).float().mean()))
        ids = ref.argmax(-1)
    errs_t = torch.tensor(errs)
    print(f"batch {batch}: logit rel error median {errs_t.median():.3g} max {errs_t.max():.3g}; "
          f"top-1 agreement {sum(agree) / len(agree):.3f}")
    assert errs_t.median() < 0.05 and sum(agree) / len(agree) > 0.9
