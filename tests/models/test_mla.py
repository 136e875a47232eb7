"""MLA decode (k3-architecture.md §1.13, §1.14, §2): the absorbed latent-cache op and the model's MLA
layer against full causal attention recomputed from scratch in float64 in the non-absorbed form
(k = [W_UK c | k_pe], v = W_UV c per head, scale (nope+rope)^-0.5, no rotation), with rows of
different lengths in one batch."""

import torch
from k3ref import Reference, mla_full_ref, rel_err

from k3compile.models import ops
from k3compile.models.layers import MLAAttention

H, NOPE, ROPE, V, C = 3, 16, 8, 16, 32


def test_mla_decode_matches_full_attention_recomputed():
    g = torch.Generator().manual_seed(0)
    Lmax, B, steps = 24, 2, 18
    kv_b = torch.randn(H * (NOPE + V), C, generator=g) / C ** 0.5
    # garbage beyond each row's length: masking must hide it
    cache = 100 * torch.randn(B, Lmax, C + ROPE, generator=g)
    lengths = torch.zeros(B, dtype=torch.long)
    hist = {0: [], 1: []}
    for t in range(steps):
        rows = 1 if t < 2 else 2  # row 0 runs alone first: two tokens ahead of row 1
        q = torch.randn(rows, H * (NOPE + ROPE), generator=g)
        latent = torch.randn(rows, C + ROPE, generator=g)
        gate = torch.randn(rows, H * V, generator=g)
        out = ops.mla_decode(q, latent, gate, cache[:rows], lengths[:rows], kv_b, NOPE, V, (NOPE + ROPE) ** -0.5)
        assert out.shape == (rows, H * V)
        for b in range(rows):
            hist[b].append(latent[b])
            seen = torch.stack(hist[b])
            want = mla_full_ref(q[b], seen[:, :C], seen[:, C:], gate[b], kv_b, NOPE, V)
            assert rel_err(out[b], want) < 1e-5, (t, b, rel_err(out[b], want))
        cache[torch.arange(rows), lengths[:rows]] = latent  # the layer's job; the op does not write
        lengths[:rows] += 1


def test_mla_scale_is_an_argument_and_used():
    g = torch.Generator().manual_seed(1)
    kv_b = torch.randn(H * (NOPE + V), C, generator=g)
    cache = torch.randn(1, 4, C + ROPE, generator=g)
    q, lat, gate = (torch.randn(1, H * (NOPE + ROPE), generator=g), torch.randn(1, C + ROPE, generator=g),
                    torch.randn(1, H * V, generator=g))
    n = torch.tensor([3])
    a = ops.mla_decode(q, lat, gate, cache, n, kv_b, NOPE, V, 24 ** -0.5)
    b = ops.mla_decode(q, lat, gate, cache, n, kv_b, NOPE, V, 0.5 * 24 ** -0.5)
    assert rel_err(a, b) > 1e-3
    seen = torch.cat([cache[0, :3], lat])
    assert rel_err(b, mla_full_ref(q[0], seen[:, :C], seen[:, C:], gate[0], kv_b, NOPE, V, 0.5 * 24 ** -0.5)) < 1e-5


def test_model_mla_layer_over_a_sequence(model_f32, mini_config_dict, mini_tensors):
    """The loaded model's MLA layer 3 (q_a/q_b, kv_a + norms, latent cache write, absorbed attention,
    output gate, o_proj) over 14 tokens, batch 1 then batch 2, against the non-absorbed float64
    reference recomputed over the whole history at each step."""
    layer = model_f32.layers[3].self_attn
    assert isinstance(layer, MLAAttention)
    st = model_f32.new_state(3, 16)
    cache = st.layers[3]
    assert cache.shape == (3, 16, 576) and cache.dtype == torch.float32
    ref = Reference(mini_config_dict, mini_tensors)
    rst = [ref._new_seq()[3] for _ in range(2)]
    lengths = torch.zeros(3, dtype=torch.long)
    g = torch.Generator().manual_seed(2)
    for t in range(14):
        B = 1 if t == 0 else 2
        x = torch.randn(B, 256, generator=g)
        with torch.no_grad():
            y = layer(x, cache, lengths[:B].clone())
        for b in range(B):
            want = ref.mla(3, x[b].double(), rst[b])
            assert rel_err(y[b], want) < 2e-5, (t, b, rel_err(y[b], want))
        lengths[:B] += 1
        if t == 0:
            assert torch.all(cache[1:] == 0)
    # cache rows hold [kv_a_layernorm(c) | raw k_pe] per position, zero beyond the length, row 2 untouched
    for b, n in ((0, 14), (1, 13)):
        want = torch.cat([torch.stack(rst[b]["c"]), torch.stack(rst[b]["kpe"])], -1)
        assert rel_err(cache[b, :n], want) < 1e-5
        assert torch.all(cache[b, n:] == 0)
    assert torch.all(cache[2] == 0)
