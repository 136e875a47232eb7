"""One test per pitfall of k3-architecture.md §5.

Most tests have two halves: the model (or op) matches the form the spec gives, checked against an
independent float64 reference (tests/models/k3ref.py, written from §1-§2), *and* the wrong form a
port might use gives a measurably different answer, so the check would catch that bug.

Tolerances: the fp32 model against the float64 reference agrees to ~2e-6 (max |diff| / max |ref|
over the logits); we require < 2e-5. Every "wrong form" differs by > 1e-2 (measured 0.5-1.8).
"""

import concurrent.futures
import math
import threading

import pytest
import torch
from k3ref import PLAN, Reference, attn_res as ref_attn_res, dequant_mxfp4, max_rel_err, mla_full_ref, rel_err
from cpu import one_thread
from k3ref import rewrite_safetensors, rope, run_model, situ as ref_situ

from k3compile.models import K3Model, k3_mini, kimi_k3, load_pretrained, mxfp4, ops
from k3compile.models import layers as layers_mod
from k3compile.models.config import K3Config
from k3compile.models.layers import KDAAttention, KDAState, LatentMoE, MLAAttention

TOL = 2e-5  # fp32 model vs float64 reference
DIFFERS = 1e-2  # a wrong form must be at least this far off
SHORT = PLAN[:3]  # mutated references only need a few tokens to show they differ


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def weight_cache():
    return {}


@pytest.fixture(scope="module")
def model_logits(model_f32):
    with one_thread():
        return run_model(model_f32, PLAN)[0]


@pytest.fixture(scope="module")
def ref_logits(mini_config_dict, mini_tensors, weight_cache):
    with one_thread():
        return Reference(mini_config_dict, mini_tensors, cache=weight_cache).run(PLAN)


@pytest.fixture(scope="module")
def check(model_logits, ref_logits, mini_config_dict, mini_tensors, weight_cache):
    """check(*mutations): the model matches the right reference; each wrong variant differs."""

    def _check(*mutations):
        err = max_rel_err(model_logits, ref_logits)
        assert err < TOL, f"model vs float64 reference: {err:.2e}"
        for m in mutations:
            wrong = Reference(mini_config_dict, mini_tensors, [m], cache=weight_cache).run(SHORT)
            d = max_rel_err(model_logits[:len(SHORT)], wrong)
            assert d > DIFFERS, f"mutation {m!r} is indistinguishable from the model ({d:.2e})"

    return _check


def _capture(monkeypatch, name):
    """Record (args, result) of every call of ops.<name> made by the model."""
    calls = []
    orig = getattr(ops, name)

    def wrapper(*a, **k):
        out = orig(*a, **k)
        calls.append((a, out))
        return out

    monkeypatch.setattr(ops, name, wrapper)
    return calls


# ---------------------------------------------------------------------------------------------- 1
def test_pitfall01_layer_schedule_from_one_based_lists_with_MM_tail(mini_ckpt, model_f32):
    c = kimi_k3()
    mla = [i for i in range(93) if c.is_mla_layer(i)]
    assert mla == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63, 67, 71, 75, 79, 83, 87, 91, 92]
    assert [i for i in range(93) if i % 4 == 3] != mla  # the periodic rule gets layer 92 wrong
    assert c.layer_types[-5:] == ["kda", "kda", "kda", "mla", "mla"]
    m = K3Model(c, device="meta")  # real shapes, no memory
    assert [i for i, lay in enumerate(m.layers) if isinstance(lay.self_attn, MLAAttention)] == mla
    assert all(isinstance(m.layers[i].self_attn, KDAAttention) for i in range(93) if i not in mla)
    assert hasattr(m.layers[0], "mlp") and not hasattr(m.layers[0], "block_sparse_moe")  # layer 0: KDA + dense
    assert all(isinstance(lay.block_sparse_moe, LatentMoE) for lay in m.layers[1:])
    st = m.new_state(1, 8)
    assert [i for i, s in enumerate(st.layers) if not isinstance(s, KDAState)] == mla
    assert st.layers[92].shape == (1, 8, 576)
    # k3-mini: the same M M tail, from its config.json
    assert [i for i, lay in enumerate(model_f32.layers) if lay.is_mla] == [3, 7, 11, 12]
    # a non-periodic schedule is read from the 1-based lists, nothing else
    d = k3_mini().to_dict()
    d["text_config"]["linear_attn_config"].update(full_attn_layers=[1, 2, 7, 13],
                                                  kda_layers=[3, 4, 5, 6, 8, 9, 10, 11, 12])
    odd = K3Model(K3Config.from_dict(d), device="meta")
    assert [i for i, lay in enumerate(odd.layers) if isinstance(lay.self_attn, MLAAttention)] == [0, 1, 6, 12]


# ---------------------------------------------------------------------------------------------- 2
def test_pitfall02_only_a_log_of_the_real_heads_is_used(ckpt_copy, model_f32, mini_tensors):
    g = torch.Generator().manual_seed(0)
    H = 8

    def garbage(t):
        for k in t:
            if k.endswith("A_log"):
                t[k] = t[k].clone()
                t[k][H:] = torch.rand(t[k].shape[0] - H, generator=g) * 6 - 3  # padding is no longer 0
        return t

    rewrite_safetensors(ckpt_copy, garbage)
    from safetensors.torch import load_file
    stored = {k: v for k, v in load_file(ckpt_copy + "/model.safetensors").items() if k.endswith("A_log")}
    m = load_pretrained(ckpt_copy, dtype=torch.float32)
    for i, lay in enumerate(m.layers):
        if not lay.is_mla:
            a = stored[f"language_model.model.layers.{i}.self_attn.A_log"]
            assert torch.equal(lay.self_attn.A_log, a[:H])
            assert torch.equal(a[:H], mini_tensors[f"language_model.model.layers.{i}.self_attn.A_log"][:H])
    base, _ = run_model(model_f32, SHORT)
    got, _ = run_model(m, SHORT)
    assert all(torch.equal(a, b) for a, b in zip(got, base))  # garbage padding changes nothing
    # A TP shard takes its heads from the real entries: tp 2, rank 1 holds heads 4..7, not padding 8..11.
    r1 = load_pretrained(ckpt_copy, dtype=torch.float32, tp_rank=1, tp_size=2)
    assert torch.equal(r1.layers[0].self_attn.A_log, stored["language_model.model.layers.0.self_attn.A_log"][4:8])
    # A model that read the padding instead would differ.
    with torch.no_grad():
        for i, lay in enumerate(m.layers):
            if not lay.is_mla:
                lay.self_attn.A_log.copy_(stored[f"language_model.model.layers.{i}.self_attn.A_log"][H:2 * H])
    wrong, _ = run_model(m, SHORT)
    assert max_rel_err(wrong, base) > DIFFERS


# ---------------------------------------------------------------------------------------------- 3
def test_pitfall03_decay_gate_is_lower_bound_sigmoid_not_softplus(check):
    H, D, W = 4, 8, 4
    g = torch.Generator().manual_seed(0)
    a_log = torch.log(torch.tensor([1.0, 2.0, 8.0, 16.0]))
    f = torch.linspace(-8, 8, H * D)[None]
    dt = torch.randn(H * D, generator=g)
    S0 = torch.rand(1, H, D, D, generator=g) + 0.5
    z = torch.zeros(1, H * D, W - 1)
    one = torch.randn(1, H * D, generator=g)
    wk = torch.zeros(H * D, 1, W)  # k = silu(0) = 0: the step only decays the state
    w = torch.randn(H * D, 1, W, generator=g)
    *_, S1 = ops.kda_decode(one, one, one, f, torch.zeros(1, H), one, z, z, z, S0, w, wk, w, a_log, dt,
                            torch.ones(D), D, -5.0, 1e-5)
    decay = (S1 / S0)[0]  # [H, K, V]: every key row scaled by its a[h, k]
    x = torch.exp(a_log.double())[:, None] * (f.double().view(H, D) + dt.double().view(H, D))
    want = torch.exp(-5 * torch.sigmoid(x))  # exp(g), g = -5 sigmoid(e^A (f + dt_bias))
    torch.testing.assert_close(decay.double(), want[:, :, None].expand(H, D, D), rtol=1e-5, atol=0)
    assert decay.min() >= math.exp(-5) * (1 - 1e-5) and decay.max() < 1
    softplus = torch.exp(-torch.exp(a_log.double())[:, None] * torch.nn.functional.softplus(x / torch.exp(
        a_log.double())[:, None]))
    assert (softplus - want).abs().max() > 0.1
    check("softplus_gate")


# ---------------------------------------------------------------------------------------------- 4
def test_pitfall04_mla_has_no_rope_shared_raw_k_pe_scale_192(model_f32, check):
    cfg = model_f32.config
    assert cfg.mla_scale == 192 ** -0.5
    Hh, n, r, v, Cl = 8, 128, 64, 128, 512
    g = torch.Generator().manual_seed(0)
    kv_b = torch.randn(Hh * (n + v), Cl, generator=g) / Cl ** 0.5
    L = 6
    cache = torch.randn(1, 8, Cl + r, generator=g)
    cache[0, :, Cl:] *= 4  # a strong k_pe so that position effects would show
    q = torch.randn(1, Hh * (n + r), generator=g)
    lat = torch.randn(1, Cl + r, generator=g)
    gate = torch.randn(1, Hh * v, generator=g)
    lengths = torch.tensor([L - 1])
    out = ops.mla_decode(q, lat, gate, cache, lengths, kv_b, n, v, cfg.mla_scale)
    seen = torch.cat([cache[0, :L - 1], lat])
    want = mla_full_ref(q[0], seen[:, :Cl], seen[:, Cl:], gate[0], kv_b, n, v, 192 ** -0.5)
    assert rel_err(out[0], want) < 1e-5
    # No positions anywhere: shuffling the earlier tokens of the cache changes nothing ...
    perm = torch.tensor([3, 0, 4, 2, 1])
    shuffled = cache.clone()
    shuffled[0, :L - 1] = cache[0, perm]
    out2 = ops.mla_decode(q, lat, gate, shuffled, lengths, kv_b, n, v, cfg.mla_scale)
    assert rel_err(out2, out) < 1e-5
    # ... whereas with RoPE on q_pe / k_pe it would.
    def roped(order):
        Kpe = torch.stack([rope(seen[order[t], Cl:].double(), t) for t in range(L)])
        qr = q[0].double().view(Hh, n + r).clone()
        qr[:, n:] = rope(qr[:, n:], L - 1)
        return mla_full_ref(qr.reshape(-1), seen[order, :Cl], Kpe, gate[0], kv_b, n, v, 192 ** -0.5)
    ident = list(range(L))
    assert rel_err(roped(perm.tolist() + [L - 1]), roped(ident)) > 1e-3
    # the cache holds one k_pe per token (shared by all heads), not one per head
    assert model_f32.new_state(1, 4).layers[3].shape[-1] == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    check("rope")


# ---------------------------------------------------------------------------------------------- 5
def test_pitfall05_mla_latent_norm_eps_is_1e6_elsewhere_config_1e5(model_f32, mini_config_dict, mini_tensors):
    assert k3_mini().rms_norm_eps == kimi_k3().rms_norm_eps == 1e-5
    g = torch.Generator().manual_seed(0)
    x_first = torch.randn(1, 256, generator=g)
    x_small = 1e-3 * torch.randn(1, 256, generator=g)  # q_a / kv_a outputs with mean square ~1e-6

    def run_mla(model):
        cache = torch.zeros(1, 4, 576)
        with torch.no_grad():
            model.layers[3].self_attn(x_first, cache, torch.tensor([0]))
            return model.layers[3].self_attn(x_small, cache, torch.tensor([1]))[0]

    def run_ref(mut):
        ref = Reference(mini_config_dict, mini_tensors, mut)
        st = ref._new_seq()[3]
        ref.mla(3, x_first[0].double(), st)
        return ref.mla(3, x_small[0].double(), st)

    got = run_mla(model_f32)
    assert rel_err(got, run_ref(())) < 1e-4
    assert rel_err(got, run_ref(["mla_eps_1e5"])) > 0.05
    # The latent norms ignore the config's rms_norm_eps; every other norm follows it.
    other = K3Model(k3_mini().replace(rms_norm_eps=1e-2), dtype=torch.float32)
    other.load_state_dict(model_f32.state_dict())
    assert torch.equal(run_mla(other), got)
    st_a, st_b = model_f32.new_state(1, 2).layers[1], other.new_state(1, 2).layers[1]
    with torch.no_grad():
        ka = model_f32.layers[1].self_attn(x_small, st_a, 1)
        kb = other.layers[1].self_attn(x_small, st_b, 1)
    assert rel_err(kb, ka) > 1e-2  # the KDA o_norm uses the config eps
    a, _ = run_model(model_f32, [[7]])
    b, _ = run_model(other, [[7]])
    assert rel_err(b[0], a[0]) > 1e-3


# ---------------------------------------------------------------------------------------------- 6
def test_pitfall06_attn_res_keys_normed_raw_values_folded_weights_seal_after_read(monkeypatch, model_f32, check):
    # the op: keys RMS-normalised (no temperature), raw values mixed, norm * proj folded
    g = torch.Generator().manual_seed(0)
    blocks = torch.randn(3, 4, 64, generator=g) * torch.tensor([0.3, 1.0, 3.0, 2.0])[None, :, None]
    prefix = torch.randn(3, 64, generator=g) * 2
    wn, wp = 2 * torch.rand(64, generator=g), torch.randn(1, 64, generator=g) / 8  # softmax not saturated
    out = ops.attn_res(prefix, blocks, wn, wp, 1e-5)
    for b in range(3):
        vals = list(blocks[b].double()) + [prefix[b].double()]
        assert rel_err(out[b], ref_attn_res(vals, wn.double(), wp.double(), 1e-5)) < 1e-6
        for wrong in ("attnres_norm_values", "attnres_proj_only"):
            assert rel_err(out[b], ref_attn_res(vals, wn.double(), wp.double(), 1e-5, {wrong})) > DIFFERS
    # the model: which candidates each read sees (k3-mini: blocks sealed at layers 0, 3, 6, 9, 12)
    calls = _capture(monkeypatch, "attn_res")
    run_model(model_f32, [[11]])
    n_blocks = [a[1].shape[1] for a, _ in calls]
    # pre-attention read of layer i sees ceil(i/3) blocks (none at layer 0: skipped); the FFN read
    # adds the block sealed at a write layer; the output read sees all 5.
    want = [1]  # layer 0: FFN read only
    for i in range(1, 13):
        want += [math.ceil(i / 3), math.ceil(i / 3) + (i % 3 == 0)]
    assert n_blocks == want + [5]
    # at a write layer the block sealed is exactly the prefix the pre-attention read just used
    for i in (3, 6, 9, 12):
        pre_attn, ffn = calls[2 * i - 1][0], calls[2 * i][0]
        assert torch.equal(ffn[1][:, -1], pre_attn[0])
    check("seal_before_read", "attnres_norm_values", "attnres_proj_only")


# ---------------------------------------------------------------------------------------------- 7
def test_pitfall07_output_attn_res_over_all_blocks_before_final_norm(monkeypatch, model_f32, check):
    res = _capture(monkeypatch, "attn_res")
    head = _capture(monkeypatch, "lm_head")
    tok = torch.tensor([11, 12])
    st = model_f32.new_state(2, 2)
    with torch.no_grad():
        model_f32.decode(tok, st)
    (prefix, blocks, nw, pw, _), h = res[-1]
    assert blocks.shape[1] == 5  # b0..b4 + P = 6 candidates (K3: 8 + P = 9)
    assert nw is model_f32.output_attn_res_norm.weight and pw is model_f32.output_attn_res_proj.weight
    # b0 is still the embedding (no aliasing of the bank with the running prefix: the "Paris" bug)
    assert torch.equal(blocks[:, 0], model_f32.embed_tokens.weight[tok])
    # the output AttnRes result is what the head normalises (final norm after AttnRes)
    (h_in, norm_w, *_), _ = head[-1]
    assert h_in is h and norm_w is model_f32.norm.weight
    check("output_skip_attnres", "output_norm_first")


# ---------------------------------------------------------------------------------------------- 8
def test_pitfall08_fp32_routing_bias_selects_only_renorm_eps_late_weights(monkeypatch, model_f32, check):
    g = torch.Generator().manual_seed(0)
    E, K, D = 16, 4, 256
    x = torch.randn(6, D, generator=g).bfloat16()
    Wr = (torch.randn(E, D, generator=g) / 16).bfloat16()
    bias = 0.05 * torch.randn(E, generator=g)
    w, ids = ops.moe_route(x, Wr, bias, K, True, 1.0)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    s = torch.sigmoid(x.double() @ Wr.double().T)  # router GEMM in fp32 (here: exact float64)
    want_ids = torch.topk(s + bias.double(), K).indices
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    sel = s.gather(-1, ids)
    torch.testing.assert_close(w.double(), sel / sel.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    bf16_gemm = torch.sigmoid((x @ Wr.T).double())  # a bf16 router GEMM would be this far off
    assert (bf16_gemm - s).abs().max() > 1e-4
    # the bias only selects: a huge bias forces expert 3 in, with its *unbiased* score as weight
    big = bias.clone()
    big[3] = 10.0
    w2, ids2 = ops.moe_route(x, Wr, big, K, True, 1.0)
    assert (ids2 == 3).any(-1).all()
    sel2 = s.gather(-1, ids2)
    torch.testing.assert_close(w2.double(), sel2 / sel2.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    # renormalisation with +1e-20: all scores 0 gives weights 0, not NaN
    w3, _ = ops.moe_route(torch.ones(2, D), -torch.ones(E, D) * 10, bias, K, True, 1.0)
    assert torch.equal(w3, torch.zeros(2, K))
    # late routing weights: the weight multiplies each expert's output
    L, I = 64, 96
    z = torch.randn(3, L, generator=g)
    packs = [mxfp4.quantize(torch.randn(E, o, i, generator=g) / i ** 0.5) for o, i in ((I, L), (I, L), (L, I))]
    rw = torch.rand(3, K, generator=g)
    rids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(3)])
    deq = [[dequant_mxfp4(p[e], sc[e]) for e in range(E)] for p, sc in packs]
    for limit in (0, 1 << 40):  # both expert paths: selected experts only / all experts densely
        monkeypatch.setattr(ops, "DENSE_EXPERTS_MAX_WEIGHTS", limit, raising=False)
        y = ops.latent_moe_experts(z, rw, rids, *packs[0], *packs[1], *packs[2], 4.0, 25.0)
        for b in range(3):
            late = early = 0
            for k in range(K):
                e, wk, zb = int(rids[b, k]), rw[b, k].double(), z[b].double()
                late = late + wk * (deq[2][e] @ ref_situ(deq[0][e] @ zb, deq[1][e] @ zb))
                early = early + deq[2][e] @ ref_situ(deq[0][e] @ (wk * zb), deq[1][e] @ (wk * zb))
            assert rel_err(y[b], late) < 1e-5, limit
            assert rel_err(y[b], early) > DIFFERS
    monkeypatch.undo()
    # the model routes on the full-width MoE input (not the latent)
    routes = _capture(monkeypatch, "moe_route")
    run_model(model_f32, [[11]])
    assert len(routes) == 12 and all(a[0].shape[-1] == 256 for a, _ in routes)
    check("route_bias_in_weights", "early_routing_weights")


# ---------------------------------------------------------------------------------------------- 9
class ThreadAllReduce:
    """An all-reduce between threads (one per rank) standing in for torch.distributed."""

    def __init__(self, n):
        self.barrier = threading.Barrier(n)
        self.slots = [None] * n
        self.log = {r: [] for r in range(n)}

    def __call__(self, x, tp):
        if tp.size == 1:
            return x
        self.log[tp.rank].append(x.clone())
        self.slots[tp.rank] = x
        self.barrier.wait()
        out = sum(self.slots[1:], self.slots[0].clone())
        self.barrier.wait()
        return out


def test_pitfall09_latent_norm_after_combine_before_up_and_tp_reduces_first(
        monkeypatch, mini_ckpt, model_f32, mini_config_dict, mini_tensors, check):
    moe = model_f32.layers[5].block_sparse_moe
    g = torch.Generator().manual_seed(0)
    y = torch.randn(3, 256, generator=g)
    for limit in (0, 1 << 40):  # both expert paths: selected experts only / all experts densely
        monkeypatch.setattr(ops, "DENSE_EXPERTS_MAX_WEIGHTS", limit, raising=False)
        with torch.no_grad():
            out = moe(y)
        for wrong in ((), ("latent_norm_per_expert",), ("no_latent_norm",)):
            ref = Reference(mini_config_dict, mini_tensors, wrong)
            for b in range(3):
                e = rel_err(out[b], ref.moe(5, y[b].double()))
                assert (e < TOL) if not wrong else (e > DIFFERS), (limit, wrong, b, e)
    monkeypatch.undo()
    # TP 2 with an in-process all-reduce: the latent partial is reduced *before* the norm.
    ranks = [load_pretrained(mini_ckpt, dtype=torch.float32, tp_rank=r, tp_size=2) for r in range(2)]
    ar = ThreadAllReduce(2)
    monkeypatch.setattr(layers_mod, "all_reduce", ar)
    with torch.no_grad(), concurrent.futures.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda m: m.layers[5].block_sparse_moe(y), ranks))
    for o in outs:
        assert rel_err(o, out) < 1e-5
    p0, p1 = ar.log[0][0], ar.log[1][0]  # first collective of each rank: the latent partial
    assert p0.shape == (3, 128)
    nw = moe.routed_expert_norm.weight
    norm = lambda t: ops.rms_norm(t, nw, 1e-5)  # noqa: E731
    assert rel_err(norm(p0) + norm(p1), norm(p0 + p1)) > DIFFERS  # norming the partials would be wrong
    check("latent_norm_per_expert", "no_latent_norm")


# ---------------------------------------------------------------------------------------------- 10
def test_pitfall10_shared_expert_reads_the_pre_down_input(model_f32, check):
    moe = model_f32.layers[2].block_sparse_moe
    seen = {}
    hooks = [moe.shared_experts.register_forward_pre_hook(lambda mod, a: seen.__setitem__("shared", a[0])),
             moe.routed_expert_down_proj.register_forward_pre_hook(lambda mod, a: seen.__setitem__("down", a[0]))]
    try:
        y = torch.randn(2, 256, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            moe(y)
    finally:
        for h in hooks:
            h.remove()
    assert seen["shared"] is y and seen["down"] is y  # both read the same full-width input
    check("shared_reads_up_output")


# ---------------------------------------------------------------------------------------------- 11
def test_pitfall11_mxfp4_low_nibble_even_scale_per_32():
    # byte 0x7F: low nibble 0xF (-6) is element 0, high nibble 0x7 (+6) is element 1
    packed = torch.full((1, 32), 0x7F, dtype=torch.uint8)
    scale = torch.tensor([[127, 129]], dtype=torch.uint8)  # x1 for elements 0..31, x4 for 32..63
    w = mxfp4.dequantize(packed, scale, torch.float32)
    assert w[0, :2].tolist() == [-6.0, 6.0]
    assert w[0, 30:34].tolist() == [-6.0, 6.0, -24.0, 24.0]
    # the model's MXFP4 matmul path sees the same order: x = e_j picks input column j
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (4, 64), generator=g, dtype=torch.uint8)
    sc = torch.tensor([[120, 130]] * 4, dtype=torch.uint8)
    p = mxfp4.pack_codes(codes)
    table = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    for j in (0, 1, 30, 31, 32, 33, 63):
        e = torch.zeros(1, 64)
        e[0, j] = 1
        col = ops.mxfp4_linear(e, p, sc)[0]
        assert torch.equal(col, table[codes[:, j].long()] * 2.0 ** (sc[:, j // 32].float() - 127))
        byte = p[:, j // 2]
        nib = (byte & 0xF) if j % 2 == 0 else (byte >> 4)
        assert torch.equal(codes[:, j], nib)


# ---------------------------------------------------------------------------------------------- 12
def test_pitfall12_beta_per_head_shared_o_norm_sigmoid_of_raw_gate(check):
    H, D, W = 4, 16, 4
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v, f, gg = r(1, H * D), r(1, H * D), r(1, H * D), r(1, H * D), 2 * r(1, H * D)
    beta = r(1, H)
    conv = [r(H * D, 1, W) for _ in range(3)]
    a_log, dt, onw = torch.log(torch.rand(H, generator=g) * 15 + 1), r(H * D), 1 + 0.2 * r(D)
    S0 = 0.1 * r(1, H, D, D)
    z = torch.zeros(1, H * D, W - 1)

    def run(beta=beta, gg=gg, onw=onw):
        y, *_, S = ops.kda_decode(q, k, v, f, beta, gg, z, z, z, S0, *conv, a_log, dt, onw, D, -5.0, 1e-5)
        return y.view(H, D), S[0]

    y0, S_0 = run()
    # beta is one scalar per head: changing head 2's beta moves head 2 only
    b2 = beta.clone()
    b2[0, 2] += 1.5
    y1, S_1 = run(beta=b2)
    changed = [h for h in range(H) if not torch.equal(y1[h], y0[h])]
    assert changed == [2] and [h for h in range(H) if not torch.equal(S_1[h], S_0[h])] == [2]
    # the o_norm weight [D] is shared by all heads: scaling entry d scales channel d of every head
    on2 = onw.clone()
    on2[5] *= 3
    y2, _ = run(onw=on2)
    torch.testing.assert_close(y2[:, 5], 3 * y0[:, 5])
    mask = torch.ones(D, dtype=torch.bool)
    mask[5] = False
    assert torch.equal(y2[:, mask], y0[:, mask])
    # the output gate is sigmoid of the raw g projection, elementwise: y(g) / y(0) = 2 sigmoid(g)
    yz, _ = run(gg=torch.zeros_like(gg))
    torch.testing.assert_close(y0 / yz, 2 * torch.sigmoid(gg.view(H, D)), rtol=1e-5, atol=1e-6)
    check("beta_head0", "kda_gate_silu", "kda_gate_normed", "o_norm_over_heads")
