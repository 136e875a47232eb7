"""Checkpoints in the released format (k3-architecture.md §7): the random writer's layout, the
loader's mapping of every tensor into the model, sharded files, the vLLM name alias, and errors that
name the offending tensor or config field."""

import json
import os

import pytest
import torch
from k3ref import dequant_mxfp4, rewrite_safetensors as rewrite, run_model
from safetensors.torch import load_file

from k3compile.models import (CheckpointError, ConfigError, k3_mini, load_pretrained, mxfp4,
                              save_random_checkpoint)

P = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
H_KDA = 8


def model_key(name: str):
    """Checkpoint name -> (model state key, expert index or None), written from §7 independently."""
    if name == LM_HEAD:
        return "lm_head.weight", None
    assert name.startswith(P), name
    rel = name[len(P):]
    if ".experts." in rel:
        head, tail = rel.split(".experts.")
        e, w, kind = tail.split(".")
        return f"{head}.experts_{w}_{kind.replace('weight_', '')}", int(e)
    return rel, None


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_random_checkpoint_layout(mini_tensors, mini_config_dict):
    t = mini_tensors
    # 5 model-level; per layer 6 common; KDA 14, MLA 8; dense layer 0: 3; MoE 8 + 16 experts x 3 x 2
    n_kda, n_mla = 9, 4
    expected = 5 + 13 * 6 + n_kda * 14 + n_mla * 8 + 3 + 12 * (8 + 16 * 6)
    assert len(t) == expected
    for name, x in t.items():
        if name.endswith(("A_log", "dt_bias", "e_score_correction_bias")):
            assert x.dtype == torch.float32, name
        elif ".experts." in name:
            assert x.dtype == torch.uint8, name
        else:
            assert x.dtype == torch.bfloat16, name
    L = P + "layers.1."
    assert t[L + "self_attn.A_log"].shape == (16,)  # stored padded, like K3's 96 -> 128
    assert torch.all(t[L + "self_attn.A_log"][H_KDA:] == 0) and torch.all(t[L + "self_attn.A_log"][:H_KDA] != 0)
    assert t[L + "self_attn.dt_bias"].shape == (H_KDA * 128,)
    assert t[L + "self_attn.q_conv1d.weight"].shape == (1024, 1, 4)
    assert t[L + "self_attn.b_proj.weight"].shape == (H_KDA, 256)
    assert t[L + "self_attn.o_norm.weight"].shape == (128,)
    assert t[L + "block_sparse_moe.experts.15.w1.weight_packed"].shape == (256, 64)
    assert t[L + "block_sparse_moe.experts.15.w1.weight_scale"].shape == (256, 4)
    assert t[L + "block_sparse_moe.experts.15.w2.weight_packed"].shape == (128, 128)
    assert t[L + "block_sparse_moe.experts.15.w2.weight_scale"].shape == (128, 8)
    M = P + "layers.12."
    assert t[M + "self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 256)
    assert t[M + "self_attn.kv_b_proj.weight"].shape == (8 * 256, 512)
    assert t[M + "self_attn.q_b_proj.weight"].shape == (8 * 192, 128)
    assert P + "layers.0.mlp.gate_proj.weight" in t and P + "layers.0.block_sparse_moe.gate.weight" not in t
    assert t[LM_HEAD].shape == (1024, 256) and not torch.equal(t[LM_HEAD], t[P + "embed_tokens.weight"])
    assert mini_config_dict["text_config"]["linear_attn_config"]["full_attn_layers"] == [4, 8, 12, 13]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_model_tensor_equals_the_checkpoint(dtype, mini_tensors, model_bf16, model_f32):
    model = model_bf16 if dtype == torch.bfloat16 else model_f32
    state = model.state_dict()
    covered: dict = {}
    for name, x in mini_tensors.items():
        key, e = model_key(name)
        dst = state[key] if e is None else state[key][e]
        if name.endswith("A_log"):
            x = x[:H_KDA]  # only the real heads
        if x.dtype == torch.uint8:
            assert dst.dtype == torch.uint8 and torch.equal(dst, x), name
        else:
            want_dtype = torch.float32 if x.dtype == torch.float32 else dtype
            assert dst.dtype == want_dtype, name
            assert torch.equal(dst, x.to(dtype=want_dtype)), name
        covered.setdefault(key, set()).add(e)
    # every model tensor (every expert slot of the stacked ones) came from the checkpoint
    assert covered.keys() == state.keys()
    for key, es in covered.items():
        if None not in es:
            assert es == set(range(state[key].shape[0])), key
    # the stacked experts dequantize to what the independent decoder reads from the file
    lay = model.layers[5].block_sparse_moe
    for e in (0, 7, 15):
        for w in ("w1", "w2", "w3"):
            b = f"{P}layers.5.block_sparse_moe.experts.{e}.{w}."
            got = mxfp4.dequantize(getattr(lay, f"experts_{w}_packed")[e], getattr(lay, f"experts_{w}_scale")[e],
                                   torch.float64)
            assert torch.equal(got, dequant_mxfp4(mini_tensors[b + "weight_packed"], mini_tensors[b + "weight_scale"]))


def test_sharded_save_loads_identically(tmp_path, mini_tensors, model_bf16):
    path = str(tmp_path / "sharded")
    limit = 4 << 20
    save_random_checkpoint(path, k3_mini(), seed=0, max_shard_bytes=limit)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert "model.safetensors" not in files and len(files) > 3
    with open(os.path.join(path, "model.safetensors.index.json")) as fh:
        index = json.load(fh)
    assert set(index["weight_map"]) == set(mini_tensors)
    assert set(index["weight_map"].values()) == set(files)
    total = 0
    for f in files:
        part = load_file(os.path.join(path, f))
        size = sum(x.numel() * x.element_size() for x in part.values())
        assert size <= limit, f
        total += size
        for name, x in part.items():
            assert index["weight_map"][name] == f
            assert torch.equal(x, mini_tensors[name]), name  # same seed -> same values
    assert index["metadata"]["total_size"] == total
    assert_same_state(load_pretrained(path), model_bf16)


def test_different_seed_gives_different_weights(tmp_path, mini_tensors):
    path = str(tmp_path / "seed1")
    save_random_checkpoint(path, k3_mini(), seed=1)
    other = load_file(os.path.join(path, "model.safetensors"))
    name = P + "layers.2.self_attn.q_proj.weight"
    assert other.keys() == mini_tensors.keys() and not torch.equal(other[name], mini_tensors[name])


def test_vllm_layer_alias_and_ignored_vision_tensors_load(ckpt_copy, model_bf16):
    def edit(t):
        out = {k.replace("language_model.model.layers.", "language_model.layers."): v for k, v in t.items()}
        out["vision_tower.patch_embed.weight"] = torch.zeros(4, 4)
        out["mm_projector.proj.weight"] = torch.zeros(2)
        return out

    rewrite(ckpt_copy, edit)
    assert_same_state(load_pretrained(ckpt_copy), model_bf16)


@pytest.mark.parametrize("victim", [
    P + "layers.5.self_attn.dt_bias",
    P + "layers.7.self_attn.kv_b_proj.weight",
    P + "layers.9.block_sparse_moe.experts.3.w2.weight_scale",
    P + "output_attn_res_proj.weight",
    LM_HEAD,
])
def test_missing_tensor_is_named(ckpt_copy, victim):
    rewrite(ckpt_copy, lambda t: {k: v for k, v in t.items() if k != victim})
    with pytest.raises(CheckpointError, match="missing tensor '" + victim.replace(".", r"\.") + "'"):
        load_pretrained(ckpt_copy)


@pytest.mark.parametrize("victim, shape", [
    (P + "layers.2.self_attn.q_proj.weight", (1024, 255)),
    (P + "layers.3.self_attn.kv_a_proj_with_mqa.weight", (512, 256)),
    (P + "layers.4.block_sparse_moe.experts.0.w1.weight_packed", (256, 128)),
    (P + "layers.6.self_attn.A_log", (4,)),  # padding may be there, heads may not be missing
])
def test_wrong_shape_is_named(ckpt_copy, victim, shape):
    def edit(t):
        t[victim] = torch.zeros(shape, dtype=t[victim].dtype)
        return t

    rewrite(ckpt_copy, edit)
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.") + ".*" + str(list(shape)).replace("[", r"\[")):
        load_pretrained(ckpt_copy)


def test_wrong_expert_dtype_is_named(ckpt_copy):
    victim = P + "layers.8.block_sparse_moe.experts.2.w3.weight_packed"

    def edit(t):
        t[victim] = t[victim].to(torch.int16)
        return t

    rewrite(ckpt_copy, edit)
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.") + ".*uint8"):
        load_pretrained(ckpt_copy)


def test_unexpected_tensor_is_named(ckpt_copy):
    extra = P + "layers.13.input_layernorm.weight"

    def edit(t):
        t[extra] = torch.ones(256, dtype=torch.bfloat16)
        return t

    rewrite(ckpt_copy, edit)
    with pytest.raises(CheckpointError, match=extra.replace(".", r"\.")):
        load_pretrained(ckpt_copy)


def test_no_weights_file(tmp_path):
    k3_mini().save(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_pretrained(tmp_path)


def _edit_config(path, edit):
    f = os.path.join(path, "config.json")
    with open(f) as fh:
        d = json.load(fh)
    edit(d)
    with open(f, "w") as fh:
        json.dump(d, fh)


@pytest.mark.parametrize("field, edit", [
    ("text_config.linear_attn_config.kda_layers", lambda d: d["text_config"]["linear_attn_config"].pop("kda_layers")),
    ("text_config.num_experts", lambda d: d["text_config"].pop("num_experts")),
    ("text_config.hidden_size", lambda d: d["text_config"].__setitem__("hidden_size", "256")),
    ("text_config.linear_attn_config.head_dim",
     lambda d: d["text_config"]["linear_attn_config"].__setitem__("head_dim", None)),
])
def test_config_json_errors_name_the_field(tmp_path, mini_ckpt, field, edit):
    path = tmp_path / "ckpt"
    path.mkdir()
    with open(os.path.join(mini_ckpt, "config.json")) as fh:
        (path / "config.json").write_text(fh.read())
    os.symlink(os.path.join(mini_ckpt, "model.safetensors"), path / "model.safetensors")
    _edit_config(str(path), edit)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_pretrained(path)


def test_released_config_without_padding_hint_loads_padded_a_log(ckpt_copy, model_f32):
    """The released config.json has no field saying A_log is padded (96 heads stored as 128); the
    loader must still accept the padded tensor (and vLLM's old (1, 1, H, 1) form)."""
    _edit_config(ckpt_copy, lambda d: d.pop("k3compile"))
    m = load_pretrained(ckpt_copy, dtype=torch.float32)
    assert m.config.a_log_padded_size == 0
    assert_same_state(m, model_f32)

    def legacy(t):
        for k in list(t):
            if k.endswith("A_log"):
                t[k] = t[k][:H_KDA].reshape(1, 1, H_KDA, 1).contiguous()
        return t

    rewrite(ckpt_copy, legacy)
    assert_same_state(load_pretrained(ckpt_copy, dtype=torch.float32), model_f32)


def test_loaded_model_decodes_like_the_session_model(ckpt_copy, model_f32):
    # a fresh load of the same files is bit-identical in behaviour, not just in weights
    a, _ = run_model(model_f32, [[1, 2], [3, 4]])
    b, _ = run_model(load_pretrained(ckpt_copy, dtype=torch.float32), [[1, 2], [3, 4]])
    assert all(torch.equal(x, y) for x, y in zip(a, b))
