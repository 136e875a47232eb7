"""The kernel plan for the real config: launch counts and bytes against k3-architecture.md §3.2.

§3.2's vLLM layout replicates the router, the latent down- and up-projections on every rank; our
shard_routing pass splits all three across ranks, so the expected MoE bytes are ``(router + down + up) / tp``
instead of their sum. Routed experts: distinct experts a batch of B
touches in expectation, E * (1 - (1 - k/E)^B), at 17,547,264 B per expert / tp (no padding at TP 16).
The KDA recurrent state (fp32, read and written) scales with B.
"""

import json

import pytest

from k3compile.cli import main
from k3compile.models import kimi_k3
from k3compile.plan import B, plans_for
from k3compile.templates.moe_experts import ROUTE_MIN_BUCKET

MB = 1e6
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
H, D, HID, E, K = 96, 128, 7168, 896, 16
EXPERT_BYTES = 17_547_264


def expected_kda_moe(tp: int, b: int) -> float:
    kda = ((5 * H * D * HID + H * D * 128 + H * HID + 3 * H * D * 4) * 2 + (H + H * D) * 4) / tp + 128 * HID * 2
    state = 2 * (H // tp) * D * D * 4 * b
    router, down, up = 896 * HID * 2, 3584 * HID * 2, HID * 3584 * 2
    shared = 3 * 6144 * HID * 2 / tp
    distinct = E * (1 - (1 - K / E) ** b)
    routed = distinct * EXPERT_BYTES / tp
    return kda + state + (router + down + up) / tp + shared + routed


@pytest.fixture(scope="module", params=[8, 16])
def plans(request):
    return request.param, plans_for(kimi_k3(), tp=request.param, buckets=BUCKETS)


def test_kda_moe_layer_launches_and_bytes(plans):
    tp, by_bucket = plans
    for b in BUCKETS:
        lp = by_bucket[b].by_kind()["kda+moe"]
        # 8, plus the router selection's own launch from ROUTE_MIN_BUCKET (each gate/up CTA would otherwise
        # select M / 4 tokens one after another per warp: ~100 us at batch 64 on the H200)
        assert len(lp.launches) <= 8 + (b >= ROUTE_MIN_BUCKET), [l.name for l in lp.launches]
        # weights + state against the hand count (activations are the rest: a few hundred kB per row)
        got = sum(float((l.weight_bytes + l.state_bytes).subs(B, b)) for l in lp.launches)
        want = expected_kda_moe(tp, b)
        assert abs(got - want) / want < 0.003, f"TP{tp} bucket {b}: plan {got / MB:.1f} MB vs {want / MB:.1f} MB"
        act = sum(float(l.act_bytes.subs(B, b)) for l in lp.launches)
        assert 0 < act < b * 0.5 * MB and lp.bytes(b) == pytest.approx(got + act, abs=len(lp.launches))
    if tp == 8:
        # §3.2 at TP8, batch 1: 298 MB in vLLM's layout; minus (router + down + up) * 7/8 sharded away here.
        assert abs(by_bucket[1].by_kind()["kda+moe"].bytes(1) / MB - (298 - (12.8 + 51.4 + 51.4) * 7 / 8)) < 3


def test_section_3_2_component_figures(plans):
    tp, by_bucket = plans
    lp = by_bucket[1].by_kind()["kda+moe"]
    kda_attention = sum(float(l.weight_bytes) for l in lp.launches[:3]) / MB  # front GEMM, KDA, o_proj
    shared_down = sum(float(l.weight_bytes) for l in lp.launches if l.stream == "shared_expert") / MB
    routed = sum(float(l.weight_bytes.subs(B, 1)) for l in lp.launches if l.op == "routed_experts") / MB
    attn, shared, experts = {8: (112.5, 33.0, 35.1), 16: (57.2, 16.5, 17.5)}[tp]
    assert kda_attention == pytest.approx(attn, rel=0.01)
    # the shared expert's gate/up come out of the MoE front GEMM (2/3 of its bytes); its down-projection
    # runs on the side stream (1/3)
    assert shared_down == pytest.approx(shared / 3, rel=0.01)
    assert routed == pytest.approx(experts, rel=0.01)


def test_routed_expert_launches_carry_the_weights_they_stream(plans):
    # gate/up streams W1 and W3 (2/3 of an expert's bytes), down W2 (1/3), the selection (from ROUTE_MIN_BUCKET)
    # none; the FLOPs follow the same split
    tp, by_bucket = plans
    for b in (1, ROUTE_MIN_BUCKET):
        lp = by_bucket[b].by_kind()["kda+moe"]
        parts = ("route", "gate_up", "down_combine")
        ls = {next(p for p in parts if l.name.endswith(p)): l for l in lp.launches if l.op == "routed_experts"}
        assert set(ls) == set(parts if b >= ROUTE_MIN_BUCKET else parts[1:]), (tp, b)
        w = {k: float(l.weight_bytes.subs(B, b)) for k, l in ls.items()}
        f = {k: float(l.flops.subs(B, b)) for k, l in ls.items()}
        distinct = E * (1 - (1 - K / E) ** b)
        assert w["gate_up"] == pytest.approx(2 * distinct * EXPERT_BYTES / 3 / tp, rel=1e-9), (tp, b)
        assert w["down_combine"] == pytest.approx(w["gate_up"] / 2, rel=1e-9) and w.get("route", 0.0) == 0.0
        assert f["down_combine"] == pytest.approx(f["gate_up"] / 2, rel=1e-9) and f.get("route", 0.0) == 0.0


def test_mla_layer_bytes(plans):
    tp, by_bucket = plans
    lp = by_bucket[1].by_kind()["mla+moe"]
    attention = sum(float(l.weight_bytes) for l in lp.launches[:4]) / MB  # front, q_b, mla, o_proj
    assert attention == pytest.approx({8: 84.6, 16: 57.4}[tp], rel=0.02)


# GPU kernels per layer from the templates each launch maps to, at K3 TP 8 and 16. The H200 profiler counted
# 12 / 14 / 15 (KDA + MoE) and 15 / 18 / 19 (gated MLA + MoE, context 1k) kernels per layer at batches 1 / 8 / 64
# for rank 0's TP8 shard on one GPU (BENCHMARKS.md, thirteenth and sixteenth entries): these plus the 2
# all-gathers, each a copy in that emulation then (the all-reduce is none there). The MoE front GEMV now writes
# both gathered entries itself (emulated_copies 0).
GPU_KERNELS = {"kda+dense": {1: 8, 8: 9, 64: 9}, "kda+moe": {1: 10, 8: 12, 64: 13}, "mla+moe": {1: 13, 8: 16, 64: 17}}


def test_layers_count_their_gpu_kernels_and_collectives(plans):
    tp, by_bucket = plans
    for kind, want in GPU_KERNELS.items():
        for b, n in want.items():
            lp = by_bucket[b].by_kind()[kind]
            c = lp.counts()
            assert (c["gpu_kernels"], c["torch_ops"], c["uncovered"]) == (n, 0, 0), (tp, kind, b, c)
            # router logits, latent rows and the up-projection's rows (shard_routing), each written into every
            # rank's slot by its GEMV: no emulation copy
            assert c["collectives"] == ({"all_gather": 3, "all_reduce": 1} if kind.endswith("moe") else {}), c
            assert c["emulated_copies"] == 0, c
            assert all(l.kernels and l.gpu_kernels == sum(3 if k == "mla_decode" else 1 for k in l.kernels)
                       for l in lp.launches), [(l.name, l.kernels, l.gpu_kernels) for l in lp.launches]
    text = by_bucket[1].text()
    assert "9 launches = 13 GPU kernels + 3 all-gathers + 1 all-reduce" in text
    assert "3: mla_decode" in text and "2: gemv+residual_attn_res" in text and "all-gather:2" in text
    model = by_bucket[1].by_kind()["model (embedding, output AttnRes, lm_head)"]
    coll = next(l for l in model.launches if l.op == "tp_all_reduce")  # the runtime's, no kernel of ours
    assert (coll.gpu_kernels, coll.collectives, coll.kernels_text()) == (0, {"all_reduce": 1}, "collective")


def test_plan_cli_json(capsys):
    assert main(["plan", "--config", "kimi_k3", "--tp", "8", "--bucket", "1", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    kda = js["layer_types"]["kda+moe"]
    assert kda["n_launches"] <= 8 and kda["count_in_model"] == 68
    assert kda["gpu_kernels"] == 10 and kda["collectives"] == {"all_gather": 3, "all_reduce": 1}
    assert [l["kernels"] for l in kda["launches"]][:3] == [["gemv"], ["kda_decode"], ["gemv", "residual_attn_res"]]
    assert kda["floor_us"] == pytest.approx(kda["bytes"] / 4.2e12 * 1e6)
    assert {l["stream"] for l in kda["launches"]} == {"main", "shared_expert"}
    side = next(l for l in kda["launches"] if l["stream"] == "shared_expert")
    assert side["waits"] and side["records"]


def test_plan_cli_rejects_bad_tp(capsys):
    assert main(["plan", "--config", "k3_mini", "--tp", "16"]) == 2
    assert "does not divide" in capsys.readouterr().err


def test_plan_cli_says_when_no_template_compiles_the_bucket(capsys):
    """A bucket no kernel template compiles for still plans (its launches 'uncovered'), with a note naming the
    bucket a batch of that size runs at."""
    assert main(["plan", "--config", "k3_mini", "--bucket", "5", "--json"]) == 0
    cap = capsys.readouterr()
    assert "bucket 5 is not one of the kernel buckets" in cap.err and "use --bucket 8" in cap.err
    assert json.loads(cap.out)["bucket"] == 5
    assert main(["plan", "--config", "k3_mini", "--bucket", "128", "--json"]) == 0
    assert "above 64 is refused at run time" in capsys.readouterr().err
    assert main(["plan", "--config", "k3_mini", "--bucket", "8", "--json"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_mla_floor_reads_the_cache_up_to_the_context(capsys):
    """The latent cache counts as read up to ``context`` rows per sequence (never written by the decode op):
    the MLA+MoE layer's bytes grow by exactly B x (32000 - 1024) cached rows of C + R bf16 between the two
    contexts, whatever the cache capacity (the lowered graph's op is mla_decode_latent)."""
    got = {}
    for ctx in (1024, 32000):
        assert main(["plan", "--config", "slice:4", "--tp", "8", "--bucket", "8", "--context", str(ctx), "--json"]) == 0
        got[ctx] = json.loads(capsys.readouterr().out)["layer_types"]["mla+moe"]["bytes"]
    assert got[32000] - got[1024] == 8 * (32000 - 1024) * (512 + 64) * 2
