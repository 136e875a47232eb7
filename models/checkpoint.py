"""Checkpoints in the released format: ``config.json`` + ``*.safetensors`` (one file, or sharded with
``model.safetensors.index.json``) under the ``language_model.`` tensor names of k3-architecture.md §7.

:func:`tensor_specs` is the one table of every tensor a config implies (name, full shape, dtype, how
TP shards it, how a random checkpoint initialises it); both the writer and the loader use it.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass
from typing import Iterator

import torch

from . import mxfp4
from .config import K3Config
from .model import K3Model
from .tp import TPInfo

PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
INDEX = "model.safetensors.index.json"
IGNORED_PREFIXES = ("vision_tower.", "mm_projector.", "language_model.vision_tower.", "language_model.mm_projector.")


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, has the wrong shape or dtype, or is not expected."""


@dataclass(frozen=True)
class Spec:
    name: str  # checkpoint name
    shape: tuple[int, ...]  # full (unsharded) shape
    dtype: torch.dtype  # dtype in the checkpoint
    shard_dim: int | None  # TP: the dim split across ranks (None = replicated)
    init: str  # random init: "normal:<std>", "norm", "alog", "dtbias", "bias", "mxfp4:<std>"


def _layer_specs(cfg: K3Config, i: int) -> Iterator[Spec]:
    bf, f32, u8 = torch.bfloat16, torch.float32, torch.uint8
    hid = cfg.hidden_size
    p = f"{PREFIX}layers.{i}."
    lin = lambda n, o, k, dim=None, scale=1.0: Spec(p + n, (o, k), bf, dim, f"normal:{scale / math.sqrt(k)}")
    norm = lambda n, d: Spec(p + n, (d,), bf, None, "norm")
    for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
        yield norm(n + ".weight", hid)
    yield lin("self_attention_res_proj.weight", 1, hid)
    yield lin("mlp_res_proj.weight", 1, hid)
    if cfg.is_mla_layer(i):
        H = cfg.num_attention_heads
        yield lin("self_attn.q_a_proj.weight", cfg.q_lora_rank, hid)
        yield norm("self_attn.q_a_layernorm.weight", cfg.q_lora_rank)
        yield lin("self_attn.q_b_proj.weight", H * cfg.qk_head_dim, cfg.q_lora_rank, 0)
        yield lin("self_attn.kv_a_proj_with_mqa.weight", cfg.kv_lora_rank + cfg.qk_rope_head_dim, hid)
        yield norm("self_attn.kv_a_layernorm.weight", cfg.kv_lora_rank)
        yield lin("self_attn.kv_b_proj.weight", H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, 0)
        yield lin("self_attn.g_proj.weight", H * cfg.v_head_dim, hid, 0)
        yield lin("self_attn.o_proj.weight", hid, H * cfg.v_head_dim, 1, 0.5)
    else:
        H, D = cfg.kda_num_heads, cfg.kda_head_dim
        for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
            yield lin(f"self_attn.{n}.weight", H * D, hid, 0)
        yield lin("self_attn.o_proj.weight", hid, H * D, 1, 0.5)
        yield lin("self_attn.f_a_proj.weight", D, hid)
        yield lin("self_attn.f_b_proj.weight", H * D, D, 0)
        yield lin("self_attn.b_proj.weight", H, hid, 0)
        for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
            yield Spec(p + f"self_attn.{n}.weight", (H * D, 1, cfg.short_conv_kernel_size), bf, 0, "normal:0.5")
        yield Spec(p + "self_attn.A_log", (cfg.a_log_padded_size or H,), f32, 0, "alog")
        yield Spec(p + "self_attn.dt_bias", (H * D,), f32, 0, "dtbias")
        yield norm("self_attn.o_norm.weight", D)
    if cfg.is_moe_layer(i):
        m = "block_sparse_moe."
        E, L, I, S = (cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size,
                      cfg.shared_intermediate_size)
        yield Spec(p + m + "gate.weight", (E, hid), bf, None, f"normal:{1 / math.sqrt(hid)}")
        yield Spec(p + m + "gate.e_score_correction_bias", (E,), f32, None, "bias")
        yield lin(m + "routed_expert_down_proj.weight", L, hid)
        yield norm(m + "routed_expert_norm.weight", L)
        yield lin(m + "routed_expert_up_proj.weight", hid, L, None, 0.5)
        yield lin(m + "shared_experts.gate_proj.weight", S, hid, 0)
        yield lin(m + "shared_experts.up_proj.weight", S, hid, 0)
        yield lin(m + "shared_experts.down_proj.weight", hid, S, 1, 0.5)
        for e in range(E):
            for w, (o, k, dim) in (("w1", (I, L, 0)), ("w3", (I, L, 0)), ("w2", (L, I, 1))):
                base = p + m + f"experts.{e}.{w}."
                yield Spec(base + "weight_packed", (o, k // 2), u8, dim, f"mxfp4:{1 / math.sqrt(k)}")
                yield Spec(base + "weight_scale", (o, k // mxfp4.GROUP), u8, dim, "mxfp4-scale")
    else:
        W = cfg.intermediate_size
        yield lin("mlp.gate_proj.weight", W, hid, 0)
        yield lin("mlp.up_proj.weight", W, hid, 0)
        yield lin("mlp.down_proj.weight", hid, W, 1, 0.5)


def tensor_specs(cfg: K3Config) -> Iterator[Spec]:
    """Every tensor of the text model, in checkpoint order."""
    bf = torch.bfloat16
    hid = cfg.hidden_size
    yield Spec(PREFIX + "embed_tokens.weight", (cfg.vocab_size, hid), bf, 0, "normal:1.0")
    for i in range(cfg.num_hidden_layers):
        yield from _layer_specs(cfg, i)
    yield Spec(PREFIX + "norm.weight", (hid,), bf, None, "norm")
    yield Spec(PREFIX + "output_attn_res_norm.weight", (hid,), bf, None, "norm")
    yield Spec(PREFIX + "output_attn_res_proj.weight", (1, hid), bf, None, f"normal:{1 / math.sqrt(hid)}")
    yield Spec(LM_HEAD, (cfg.vocab_size, hid), bf, 0, f"normal:{1 / math.sqrt(hid)}")


# ---------------------------------------------------------------------------------------------- writing
def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _random_tensor(spec: Spec, cfg: K3Config, seed: int, cache: dict) -> torch.Tensor:
    kind, _, arg = spec.init.partition(":")
    g = _generator(seed, spec.name)
    if kind == "normal":
        return (torch.randn(spec.shape, generator=g) * float(arg)).to(spec.dtype)
    if kind == "norm":
        return (1.0 + 0.1 * torch.randn(spec.shape, generator=g)).to(spec.dtype)
    if kind == "alog":
        H = cfg.kda_num_heads
        out = torch.zeros(spec.shape, dtype=torch.float32)
        out[:H] = torch.log(torch.empty(H).uniform_(1.0, 16.0, generator=g))  # padding stays exactly 0
        return out
    if kind == "dtbias":
        return -3.0 + 0.5 * torch.randn(spec.shape, generator=g)
    if kind == "bias":
        return 0.05 * torch.randn(spec.shape, generator=g)
    if kind == "mxfp4":
        o, half = spec.shape
        w = torch.randn(o, half * 2, generator=g) * float(arg)
        packed, scale = mxfp4.quantize(w)
        cache[spec.name.replace("weight_packed", "weight_scale")] = scale
        return packed
    if kind == "mxfp4-scale":
        return cache.pop(spec.name)
    raise AssertionError(spec.init)


def save_random_checkpoint(path, config: K3Config, *, seed: int = 0, max_shard_bytes: int = 2 << 30) -> str:
    """Write ``config.json`` and random weights in the released format to ``path``.

    Scales keep activations O(1) through every layer and give non-degenerate routing. Tensors are
    streamed to shards of at most ``max_shard_bytes`` (more than one shard adds
    ``model.safetensors.index.json``). The values depend only on ``seed`` and the tensor name.
    """
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config.save(os.path.join(path, "config.json"))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, cache = 0, {}
    for spec in tensor_specs(config):
        t = _random_tensor(spec, config, seed, cache).contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes and not spec.init.startswith("mxfp4-scale"):
            shards.append({})
            size = 0
        shards[-1][spec.name] = t
        size += nbytes
    n = len(shards)
    if n == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return path
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    with open(os.path.join(path, INDEX), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1)
    return path


def save_checkpoint(model: K3Model, path) -> str:
    """Write ``model`` (unsharded) as ``config.json`` + ``model.safetensors`` in the released format.

    Every tensor of :func:`tensor_specs` is read from the model under its checkpoint name and cast to the
    checkpoint dtype (BF16 weights, F32 ``A_log`` / ``dt_bias`` / ``e_score_correction_bias``, U8 MXFP4
    experts); ``A_log`` gets its zero padding back. :func:`load_pretrained` reads the result.
    """
    from safetensors.torch import save_file

    if model.tp.size != 1:
        raise ValueError("save_checkpoint writes an unsharded model (tp_size 1)")
    config = model.config
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    tensors: dict[str, torch.Tensor] = {}
    for spec in tensor_specs(config):
        key, expert, _ = _model_key(spec.name)
        t = state[key].detach()
        if expert is not None:  # (codes in the checkpoint's layout, should a runtime have relaid them in place)
            t = mxfp4.checkpoint_codes(state[key], expert).detach() if key.endswith("_packed") else t[expert]
        if spec.name.endswith("self_attn.A_log"):
            padded = torch.zeros(spec.shape, dtype=torch.float32)
            padded[: t.numel()] = t.float().cpu()
            t = padded
        if tuple(t.shape) != spec.shape:
            raise CheckpointError(f"model tensor {key} has shape {list(t.shape)}, the checkpoint needs "
                                  f"{list(spec.shape)} for '{spec.name}'")
        tensors[spec.name] = t.to(device="cpu", dtype=spec.dtype).contiguous()
    os.makedirs(path, exist_ok=True)
    config.save(os.path.join(path, "config.json"))
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return os.fspath(path)


# ---------------------------------------------------------------------------------------------- loading
def _canonical(name: str) -> str:
    if name.startswith("language_model.layers."):  # vLLM's hf_to_vllm_mapper alias
        return "language_model.model.layers." + name[len("language_model.layers."):]
    return name


def _open_checkpoint(path: str) -> dict[str, tuple[str, str]]:
    """canonical name -> (file, stored name)."""
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        with open(index) as fh:
            weight_map = json.load(fh)["weight_map"]
        files = {n: os.path.join(path, f) for n, f in weight_map.items()}
    else:
        single = os.path.join(path, "model.safetensors")
        if not os.path.exists(single):
            raise CheckpointError(f"no model.safetensors or {INDEX} in {path}")
        from safetensors import safe_open
        with safe_open(single, "pt") as fh:
            files = {n: single for n in fh.keys()}
    return {_canonical(n): (f, n) for n, f in files.items()}


def _model_key(ckpt_name: str) -> tuple[str, int | None, str | None]:
    """Checkpoint name -> (model state key, expert index or None, expert tensor or None)."""
    if ckpt_name == LM_HEAD:
        return "lm_head.weight", None, None
    rel = ckpt_name[len(PREFIX):]
    if ".block_sparse_moe.experts." in rel:
        head, _, tail = rel.partition(".experts.")
        e, w, kind = tail.split(".")  # "{e}.w1.weight_packed"
        return f"{head}.experts_{w}_{kind.split('_')[1]}", int(e), None
    return rel, None, None


def load_pretrained(path, *, dtype: torch.dtype = torch.bfloat16, device="cpu", tp_rank: int = 0,
                    tp_size: int = 1) -> K3Model:
    """Load ``config.json`` + safetensors from ``path``; a TP model reads only its shard of each tensor."""
    from safetensors import safe_open

    path = os.fspath(path)
    config = K3Config.from_json(path)
    model = K3Model(config, dtype=dtype, device=device, tp_rank=tp_rank, tp_size=tp_size)
    tp = model.tp
    params = dict(model.named_parameters())
    params.update(model.named_buffers())
    stored = _open_checkpoint(path)
    handles: dict[str, object] = {}
    expected = set()
    try:
        for spec in tensor_specs(config):
            expected.add(spec.name)
            if spec.name not in stored:
                raise CheckpointError(f"checkpoint {path} is missing tensor '{spec.name}' "
                                      f"(expected shape {list(spec.shape)}, {spec.dtype})")
            fname, sname = stored[spec.name]
            if fname not in handles:
                handles[fname] = safe_open(fname, "pt", device="cpu")
            sl = handles[fname].get_slice(sname)
            shape = tuple(sl.get_shape())
            if shape != spec.shape and not _a_log_shape_ok(spec, shape, config):
                raise CheckpointError(f"tensor '{spec.name}' has shape {list(shape)} in {os.path.basename(fname)}, "
                                      f"expected {list(spec.shape)} for this config.json")
            if spec.dtype == torch.uint8 and sl.get_dtype() != "U8":
                raise CheckpointError(f"tensor '{spec.name}' must be uint8 (MXFP4 packed codes / E8M0 scales), "
                                      f"got {sl.get_dtype()}")
            key, expert, _ = _model_key(spec.name)
            target = params[key]
            t = _read_shard(sl, spec, config, tp)
            dst = target[expert] if expert is not None else target
            if tuple(t.shape) != tuple(dst.shape):
                raise CheckpointError(f"tensor '{spec.name}': shard shape {list(t.shape)} does not fit the model's "
                                      f"{list(dst.shape)}")
            dst.copy_(t.to(dst.dtype))
    finally:
        handles.clear()
    unexpected = sorted(n for n in stored if n not in expected and not n.startswith(IGNORED_PREFIXES))
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise CheckpointError(f"checkpoint {path} has tensors this config.json does not describe: "
                              f"{unexpected[:5]}{more}; check num_hidden_layers and the layer lists")
    return model.eval()


def _a_log_shape_ok(spec: Spec, shape: tuple, cfg: K3Config) -> bool:
    """A_log may be stored padded ([128] for K3's 96 heads) whatever config.json says: the released
    config has no field for the padding. vLLM also accepts an old (1, 1, H, 1) form (§1.4)."""
    if not spec.name.endswith("self_attn.A_log"):
        return False
    H = cfg.kda_num_heads
    return (len(shape) == 1 and shape[0] >= H) or shape == (1, 1, H, 1)


def _read_shard(sl, spec: Spec, cfg: K3Config, tp: TPInfo) -> torch.Tensor:
    if spec.name.endswith("self_attn.A_log"):
        full = sl[:].reshape(-1)[: cfg.kda_num_heads]  # stored padded; only the first `heads` entries are real
        return full[tp.shard(cfg.kda_num_heads)]
    if spec.shard_dim is None or tp.size == 1:
        return sl[:]
    n = spec.shape[spec.shard_dim]
    s = tp.shard(n)
    return sl[s] if spec.shard_dim == 0 else sl[:, s]
