"""K3Config: the presets against k3-architecture.md §1.2 / §4, the released config.json layout of §6
(1-based layer lists inside linear_attn_config), JSON round trips, errors that name the field, and
the TP divisibility check."""

import copy
import dataclasses
import json

import pytest

from k3compile.models import ConfigError, K3Config, k3_mini, k3_slice, kimi_k3

KIMI_FULL_ATTN_1B = [4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 68, 72, 76, 80, 84, 88, 92, 93]


def released_config_dict() -> dict:
    """config.json as released (§6), typed in from the document, with no k3compile extension."""
    return copy.deepcopy({
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "tie_word_embeddings": False,
        "media_placeholder_token_id": 163605,
        "text_config": {
            "model_type": "kimi_linear", "hidden_size": 7168, "num_hidden_layers": 93, "vocab_size": 163840,
            "rms_norm_eps": 1e-5, "hidden_act": "situ", "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0, "intermediate_size": 33792, "first_k_dense_replace": 1,
            "moe_layer_freq": 1, "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536,
            "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "mla_use_nope": True, "mla_use_output_gate": True,
            "linear_attn_config": {
                "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
                "gate_lower_bound": -5.0, "full_attn_layers": KIMI_FULL_ATTN_1B,
                "kda_layers": [i for i in range(1, 94) if i not in KIMI_FULL_ATTN_1B],
            },
            "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
            "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
            "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc", "use_grouped_topk": True,
            "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 1.0,
            "attn_res_block_size": 12, "num_nextn_predict_layers": 0, "max_position_embeddings": 1048576,
        },
        "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"},
    })


def semantic_fields(cfg: K3Config) -> dict:
    d = dataclasses.asdict(cfg)
    for k in ("extra_top_level", "name", "a_log_padded_size"):
        d.pop(k)
    return d


def test_kimi_k3_matches_the_released_config():
    c = kimi_k3()
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size, c.rms_norm_eps) == (7168, 93, 163840, 1e-5)
    assert (c.intermediate_size, c.first_k_dense_replace, c.moe_layer_freq) == (33792, 1, 1)
    assert (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (96, 1536, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.qk_head_dim) == (128, 64, 128, 192)
    assert c.mla_scale == pytest.approx(192 ** -0.5)
    assert (c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size, c.gate_lower_bound) == (96, 128, 4, -5.0)
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts) == (896, 16, 2)
    assert (c.moe_intermediate_size, c.routed_expert_hidden_size, c.shared_intermediate_size) == (3072, 3584, 6144)
    assert (c.routed_scaling_factor, c.attn_res_block_size) == (1.0, 12)
    assert (c.activation_situ_beta, c.activation_situ_linear_beta) == (4.0, 25.0)
    assert list(c.full_attn_layers) == KIMI_FULL_ATTN_1B and len(c.kda_layers) == 69
    assert [i for i in range(93) if c.is_block_write_layer(i)] == [0, 12, 24, 36, 48, 60, 72, 84]
    assert not c.is_moe_layer(0) and all(c.is_moe_layer(i) for i in range(1, 93))
    assert semantic_fields(K3Config.from_dict(released_config_dict())) == semantic_fields(c)


def test_k3_mini_values():
    c = k3_mini()
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size, c.rms_norm_eps) == (256, 13, 1024, 1e-5)
    assert c.full_attn_layers == (4, 8, 12, 13)
    assert c.layer_types == ["kda", "kda", "kda", "mla"] * 3 + ["mla"]
    assert (c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size, c.gate_lower_bound) == (8, 128, 4, -5.0)
    assert (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (8, 128, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (128, 64, 128)
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts) == (16, 4, 2)
    assert (c.moe_intermediate_size, c.routed_expert_hidden_size, c.intermediate_size) == (256, 128, 1024)
    assert c.attn_res_block_size == 3
    assert [i for i in range(13) if c.is_block_write_layer(i)] == [0, 3, 6, 9, 12]
    assert c.valid_tp_sizes() == [1, 2, 4, 8]


def test_k3_slice():
    s = k3_slice(8)
    assert s.num_hidden_layers == 8 and s.hidden_size == 7168
    assert [i for i in range(8) if s.is_mla_layer(i)] == [3, 7]
    full = k3_slice(93)
    assert semantic_fields(full) == semantic_fields(kimi_k3())
    for bad in (0, 94):
        with pytest.raises(ConfigError):
            k3_slice(bad)


@pytest.mark.parametrize("make", [kimi_k3, k3_mini, lambda: k3_slice(5)])
def test_dict_and_json_round_trip(make, tmp_path):
    c = make()
    assert K3Config.from_dict(c.to_dict()) == c
    c.save(tmp_path / "config.json")
    for p in (tmp_path / "config.json", tmp_path):  # a file or the checkpoint folder
        c2 = K3Config.from_json(p)
        assert c2 == c and c2.a_log_padded_size == c.a_log_padded_size
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["model_type"] == "kimi_k3" and d["text_config"]["model_type"] == "kimi_linear"
    la = d["text_config"]["linear_attn_config"]
    assert la["full_attn_layers"] == list(c.full_attn_layers)  # 1-based, inside linear_attn_config


def test_unknown_top_level_fields_survive_a_round_trip():
    d = released_config_dict()
    d["bos_token_id"] = 163584
    c = K3Config.from_dict(d)
    assert c.to_dict()["bos_token_id"] == 163584


def test_quantization_config_inside_text_config_is_read():
    d = released_config_dict()
    d["text_config"]["quantization_config"] = {"format": "nvfp4-pack-quantized"}
    with pytest.raises(ConfigError, match="nvfp4"):
        K3Config.from_dict(d)
    d = released_config_dict()
    d["quantization_config"]["format"] = "int4"
    with pytest.raises(ConfigError, match="int4"):
        K3Config.from_dict(d)


def test_layer_lists_are_one_based():
    d = released_config_dict()
    d["text_config"]["num_hidden_layers"] = 5
    d["text_config"]["linear_attn_config"]["full_attn_layers"] = [1, 5]
    d["text_config"]["linear_attn_config"]["kda_layers"] = [2, 3, 4]
    c = K3Config.from_dict(d)
    assert c.layer_types == ["mla", "kda", "kda", "kda", "mla"]
    # A 0-based reading would have index 5 out of range and 0 missing.
    d["text_config"]["linear_attn_config"]["full_attn_layers"] = [0, 4]
    d["text_config"]["linear_attn_config"]["kda_layers"] = [1, 2, 3]
    with pytest.raises(ConfigError, match="1-based"):
        K3Config.from_dict(d)


def test_overlapping_layer_lists_rejected():
    d = released_config_dict()
    d["text_config"]["linear_attn_config"]["kda_layers"].append(4)
    with pytest.raises(ConfigError, match="overlap"):
        K3Config.from_dict(d)


def _drop(d, path):
    *parents, last = path.split(".")
    for p in parents:
        d = d[p]
    del d[last]


def _set(d, path, value):
    *parents, last = path.split(".")
    for p in parents:
        d = d[p]
    d[last] = value


@pytest.mark.parametrize("field", [
    "text_config.linear_attn_config.kda_layers",
    "text_config.linear_attn_config.full_attn_layers",
    "text_config.linear_attn_config.num_heads",
    "text_config.hidden_size",
    "text_config.kv_lora_rank",
    "text_config.routed_expert_hidden_size",
    "text_config.attn_res_block_size",
    "text_config.linear_attn_config",
])
def test_missing_field_is_named(field):
    d = copy.deepcopy(released_config_dict())
    _drop(d, field)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        K3Config.from_dict(d)


@pytest.mark.parametrize("field, value", [
    ("text_config.hidden_size", "7168"),
    ("text_config.hidden_size", True),
    ("text_config.num_experts", 896.5),
    ("text_config.rms_norm_eps", "1e-5"),
    ("text_config.linear_attn_config.kda_layers", "1,2,3"),
    ("text_config.linear_attn_config.head_dim", [128]),
])
def test_wrong_type_is_named(field, value):
    d = copy.deepcopy(released_config_dict())
    _set(d, field, value)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        K3Config.from_dict(d)


def test_non_integer_layer_entries_named():
    d = released_config_dict()
    d["text_config"]["linear_attn_config"]["full_attn_layers"][0] = "4"
    with pytest.raises(ConfigError, match="full_attn_layers"):
        K3Config.from_dict(d)


def test_structural_errors():
    with pytest.raises(ConfigError, match="text_config"):
        K3Config.from_dict({"hidden_size": 7168})
    d = released_config_dict()
    d["text_config"]["mla_use_nope"] = False
    with pytest.raises(ConfigError, match="RoPE"):
        K3Config.from_dict(d)
    d = released_config_dict()
    d["text_config"]["hidden_act"] = "silu"
    with pytest.raises(ConfigError, match="hidden_act"):
        K3Config.from_dict(d)
    d = released_config_dict()
    d["text_config"]["num_experts_per_token"] = 1000
    with pytest.raises(ConfigError, match="num_experts"):
        K3Config.from_dict(d)


def test_from_json_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        K3Config.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        K3Config.from_json(tmp_path)


def test_check_tp():
    assert kimi_k3().valid_tp_sizes() == [1, 2, 4, 8, 16]
    mini = k3_mini()
    for t in (1, 2, 4, 8):
        mini.check_tp(t)
    with pytest.raises(ConfigError, match=r"tp_size=3 does not divide linear_attn_config\.num_heads"):
        mini.check_tp(3)
    with pytest.raises(ConfigError, match="tp_size=16"):  # 8 KDA heads
        mini.check_tp(16)
    with pytest.raises(ConfigError):
        mini.check_tp(0)
    # 256-wide routed experts: TP 16 would leave 16 columns, less than one MXFP4 group of 32.
    wide_heads = mini.replace(kda_num_heads=16, num_attention_heads=16, num_key_value_heads=16)
    with pytest.raises(ConfigError, match="MXFP4"):
        wide_heads.check_tp(16)
