"""Train a small K3-architecture model on real text (issue #8): the Python standard library's sources.

Random weights produce meaningless text and routing that nothing taught; this module trains a model
with every K3 quirk on real bytes so that its routing, expert load and numerics come from data.

What is trained
  :func:`k3_mini_text` - k3-mini's per-head geometry (hidden 256, KDA heads of 128, MLA kv_lora 512 /
  rope 64 / nope 128 / v 128, latent 128, 16 MXFP4 experts top-4 + 2 shared, SiTU 4/25, sigmoid
  routing with a selection-only bias) at 2 heads and 5 layers ``K K K M M`` (dense layer 0, the M M
  tail, MoE layers 1-4, AttnRes blocks of 2 so that layers 0, 2, 4 seal blocks). It is small enough
  to commit (8.2 MB) and to train on one CPU core in about 35 minutes.

Same math as the decode step
  :func:`forward_sequence` runs whole sequences ``[B, T]`` through the functions that
  ``K3Model.decode`` calls (:mod:`models.ops`: ``attn_res``, ``rms_norm``, ``kda_decode``, ``moe_route``,
  ``situ_glu``, ``lm_head``), with the model's own weight modules. Row-wise operations run on all
  ``B*T`` tokens at once; KDA runs ``kda_decode`` itself one step at a time with the conv and
  recurrent state passed functionally (decode writes them in place, which autograd cannot
  differentiate through); MLA runs :func:`mla_causal`, ``mla_decode``'s computation line for line
  with a time axis and a causal mask in place of the cache (calling ``mla_decode`` per step costs
  ~15x more on a CPU: it broadcasts the absorbed weights per row). The routed experts run
  :func:`routed_experts`, the all-experts path of ``latent_moe_experts`` on dequantised weights.
  tests/models/test_trained.py checks that the whole forward gives the logits of token-by-token
  ``model.decode``.

MXFP4 experts: quantisation-aware training
  The routed experts keep fp32 master weights; every forward uses ``dequantize(quantize(w))`` (the
  exact MXFP4 values the checkpoint will hold, :mod:`models.mxfp4`) with a straight-through
  estimator for the gradient. Export packs the masters with the same ``quantize``, so the saved
  model computes what was trained.

Routing: aux-loss-free balancing
  ``gate.e_score_correction_bias`` gets no gradient; after every step it moves by
  ``bias_rate * sign(mean_load - load)`` per expert (DeepSeek-V3's aux-loss-free rule). It only
  picks experts (``noaux_tc``): the routing weights stay the unbiased sigmoid scores.

Tokenizer: bytes are token ids 0..255; :data:`BOS` (256) starts every sequence.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import struct
import sys
import tempfile
import time
import zlib
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from . import mxfp4, ops
from .checkpoint import load_pretrained, save_checkpoint, save_random_checkpoint
from .config import K3Config, k3_mini
from .model import K3Model

# ---------------------------------------------------------------------------------------------- config
def k3_mini_text() -> K3Config:
    """k3-mini's shapes per head, at 2 heads and 5 layers (``K K K M M``), byte vocabulary.

    Kept from k3-mini (and K3): hidden 256, KDA head_dim 128 with conv 4 and the -5 lower-bound
    gate, MLA kv_lora 512 / rope 64 / nope 128 / v 128 with the output gate, q_lora 128, 16 experts
    top-4 + 2 shared, latent 128 with its norm, SiTU 4/25, eps 1e-5, first layer dense, the last
    two layers MLA. Smaller: 2 KDA and 2 MLA heads (TP 1 and 2), 5 layers, dense width 512, expert
    width 64, vocab 264 (256 bytes + specials), AttnRes blocks of 2 (three sealed blocks: 0, 2, 4).
    """
    n = 5
    full = (4, 5)
    return dataclasses.replace(
        k3_mini(), num_hidden_layers=n, full_attn_layers=full,
        kda_layers=tuple(i for i in range(1, n + 1) if i not in full), vocab_size=VOCAB_SIZE,
        kda_num_heads=2, num_attention_heads=2, num_key_value_heads=2, intermediate_size=512,
        moe_intermediate_size=64, attn_res_block_size=2, a_log_padded_size=0, name="k3_mini_text",
    ).validate()


# ---------------------------------------------------------------------------------------------- tokenizer
BOS = 256  # starts every sequence (training windows, held-out chunks, prompts)
EOS = 257  # reserved (never trained on)
PAD = 258  # reserved
VOCAB_SIZE = 264  # 256 bytes + 8 specials (a multiple of 8, so the vocabulary splits evenly under TP)


class ByteTokenizer:
    """UTF-8 bytes are the token ids 0..255; ids >= 256 are specials."""

    bos, eos, pad, vocab_size = BOS, EOS, PAD, VOCAB_SIZE

    def encode(self, text: str | bytes, *, bos: bool = True) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return ([BOS] if bos else []) + list(data)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------- corpus
# Fixed lists of standard-library files (paths relative to os.path.dirname(os.__file__)), plain .py
# modules that CPython has kept for many releases; a missing file is skipped, and report.json lists the
# files a run used.
TRAIN_FILES = (
    "abc.py", "argparse.py", "ast.py", "base64.py", "bisect.py", "calendar.py", "cmd.py", "code.py",
    "codecs.py", "collections/__init__.py", "colorsys.py", "configparser.py", "contextlib.py", "copy.py",
    "csv.py", "dataclasses.py", "difflib.py", "dis.py", "enum.py", "filecmp.py", "fractions.py",
    "ftplib.py", "functools.py", "genericpath.py", "getopt.py", "getpass.py", "gettext.py", "glob.py",
    "graphlib.py", "gzip.py", "hashlib.py", "hmac.py", "inspect.py", "io.py", "ipaddress.py",
    "json/__init__.py", "json/decoder.py", "json/encoder.py", "keyword.py", "linecache.py", "locale.py",
    "logging/__init__.py", "logging/handlers.py", "lzma.py", "mimetypes.py", "numbers.py", "opcode.py",
    "operator.py", "optparse.py", "os.py", "pickle.py", "pkgutil.py", "platform.py", "plistlib.py",
    "posixpath.py", "pprint.py", "queue.py", "quopri.py", "random.py", "reprlib.py", "rlcompleter.py",
    "sched.py", "secrets.py", "selectors.py", "shutil.py", "signal.py", "socket.py", "socketserver.py",
    "statistics.py", "string.py", "stringprep.py", "subprocess.py", "symtable.py", "tabnanny.py",
    "tarfile.py", "tempfile.py", "threading.py", "timeit.py", "token.py", "tokenize.py", "trace.py",
    "traceback.py", "tracemalloc.py", "types.py", "typing.py", "uuid.py", "warnings.py", "wave.py",
    "weakref.py", "zipapp.py",
)
HELDOUT_FILES = ("textwrap.py", "heapq.py", "fnmatch.py", "shlex.py", "ntpath.py")


def stdlib_dir() -> str:
    return os.path.dirname(os.__file__)


def read_files(names: Sequence[str], root: str | None = None) -> tuple[bytes, list[str]]:
    """The files joined by blank lines, and the names that were found (missing ones are skipped)."""
    root = root or stdlib_dir()
    parts, found = [], []
    for name in names:
        p = os.path.join(root, name)
        if os.path.isfile(p):
            with open(p, "rb") as fh:
                parts.append(fh.read().replace(b"\r\n", b"\n"))
            found.append(name)
    if not parts:
        raise FileNotFoundError(f"none of the corpus files exist under {root}")
    return b"\n\n".join(parts), found


def line_starts(text: bytes) -> list[int]:
    return [0] + [i + 1 for i, c in enumerate(text) if c == 10 and i + 1 < len(text)]


def eval_chunks(text: bytes, length: int, max_chunks: int | None = None) -> list[list[int]]:
    """Deterministic, non-overlapping held-out sequences ``[BOS] + length bytes``, each starting at a
    line start (as training windows do)."""
    starts = line_starts(text)
    out, nxt = [], 0
    for s in starts:
        if s < nxt or s + length > len(text):
            continue
        out.append([BOS] + list(text[s:s + length]))
        nxt = s + length
        if max_chunks is not None and len(out) >= max_chunks:
            break
    return out


def split_chunks(text: bytes, length: int) -> list[list[int]]:
    """``[BOS] + length bytes`` for each consecutive piece of ``text`` (a heldout_sample.txt, which holds whole
    :func:`eval_chunks` chunks back to back, splits back into exactly those chunks)."""
    return [[BOS] + list(text[i:i + length]) for i in range(0, len(text) - length + 1, length)]


class WindowSampler:
    """Random training windows ``[BOS] + T bytes`` that start at line starts of the training text."""

    def __init__(self, text: bytes, length: int, seed: int):
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.length = length
        self.starts = [s for s in line_starts(text) if s + length <= len(text)]
        self.rng = random.Random(seed)

    def batch(self, batch_size: int) -> torch.Tensor:
        rows = [self.data[s:s + self.length] for s in (self.rng.choice(self.starts) for _ in range(batch_size))]
        bos = torch.full((batch_size, 1), BOS, dtype=torch.long)
        return torch.cat([bos, torch.stack(rows)], dim=1)  # [B, T+1]: inputs [:, :-1], targets [:, 1:]


# ---------------------------------------------------------------------------------------------- model
def fake_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """The MXFP4 value of ``w`` in the forward pass, identity gradient (straight-through estimator)."""
    with torch.no_grad():
        packed, scale = mxfp4.quantize(w)
        q = mxfp4.dequantize(packed, scale, w.dtype)
    return w + (q - w).detach()


def routed_experts(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                   w2: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """``ops.latent_moe_experts`` (its all-experts path, the one the eager model takes at this size) on
    dequantised expert weights ``w1, w3 [E, I, L]``, ``w2 [E, L, I]``, so that gradients reach them."""
    dt = z.dtype
    E = w1.shape[0]
    zs = z[None].expand(E, -1, -1)
    gate = torch.bmm(zs, w1.transpose(1, 2))
    up = torch.bmm(zs, w3.transpose(1, 2))
    y = torch.bmm(ops.situ_glu(gate, up, beta, linear_beta), w2.transpose(1, 2))  # [E, N, L]
    dense_w = torch.zeros(z.shape[0], E, dtype=torch.float32, device=z.device).scatter(1, ids, weights.float())
    return (y.float() * dense_w.t()[..., None]).sum(0).to(dt)


class Trainable:
    """A ``K3Model`` (fp32, gradients on) plus fp32 master weights for the MXFP4 experts."""

    def __init__(self, model: K3Model):
        if model.tp.size != 1:
            raise ValueError("training runs unsharded (tp_size 1)")
        self.model = model
        self.config = model.config
        self.masters: dict[int, dict[str, torch.nn.Parameter]] = {}
        for i, layer in enumerate(model.layers):
            if layer.is_moe:
                moe = layer.block_sparse_moe
                self.masters[i] = {
                    w: torch.nn.Parameter(mxfp4.dequantize(
                        mxfp4.checkpoint_codes(getattr(moe, f"experts_{w}_packed")),
                        getattr(moe, f"experts_{w}_scale"), torch.float32))
                    for w in ("w1", "w3", "w2")}
        for name, p in model.named_parameters():
            p.requires_grad_(not name.endswith("e_score_correction_bias"))

    @classmethod
    def from_checkpoint(cls, path: str) -> "Trainable":
        return cls(load_pretrained(path, dtype=torch.float32))

    def parameters(self) -> list[torch.nn.Parameter]:
        ps = [p for p in self.model.parameters() if p.requires_grad]
        return ps + [p for m in self.masters.values() for p in m.values()]

    def export(self) -> K3Model:
        """Pack the master expert weights into the model's MXFP4 buffers (the model then decodes exactly
        what the QAT forward computed)."""
        with torch.no_grad():
            for i, m in self.masters.items():
                moe = self.model.layers[i].block_sparse_moe
                for w, master in m.items():
                    packed, scale = mxfp4.quantize(master)
                    getattr(moe, f"experts_{w}_packed").copy_(packed)
                    getattr(moe, f"experts_{w}_scale").copy_(scale)
        return self.model


def _kda_sequence(attn, x: torch.Tensor) -> torch.Tensor:
    """KDA over ``x [B, T, hidden]``: ``ops.kda_decode`` step by step, state carried functionally (the
    recurrent loop of the decode step; chunked-parallel KDA would be a different summation order)."""
    cfg = attn.cfg
    B, T, _ = x.shape
    H, D = attn.local_heads, cfg.kda_head_dim
    # One projection GEMM per weight for the whole sequence, then per-step views (unbind: one backward
    # node instead of T slices that each scatter into a zero tensor of the full sequence).
    q, k, v, g = (p(x).unbind(1) for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.g_proj))
    f = attn.f_b_proj(attn.f_a_proj(x)).unbind(1)
    beta = attn.b_proj(x).unbind(1)
    conv = torch.zeros(B, H * D, cfg.short_conv_kernel_size - 1, dtype=x.dtype, device=x.device)
    cq, ck, cv = conv, conv, conv
    s = torch.zeros(B, H, D, D, dtype=torch.float32, device=x.device)
    ys = []
    for t in range(T):
        y, cq, ck, cv, s = ops.kda_decode(
            q[t], k[t], v[t], f[t], beta[t], g[t], cq, ck, cv, s,
            attn.q_conv1d.weight, attn.k_conv1d.weight, attn.v_conv1d.weight, attn.A_log, attn.dt_bias,
            attn.o_norm.weight, D, cfg.gate_lower_bound, cfg.rms_norm_eps)
        ys.append(y)
    return attn.o_proj(torch.stack(ys, 1))


def mla_causal(q: torch.Tensor, latent: torch.Tensor, gate: torch.Tensor, kv_b_weight: torch.Tensor, nope_dim: int,
               v_dim: int, scale: float) -> torch.Tensor:
    """``ops.mla_decode`` for every position of ``[B, T]`` sequences at once: position t attends to the
    latents 0..t. Line for line the decode op's math (absorbed NoPE MLA, fp32 inside, scores
    ``ql.c + q_pe.k_pe`` times ``scale``, softmax, ``p.c`` then ``w_uv``, sigmoid output gate) with a
    time axis and a causal mask instead of the cache and its lengths. q [B, T, H*(nope+rope)],
    latent [B, T, C+R], gate [B, T, H*v] -> [B, T, H*v]."""
    B, T = q.shape[:2]
    C = kv_b_weight.shape[1]
    H = kv_b_weight.shape[0] // (nope_dim + v_dim)
    R = latent.shape[-1] - C
    qh = q.float().view(B, T, H, nope_dim + R)
    q_nope, q_pe = qh[..., :nope_dim], qh[..., nope_dim:]
    wkv = kv_b_weight.float().view(H, nope_dim + v_dim, C)
    w_uk, w_uv = wkv[:, :nope_dim], wkv[:, nope_dim:]
    ql = torch.einsum("bthn,hnc->bhtc", q_nope, w_uk)  # absorbed queries [B, H, T, C]
    kv = latent.float()
    c, k_pe = kv[..., :C], kv[..., C:]
    s = (torch.matmul(ql, c[:, None].transpose(-1, -2))
         + torch.matmul(q_pe.transpose(1, 2), k_pe[:, None].transpose(-1, -2))) * scale  # [B, H, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~causal, float("-inf"))
    p = torch.softmax(s, dim=-1)
    ol = torch.matmul(p, c[:, None])  # [B, H, T, C]
    o = torch.einsum("bhtc,hvc->bthv", ol, w_uv).reshape(B, T, H * v_dim)
    return (o * torch.sigmoid(gate.float())).to(q.dtype)


def _mla_sequence(attn, x: torch.Tensor) -> torch.Tensor:
    """MLA over ``x [B, T, hidden]``: MLAAttention.forward's projections, then :func:`mla_causal`."""
    cfg = attn.cfg
    eps = attn.LATENT_NORM_EPS
    q = attn.q_b_proj(ops.rms_norm(attn.q_a_proj(x), attn.q_a_layernorm.weight, eps))
    kv = attn.kv_a_proj_with_mqa(x)
    c = ops.rms_norm(kv[..., :cfg.kv_lora_rank], attn.kv_a_layernorm.weight, eps)
    latent = torch.cat([c, kv[..., cfg.kv_lora_rank:]], dim=-1)  # [B, T, C+R], k_pe unrotated
    o = mla_causal(q, latent, attn.g_proj(x), attn.kv_b_proj.weight, cfg.qk_nope_head_dim, cfg.v_head_dim,
                   cfg.mla_scale)
    return attn.o_proj(o)


def _moe(moe, y: torch.Tensor, masters: dict | None, quantize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = moe.cfg
    weights, ids = ops.moe_route(y, moe.gate.weight, moe.gate.e_score_correction_bias, cfg.num_experts_per_token,
                                 cfg.moe_renormalize, cfg.routed_scaling_factor)
    z = moe.routed_expert_down_proj(y)
    if masters is None:  # the packed experts as stored (what decode uses)
        w = [mxfp4.dequantize(mxfp4.checkpoint_codes(getattr(moe, f"experts_{n}_packed")),
                              getattr(moe, f"experts_{n}_scale"), z.dtype)
             for n in ("w1", "w3", "w2")]
    else:
        w = [fake_mxfp4(masters[n]) if quantize else masters[n] for n in ("w1", "w3", "w2")]
    r = routed_experts(z, weights, ids, *w, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    if cfg.latent_moe_use_norm:
        r = ops.rms_norm(r, moe.routed_expert_norm.weight, cfg.rms_norm_eps)
    return moe.routed_expert_up_proj(r) + moe.shared_experts(y), ids


def forward_sequence(model: K3Model, tokens: torch.Tensor, masters: dict | None = None, *,
                     quantize: bool = True) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Logits ``[B, T, vocab]`` for ``tokens [B, T]`` read from a fresh state: the decode step's math
    (``K3Model.decode``, layer for layer), differentiable. ``masters`` (from :class:`Trainable`) replaces
    the packed experts by fp32 weights, fake-quantised to MXFP4 (QAT) unless ``quantize=False`` (then the
    checkpoint's MXFP4 comes from post-training packing in :meth:`Trainable.export`). Also returns each
    MoE layer's expert ids ``[B*T, k]``."""
    cfg = model.config
    eps = cfg.rms_norm_eps
    B, T = tokens.shape
    prefix = model.embed(tokens.reshape(-1))  # [B*T, hidden]: row-wise ops see one token per row
    blocks: list[torch.Tensor] = []
    routes: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.layers):
        h = prefix
        if blocks:
            h = ops.attn_res(prefix, torch.stack(blocks, 1), layer.self_attention_res_norm.weight,
                             layer.self_attention_res_proj.weight, eps)
        if layer.is_block_write:
            blocks.append(prefix)
            prefix = None
        x = ops.rms_norm(h, layer.input_layernorm.weight, eps).view(B, T, -1)
        a = (_mla_sequence if layer.is_mla else _kda_sequence)(layer.self_attn, x).reshape(B * T, -1)
        prefix = a if prefix is None else prefix + a
        h2 = ops.attn_res(prefix, torch.stack(blocks, 1), layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps)
        y = ops.rms_norm(h2, layer.post_attention_layernorm.weight, eps)
        if layer.is_moe:
            f, routes[i] = _moe(layer.block_sparse_moe, y, None if masters is None else masters[i], quantize)
        else:
            f = layer.mlp(y)
        prefix = prefix + f
    h = ops.attn_res(prefix, torch.stack(blocks, 1), model.output_attn_res_norm.weight,
                     model.output_attn_res_proj.weight, eps)
    logits = ops.lm_head(h, model.norm.weight, model.lm_head.weight, eps)
    return logits.view(B, T, -1), routes


def update_selection_bias(model: K3Model, routes: dict[int, torch.Tensor], rate: float) -> dict[int, torch.Tensor]:
    """Aux-loss-free balancing: ``bias += rate * sign(mean load - load)`` per expert. Returns the loads."""
    loads = {}
    with torch.no_grad():
        for i, ids in routes.items():
            gate = model.layers[i].block_sparse_moe.gate
            load = torch.bincount(ids.reshape(-1), minlength=gate.e_score_correction_bias.numel()).float()
            gate.e_score_correction_bias.add_(rate * torch.sign(load.mean() - load))
            loads[i] = load
    return loads


# ---------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def decode_nll(model: K3Model, chunks: Sequence[Sequence[int]]) -> tuple[float, int]:
    """Summed next-token NLL (nats) and the number of predicted tokens, running ``model.decode`` token by
    token over equal-length ``chunks`` (one batch row each)."""
    ids = torch.tensor([list(c) for c in chunks], dtype=torch.long, device=model.device)
    B, T = ids.shape
    state = model.new_state(B, T)
    total = 0.0
    for t in range(T - 1):
        logits = model.decode(ids[:, t], state)
        total += float(F.cross_entropy(logits.float(), ids[:, t + 1], reduction="sum"))
    return total, B * (T - 1)


@torch.no_grad()
def decode_with_expert_load(model: K3Model, chunks: Sequence[Sequence[int]]
                            ) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Run ``model.decode`` token by token over ``chunks`` and count expert load.

    Returns the NLL per predicted byte (nats), the expert load per sequence: how many of a row's tokens
    picked each expert, ``[n_moe_layers, len(chunks), num_experts]`` (sum over dim 1 for the whole text),
    counted from ``ops.moe_route`` on each MoE block's input; and, on the same inputs, the router's own
    preference: the top-k of the sigmoid scores *without* the selection bias (what the experts would get
    if ``e_score_correction_bias`` did not balance them).
    """
    moe_layers = [l for l in model.layers if l.is_moe]
    cfg = model.config
    k = cfg.num_experts_per_token
    counts = torch.zeros(len(moe_layers), len(chunks), cfg.num_experts, dtype=torch.long)
    preferred = torch.zeros_like(counts)
    handles = []
    for j, layer in enumerate(moe_layers):
        def hook(mod, args, j=j):
            bias = mod.gate.e_score_correction_bias
            for out, b in ((counts, bias), (preferred, torch.zeros_like(bias))):
                _, ids = ops.moe_route(args[0], mod.gate.weight, b, k, cfg.moe_renormalize, cfg.routed_scaling_factor)
                out[j].scatter_add_(1, ids.cpu(), torch.ones(ids.shape, dtype=torch.long))
        handles.append(layer.block_sparse_moe.register_forward_pre_hook(hook))
    try:
        nll, n = decode_nll(model, chunks)
    finally:
        for h in handles:
            h.remove()
    return nll / n, counts, preferred


def load_cv(counts: torch.Tensor) -> torch.Tensor:
    """Coefficient of variation (std / mean) of expert token counts over the last dim (the experts)."""
    c = counts.double()
    return c.std(-1, unbiased=False) / c.mean(-1)


def unigram_nll(train_text: bytes, eval_chunks_: Sequence[Sequence[int]], vocab: int = VOCAB_SIZE) -> float:
    """Nats per predicted byte of an add-one-smoothed unigram model fitted on ``train_text``."""
    counts = torch.bincount(torch.frombuffer(bytearray(train_text), dtype=torch.uint8).long(), minlength=vocab)
    logp = torch.log((counts.double() + 1) / (counts.sum() + vocab))
    targets = torch.tensor([t for c in eval_chunks_ for t in c[1:]], dtype=torch.long)
    return float(-logp[targets].mean())


def empirical_entropy(eval_chunks_: Sequence[Sequence[int]]) -> float:
    """Nats per byte of the best unigram model *for the evaluated bytes themselves* (their empirical
    entropy): a lower bound on every unigram model's loss on them."""
    targets = torch.tensor([t for c in eval_chunks_ for t in c[1:]], dtype=torch.long)
    p = torch.bincount(targets).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


# ---------------------------------------------------------------------------------------------- checkpoint
def trained_checkpoint() -> str:
    """Path of the committed trained checkpoint (``checkpoints/k3_mini_text`` in the source checkout)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "checkpoints", "k3_mini_text")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        raise FileNotFoundError(f"no trained checkpoint at {path}: it ships with the source checkout (install "
                                "with pip install -e .), or train one with examples/train_mini.py")
    return path


def heldout_sample_path() -> str:
    """The fixed held-out text sample committed next to the trained checkpoint (used by the tests)."""
    return os.path.join(trained_checkpoint(), "heldout_sample.txt")


# ---------------------------------------------------------------------------------------------- training
@dataclasses.dataclass
class TrainArgs:
    out: str
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 1000
    time_budget_s: float = 33 * 60.0  # setup + training; the schedule is shortened to fit (evaluation follows)
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    bias_rate: float = 1e-3
    qat: bool = True  # False: train the expert masters unquantised and pack them to MXFP4 only at export
    seed: int = 0
    eval_len: int = 128
    eval_chunks: int = 128
    sample_chunks: int = 16  # chunks written to heldout_sample.txt for the tests
    log_every: int = 25
    prompt: str = "def "
    sample_tokens: int = 200
    threads: int = 1


def _lr(step: int, total: int, a: TrainArgs) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    prog = min(1.0, (step - a.warmup) / max(1, total - a.warmup))
    return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))


def train(a: TrainArgs, log: Callable[[str], None] = print) -> dict:
    """Train :func:`k3_mini_text` on the standard library, write the checkpoint, plot and report to ``a.out``."""
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    t_start = time.perf_counter()
    os.makedirs(a.out, exist_ok=True)
    cfg = k3_mini_text()
    train_text, train_found = read_files(TRAIN_FILES)
    held_text, held_found = read_files(HELDOUT_FILES)
    log(f"corpus: {len(train_found)}/{len(TRAIN_FILES)} training files ({len(train_text)} bytes), "
        f"{len(held_found)}/{len(HELDOUT_FILES)} held-out files ({len(held_text)} bytes) from {stdlib_dir()}")

    # The random-weight baseline and the starting point: the same seed-0 random checkpoint.
    with tempfile.TemporaryDirectory() as tmp:
        tr = Trainable.from_checkpoint(save_random_checkpoint(os.path.join(tmp, "random"), cfg, seed=a.seed))

    model = tr.model
    params = tr.parameters()
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    n_params = sum(p.numel() for p in params)
    log(f"model {cfg.name}: {n_params / 1e6:.2f} M trainable params ({cfg.layer_types}), "
        f"batch {a.batch_size} x {a.seq_len} bytes, {a.steps} steps, {torch.get_num_threads()} thread(s)")
    sampler = WindowSampler(train_text, a.seq_len, a.seed)
    history = []
    total = a.steps
    step = 0
    t_train = time.perf_counter()
    ema = None
    while step < total:
        for g in opt.param_groups:
            g["lr"] = _lr(step, total, a)
        batch = sampler.batch(a.batch_size)
        logits, routes = forward_sequence(model, batch[:, :-1], tr.masters, quantize=a.qat)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, a.grad_clip)
        opt.step()
        loads = update_selection_bias(model, routes, a.bias_rate)
        step += 1
        loss_v = loss.item()
        ema = loss_v if ema is None else 0.95 * ema + 0.05 * loss_v
        elapsed = time.perf_counter() - t_train
        if step % a.log_every == 0 or step == 1:
            cv = float(torch.stack([load_cv(l) for l in loads.values()]).mean())
            history.append({"step": step, "loss": round(loss_v, 4), "loss_ema": round(ema, 4),
                            "elapsed_s": round(elapsed, 1), "grad_norm": round(float(gnorm), 3),
                            "batch_load_cv": round(cv, 3)})
            log(f"step {step:5d}/{total}  loss {loss_v:.4f} (ema {ema:.4f})  |g| {float(gnorm):.2f}  "
                f"load cv {cv:.2f}  lr {opt.param_groups[0]['lr']:.2e}  {elapsed:.0f}s "
                f"({elapsed / step:.2f} s/step)")
        # Time budget: shorten the schedule so that the cosine still ends at its floor.
        if step == 20 or step % 100 == 0:
            per = elapsed / step
            fit = int(step + (a.time_budget_s - (time.perf_counter() - t_start)) / per)
            if fit < total:
                total = max(step + 1, fit)
                log(f"time budget {a.time_budget_s:.0f}s: training for {total} steps")
    train_s = time.perf_counter() - t_train
    model = tr.export().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    save_checkpoint(model, a.out)
    log(f"trained {step} steps in {train_s:.0f} s; checkpoint written to {a.out}")
    training = {k: v for k, v in dataclasses.asdict(a).items() if k != "out"} | {
        "trainable_params": n_params, "steps_run": step, "train_wall_s": round(train_s, 1),
        "tokens_seen": step * a.batch_size * a.seq_len, "train_files": train_found, "train_bytes": len(train_text),
        "stdlib_dir": stdlib_dir(), "python": sys.version.split()[0],
        "mxfp4": ("QAT: fp32 expert masters, forward on dequantize(quantize(w)), straight-through gradient"
                  if a.qat else "post-training packing of fp32 expert masters"),
        "history": history}
    report = write_report(a.out, training, log=log)
    report["training"]["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    with open(os.path.join(a.out, "report.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    return report


def load_stats(counts: torch.Tensor) -> dict:
    """Per-MoE-layer statistics of expert token counts ``[layers, experts]``."""
    c = counts.double()
    return {"cv": [round(float(x), 4) for x in load_cv(counts)],
            "max_over_mean": [round(float(x), 3) for x in c.max(-1).values / c.mean(-1)]}


def write_report(out: str, training: dict, *, log: Callable[[str], None] = print) -> dict:
    """Evaluate the checkpoint in ``out`` through ``model.decode`` against a random-weight model (the same
    seed's random checkpoint: the training's starting point) and a unigram baseline; write report.json,
    expert_load.png and heldout_sample.txt. ``training`` (settings, history, timings) is stored as is."""
    t0 = time.perf_counter()
    seed, eval_len, n_chunks = training["seed"], training["eval_len"], training["eval_chunks"]
    cfg = K3Config.from_json(out)
    train_text, _ = read_files(training["train_files"])
    held_text, held_found = read_files(HELDOUT_FILES)
    chunks = eval_chunks(held_text, eval_len, n_chunks)
    with open(os.path.join(out, "heldout_sample.txt"), "wb") as fh:
        fh.write(b"".join(bytes(c[1:]) for c in chunks[:training["sample_chunks"]]))
    trained = load_pretrained(out)
    with tempfile.TemporaryDirectory() as tmp:
        random_model = load_pretrained(save_random_checkpoint(os.path.join(tmp, "random"), cfg, seed=seed))
    nll_trained, rows_trained, pref_trained = decode_with_expert_load(trained, chunks)
    nll_random, rows_random, pref_random = decode_with_expert_load(random_model, chunks)
    load_trained, load_random = rows_trained.sum(1), rows_random.sum(1)
    nll_trained_f32, _, _ = decode_with_expert_load(load_pretrained(out, dtype=torch.float32), chunks)
    tok = ByteTokenizer()
    prompt = training["prompt"]
    sample_text = prompt + tok.decode(trained.generate([tok.encode(prompt)], training["sample_tokens"])[0])
    sampled_text = prompt + tok.decode(trained.generate([tok.encode(prompt)], training["sample_tokens"],
                                                        temperature=0.7, seed=0)[0])
    report = {
        "config": cfg.name,
        "layer_types": cfg.layer_types,
        "checkpoint_bytes": os.path.getsize(os.path.join(out, "model.safetensors")),
        "training": training,
        "heldout_eval": {"files": held_found, "file_bytes": len(held_text), "chunks": len(chunks),
                         "bytes_per_chunk": eval_len, "predicted_bytes": len(chunks) * eval_len,
                         "via": "model.decode token by token from a fresh state, BOS first"},
        "heldout_nats_per_byte": {
            "trained_bf16": round(nll_trained, 4), "trained_fp32": round(nll_trained_f32, 4),
            "random_weights": round(nll_random, 4), "unigram_train": round(unigram_nll(train_text, chunks), 4),
            "unigram_oracle_entropy": round(empirical_entropy(chunks), 4)},
        "heldout_bits_per_byte_trained": round(nll_trained / math.log(2), 4),
        "expert_load": {
            "layers": [i for i, l in enumerate(trained.layers) if l.is_moe],
            "slots_per_layer": int(load_trained[0].sum()),
            "uniform_noise_cv": round(math.sqrt((cfg.num_experts - 1) / float(load_trained[0].sum())), 4),
            "trained_counts": load_trained.tolist(), "random_counts": load_random.tolist(),
            "trained_router_preference_counts": pref_trained.sum(1).tolist(),
            "trained": load_stats(load_trained), "random": load_stats(load_random),
            "trained_router_preference": load_stats(pref_trained.sum(1)),
            "random_router_preference": load_stats(pref_random.sum(1)),
            "trained_per_sequence_cv": round(float(load_cv(rows_trained).mean()), 4),
            "random_per_sequence_cv": round(float(load_cv(rows_random).mean()), 4)},
        "selection_bias_range": [[round(float(l.block_sparse_moe.gate.e_score_correction_bias.min()), 4),
                                  round(float(l.block_sparse_moe.gate.e_score_correction_bias.max()), 4)]
                                 for l in trained.layers if l.is_moe],
        "sample": {"prompt": prompt, "new_tokens": training["sample_tokens"], "greedy": sample_text,
                   "temperature_0.7_seed_0": sampled_text},
        "eval_wall_s": round(time.perf_counter() - t0, 1),
    }
    plot_expert_load(os.path.join(out, "expert_load.png"), report["expert_load"])
    with open(os.path.join(out, "report.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    log(json.dumps(report["heldout_nats_per_byte"]))
    el = report["expert_load"]
    log(f"expert load cv: trained {el['trained']['cv']}, its router without the bias "
        f"{el['trained_router_preference']['cv']}, random weights {el['random']['cv']} "
        f"(uniform routing would give {el['uniform_noise_cv']})")
    log(f"sample: {sample_text!r}")
    return report


# ---------------------------------------------------------------------------------------------- PNG plot
# A 3x5 pixel font (rows top to bottom, 3 bits each, MSB = left) for the plot's labels.
_FONT = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7), "4": (5, 5, 7, 1, 1),
    "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 2, 2), "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7),
    "A": (2, 5, 7, 5, 5), "B": (6, 5, 6, 5, 6), "C": (3, 4, 4, 4, 3), "D": (6, 5, 5, 5, 6), "E": (7, 4, 6, 4, 7),
    "F": (7, 4, 6, 4, 4), "G": (3, 4, 5, 5, 3), "H": (5, 5, 7, 5, 5), "I": (7, 2, 2, 2, 7), "J": (1, 1, 1, 5, 2),
    "K": (5, 5, 6, 5, 5), "L": (4, 4, 4, 4, 7), "M": (5, 7, 7, 5, 5), "N": (6, 5, 5, 5, 5), "O": (2, 5, 5, 5, 2),
    "P": (6, 5, 6, 4, 4), "Q": (2, 5, 5, 6, 3), "R": (6, 5, 6, 5, 5), "S": (3, 4, 2, 1, 6), "T": (7, 2, 2, 2, 2),
    "U": (5, 5, 5, 5, 7), "V": (5, 5, 5, 5, 2), "W": (5, 5, 7, 7, 5), "X": (5, 5, 2, 5, 5), "Y": (5, 5, 2, 2, 2),
    "Z": (7, 1, 2, 4, 7), " ": (0, 0, 0, 0, 0), ".": (0, 0, 0, 0, 2), ",": (0, 0, 0, 2, 4), ":": (0, 2, 0, 2, 0),
    "-": (0, 0, 7, 0, 0), "/": (1, 1, 2, 4, 4), "(": (1, 2, 2, 2, 1), ")": (4, 2, 2, 2, 4), "=": (0, 7, 0, 7, 0),
    "%": (5, 1, 2, 4, 5), "#": (5, 7, 5, 7, 5), "+": (0, 2, 7, 2, 0), "_": (0, 0, 0, 0, 7),
}


class Canvas:
    """An RGB raster with rectangles and 3x5-font text, written as PNG with zlib (no plotting library)."""

    def __init__(self, width: int, height: int, bg=(255, 255, 255)):
        self.w, self.h = width, height
        self.px = bytearray(bytes(bg) * (width * height))

    def rect(self, x0: int, y0: int, x1: int, y1: int, color) -> None:
        x0, x1 = max(0, min(x0, x1)), min(self.w, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.h, max(y0, y1))
        row = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            o = 3 * (y * self.w + x0)
            self.px[o:o + len(row)] = row

    def text(self, x: int, y: int, s: str, color=(0, 0, 0), scale: int = 2) -> None:
        for ch in s.upper():
            glyph = _FONT.get(ch, _FONT["#"])
            for r, bits in enumerate(glyph):
                for c in range(3):
                    if bits >> (2 - c) & 1:
                        self.rect(x + c * scale, y + r * scale, x + (c + 1) * scale, y + (r + 1) * scale, color)
            x += 4 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * y * self.w:3 * (y + 1) * self.w]) for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def plot_expert_load(path: str, load: dict) -> None:
    """Bar chart per MoE layer: each expert's share of the routed token slots on held-out text, for the
    trained model (blue), the trained router's own top-k without the selection bias (light blue) and the
    random-weight model (grey); the dashed line is the uniform share."""
    series = [(load["trained_counts"], (31, 119, 180), "TRAINED"),
              (load["trained_router_preference_counts"], (158, 202, 225), "TRAINED, BIAS OFF"),
              (load["random_counts"], (170, 170, 170), "RANDOM WEIGHTS")]
    n_layers, E = len(series[0][0]), len(series[0][0][0])
    bar, gap, panel_h, top = 5, 6, 150, 60
    panel_w = E * (3 * bar + gap) + 60
    cv = Canvas(panel_w * 2 + 40, top + ((n_layers + 1) // 2) * (panel_h + 50) + 10)
    black = (0, 0, 0)
    cv.text(10, 8, "EXPERT LOAD ON HELD-OUT TEXT: SHARE OF ROUTED SLOTS PER EXPERT", scale=2)
    x = 10
    for _, col, label in series:
        cv.rect(x, 30, x + 12, 40, col)
        cv.text(x + 16, 31, label, scale=2)
        x += 16 + 8 * len(label) + 24
    cv.text(x, 31, "- - UNIFORM", scale=2)
    ymax = max(max(c) / sum(c) for counts, _, _ in series for c in counts) * 1.1
    for j in range(n_layers):
        ox = 20 + (j % 2) * (panel_w + 10)
        oy = top + (j // 2) * (panel_h + 50)
        base = oy + panel_h
        cv.text(ox + 40, oy - 4, f"LAYER {load['layers'][j]}   CV {load['trained']['cv'][j]:.2f} / "
                                 f"{load['trained_router_preference']['cv'][j]:.2f} / {load['random']['cv'][j]:.2f}")
        cv.rect(ox + 36, oy + 10, ox + 37, base, black)
        cv.rect(ox + 36, base, ox + panel_w - 10, base + 1, black)
        for frac in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5):
            if frac <= ymax:
                y = base - int(frac / ymax * (panel_h - 10))
                cv.rect(ox + 32, y, ox + 36, y + 1, black)
                cv.text(ox, y - 4, f"{frac:.1f}", scale=1)
        uni = base - int((1 / E) / ymax * (panel_h - 10))
        for x in range(ox + 38, ox + panel_w - 10, 8):
            cv.rect(x, uni, x + 4, uni + 1, black)
        for e in range(E):
            x = ox + 40 + e * (3 * bar + gap)
            for k, (counts, col, _) in enumerate(series):
                c = counts[j]
                hgt = int(c[e] / sum(c) / ymax * (panel_h - 10))
                cv.rect(x + k * bar, base - hgt, x + (k + 1) * bar - 1, base, col)
            cv.text(x + (3 if e < 10 else -1), base + 4, str(e), scale=1)
        cv.text(ox + panel_w // 2 - 20, base + 12, "EXPERT", scale=1)
    with open(path, "wb") as fh:
        fh.write(cv.png())
