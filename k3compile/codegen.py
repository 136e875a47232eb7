"""Offline codegen: kernel plan -> template points -> rendered CuTe DSL files -> (compiled) package.

For every (TP, bucket) point the plan of every layer is lowered; each plan launch maps to the template
points that implement it (``_LOWERING``: one function per dialect op, reading the op's FX arguments for
shapes and constants). Identical points (same template, constants and arch) are one kernel, listed once
with every plan entry it serves. What has no template yet is listed as *uncovered* with the reason, in
the manifest and on the console: codegen never pretends.

Output directory::

    manifest.json                  kernels (template, constants, arguments, bytes, FLOPs, source hash,
                                   ptxas report, the plan entries it implements) and, per (TP, bucket)
                                   and layer kind, each plan launch -> kernels | uncovered reason
    kernels/<name>/kernel.py       rendered source (header: template, point, constants, plan entries)
    kernels/<name>/kernel.ptx/.cubin/report.json       (unless --no-compile)
    kernels/<name>/kernel.so       (--package) + runtime/libcute_dsl_runtime.so
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import dialect
from .audit import audit_point
from .graph_text import node_value
from .templates import get as get_template
from .templates.base import Point, TemplateError
from .templates.moe_experts import ROUTE_MIN_BUCKET

MANIFEST_VERSION = 1


@dataclass
class Entry:
    """One plan launch at one (TP, bucket): what it is and the kernels that implement it."""
    tp: int
    bucket: int
    layer_kind: str
    layer: int
    launch: str
    op: str
    node: str
    kernels: list[str] = field(default_factory=list)
    uncovered: str = ""
    note: str = ""


# -------------------------------------------------------------------------------------------- lowering
def _shape(n) -> tuple:
    """Static dims as ints; the symbolic batch dim stays a SymInt (converting it would specialise it)."""
    return tuple(d if isinstance(d, torch.SymInt) else int(d) for d in node_value(n).shape)


def _arg(node, name: str):
    """A dialect node's argument by schema name (positional or keyword)."""
    names = [a.name for a in node.target._schema.arguments]
    i = names.index(name)
    return node.args[i] if i < len(node.args) else node.kwargs.get(name)


L2_WINDOW = 40 << 20  # of the H200's 60 MB L2: what a prefetch and the kernel running meanwhile may fill together
PREFETCH_MAX = 0  # bytes of weights a GEMV pulls into L2 before its PDL wait, at most (off: see _gemv_prefetch)
_PROLOGUE_NOTE = "the GEMV prologue (RMSNorm / SiTU-GLU) runs once in its own kernel"


def _gemv(bucket, n, k, *, n_f32=0, pro="none", eps=1e-6, beta=4.0, linear_beta=25.0, **layout):
    """A gemv spec; ``layout``: the output-layout parameters (segments, replicas, f32_replicas) a caller sets."""
    params = dict(bucket=bucket, n=n, k=k, n_f32=n_f32, pro=pro, eps=eps, beta=beta, linear_beta=linear_beta)
    return ("gemv", {**params, **layout})


def _rows(node, tp: int, gather: bool) -> int:
    rows = _shape(node)[0]
    return rows // tp if gather and tp > 1 else rows


def _lower_front_gemm(node, b, tp):
    x, ws, fp32, gather = (_arg(node, a) for a in ("x", "weights", "fp32", "gather"))
    k = _shape(x)[-1]
    n_f32 = sum(_rows(w, tp, g) for w, f, g in zip(ws, fp32, gather) if f)
    n = sum(_rows(w, tp, g) for w, g in zip(ws, gather))
    note = "weights concatenated at load (fp32 entries first); " + (
        "gathered entries: this rank's rows, written into every rank's slot of the gathered layout" if tp > 1
        and any(gather) else "")
    # with more than one batch row, a column slice of a [M, n] output is strided: the kernel writes each bf16
    # entry as its own compact [M, rows] block instead, so its consumers need no copy. An all-gathered entry's
    # block holds TP copies of this rank's rows (REPLICAS): the gathered layout, which one-GPU emulation uses as
    # it is and real ranks fill by an all-gather of one slot (runtime.Binding._front_gemm)
    segs = tuple(_rows(w, tp, g) for w, f, g in zip(ws, fp32, gather) if not f)
    reps = tuple(tp if g and tp > 1 else 1 for f, g in zip(fp32, gather) if not f)
    f32_gather = [g for f, g in zip(fp32, gather) if f]
    f32_reps = tp if tp > 1 and f32_gather == [True] else 1  # one gathered fp32 entry (the router logits)
    gathered = any(r > 1 for r in reps)
    layout = {}
    if (b > 1 and len(segs) > 1) or gathered:
        layout["segments"] = segs
    if gathered:
        layout["replicas"] = reps
    if f32_reps > 1:
        layout["f32_replicas"] = f32_reps
    return [_gemv(b, n, k, n_f32=n_f32, **layout)], note.rstrip("; ")


def _lower_linear(node, b, tp):
    return [_gemv(b, _shape(_arg(node, "weight"))[0], _shape(_arg(node, "x"))[-1])], ""


def _lower_linear_gather(node, b, tp):
    w = _arg(node, "weight")
    n = _rows(w, tp, True)
    return [_gemv(b, n, _shape(w)[1], n_f32=n if _arg(node, "fp32") else 0)], \
        "this rank's rows; all-gathered after the kernel" if tp > 1 else ""


def _lower_rms_norm_linear(node, b, tp):
    w = _arg(node, "weight")
    return [_gemv(b, _shape(w)[0], _shape(w)[1], pro="rms_norm", eps=float(_arg(node, "eps")))], ""


def _lower_lm_head(node, b, tp):
    w = _arg(node, "weight")
    n = _shape(w)[0]
    return [_gemv(b, n, _shape(w)[1], n_f32=n, pro="rms_norm", eps=float(_arg(node, "eps")))], ""


def _lower_situ_linear(node, b, tp):
    """Below PROLOGUE_SPLIT_BUCKET, where the bf16 input fits the GEMV's shared-memory staging: one GEMV whose
    prologue forms SiTU-GLU once per CTA into shared memory (gemv STAGE_X). Otherwise the situ_glu kernel, then
    a plain GEMV: a prologue forming SiTU-GLU in every K step costs an exp and two tanh per element N / ROWS
    times (the dense layer's down-projection, K 4224: 54 us against a 14.5 us weight floor at batch 1). The
    prologue and situ_glu run the same ops, so either form gives the same bits (batch invariance holds)."""
    from .templates.gemv import STAGE_X_BYTES

    w = _arg(node, "weight")
    beta, linear_beta = float(_arg(node, "beta")), float(_arg(node, "linear_beta"))
    n, k = _shape(w)
    if b < PROLOGUE_SPLIT_BUCKET and b * k * 2 <= STAGE_X_BYTES:
        return [_gemv(b, n, k, pro="situ", beta=beta, linear_beta=linear_beta)], ""
    return [("situ_glu", dict(bucket=b, k=k, beta=beta, linear_beta=linear_beta)),
            _gemv(b, n, k, beta=beta, linear_beta=linear_beta)], _PROLOGUE_NOTE


def _residual(b, d, nb, *, add, has_prefix, out_norm, eps, out_eps, tp=1, add_r=False):
    """A residual_attn_res kernel; ``tp`` > 1: it all-reduces its added input ``a`` itself (one-shot);
    ``add_r``: it adds an up-projection output ``r`` to that sum before the prefix."""
    params = dict(bucket=b, d=d, nb=nb, add=add, has_prefix=has_prefix, out_norm=out_norm, eps=eps,
                  out_eps=out_eps, tp=tp)
    return ("residual_attn_res", {**params, "add_r": True} if add_r else params)


def _nb(blocks) -> int:
    return _shape(blocks)[1]


def _lower_rms_norm(node, b, tp):
    return [("rms_norm", dict(bucket=b, n=_shape(_arg(node, "x"))[-1], eps=float(_arg(node, "eps"))))], ""


def _lower_attn_res(node, b, tp):
    blocks = _arg(node, "blocks")
    return [_residual(b, _shape(blocks)[-1], _nb(blocks), add=False, has_prefix=True, out_norm=False,
                      eps=float(_arg(node, "eps")), out_eps=1e-6)], ""


def _lower_attn_res_rms_norm(node, b, tp):
    blocks = _arg(node, "blocks")
    return [_residual(b, _shape(blocks)[-1], _nb(blocks), add=False, has_prefix=True, out_norm=True,
                      eps=float(_arg(node, "eps")), out_eps=float(_arg(node, "out_eps")))], ""


_FUSED_AR = ("the all-reduce runs inside the residual kernel (one-shot over peer buffers; the identity in "
             "single-GPU emulation)")


def _lower_oproj_residual_norm(node, b, tp):
    w, blocks = _arg(node, "weight"), _arg(node, "blocks")
    n, k = _shape(w)
    res = _residual(b, n, _nb(blocks), add=True, has_prefix=_arg(node, "prefix") is not None, out_norm=True,
                    eps=float(_arg(node, "eps")), out_eps=float(_arg(node, "out_eps")), tp=tp)
    note = "two kernels until the GEMV epilogue runs the residual/AttnRes/RMSNorm row step itself"
    if tp > 1:
        note += "; " + _FUSED_AR
    return [_gemv(b, n, k), res], note


def _ffn_up(node, b, tp):
    """The up-projection GEMV (RMSNorm prologue) when the FFN output is ``up(rms_norm(all_reduce(latent_partial)))
    + all_reduce(partial)``, else none: the residual kernel after it adds its output ``r`` (add_r) to the partial
    it all-reduces itself."""
    if _arg(node, "latent_partial") is None:
        return []
    n, k = _shape(_arg(node, "up_weight"))
    up_rank = _arg(node, "up_rank")
    if up_rank is None or up_rank < 0 or tp == 1:
        return [_gemv(b, n, k, pro="rms_norm", eps=float(_arg(node, "latent_eps")))]
    # row-sharded (shard_routing): this rank's n / tp rows, written into every rank's slot of the gathered
    # [B, n] (the single-GPU emulation's all-gather, no copy kernel; real ranks all-gather slot 0)
    return [_gemv(b, n // tp, k, pro="rms_norm", eps=float(_arg(node, "latent_eps")), segments=(n // tp,),
                  replicas=(tp,))]


def _lower_ffn_tail_norm(node, b, tp):
    blocks = _arg(node, "blocks")
    up = _ffn_up(node, b, tp)
    res = _residual(b, _shape(blocks)[-1], _nb(blocks), add=True, has_prefix=True, out_norm=True,
                    eps=float(_arg(node, "eps")), out_eps=float(_arg(node, "out_eps")), tp=tp, add_r=bool(up))
    note = _FUSED_AR + "; the latent all-reduce before the up-projection is NCCL" if tp > 1 else ""
    if up:
        note = ("two kernels until the GEMV epilogue runs the row step itself: up-projection (RMSNorm prologue), "
                "then up + partial + prefix with AttnRes + RMSNorm" + (f"; {note}" if note else ""))
    return up + [res], note


def _lower_ffn_tail(node, b, tp):
    up = _ffn_up(node, b, tp)
    d = _shape(_arg(node, "prefix"))[-1]
    res = _residual(b, d, 0, add=True, has_prefix=True, out_norm=False, eps=1e-6, out_eps=1e-6, tp=tp,
                    add_r=bool(up))
    return up + [res], "the last layer's tail: new prefix only (the output AttnRes reads it)"


def _lower_routed_experts(node, b, tp):
    w1 = _arg(node, "w1_packed")
    e, inter, half_l = _shape(w1)
    params = dict(bucket=b, n_experts=e, top_k=int(_arg(node, "top_k")), latent=2 * half_l, inter=inter,
                  renormalize=bool(_arg(node, "renormalize")), scaling_factor=float(_arg(node, "scaling_factor")),
                  beta=float(_arg(node, "beta")), linear_beta=float(_arg(node, "linear_beta")))
    if b >= ROUTE_MIN_BUCKET:  # select once rather than in every gate/up CTA (M / WARPS selections per warp)
        return [("moe_route", params), ("moe_gate_up", params), ("moe_down_combine", params)], ""
    return [("moe_gate_up", params), ("moe_down_combine", params)], ""


def _lower_kda(node, b, tp):
    a_log = _arg(node, "a_log")
    f_b = _arg(node, "f_b_weight")
    params = dict(bucket=b, heads=_shape(a_log)[0], head_dim=int(_arg(node, "head_dim")), rank=_shape(f_b)[1],
                  conv_width=_shape(_arg(node, "q_conv_weight"))[-1], lower_bound=float(_arg(node, "lower_bound")),
                  eps=float(_arg(node, "eps")))
    return [("kda_decode", params)], ""


def _lower_mla(node, b, tp):
    kv_b = _arg(node, "kv_b_weight")
    nope, vdim = int(_arg(node, "nope_dim")), int(_arg(node, "v_dim"))
    c = _shape(kv_b)[1]
    heads = _shape(kv_b)[0] // (nope + vdim)
    rope = _shape(_arg(node, "kv"))[-1] - c
    params = dict(bucket=b, heads=heads, nope=nope, rope=rope, v=vdim, kv_lora=c,
                  lmax=_shape(_arg(node, "cache"))[1], kv_eps=float(_arg(node, "kv_eps")),
                  scale=float(_arg(node, "scale")))
    return [("mla_decode", params)], ""


class _Uncovered(Exception):
    pass


PROLOGUE_SPLIT_BUCKET = 8  # from this bucket GEMV prologues are kernels (_split_prologues, _lower_situ_linear)


def _split_prologues(specs: list, *, rms_norm: bool) -> tuple[list, bool]:
    """Each GEMV with an RMSNorm prologue as [rms_norm kernel, plain GEMV] when ``rms_norm``. Up to batch 4
    the GEMV forms xin once per CTA in shared memory (gemv STAGE_X). Larger batches do not fit there, and a
    fused prologue forms xin for every group of weight rows a warp takes (N / ROWS times per element): at
    batch 64 most of the time (measured on the H200 at K3 TP8 shapes: the lm_head 1.52 ms). Computed once it
    costs one small launch; the rms_norm kernel sums a row's squares in another order than the prologue.
    (SiTU-GLU prologues: see _lower_situ_linear.)"""
    out, split = [], False
    for t, params in specs:
        if t == "gemv" and params.get("pro") == "rms_norm" and rms_norm and params["k"] % 256 == 0:
            # ^ the rms_norm template's row-length rule
            out += [("rms_norm", dict(bucket=params["bucket"], n=params["k"], eps=params["eps"])),
                    (t, {**params, "pro": "none"})]
            split = True
        else:
            out.append((t, params))
    return out, split


def lower_node(node, bucket: int, tp: int, *, batch_invariant: bool = False, prev: int | None = None,
               arch: str = "sm_90a", l2_prefetch: int | None = None) -> tuple[list, str]:
    """(template, params) specs and a note for one dialect node at one (bucket, TP).

    ``prev``: the bytes the kernel launched just before this node's first one moves (None: not known), which
    sets how much of its weights a GEMV pulls into L2 before its PDL wait (``_gemv_prefetch``, at most
    ``l2_prefetch`` bytes, default PREFETCH_MAX). Codegen and the runtime both walk the lowered graph in
    order and pass it (``last_bytes`` of the node before), so that they name the same kernels.

    From bucket PROLOGUE_SPLIT_BUCKET a GEMV's RMSNorm or SiTU-GLU prologue runs as its own kernel before a
    plain GEMV (_split_prologues, _lower_situ_linear). ``batch_invariant``: every bucket reduces each row in the
    same order as bucket 1, so RMSNorm prologues stay fused (the rms_norm kernel sums a row's squares in
    another order than the GEMV prologue), GEMVs keep the FMA path (the tensor-core path, from bucket 8,
    permutes K inside each MMA) and moe_gate_up gives each expert's reduction to one warp (at batch 1 it
    would split it over two); moe_down_combine, the norm and KDA kernels already do (one row's reduction
    never depends on the other rows or on the bucket's tiling); the MLA split-context decode picks fewer
    context splits and the residual kernel fewer CTAs per row (its cluster) for larger buckets, so here they
    take bucket 1's (more CTAs and workspace at large buckets, same sums)."""
    specs, note = _LOWERING[dialect.op_name(node)](node, bucket, tp)
    specs, split = _split_prologues(specs, rms_norm=not batch_invariant and bucket >= PROLOGUE_SPLIT_BUCKET)
    if split:
        note = "; ".join(x for x in (note, _PROLOGUE_NOTE) if x)
    if batch_invariant:
        specs = batch_invariant_specs(specs)
    most = PREFETCH_MAX if l2_prefetch is None else l2_prefetch
    out = []
    for t, params in specs:  # each kernel after the one before it, the first after ``prev``
        if t == "gemv":
            params = _gemv_prefetch(params, prev, arch, most)
        out.append((t, params))
        prev = _bytes(t, params, arch)
    return out, note


def _bytes(template: str, params: dict, arch: str) -> int:
    p = get_template(template).point(arch=arch, **params)
    return int(p.template.bytes(p.c))


def last_bytes(points: list) -> int | None:
    """What the last of a node's kernels (template points, launch order) moves: ``prev`` of the next node."""
    return int(points[-1].template.bytes(points[-1].c)) if points else None


def batch_invariant_specs(specs: list) -> list:
    """``specs`` with every per-row reduction in bucket 1's order (see ``lower_node``)."""
    from .templates.mla_decode import default_chunk_min, default_splits
    from .templates.residual_attn_res import default_cluster

    specs = [(t, {**params, "ksplit": 1, "diag": False}) if t == "moe_gate_up" else (t, dict(params))
             for t, params in specs]
    # ^ bucket 1 would split each expert's reduction over two warps and sum each MX block apart (DIAG), larger
    # buckets do neither
    for t, params in specs:
        if t == "gemv":
            params["mma"] = False  # the tensor-core path sums K in another order than bucket 1's FMA path
        if t == "mla_decode":
            params.setdefault("chunk_min", default_chunk_min(1))  # a row's splits depend on it and its length
            params["splits"] = default_splits(1, params["lmax"], params["chunk_min"])
            params["combine_rows"] = 1  # the combine kernel's merge order depends on its rows per CTA
            params["balance"] = False  # balanced splits depend on the other rows' lengths
        if t == "residual_attn_res":  # a row's statistics are summed per CTA, then over the cluster
            params["cluster"] = default_cluster(1, params["d"])
    return specs


def check_arch(arch: str) -> None:
    from .templates import TEMPLATES

    archs = sorted({a for t in TEMPLATES.values() for a in t.archs})
    if arch not in archs:
        raise ValueError(f"arch {arch} is not supported: the kernel templates are written for {', '.join(archs)}; "
                         f"pass --arch {archs[0]}")


_LOWERING = {
    "front_gemm": _lower_front_gemm, "linear": _lower_linear, "linear_gather": _lower_linear_gather,
    "rms_norm_linear": _lower_rms_norm_linear, "lm_head": _lower_lm_head, "situ_linear": _lower_situ_linear,
    "rms_norm": _lower_rms_norm, "attn_res": _lower_attn_res, "attn_res_rms_norm": _lower_attn_res_rms_norm,
    "oproj_residual_norm": _lower_oproj_residual_norm, "ffn_tail_norm": _lower_ffn_tail_norm,
    "ffn_tail": _lower_ffn_tail,
    "routed_experts": _lower_routed_experts, "kda_decode_fb": _lower_kda, "mla_decode_latent": _lower_mla,
}


# -------------------------------------------------------------------------------------------- codegen
@dataclass
class Codegen:
    config: str
    arch: str
    tps: tuple[int, ...]
    buckets: tuple[int, ...]
    points: dict[str, Point] = field(default_factory=dict)  # kernel name -> point
    entries: list[Entry] = field(default_factory=list)
    params: dict[str, dict] = field(default_factory=dict)  # kernel name -> template params
    examples: dict[str, str] = field(default_factory=dict)  # kernel name -> "<template>:<label>" (examples mode)
    max_context: int = 0  # MLA cache capacity the kernels serve (plan mode)
    batch_invariant: bool = False  # every bucket reduces a row in bucket 1's order (lower_node)
    l2_prefetch: int = PREFETCH_MAX  # weights a GEMV may pull into L2 ahead of its wait, at most (lower_node)
    skipped_passed: int = 0  # kernels left out because an earlier GPU check passed them (skip_passed)
    only_templates: tuple = ()  # the templates a plan's package was cut down to (keep_templates), if any

    def skip_passed(self, done: set[str]) -> int:
        """Leave out the kernels named in ``done`` (kernel names are source hashes: a name that passed a GPU check
        is that very kernel); the package then holds only the rest, for a GPU check rather than for serving (the
        plan part of the manifest still names every kernel). Returns how many went."""
        gone = self._drop(lambda n, p: n in done)
        self.skipped_passed += gone
        return gone

    def keep_templates(self, names) -> int:
        """Keep only the kernels of these templates (a package for a GPU check of a template's change, not for
        serving: the plan part of the manifest still names every kernel). Returns how many went."""
        from .templates import TEMPLATES

        unknown = sorted(set(names) - set(TEMPLATES))
        if unknown:
            raise ValueError(f"unknown template(s) {', '.join(unknown)}; the templates are "
                             f"{', '.join(sorted(TEMPLATES))}")
        self.only_templates = tuple(sorted(names))
        return self._drop(lambda n, p: p.template.name not in names)

    def _drop(self, leave) -> int:
        """Leave out the kernels for which ``leave(name, point)`` holds; returns how many."""
        gone = [n for n, p in self.points.items() if leave(n, p)]
        for n in gone:
            del self.points[n]
            self.params.pop(n, None)
        return len(gone)

    def uncovered(self) -> list[Entry]:
        return [e for e in self.entries if e.uncovered]

    def implements(self, name: str) -> list[dict]:
        return [{"tp": e.tp, "bucket": e.bucket, "layer_kind": e.layer_kind, "layer": e.layer, "launch": e.launch,
                 "node": e.node} for e in self.entries if name in e.kernels]


def plan_points(config, *, tps, buckets, arch: str = "sm_90a", max_context: int | None = None,
                batch_invariant: bool = False, l2_prefetch: int | None = None) -> Codegen:
    """Lower every layer at every (TP, bucket) and map each plan launch to template points.

    ``max_context`` (default: the config's maximum position count) is the MLA cache capacity the kernels
    serve: the full context length unless a deployment chooses less. ``l2_prefetch``: bytes of weights a
    GEMV may pull into L2 while the kernel before it runs, at most (default PREFETCH_MAX; 0: none beyond
    its first vectors; see ``_gemv_prefetch``)."""
    from .plan import plans_for

    check_arch(arch)
    max_context = config.max_position_embeddings if max_context is None else max_context
    if max_context < 1 or max_context > config.max_position_embeddings:
        raise ValueError(f"max_context {max_context} must be in 1..{config.max_position_embeddings} (the "
                         f"config's max_position_embeddings)")
    l2_prefetch = PREFETCH_MAX if l2_prefetch is None else l2_prefetch
    if l2_prefetch < 0 or l2_prefetch > L2_WINDOW:
        raise ValueError(f"l2_prefetch={l2_prefetch >> 20} MiB must be in 0..{L2_WINDOW >> 20} MiB (what a GEMV may "
                         f"pull into the H200's L2 ahead of its wait); pass 0 to turn the prefetch off")
    cg = Codegen(config.name, arch, tuple(tps), tuple(buckets), max_context=max_context,
                 batch_invariant=batch_invariant)
    for tp in tps:
        plans = plans_for(config, tp=tp, buckets=buckets, every_layer=True, max_context=max_context)
        for b, plan in plans.items():
            groups: dict = {}  # one op can be several launches (routed experts: gate/up, down+combine)
            for lp in plan.layers:
                for la in lp.launches:
                    if la.fx is not None and dialect.is_k3(la.fx):  # unfused torch ops: run by the runtime
                        groups.setdefault(la.fx, (lp, []))[1].append(la)
            order = {n: i for i, n in enumerate(next(iter(groups)).graph.nodes)} if groups else {}
            prev = None  # bytes the kernel launched before the next one moves (None: not known)
            for node in sorted(groups, key=order.__getitem__):  # launch order, as the runtime binds them
                lp, las = groups[node]
                es = [Entry(tp, b, lp.kind, lp.layer, la.name, la.op, la.node) for la in las]
                cg.entries.extend(es)
                prev = _map(cg, node, es, b, tp, arch, batch_invariant, prev, l2_prefetch)
    cg.l2_prefetch = l2_prefetch
    return cg


def _gemv_prefetch(params: dict, prev_bytes: int | None, arch: str, most: int = PREFETCH_MAX) -> dict:
    """``params`` of a GEMV with ``prefetch`` set from what the kernel before it moves (``prev_bytes``).

    A GEMV's CTAs start (PDL) while the kernel before it runs. After attention or the residual kernel,
    latency-bound kernels that move a few MB, HBM sits idle: the GEMV can pull up to PREFETCH_MAX of its
    weights (``most``) into L2 meanwhile: the same number of bytes of every row (the tensor-core path: of every
    CTA's share of K, from its first stages on), as many as the budget allows. The budget
    shrinks by what the kernel before moves, so that the prefetched lines are not evicted before use (after
    a large weight stream, e.g. the dense FFN's up-projection before its down-projection, it is 0 and the
    GEMV prefetches only its first vectors); with the kernel before unknown it is 0 too.

    Off by default (PREFETCH_MAX = 0; ``codegen --l2-prefetch 24`` turns it on): on the H200 at K3 TP8-shard
    widths it measured no gain (BENCHMARKS.md, 2026-12-02 thirteenth entry). At batch 1 the o_proj GEMV after
    the KDA decode was as fast with its 21 MiB in L2 as without, the KDA decode itself got slower under the
    prefetch traffic, and the lm_head, whose grid the prefetch caps to what is resident at once, lost 12 us."""
    budget = 0 if prev_bytes is None else min(most, max(0, L2_WINDOW - prev_bytes))
    if budget == 0:
        return params
    per_row = budget // params["n"] // 256 * 256  # every row of W, from its start (tensor cores: its first stages)
    if not per_row:
        return params
    per_row = get_template("gemv").point(arch=arch, **params, prefetch=per_row).c["PREFETCH"]  # clipped to a row
    return {**params, "prefetch": per_row}


def example_points(templates=None, labels=None, arch: str = "sm_90a") -> Codegen:
    """The templates' own example points (k3-mini and real K3 TP8-shard shapes): what the kernel tests and
    ``bench-kernels`` run. ``labels`` filters by label prefix (e.g. ``mini_``)."""
    from .templates import TEMPLATES

    check_arch(arch)
    cg = Codegen("template examples", arch, (), ())
    for tname in templates or sorted(TEMPLATES):
        t = get_template(tname)
        for label, params in t.examples().items():
            if labels and not any(label.startswith(x) for x in labels):
                continue
            p = t.point(arch=arch, **params)
            cg.points.setdefault(p.name, p)
            cg.params.setdefault(p.name, params)
            cg.examples.setdefault(p.name, f"{tname}:{label}")
    return cg


def _map(cg: Codegen, node, es: list[Entry], b: int, tp: int, arch: str, batch_invariant: bool = False,
         prev: int | None = None, l2_prefetch: int = PREFETCH_MAX) -> int | None:
    """Map one dialect node's launches to template points (recorded in ``cg``); returns the bytes its last
    kernel moves (None if uncovered). ``prev``: the bytes the kernel before it moves (GEMV prefetch)."""
    op = es[0].op
    lower = _LOWERING.get(op)
    try:
        if lower is None:
            raise _Uncovered(f"no template for dialect op {op}" + (
                " (a model-level collective: the runtime issues it through torch.distributed, NCCL on GPUs)"
                if op in dialect.COLLECTIVE_OPS else ""))
        try:
            specs, note = lower_node(node, b, tp, batch_invariant=batch_invariant, prev=prev, arch=arch,
                                     l2_prefetch=l2_prefetch)
        except TemplateError as why:
            raise _Uncovered(str(why)) from None
        names = []
        for tname, params in specs:
            try:
                p = get_template(tname).point(arch=arch, **params)
            except TemplateError as why:
                raise _Uncovered(f"{tname}: {why}") from None
            cg.points.setdefault(p.name, p)
            cg.params.setdefault(p.name, params)
            names.append(p.name)
            prev = last_bytes([p])
    except _Uncovered as why:
        for e in es:
            e.uncovered = str(why)
        return None
    for e, ks in zip(es, per_launch(names, len(es))):
        if ks:
            e.kernels, e.note = ks, note
    return prev


def per_launch(kernels: list, n: int) -> list[list]:
    """A node's kernels over its n plan launches: one each when the counts match, else (more kernels than the
    plan counts: a fusion the templates do not do yet) all on the first."""
    return [[k] for k in kernels] if len(kernels) == n else [list(kernels)] + [[] for _ in range(n - 1)]


def _header(cg: Codegen, name: str) -> list[str]:
    p = cg.points[name]
    uses = cg.implements(name)
    pts = sorted({(u["tp"], u["bucket"]) for u in uses})
    where = sorted({f"{u['layer_kind']}/{u['launch']}" for u in uses})
    lines = [f"kernel: {name}"]
    if name in cg.examples:
        lines.append(f"example point {cg.examples[name]} of the template (kernel tests, bench-kernels)")
    else:
        lines += [f"config: {cg.config}; (TP, bucket) points: " + ", ".join(f"({t}, {b})" for t, b in pts),
                  f"implements: {', '.join(where)}"]
    lines += ["parameters: " + ", ".join(f"{k}={v!r}" for k, v in sorted(cg.params[name].items())),
              "arguments: " + ", ".join(f"{a.name}[{a.role}] {a.dtype}{list(a.shape)}" for a in p.args())]
    return lines


def write(cg: Codegen, out: Path, *, compile: bool = True, package: bool = False, workers: int | None = None,
          quiet: bool = False) -> dict:
    """Render every kernel into ``out``, compile (and package) them; returns the manifest."""
    from . import build

    out.mkdir(parents=True, exist_ok=True)
    names = sorted(cg.points)
    jobs = [build.job_for(cg.points[n], package=package, header=_header(cg, n)) for n in names]
    sources = {j.name: j.source for j in jobs}
    reports: dict[str, dict] = {}
    if compile:
        t0 = time.time()
        reports = build.build(jobs, out / "kernels", workers=workers,
                              progress=None if quiet else _progress(len(jobs), t0))
        if not quiet:
            print(file=sys.stderr)
        if package:
            rt = out / "runtime"
            rt.mkdir(exist_ok=True)
            shutil.copy2(build.runtime_library(), rt / "libcute_dsl_runtime.so")
    for n in names:  # after the build: a cached kernel.py may carry another run's header comments
        d = out / "kernels" / n
        d.mkdir(parents=True, exist_ok=True)
        (d / "kernel.py").write_text(sources[n])
    audits = {n: audit_point(cg.points[n], (out / "kernels" / n / "kernel.ptx").read_text()).as_dict()
              for n in reports}  # memory ordering, read from the PTX (k3compile.audit)
    manifest = _manifest(cg, sources, reports, audits, compiled=compile, packaged=package and compile)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def _progress(total: int, t0: float):
    tty = sys.stderr.isatty()

    def show(name, rep, done, _total):
        bar = "#" * int(30 * done / total)
        tag = "cached" if rep.get("cached") else f"{rep['compile_s']:.1f}s"
        msg = f"[{bar:<30}] {done}/{total} {name} ({tag}) {time.time() - t0:.0f}s"
        print(("\r" + msg.ljust(100)) if tty else msg, end="" if tty else "\n", file=sys.stderr, flush=True)
    return show


def _manifest(cg: Codegen, sources: dict, reports: dict, audits: dict, *, compiled: bool, packaged: bool) -> dict:
    from .build import versions

    kernels = {}
    for n, p in sorted(cg.points.items()):
        t = p.template
        c = p.c
        kernels[n] = {
            "template": t.name, "arch": p.arch, "parameters": cg.params[n], "constants": c,
            "arguments": [{"name": a.name, "dtype": a.dtype, "shape": list(a.shape), "role": a.role}
                          for a in p.args()],
            "bytes": int(t.bytes(c)), "flops": int(t.flops(c)),
            "source_sha256": hashlib.sha256(sources[n].encode()).hexdigest(),
            "implements": cg.implements(n),
            **({"example": cg.examples[n]} if n in cg.examples else {}),
        }
        if n in reports:
            r = reports[n]
            kernels[n]["ptxas"] = {k: r[k] for k in ("registers", "stack_bytes")}
            kernels[n]["audit"] = audits[n]
    plan: dict = {}
    for e in cg.entries:
        kinds = plan.setdefault(f"tp{e.tp}_b{e.bucket}", {})
        kinds.setdefault(e.layer_kind, {}).setdefault(str(e.layer), []).append(
            {"launch": e.launch, "op": e.op, "node": e.node, "kernels": e.kernels,
             **({"uncovered": e.uncovered} if e.uncovered else {}), **({"note": e.note} if e.note else {})})
    unc = cg.uncovered()
    return {"manifest_version": MANIFEST_VERSION, "config": cg.config, "arch": cg.arch, "tp": list(cg.tps),
            "buckets": list(cg.buckets), "max_context": cg.max_context, "batch_invariant": cg.batch_invariant,
            "l2_prefetch": cg.l2_prefetch, **({"skipped_passed": cg.skipped_passed} if cg.skipped_passed else {}),
            **({"only_templates": list(cg.only_templates)} if cg.only_templates else {}),
            "versions": versions() if compiled else {}, "compiled": compiled,
            "packaged": packaged, "kernels": kernels, "plan": plan,
            "coverage": {"plan_launches": len(cg.entries), "covered": len(cg.entries) - len(unc),
                         "uncovered": sorted({f"{e.layer_kind}/{e.launch} ({e.op}): {e.uncovered}" for e in unc})}}


def summary(manifest: dict) -> str:
    cov = manifest["coverage"]
    ctx = f", context up to {manifest['max_context']}" if manifest.get("max_context") else ""
    lines = [f"k3compile codegen: {manifest['config']}, TP {manifest['tp']}, buckets {manifest['buckets']}{ctx}, "
             f"{manifest['arch']}: {len(manifest['kernels'])} kernels for {cov['plan_launches']} plan launches"]
    by_t: dict[str, int] = {}
    for k in manifest["kernels"].values():
        by_t[k["template"]] = by_t.get(k["template"], 0) + 1
    lines.append("  per template: " + ", ".join(f"{t} {n}" for t, n in sorted(by_t.items())))
    if manifest["compiled"]:
        worst = max((k["ptxas"]["registers"] for k in manifest["kernels"].values()), default=0)
        spills: dict[str, list[int]] = {}
        for k in manifest["kernels"].values():
            if k["ptxas"]["stack_bytes"]:
                spills.setdefault(k["template"], []).append(k["ptxas"]["stack_bytes"])
        per = ", ".join(f"{t} {len(b)} ({min(b)}-{max(b)} B)" if min(b) != max(b) else f"{t} {len(b)} ({b[0]} B)"
                        for t, b in sorted(spills.items()))
        lines.append(f"  compiled for {manifest['arch']}: max {worst} registers; local memory (spills or a "
                     f"local array) in {sum(len(b) for b in spills.values())} kernels" + (f": {per}" if per else "")
                     + ("; the manifest's ptxas entries name them" if spills else ""))
        bad = [n for n, k in manifest["kernels"].items() if not k["audit"]["ok"]]
        n_all = len(manifest["kernels"])
        lines.append(f"  memory-ordering audit (PTX: only weights read, nothing written and no dependent "
                     f"released before griddepcontrol.wait): {n_all - len(bad)} of {n_all} kernels pass")
        for n in bad:
            lines += [f"  audit FAILED: {p}" for p in manifest["kernels"][n]["audit"]["problems"]]
    lines.append(f"  coverage: {cov['covered']} of {cov['plan_launches']} plan launches have kernels")
    for u in cov["uncovered"]:
        lines.append(f"  uncovered: {u}")
    return "\n".join(lines)
