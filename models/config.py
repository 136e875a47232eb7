"""K3Config: the text-model configuration, read from a released-layout ``config.json``.

The file is laid out as Moonshot released it (k3-architecture.md §6): the text model sits under
``text_config``; the layer-type lists live inside ``linear_attn_config`` and are **1-based**;
``quantization_config`` may sit inside ``text_config`` or at the top level.

Presets:
  * :func:`kimi_k3`   - the real model (93 layers, 7168 wide, 896 experts top-16).
  * :func:`k3_mini`   - every K3 quirk at toy size, for tests (k3-architecture.md §4, with expert
                        widths chosen so that TP 1, 2, 4 and 8 keep whole MXFP4 scale groups).
  * :func:`k3_slice`  - the real dimensions, first ``n_layers`` layers (performance work).
"""

from __future__ import annotations


import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

MXFP4_GROUP = 32


class ConfigError(ValueError):
    """A config.json that is missing a field, has a wrong type, or is inconsistent."""


@dataclass(frozen=True)
class K3Config:
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    num_attention_heads: int
    num_key_value_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int
    gate_lower_bound: float
    full_attn_layers: tuple[int, ...]  # 1-based, as in the file
    kda_layers: tuple[int, ...]  # 1-based, as in the file
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int
    routed_scaling_factor: float
    attn_res_block_size: int
    max_position_embeddings: int
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    latent_moe_use_norm: bool = True
    moe_renormalize: bool = True
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    use_full_rank_gate: bool = True
    # A_log is stored padded (K3: 96 heads stored as 128); only the first kda_num_heads are used.
    a_log_padded_size: int = 0
    # Non-semantic top-level fields kept so that a round trip writes them back.
    extra_top_level: dict = field(default_factory=dict, compare=False, repr=False)
    name: str = field(default="custom", compare=False)

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_scale(self) -> float:
        return self.qk_head_dim ** -0.5

    @property
    def kda_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    def is_mla_layer(self, i: int) -> bool:
        """0-based layer index; the lists in the file are 1-based (pitfall 1)."""
        return (i + 1) in self.full_attn_layers

    def is_kda_layer(self, i: int) -> bool:
        return (i + 1) in self.kda_layers

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and (i - self.first_k_dense_replace) % self.moe_layer_freq == 0

    def is_block_write_layer(self, i: int) -> bool:
        return i % self.attn_res_block_size == 0

    @property
    def layer_types(self) -> list[str]:
        return ["mla" if self.is_mla_layer(i) else "kda" for i in range(self.num_hidden_layers)]

    # ------------------------------------------------------------------ validation
    def validate(self) -> "K3Config":
        n = self.num_hidden_layers
        positive = [
            "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_attention_heads",
            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "kda_num_heads", "kda_head_dim",
            "short_conv_kernel_size", "num_experts", "num_experts_per_token", "moe_intermediate_size",
            "routed_expert_hidden_size", "attn_res_block_size", "max_position_embeddings", "moe_layer_freq",
        ]
        for f in positive:
            if getattr(self, f) <= 0:
                raise ConfigError(f"text_config.{f} must be positive, got {getattr(self, f)}")
        layers = set(self.full_attn_layers) | set(self.kda_layers)
        if set(self.full_attn_layers) & set(self.kda_layers):
            raise ConfigError("linear_attn_config.full_attn_layers and kda_layers overlap: "
                              f"{sorted(set(self.full_attn_layers) & set(self.kda_layers))}")
        if layers != set(range(1, n + 1)):
            missing = sorted(set(range(1, n + 1)) - layers)
            bad = sorted(layers - set(range(1, n + 1)))
            raise ConfigError(
                "linear_attn_config.full_attn_layers + kda_layers must cover layers 1..num_hidden_layers "
                f"({n}) exactly once (the lists are 1-based); missing {missing}, out of range {bad}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError("text_config.num_key_value_heads must equal num_attention_heads for K3 MLA")
        if self.num_experts_per_token > self.num_experts:
            raise ConfigError("text_config.num_experts_per_token exceeds num_experts")
        for f in ("routed_expert_hidden_size", "moe_intermediate_size"):
            if getattr(self, f) % MXFP4_GROUP:
                raise ConfigError(f"text_config.{f} ({getattr(self, f)}) must be a multiple of the MXFP4 group "
                                  f"size {MXFP4_GROUP}")
        if not self.mla_use_nope:
            raise ConfigError("text_config.mla_use_nope must be true: K3 MLA has no RoPE")
        if self.a_log_padded_size and self.a_log_padded_size < self.kda_num_heads:
            raise ConfigError("A_log padded size is smaller than linear_attn_config.num_heads")
        return self

    def check_tp(self, tp_size: int) -> None:
        """Raise a clear error if ``tp_size`` does not shard this model evenly."""
        problem = self._tp_problem(tp_size)
        if problem:
            raise ConfigError(f"{problem}; use a tp_size among {self.valid_tp_sizes()}")

    def _tp_problem(self, tp_size: int) -> str | None:
        """Why ``tp_size`` does not shard this model evenly, or None. (Never raises, so that
        ``valid_tp_sizes`` can call it while ``check_tp`` formats its message.)"""
        if tp_size < 1:
            return f"tp_size must be >= 1, got {tp_size}"
        checks = [
            ("linear_attn_config.num_heads (KDA heads)", self.kda_num_heads, 1),
            ("num_attention_heads (MLA heads)", self.num_attention_heads, 1),
            ("intermediate_size (dense MLP)", self.intermediate_size, 1),
            ("num_shared_experts * moe_intermediate_size (shared MLP)", self.shared_intermediate_size, 1),
            ("moe_intermediate_size (routed experts; each shard must hold whole MXFP4 groups of 32)",
             self.moe_intermediate_size, MXFP4_GROUP),
            ("vocab_size (embedding and lm_head are split by vocab)", self.vocab_size, 1),
        ]
        for what, size, unit in checks:
            if size % (tp_size * unit):
                return (f"tp_size={tp_size} does not divide {what}={size}"
                        + (f" into multiples of {unit}" if unit > 1 else ""))
        return None

    def valid_tp_sizes(self, candidates=(1, 2, 4, 8, 16)) -> list[int]:
        return [t for t in candidates if self._tp_problem(t) is None]

    # ------------------------------------------------------------------ json
    def to_dict(self) -> dict[str, Any]:
        text = {
            "model_type": "kimi_linear",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "situ",
            "activation_situ_beta": self.activation_situ_beta,
            "activation_situ_linear_beta": self.activation_situ_linear_beta,
            "intermediate_size": self.intermediate_size,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": self.mla_use_nope,
            "mla_use_output_gate": self.mla_use_output_gate,
            "linear_attn_config": {
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.short_conv_kernel_size,
                "use_full_rank_gate": self.use_full_rank_gate,
                "gate_lower_bound": self.gate_lower_bound,
                "full_attn_layers": list(self.full_attn_layers),
                "kda_layers": list(self.kda_layers),
            },
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "routed_expert_hidden_size": self.routed_expert_hidden_size,
            "latent_moe_use_norm": self.latent_moe_use_norm,
            "moe_router_activation_func": "sigmoid",
            "topk_method": "noaux_tc",
            "use_grouped_topk": True,
            "num_expert_group": 1,
            "topk_group": 1,
            "moe_renormalize": self.moe_renormalize,
            "routed_scaling_factor": self.routed_scaling_factor,
            "attn_res_block_size": self.attn_res_block_size,
            "num_nextn_predict_layers": 0,
            "max_position_embeddings": self.max_position_embeddings,
            "quantization_config": _quantization_config(),
        }
        top = {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "tie_word_embeddings": False,
            "media_placeholder_token_id": 163605,
        }
        top.update(self.extra_top_level)
        top["text_config"] = text
        if self.a_log_padded_size:
            top.setdefault("k3compile", {})["a_log_padded_size"] = self.a_log_padded_size
        return top

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any], name: str = "custom") -> "K3Config":
        if not isinstance(d, dict):
            raise ConfigError("config.json must hold a JSON object")
        if "text_config" not in d:
            raise ConfigError("config.json has no 'text_config': expected the released Kimi K3 layout "
                              "(top-level model_type 'kimi_k3' with the text model under 'text_config')")
        t = d["text_config"]
        la = _req(t, "linear_attn_config", dict, "text_config")

        def g(key, typ, where=t, prefix="text_config"):
            return _req(where, key, typ, prefix)

        if t.get("model_type", "kimi_linear") != "kimi_linear":
            raise ConfigError(f"text_config.model_type must be 'kimi_linear', got {t.get('model_type')!r}")
        act = t.get("hidden_act", "situ")
        if act != "situ":
            raise ConfigError(f"text_config.hidden_act must be 'situ', got {act!r}")
        if t.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ConfigError("text_config.moe_router_activation_func must be 'sigmoid'")
        if t.get("num_expert_group", 1) != 1 or t.get("topk_group", 1) != 1:
            raise ConfigError("text_config.num_expert_group / topk_group other than 1 are not supported")
        q = t.get("quantization_config", d.get("quantization_config"))
        if q is not None and q.get("format", "mxfp4-pack-quantized") != "mxfp4-pack-quantized":
            raise ConfigError(f"quantization_config.format {q.get('format')!r} is not supported; "
                              "expected 'mxfp4-pack-quantized'")
        extra = {k: v for k, v in d.items() if k not in ("text_config", "k3compile")}
        cfg = cls(
            hidden_size=g("hidden_size", int),
            num_hidden_layers=g("num_hidden_layers", int),
            vocab_size=g("vocab_size", int),
            rms_norm_eps=g("rms_norm_eps", float),
            intermediate_size=g("intermediate_size", int),
            first_k_dense_replace=g("first_k_dense_replace", int),
            moe_layer_freq=g("moe_layer_freq", int),
            num_attention_heads=g("num_attention_heads", int),
            num_key_value_heads=g("num_key_value_heads", int),
            q_lora_rank=g("q_lora_rank", int),
            kv_lora_rank=g("kv_lora_rank", int),
            qk_nope_head_dim=g("qk_nope_head_dim", int),
            qk_rope_head_dim=g("qk_rope_head_dim", int),
            v_head_dim=g("v_head_dim", int),
            kda_num_heads=g("num_heads", int, la, "text_config.linear_attn_config"),
            kda_head_dim=g("head_dim", int, la, "text_config.linear_attn_config"),
            short_conv_kernel_size=g("short_conv_kernel_size", int, la, "text_config.linear_attn_config"),
            gate_lower_bound=g("gate_lower_bound", float, la, "text_config.linear_attn_config"),
            full_attn_layers=tuple(g("full_attn_layers", list, la, "text_config.linear_attn_config")),
            kda_layers=tuple(g("kda_layers", list, la, "text_config.linear_attn_config")),
            use_full_rank_gate=bool(la.get("use_full_rank_gate", True)),
            num_experts=g("num_experts", int),
            num_experts_per_token=g("num_experts_per_token", int),
            num_shared_experts=g("num_shared_experts", int),
            moe_intermediate_size=g("moe_intermediate_size", int),
            routed_expert_hidden_size=g("routed_expert_hidden_size", int),
            routed_scaling_factor=g("routed_scaling_factor", float),
            attn_res_block_size=g("attn_res_block_size", int),
            max_position_embeddings=g("max_position_embeddings", int),
            activation_situ_beta=float(t.get("activation_situ_beta", 4.0)),
            activation_situ_linear_beta=float(t.get("activation_situ_linear_beta", 25.0)),
            latent_moe_use_norm=bool(t.get("latent_moe_use_norm", True)),
            moe_renormalize=bool(t.get("moe_renormalize", True)),
            mla_use_nope=bool(t.get("mla_use_nope", True)),
            mla_use_output_gate=bool(t.get("mla_use_output_gate", True)),
            a_log_padded_size=int(d.get("k3compile", {}).get("a_log_padded_size", 0)),
            extra_top_level=extra,
            name=name,
        )
        for lst_name in ("full_attn_layers", "kda_layers"):
            for v in getattr(cfg, lst_name):
                if not isinstance(v, int):
                    raise ConfigError(f"text_config.linear_attn_config.{lst_name} must hold integers, got {v!r}")
        if not cfg.use_full_rank_gate:
            raise ConfigError("text_config.linear_attn_config.use_full_rank_gate must be true for K3")
        return cfg.validate()

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "K3Config":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise ConfigError(f"no config.json at {path}")
        with open(path) as fh:
            try:
                d = json.load(fh)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(d, name=os.path.basename(os.path.dirname(os.path.abspath(path))))

    def replace(self, **kw) -> "K3Config":
        return dataclasses.replace(self, **kw).validate()


def _req(d: dict, key: str, typ: type, prefix: str):
    if key not in d:
        raise ConfigError(f"config.json is missing required field '{prefix}.{key}'")
    v = d[key]
    if typ is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if typ is int and isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise ConfigError(f"config.json field '{prefix}.{key}' must be {typ.__name__}, got {type(v).__name__} {v!r}")
    return v


def _quantization_config() -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "format": "mxfp4-pack-quantized",
                "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group",
                            "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"},
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
                   "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    }


def _schedule(n_layers: int, full_attn_1based: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    full = tuple(sorted(i for i in full_attn_1based if i <= n_layers))
    kda = tuple(i for i in range(1, n_layers + 1) if i not in full)
    return full, kda


KIMI_K3_FULL_ATTN = [4 * k for k in range(1, 24)] + [93]


def kimi_k3() -> K3Config:
    full, kda = _schedule(93, KIMI_K3_FULL_ATTN)
    return K3Config(
        hidden_size=7168, num_hidden_layers=93, vocab_size=163840, rms_norm_eps=1e-5, intermediate_size=33792,
        first_k_dense_replace=1, moe_layer_freq=1, num_attention_heads=96, num_key_value_heads=96,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        kda_num_heads=96, kda_head_dim=128, short_conv_kernel_size=4, gate_lower_bound=-5.0,
        full_attn_layers=full, kda_layers=kda, num_experts=896, num_experts_per_token=16, num_shared_experts=2,
        moe_intermediate_size=3072, routed_expert_hidden_size=3584, routed_scaling_factor=1.0,
        attn_res_block_size=12, max_position_embeddings=1048576, a_log_padded_size=128, name="kimi_k3",
    ).validate()


def k3_mini() -> K3Config:
    """k3-architecture.md §4 k3-mini. Routed-expert width is 256 (not 128) so that every TP shard up to 8
    holds whole MXFP4 groups of 32 along the down-projection's input (256 / 8 = 32)."""
    return K3Config(
        hidden_size=256, num_hidden_layers=13, vocab_size=1024, rms_norm_eps=1e-5, intermediate_size=1024,
        first_k_dense_replace=1, moe_layer_freq=1, num_attention_heads=8, num_key_value_heads=8,
        q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        kda_num_heads=8, kda_head_dim=128, short_conv_kernel_size=4, gate_lower_bound=-5.0,
        full_attn_layers=(4, 8, 12, 13), kda_layers=(1, 2, 3, 5, 6, 7, 9, 10, 11), num_experts=16,
        num_experts_per_token=4, num_shared_experts=2, moe_intermediate_size=256, routed_expert_hidden_size=128,
        routed_scaling_factor=1.0, attn_res_block_size=3, max_position_embeddings=8192, a_log_padded_size=16,
        name="k3_mini",
    ).validate()


def k3_slice(n_layers: int = 8) -> K3Config:
    """True K3 dimensions, first ``n_layers`` layers (the schedule is the real one, truncated)."""
    real = kimi_k3()
    if not 1 <= n_layers <= real.num_hidden_layers:
        raise ConfigError(f"slice n_layers must be in 1..{real.num_hidden_layers}, got {n_layers}")
    full, kda = _schedule(n_layers, list(real.full_attn_layers))
    return dataclasses.replace(real, num_hidden_layers=n_layers, full_attn_layers=full, kda_layers=kda,
                               name=f"slice{n_layers}").validate()


PRESETS = {"kimi_k3": kimi_k3, "k3_mini": k3_mini, "slice": k3_slice}


def get_config(name_or_path: str) -> K3Config:
    """``kimi_k3``, ``k3_mini``, ``slice`` / ``slice:N`` or a path to a config.json / checkpoint folder."""
    if name_or_path.startswith("slice"):
        _, _, n = name_or_path.partition(":")
        return k3_slice(int(n) if n else 8)
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]()
    if os.path.exists(name_or_path):
        return K3Config.from_json(name_or_path)
    raise ConfigError(f"unknown config {name_or_path!r}: use one of kimi_k3, k3_mini, slice[:N] or a path "
                      "to a config.json")


