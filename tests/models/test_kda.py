"""KDA decode (k3-architecture.md §1.12, §2): the step-by-step op and the model's KDA layer against a
chunk-free float64 recurrence over whole sequences (causal short conv recomputed from the full
history with zero left padding), rows of different lengths in one batch, and the state layout."""

import torch
from k3ref import Reference, kda_sequence_ref, rel_err

from k3compile.models import ops
from k3compile.models.layers import KDAAttention, KDAState

H, D, W = 3, 16, 4
T = 20


def random_inputs(seed, T=T, B=2):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    seq = dict(q=r(T, B, H * D), k=r(T, B, H * D), v=r(T, B, H * D), f=r(T, B, H * D), beta=r(T, B, H),
               g=r(T, B, H * D, scale=2.0))
    w = dict(wq=r(H * D, 1, W, scale=0.5), wk=r(H * D, 1, W, scale=0.5), wv=r(H * D, 1, W, scale=0.5),
             a_log=torch.log(torch.rand(H, generator=g) * 15 + 1), dt_bias=r(H * D, scale=0.5) - 1.0,
             o_norm=1 + 0.1 * r(D))
    return seq, w


def step(x, st, w, rows):
    """ops.kda_decode on state rows [:rows]; writes the new state back like the layer does."""
    y, cq, ck, cv, s = ops.kda_decode(
        x["q"], x["k"], x["v"], x["f"], x["beta"], x["g"], st["cq"][:rows], st["ck"][:rows], st["cv"][:rows],
        st["S"][:rows], w["wq"], w["wk"], w["wv"], w["a_log"], w["dt_bias"], w["o_norm"], D, -5.0, 1e-5)
    for k, v in (("cq", cq), ("ck", ck), ("cv", cv), ("S", s)):
        st[k][:rows] = v
    return y


def new_state(B=2):
    return dict(cq=torch.zeros(B, H * D, W - 1), ck=torch.zeros(B, H * D, W - 1), cv=torch.zeros(B, H * D, W - 1),
                S=torch.zeros(B, H, D, D))


def test_kda_decode_sequence_matches_float64_recurrence():
    seq, w = random_inputs(0)
    st = new_state()
    outs = {0: [], 1: []}
    # Row 0 runs alone for 3 steps, then rows 0 and 1 together: row 0 stays 3 tokens ahead.
    lag = 3
    for t in range(T):
        if t < lag:
            x = {k: v[t, :1] for k, v in seq.items()}
            outs[0].append(step(x, st, w, 1)[0])
        else:
            x = {k: torch.stack([v[t, 0], v[t - lag, 1]]) for k, v in seq.items()}
            y = step(x, st, w, 2)
            outs[0].append(y[0])
            outs[1].append(y[1])
    for b, n in ((0, T), (1, T - lag)):
        ref, S = kda_sequence_ref(seq["q"][:n, b], seq["k"][:n, b], seq["v"][:n, b], seq["f"][:n, b],
                                  seq["beta"][:n, b], seq["g"][:n, b], w["wq"], w["wk"], w["wv"], w["a_log"],
                                  w["dt_bias"], w["o_norm"])
        got = torch.stack(outs[b])
        assert got.shape == ref.shape
        for t in range(n):
            assert rel_err(got[t], ref[t]) < 1e-5, (b, t, rel_err(got[t], ref[t]))
        assert rel_err(st["S"][b], S) < 1e-5
        # the conv state holds the last W-1 pre-conv inputs, oldest first
        assert torch.equal(st["cq"][b], seq["q"][n - (W - 1):n, b].T)


def test_short_conv_zero_left_padding():
    g = torch.Generator().manual_seed(1)
    C = 8
    w = torch.randn(C, 1, W, generator=g)
    xs = torch.randn(3, 1, C, generator=g)
    state = torch.zeros(1, C, W - 1)
    ys = []
    for t in range(3):
        y, state = ops.short_conv(xs[t], state, w)
        ys.append(y[0])
    silu = torch.nn.functional.silu
    wd = w[:, 0, :]
    # the window is [x_{t-3}, x_{t-2}, x_{t-1}, x_t] and w[:, 3] multiplies the newest input
    torch.testing.assert_close(ys[0], silu(wd[:, 3] * xs[0, 0]))
    torch.testing.assert_close(ys[1], silu(wd[:, 2] * xs[0, 0] + wd[:, 3] * xs[1, 0]))
    torch.testing.assert_close(ys[2], silu(wd[:, 1] * xs[0, 0] + wd[:, 2] * xs[1, 0] + wd[:, 3] * xs[2, 0]))
    assert torch.equal(state[0], torch.stack([xs[0, 0], xs[1, 0], xs[2, 0]], -1))  # the last W-1 inputs


def test_state_layout_is_head_key_value():
    """From a zero state one step gives S = beta * k v^T, stored [B, H, K, V] (row = key index)."""
    seq, w = random_inputs(2, T=1, B=1)
    st = new_state(1)
    step({k: v[0] for k, v in seq.items()}, st, w, 1)
    silu = torch.nn.functional.silu
    k = silu(w["wk"][:, 0, 3] * seq["k"][0, 0]).view(H, D)
    k = k / torch.sqrt((k ** 2).sum(-1, keepdim=True) + 1e-6)
    v = silu(w["wv"][:, 0, 3] * seq["v"][0, 0]).view(H, D)
    beta = torch.sigmoid(seq["beta"][0, 0])
    want = beta[:, None, None] * k[:, :, None] * v[:, None, :]
    torch.testing.assert_close(st["S"][0], want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(st["S"][0], want.transpose(-1, -2), rtol=1e-3, atol=1e-4)


def test_model_kda_layer_over_a_sequence(model_f32, mini_config_dict, mini_tensors):
    """The loaded model's KDA layer 1 (projections, conv state, recurrence, gated norm, o_proj) over 12
    tokens, batch 1 then batch 2 (row 0 one token ahead), against the float64 reference layer."""
    layer = model_f32.layers[1].self_attn
    assert isinstance(layer, KDAAttention)
    state = model_f32.new_state(2, 4).layers[1]
    assert isinstance(state, KDAState)
    assert state.conv_q.shape == (2, 1024, 3) and state.recurrent.shape == (2, 8, 128, 128)
    assert state.recurrent.dtype == torch.float32
    ref = Reference(mini_config_dict, mini_tensors)
    rst = [ref._new_seq()[1] for _ in range(2)]
    g = torch.Generator().manual_seed(3)
    for t in range(12):
        B = 1 if t == 0 else 2
        x = torch.randn(B, 256, generator=g)
        with torch.no_grad():
            y = layer(x, state, B)
        for b in range(B):
            want = ref.kda(1, x[b].double(), rst[b])
            assert rel_err(y[b], want) < 2e-5, (t, b, rel_err(y[b], want))
    for b in range(2):
        assert rel_err(state.recurrent[b], rst[b]["S"]) < 2e-5
