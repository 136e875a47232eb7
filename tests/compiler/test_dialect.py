"""The K3 dialect: schema + fake (meta) implementations agree with the eager ones; lifted op counts."""

from collections import Counter

import pytest
import torch

import k3compile
from k3compile import dialect
from k3compile.capture import capture_config
from k3compile.compiler import Options, lower
from k3compile.models import k3_mini
from k3compile.models.mxfp4 import quantize
from k3compile.pipeline_table import default_passes


class _RecordK3(torch.fx.Interpreter):
    """Runs a lowered graph and keeps the real arguments of the first call of every dialect op."""

    def __init__(self, gm):
        super().__init__(gm)
        self.calls = {}

    def call_function(self, target, args, kwargs):
        if getattr(target, "namespace", None) == "k3" and target not in self.calls:
            self.calls[target] = (tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args), kwargs)
        return super().call_function(target, args, kwargs)


def _recorded_calls(model, passes):
    compiled = k3compile.compile(model, buckets=(4,), options={"passes": passes})
    compiled(torch.tensor([1, 2, 3]), model.new_state(3, 8))
    dispatcher = compiled.dispatchers[-1]
    rec = _RecordK3(dispatcher.graphs[4])
    dispatcher.graphs[4] = lambda *args: rec.run(*args)
    compiled(torch.tensor([4, 5, 6]), model.new_state(3, 8))
    return rec.calls


def test_every_dialect_op_has_consistent_fake_impl(mini_model):
    """opcheck (schema + fake impl against the real one) on real arguments of every op the pipeline
    produces: once right after lifting, once after every pass."""
    lifted_only = {p.name: {"enabled": False} for p in default_passes()[2:]}
    calls = {**_recorded_calls(mini_model, lifted_only), **_recorded_calls(mini_model, {})}
    seen = {f.__name__.split(".")[0] for f in calls}
    assert seen == {"rms_norm", "attn_res", "linear", "situ_glu", "moe_route", "latent_moe_experts", "kda_decode",
                    "mla_decode", "lm_head", "front_gemm", "kda_decode_fb", "oproj_residual_norm", "routed_experts",
                    "situ_linear", "ffn_tail_norm", "ffn_tail", "mla_decode_latent", "rms_norm_linear", "prefetch"} \
        - {"prefetch"}  # TP 1 has no collectives to prefetch behind
    for func, (args, kwargs) in calls.items():
        torch.library.opcheck(func, args, kwargs, test_utils=("test_schema", "test_faketensor"))


def test_ops_not_in_k3_mini_graph():
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    r = torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.rand(64, dtype=torch.bfloat16) + 0.5
    torch.library.opcheck(torch.ops.k3.add_rms_norm.default, (x, r, w, 1e-5))
    normed, s = torch.ops.k3.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r)
    packed, scale = quantize(torch.randn(32, 64))
    torch.library.opcheck(torch.ops.k3.linear_mxfp4.default, (x, packed, scale))
    torch.library.opcheck(torch.ops.k3.tp_all_reduce.default, (x, "0", 1))
    torch.library.opcheck(torch.ops.k3.tp_all_gather.default, (x, "0", 1))
    torch.library.opcheck(torch.ops.k3.allreduce_rms_norm.default, (x, "0", 1, w, 1e-5))
    w2 = torch.randn(16, 64, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.k3.linear_gather.default, (x, w2, True, "0", 1, 0))
    logits = torch.randn(3, 16)
    torch.library.opcheck(torch.ops.k3.moe_select.default, (logits, torch.zeros(16), 4, True, 1.0))
    torch.library.opcheck(torch.ops.k3.prefetch.default, ([w2], 2048))


def _counts(tp):
    cap = capture_config(k3_mini(), tp_size=tp)
    lifted_only = {p.name: {"enabled": False} for p in default_passes()[2:]}
    gm = lower(cap.graph_module, cap.inputs, tp_size=tp, bucket=1, options=Options.make(passes=lifted_only))
    return Counter(n.target.__name__.split(".")[0] for n in gm.graph.nodes if dialect.is_k3(n))


@pytest.mark.parametrize("tp", [1, 2])
def test_lifted_op_counts(tp):
    c = _counts(tp)
    cfg = k3_mini()
    n_kda = sum(cfg.is_kda_layer(i) for i in range(13))
    n_mla = 13 - n_kda
    n_moe = 12
    assert c["kda_decode"] == n_kda == 9
    assert c["mla_decode"] == n_mla == 4
    assert c["moe_route"] == c["latent_moe_experts"] == n_moe
    assert c["situ_glu"] == 1 + n_moe  # dense MLP of layer 0 + one shared MLP per MoE layer
    assert c["lm_head"] == 1
    assert c["attn_res"] == 2 * 13 - 1 + 1  # pre-attn (not layer 0) + pre-FFN per layer + output
    # rms_norm: input + post-attention per layer, MLA q_a and kv_a norms, latent norm per MoE layer
    assert c["rms_norm"] == 2 * 13 + 2 * n_mla + n_moe
    # linears: KDA q,k,v,g,b,f_a,f_b,o (8); MLA q_a,q_b,kv_a,g,o (5); dense gate/up/down; MoE down, up,
    # shared gate/up/down (5)
    assert c["linear"] == 8 * n_kda + 5 * n_mla + 3 + 5 * n_moe
    assert c["tp_all_reduce"] == (0 if tp == 1 else 1 + 13 + 1 + 2 * n_moe)
