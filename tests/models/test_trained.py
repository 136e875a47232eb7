"""The committed trained checkpoint (issue #8, ``checkpoints/k3_mini_text``) and the training code behind it.

* it loads through ``load_pretrained`` in the released format and keeps every K3 quirk;
* on a fixed held-out sample of standard-library source (``heldout_sample.txt``, files never trained on)
  its loss through ``model.decode`` is below the best unigram model of that very sample by a margin,
  while the random-weight model's is above it (the training really happened);
* its expert load on that text is measurably non-uniform, unlike the random-weight model's;
* the training forward is the decode step's math, QAT included, and reaches every weight;
* ``save_checkpoint`` writes back exactly what ``load_pretrained`` read.
"""

from __future__ import annotations

import os
import struct
import zlib

import pytest
import torch

from k3compile.models import (K3Model, k3_mini_text, load_pretrained, save_checkpoint, save_random_checkpoint,
                              tensor_specs, trained_checkpoint)
from k3compile.models import train as T

SEQ = 128  # bytes per held-out sequence (as in the report)
N_SEQ = 16  # held-out sequences decoded per model (2048 predicted bytes)
# Stated margin: nats/byte below the held-out sample's own unigram entropy (the lowest loss any unigram model
# can get on it). Measured at commit: entropy 3.13, trained 1.78 (margin 1.36); random weights 5.94.
LOSS_MARGIN = 1.0
# Mean per-layer CV of the expert load that separates the trained model from random weights (see
# test_expert_load_is_non_uniform_and_differs_from_random_weights).
LOAD_CV_SPLIT = 0.35


def _sample_chunks() -> list[list[int]]:
    with open(T.heldout_sample_path(), "rb") as fh:
        chunks = T.split_chunks(fh.read(), SEQ)
    assert len(chunks) >= N_SEQ
    return chunks[:N_SEQ]


@pytest.fixture(scope="module")
def trained() -> K3Model:
    return load_pretrained(trained_checkpoint())


@pytest.fixture(scope="module")
def trained_eval(trained):
    return T.decode_with_expert_load(trained, _sample_chunks())


@pytest.fixture(scope="module")
def random_eval(tmp_path_factory):
    path = save_random_checkpoint(str(tmp_path_factory.mktemp("k3_mini_text_random")), k3_mini_text(), seed=0)
    return T.decode_with_expert_load(load_pretrained(path), _sample_chunks())


def test_committed_checkpoint_loads_in_released_format_with_every_quirk(trained):
    from safetensors import safe_open

    path = trained_checkpoint()
    cfg = trained.config
    assert cfg == k3_mini_text() and cfg.validate() is cfg
    assert cfg.layer_types == ["kda", "kda", "kda", "mla", "mla"]  # K3's K K K M M tail
    assert [l.is_moe for l in trained.layers] == [False, True, True, True, True]  # dense layer 0
    assert [l.is_block_write for l in trained.layers] == [True, False, True, False, True]
    assert cfg.num_experts_per_token < cfg.num_experts and cfg.num_shared_experts == 2 and cfg.latent_moe_use_norm
    assert cfg.kda_head_dim == 128 and cfg.kv_lora_rank + cfg.qk_rope_head_dim == 576 and cfg.hidden_size == 256
    size = os.path.getsize(os.path.join(path, "model.safetensors"))
    assert size < 10 * 2 ** 20, size  # small enough to commit
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as fh:
        names = set(fh.keys())
        specs = list(tensor_specs(cfg))
        assert names == {s.name for s in specs}
        for s in specs:
            sl = fh.get_slice(s.name)
            assert tuple(sl.get_shape()) == s.shape
            assert sl.get_dtype() == {torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8"}[s.dtype]
    # The selection bias was moved by the balancing rule (random init: 0.05 * randn).
    bias = torch.stack([l.block_sparse_moe.gate.e_score_correction_bias for l in trained.layers if l.is_moe])
    assert float(bias.abs().max()) > 0.2


def test_heldout_loss_is_below_the_unigram_baseline_by_a_margin(trained_eval, random_eval):
    """Nats per byte through ``model.decode`` (bf16, as loaded) on 16 x 128 held-out bytes. The baseline is
    the sample's own byte entropy, i.e. the best possible unigram model *fitted on the test bytes*
    (stricter than a unigram fitted on the training files)."""
    chunks = _sample_chunks()
    unigram = T.empirical_entropy(chunks)
    nll_trained = trained_eval[0]
    nll_random = random_eval[0]
    assert 2.5 < unigram < 4.0, unigram  # it is source text, not something degenerate
    assert nll_trained < unigram - LOSS_MARGIN, (nll_trained, unigram)
    assert nll_random > unigram, (nll_random, unigram)  # random weights know nothing: worse than unigram


def test_expert_load_is_non_uniform_and_differs_from_random_weights(trained_eval, random_eval):
    """Statistic: the coefficient of variation (std / mean) of the per-expert token counts of each MoE layer
    over the held-out sample (16 x 128 tokens x top-4 = 8192 routed slots per layer).

    * Non-uniform: every layer's CV is above 2.5x the CV that uniformly random routing would show with this
      many slots, sqrt((E - 1) / slots) = 0.043 (measured at commit: 0.17-0.23).
    * Learned hot experts: the trained router's own top-4 (the same hidden states, selection bias off) is
      far more skewed, mean CV > 0.4 (measured 0.6); the bias learned by the aux-loss-free rule flattens
      it by more than 2x.
    * Differs from random weights, in the direction measured (the issue expected random routing to be the
      uniform one; with this project's random init it is not): random weights route by a component their
      hidden states share, so their load is skewed, mean CV > 0.35 (measured 0.49), and their small random
      bias does not balance it; the trained model's mean CV is below 0.35 (measured 0.21).
    """
    _, counts, preferred = trained_eval
    _, r_counts, r_preferred = random_eval
    load, pref, r_load, r_pref = (c.sum(1) for c in (counts, preferred, r_counts, r_preferred))
    slots = int(load[0].sum())
    assert slots == N_SEQ * SEQ * 4 and bool((load.sum(-1) == slots).all())
    noise = ((load.shape[-1] - 1) / slots) ** 0.5
    cv, pref_cv, r_cv, r_pref_cv = (T.load_cv(c) for c in (load, pref, r_load, r_pref))
    assert bool((cv > 2.5 * noise).all()), (cv.tolist(), noise)
    assert float(pref_cv.mean()) > 0.4 and float(pref_cv.mean()) > 2 * float(cv.mean()), (pref_cv.tolist(), cv.tolist())
    assert float(cv.mean()) < LOAD_CV_SPLIT < float(r_cv.mean()), (cv.tolist(), r_cv.tolist())
    assert float(r_pref_cv.mean()) > LOAD_CV_SPLIT  # random: not a bias-balanced router


def test_training_forward_is_the_decode_step(trained):
    """``train.forward_sequence`` (all positions at once; KDA through ``ops.kda_decode`` step by step, MLA
    causal) gives the logits of token-by-token ``model.decode``, with the packed experts and with the QAT
    path (fp32 masters fake-quantised to MXFP4: the masters read back from the checkpoint re-quantise to
    the same codes)."""
    model = load_pretrained(trained_checkpoint(), dtype=torch.float32)
    chunks = _sample_chunks()[:3]
    toks = torch.tensor([c[:40] for c in chunks])
    state = model.new_state(3, 40)
    with torch.no_grad():
        ref = torch.stack([model.decode(toks[:, t], state) for t in range(40)], 1)
        packed, routes = T.forward_sequence(model, toks)
        trainable = T.Trainable(model)
        qat, _ = T.forward_sequence(model, toks, trainable.masters)
    scale = float(ref.abs().max())
    assert float((packed - ref).abs().max()) < 1e-4 * scale
    assert float((qat - ref).abs().max()) < 1e-4 * scale
    assert sorted(routes) == [1, 2, 3, 4] and routes[1].shape == (3 * 40, model.config.num_experts_per_token)


def test_training_step_reaches_every_weight_and_balancing_moves_the_bias(tmp_path):
    """One QAT step on a random model: every trainable tensor (experts through the straight-through
    estimator, router, AttnRes projections, A_log, dt_bias, ...) gets a finite, non-zero gradient; the
    selection bias gets none and is moved by the aux-loss-free rule: down for over-loaded experts, up for
    under-loaded ones."""
    torch.manual_seed(0)
    tr = T.Trainable.from_checkpoint(save_random_checkpoint(str(tmp_path / "r"), k3_mini_text(), seed=1))
    toks = torch.randint(0, 256, (2, 9))
    toks[:, 0] = T.BOS
    logits, routes = T.forward_sequence(tr.model, toks[:, :-1], tr.masters)
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), toks[:, 1:].reshape(-1)).backward()
    named = [(n, p) for n, p in tr.model.named_parameters() if p.requires_grad]
    named += [(f"masters.{i}.{w}", p) for i, m in tr.masters.items() for w, p in m.items()]
    assert len(named) == len(tr.parameters())
    # Layer 0's pre-attention AttnRes read has no sealed block to read yet, so decode (and training) never
    # uses its weights: they are in the checkpoint but get no gradient.
    unread = {"layers.0.self_attention_res_norm.weight", "layers.0.self_attention_res_proj.weight"}
    for name, p in named:
        if name in unread:
            assert p.grad is None, name
        else:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    gates = {i: tr.model.layers[i].block_sparse_moe.gate for i in routes}
    assert all(g.e_score_correction_bias.grad is None and not g.e_score_correction_bias.requires_grad
               for g in gates.values())
    before = {i: g.e_score_correction_bias.clone() for i, g in gates.items()}
    loads = T.update_selection_bias(tr.model, routes, 1e-3)
    for i, g in gates.items():
        delta = g.e_score_correction_bias - before[i]
        over, under = loads[i] > loads[i].mean(), loads[i] < loads[i].mean()
        assert torch.allclose(delta[over], torch.full_like(delta[over], -1e-3))
        assert torch.allclose(delta[under], torch.full_like(delta[under], 1e-3))


def test_save_checkpoint_writes_back_what_was_loaded(tmp_path, trained, model_bf16, mini_tensors):
    """``save_checkpoint`` of a loaded model reproduces the files bit for bit: the trained checkpoint, and
    the random k3-mini one (whose A_log is stored padded: the zero padding comes back)."""
    from safetensors.torch import load_file

    for model, ref in ((trained, load_file(os.path.join(trained_checkpoint(), "model.safetensors"))),
                       (model_bf16, mini_tensors)):
        out = tmp_path / model.config.name
        save_checkpoint(model, out)
        got = load_file(os.path.join(out, "model.safetensors"))
        assert got.keys() == ref.keys()
        for name, t in ref.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        assert type(model.config).from_json(out) == model.config


def test_expert_load_plot_is_a_valid_png():
    """docs/expert_load.png (written by the project's own zlib PNG writer): signature, chunk CRCs, and
    pixel data of the size its header states."""
    root = os.path.dirname(os.path.dirname(trained_checkpoint()))
    with open(os.path.join(root, "docs", "expert_load.png"), "rb") as fh:
        data = fh.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0] == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + n
    w, h, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 2) and w > 300 and h > 200
    assert len(zlib.decompress(chunks[b"IDAT"])) == h * (1 + 3 * w)
