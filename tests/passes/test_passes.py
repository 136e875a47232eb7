"""Every pass of the pipeline: golden diff on k3-mini (TP 2, bucket 1), match counts per bucket, and the
conditions each pass promises (ensures) -- including the rejections the design depends on."""

from pathlib import Path

import pytest

from k3compile import dialect
from k3compile.pipeline import PassConditionError, PassContext
from k3compile.passes.prefetch_weights import PrefetchWeights
from k3compile.passes.shared_expert_stream import SharedExpertStream

from golden import check_golden
from harness import PASSES

GOLDEN = Path(__file__).parent / "golden"

# k3-mini: 13 layers (9 KDA, 4 MLA), layer 0 dense, 12 MoE; TP 2 has 39 all-reduces.
EXPECTED_MATCHES = {
    "lift_dialect": 317,          # 278 semantic/linear ops + 39 all-reduce pairs
    "eliminate_dead_code": 0,
    "shard_routing": 36,          # 12 routers + 12 latent down- + 12 up-projections
    "fuse_attn_res_norm": 25,     # 2 reads per layer, minus layer 0's pre-attention (no blocks yet)
    "fuse_oproj_allreduce": 38,   # 13 attention chains, 12 latent reductions, 13 FFN tails
    "front_gemm": 26,             # 9 KDA + 4 MLA + 1 dense + 12 MoE front GEMMs
    "fuse_elementwise": 42,       # 13 SiTU->down, 4 q_a norm->q_b, 9 f_b, 12 expert selections, 4 MLA latents
    "shared_expert_stream": 12,   # one shared expert per MoE layer
    "prefetch_weights": 39,       # one per communicating kernel
    "select_kernels": 98,         # every dialect kernel op left (prefetch hints excluded)
}


@pytest.mark.parametrize("name", PASSES)
def test_golden_diff(name, lowered_tp2):
    rec = next(r for r in lowered_tp2[1].meta["k3_records"] if r.name == name)
    path = GOLDEN / f"{rec.index:02d}_{name}.tp2_b1.diff"
    check_golden(path, rec.diff(), f"{name}: graph diff")


@pytest.mark.parametrize("bucket", [1, 8, 64])
def test_match_counts_per_bucket(bucket, lowered_tp2):
    records = {r.name: r for r in lowered_tp2[bucket].meta["k3_records"]}
    assert [r.name for r in lowered_tp2[bucket].meta["k3_records"]] == PASSES
    got = {name: r.match_count for name, r in records.items()}
    assert got == EXPECTED_MATCHES
    assert all(r.applied for r in records.values())


def test_kernel_families_depend_on_bucket(lowered_tp2):
    def labels(gm):
        return {str(n.meta["k3_kernel"]) for n in gm.graph.nodes if "k3_kernel" in n.meta}

    assert {"gemv(cores=fma)", "mxfp4_mma(decode=prepacked,mma=m16n8k16)"} <= labels(lowered_tp2[1])
    for b in (8, 64):  # tensor-core GEMVs from gemv.MMA_MIN_BUCKET
        assert "gemv(cores=mma.sync)" in labels(lowered_tp2[b]) and "gemv(cores=fma)" not in labels(lowered_tp2[b])


def test_kda_moe_layer_ops(lowered_tp2):
    """What a KDA+MoE layer is after the pipeline (layer 1 of k3-mini)."""
    gm = lowered_tp2[1]
    labels = {i.name: i.label for i in gm.meta["k3_inputs"]}
    ops = []
    for n in gm.graph.nodes:
        if dialect.is_k3(n) and not dialect.is_k3(n, "prefetch"):
            ws = [labels[a.name] for a in n.all_input_nodes if a.name in labels]
            if ws and min(ws).startswith("layers.1.") and (dialect.op_name(n) != "ffn_tail_norm"
                                                           or any(w.startswith("layers.1.block") for w in ws)):
                ops.append((dialect.op_name(n), n.meta.get("k3_stream", "main")))
    assert ops == [("front_gemm", "main"), ("kda_decode_fb", "main"), ("oproj_residual_norm", "main"),
                   ("front_gemm", "main"), ("routed_experts", "main"), ("situ_linear", "shared_expert"),
                   ("ffn_tail_norm", "main")]


def _ctx(gm):
    return PassContext(bucket=1, tp_size=2, inputs=gm.meta["k3_inputs"])


def test_collective_on_side_stream_is_rejected(lowered_tp2):
    gm = lowered_tp2[8]
    victim = next(n for n in gm.graph.nodes if dialect.is_k3(n, "oproj_residual_norm"))
    victim.meta["k3_stream"] = "shared_expert"
    try:
        with pytest.raises(PassConditionError, match=r"shared_expert_stream' ensures violated: collective "
                                                     r"oproj_residual_norm.* must stay on the main stream"):
            SharedExpertStream().ensures(gm, _ctx(gm))
    finally:
        victim.meta.pop("k3_stream")
    SharedExpertStream().ensures(gm, _ctx(gm))


def test_prefetch_of_an_activation_is_rejected(lowered_tp2):
    gm = lowered_tp2[64]
    pf = next(n for n in gm.graph.nodes if dialect.is_k3(n, "prefetch"))
    activation = next(n for n in gm.graph.nodes if dialect.is_k3(n, "front_gemm"))
    state = next(n for n in gm.graph.nodes if n.op == "placeholder" and "lengths" in n.name)
    original = pf.args
    try:
        for bad in (activation, state):
            pf.args = ([*original[0], bad], original[1])
            with pytest.raises(PassConditionError, match=r"prefetch_weights' ensures violated: .* not a static weight"):
                PrefetchWeights().ensures(gm, _ctx(gm))
    finally:
        pf.args = original
    PrefetchWeights().ensures(gm, _ctx(gm))


def test_prefetch_budget_is_respected(lowered_tp2):
    budget = PrefetchWeights().config.l2_budget_bytes
    for n in lowered_tp2[1].graph.nodes:
        if dialect.is_k3(n, "prefetch"):
            total = sum(w.meta["example_value"].numel() * w.meta["example_value"].element_size() for w in n.args[0])
            assert total == n.args[1] <= budget
            assert dialect.communicates(n.next)
