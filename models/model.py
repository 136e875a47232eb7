"""K3Model: the eager Kimi K3 decode step (k3-architecture.md §2), the reference for everything.

``model.decode(token_ids, state)`` runs one token per sequence through all layers and advances the
state; ``model.generate`` feeds prompts token by token through ``decode``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from . import ops
from .config import K3Config
from .layers import DecoderLayer, KDAState, Weight
from .sampling import sample
from .tp import TPInfo, all_gather_last, all_reduce


@torch.library.custom_op("k3model::check_decode_inputs", mutates_args=())
def check_decode_inputs(token_ids: torch.Tensor, lengths: torch.Tensor, vocab_size: int,
                        max_context: int) -> torch.Tensor:
    """Validate a decode step's data before any state is touched; return the write positions.

    A custom op so that a graph capture keeps the check as one opaque node that everything
    downstream depends on (its output is the position each token is written at).
    """
    bad = (token_ids < 0) | (token_ids >= vocab_size)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"token id {int(token_ids[row])} in batch row {row} is outside the vocabulary "
                         f"[0, {vocab_size}); pass ids produced by this model's tokenizer")
    full = lengths >= max_context
    if bool(full.any()):
        row = int(full.nonzero()[0, 0])
        raise ValueError(f"sequence in batch row {row} already holds {int(lengths[row])} tokens, the state's "
                         f"max_context; allocate a larger state with model.new_state(batch, max_context) "
                         f"(the config allows up to max_position_embeddings)")
    return lengths.clone()


@check_decode_inputs.register_fake
def _(token_ids, lengths, vocab_size, max_context):
    return torch.empty_like(lengths)


class DecodeState:
    """Everything a decode step carries over: per-sequence lengths, per-KDA-layer conv + recurrent
    state, per-MLA-layer latent cache ``[batch, max_context, kv_lora + rope]`` preallocated.

    ``decode`` with B token ids uses rows ``0..B-1``; sequences in a batch may have different lengths.
    """

    def __init__(self, model: "K3Model", batch_size: int, max_context: int):
        cfg = model.config
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 1 <= max_context <= cfg.max_position_embeddings:
            raise ValueError(f"max_context must be in 1..{cfg.max_position_embeddings} "
                             f"(the config's max_position_embeddings), got {max_context}")
        self.batch_size, self.max_context = batch_size, max_context
        dev, dt = model.device, model.dtype
        # what decode checks a state against (K3Model.check_decode_args), recorded once: layer kinds, dtype, device
        self.kinds, self.dtype, self.device = model.layer_kinds, dt, dev
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=dev)
        self.layers: list = []
        for layer in model.layers:
            if layer.is_mla:
                width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
                self.layers.append(torch.zeros(batch_size, max_context, width, dtype=dt, device=dev))
            else:
                H = layer.self_attn.local_heads
                self.layers.append(KDAState(batch_size, H * cfg.kda_head_dim, H, cfg.kda_head_dim,
                                            cfg.short_conv_kernel_size, dt, dev))

    def tensors(self) -> list[torch.Tensor]:
        out = [self.lengths]
        for s in self.layers:
            out.extend(s.tensors() if isinstance(s, KDAState) else [s])
        return out

    def reset(self, rows: Sequence[int] | None = None) -> None:
        """Forget the given sequences (all if None) so that their rows can hold new ones."""
        idx = slice(None) if rows is None else torch.as_tensor(list(rows), dtype=torch.long)
        for t in self.tensors():
            t[idx] = 0

    def clone(self) -> "DecodeState":
        new = object.__new__(DecodeState)
        new.batch_size, new.max_context = self.batch_size, self.max_context
        new.kinds, new.dtype, new.device = self.kinds, self.dtype, self.device
        new.lengths = self.lengths.clone()
        new.layers = []
        for s in self.layers:
            if isinstance(s, KDAState):
                c = object.__new__(KDAState)
                c.conv_q, c.conv_k, c.conv_v, c.recurrent = (t.clone() for t in s.tensors())
                new.layers.append(c)
            else:
                new.layers.append(s.clone())
        return new


class K3Model(nn.Module):
    def __init__(self, config: K3Config, *, dtype: torch.dtype = torch.bfloat16, device="cpu",
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        if dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            raise TypeError(f"unsupported model dtype {dtype}; use torch.bfloat16 (the checkpoint's), "
                            "float16, float32 or float64")
        config.check_tp(tp_size)
        self.config = config
        self.tp = TPInfo(tp_rank, tp_size)
        hid = config.hidden_size
        V = config.vocab_size // tp_size
        with torch.device(device):
            self.embed_tokens = Weight(V, hid, dtype=dtype)
            self.layers = nn.ModuleList(DecoderLayer(config, self.tp, i, dtype)
                                        for i in range(config.num_hidden_layers))
            self.norm = Weight(hid, dtype=dtype)
            self.output_attn_res_norm = Weight(hid, dtype=dtype)
            self.output_attn_res_proj = Weight(1, hid, dtype=dtype)
            self.lm_head = Weight(V, hid, dtype=dtype)
        self.layer_kinds = tuple(layer.is_mla for layer in self.layers)  # MLA (else KDA), what a state records

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_state(self, batch_size: int, max_context: int) -> DecodeState:
        return DecodeState(self, batch_size, max_context)

    # ------------------------------------------------------------------ one decode step
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embed_tokens.weight[token_ids]
        per = self.embed_tokens.weight.shape[0]
        local = token_ids - self.tp.rank * per
        mine = (local >= 0) & (local < per)
        rows = self.embed_tokens.weight[local.clamp(0, per - 1)]
        return all_reduce(torch.where(mine[:, None], rows, torch.zeros_like(rows)), self.tp)

    def check_decode_args(self, token_ids: torch.Tensor, state: DecodeState) -> None:
        """The checks of :meth:`decode` that need no data (shapes, dtypes, devices): a compiled step runs them
        before its graph, so a wrong argument gets the same error as in eager mode."""
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1:
            raise ValueError("token_ids must be a 1-D LongTensor [batch] (one new token per sequence)")
        if token_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"token_ids must be an integer tensor (torch.long), got {token_ids.dtype}")
        if token_ids.device != self.device:
            raise ValueError(f"token_ids are on {token_ids.device}, the model on {self.device}; move them there")
        B = token_ids.shape[0]
        if B > state.batch_size:
            raise ValueError(f"batch of {B} token ids exceeds the state's batch size {state.batch_size}; "
                             f"create the state with model.new_state({B}, max_context)")
        if B < 1:
            raise ValueError("token_ids is empty")
        # (from what the state recorded when it was made: a per-tensor walk costs ~0.6 ms a step at 93 layers)
        if not isinstance(state, DecodeState) or state.kinds != self.layer_kinds:
            raise ValueError("state is not a decode state of this model's layers; create it with "
                             "model.new_state(batch, max_context)")
        if state.dtype != self.dtype or state.device != token_ids.device:
            raise ValueError(f"the state was made for a {state.dtype} model on {state.device}; this model computes "
                             f"in {self.dtype} on {token_ids.device}: create the state with this model's "
                             f"new_state(batch, max_context)")

    def decode(self, token_ids: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """One decode step: ``token_ids [B]`` (rows 0..B-1 of ``state``) -> fp32 logits ``[B, vocab]``."""
        cfg = self.config
        self.check_decode_args(token_ids, state)
        B = token_ids.shape[0]
        positions = torch.ops.k3model.check_decode_inputs(token_ids, state.lengths[:B], cfg.vocab_size,
                                                           state.max_context)
        eps = cfg.rms_norm_eps
        prefix = self.embed(token_ids)
        blocks: list[torch.Tensor] = []
        for layer, layer_state in zip(self.layers, state.layers):
            # Pre-attention AttnRes read over the sealed blocks, *then* seal at block boundaries (pitfall 6).
            h = prefix
            if blocks:
                h = ops.attn_res(prefix, torch.stack(blocks, 1), layer.self_attention_res_norm.weight,
                                 layer.self_attention_res_proj.weight, eps)
            if layer.is_block_write:
                blocks.append(prefix)
                prefix = None
            x = ops.rms_norm(h, layer.input_layernorm.weight, eps)
            if layer.is_mla:
                a = layer.self_attn(x, layer_state, positions)
            else:
                a = layer.self_attn(x, layer_state, B)
            prefix = a if prefix is None else prefix + a
            h2 = ops.attn_res(prefix, torch.stack(blocks, 1), layer.mlp_res_norm.weight,
                              layer.mlp_res_proj.weight, eps)
            y = ops.rms_norm(h2, layer.post_attention_layernorm.weight, eps)
            f = layer.block_sparse_moe(y) if layer.is_moe else layer.mlp(y)
            prefix = prefix + f
        # Output AttnRes over every sealed block + the running prefix, before the final norm (pitfall 7).
        h = ops.attn_res(prefix, torch.stack(blocks, 1), self.output_attn_res_norm.weight,
                         self.output_attn_res_proj.weight, eps)
        logits = all_gather_last(ops.lm_head(h, self.norm.weight, self.lm_head.weight, eps), self.tp)
        state.lengths[:B].copy_(positions + 1)
        return logits

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, decode=None) -> list[list[int]]:
        """Feed each prompt token by token through ``decode`` and sample ``max_new_tokens`` per prompt.

        Prompts may differ in length: a sequence starts sampling after its last prompt token while the
        others are still reading theirs. Greedy at temperature 0. ``decode`` lets a compiled step
        (``k3compile.compile(model)``) stand in for ``self.decode``; the state gets the rows it asks for
        (``decode.state_rows(batch)``: a kernel runtime pads the batch to its bucket), else one per prompt.
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt and every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        step = decode or self.decode
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed) if seed is not None else gen.seed()  # no seed: a fresh random one
        B = len(prompts)
        lens = [len(p) for p in prompts]
        total = max(lens) + max_new_tokens - 1
        rows = getattr(step, "state_rows", None)
        state = self.new_state(rows(B) if rows else B, max(lens) + max_new_tokens)
        out: list[list[int]] = [[] for _ in range(B)]
        current = torch.tensor([p[0] for p in prompts], dtype=torch.long, device=self.device)
        for t in range(total):
            logits = step(current, state)
            nxt = sample(logits, temperature=temperature, top_p=top_p, generator=gen)
            ids = []
            for b in range(B):
                if t + 1 < lens[b]:
                    ids.append(prompts[b][t + 1])
                else:
                    tok = int(nxt[b])
                    if len(out[b]) < max_new_tokens:
                        out[b].append(tok)
                    ids.append(tok)
            current = torch.tensor(ids, dtype=torch.long, device=self.device)
            if all(len(o) >= max_new_tokens for o in out):
                break
        return out
