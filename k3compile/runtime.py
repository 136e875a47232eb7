"""The kernel runtime: runs a lowered decode graph through the generated kernels.

Per (bucket, TP) the pipeline's lowered FX graph holds K3 dialect ops (``k3::front_gemm``, ...) and a
little torch glue (embedding lookup, ``torch.stack`` of the AttnRes blocks, the MLA cache write). The
runtime rewrites every dialect node into a :class:`Binding` that calls the kernels codegen maps that
node to (``codegen._LOWERING``: the same mapping, so the package built offline is exactly what runs), and
drops the glue the kernels make redundant: the blocks reach the residual kernels as a list
(``_unstack_blocks``), the MLA kernel writes the new cache row itself (``_drop_cache_writes``), the KDA
kernel updates its state in place (``_drop_self_copies``)::

    before: front_gemm_0 = k3.front_gemm(x, [Wq, Wk, Wv, ...], fp32, gather, '', 1, 0)
    after:  front_gemm_0 = Binding[front_gemm -> gemv_1a2b3c4d5e](x, [Wq, Wk, Wv, ...], ...)
                           # one GEMV over the weights concatenated at first use, outputs split; the
                           # model's parameters are then pointed at their rows of the concatenation
                           # (same values, one copy in memory; eager decode keeps working)

Kernels come from a :class:`KernelSource`:

* :class:`PackageKernels`: a prebuilt package (``k3compile codegen --package``, loaded with ``tvm_ffi``)
  or one compiled just in time into the build cache (:func:`jit_package`, needs the CuTe DSL);
* :class:`ReferenceKernels`: each kernel's float64 template reference, on any device. CI runs the whole
  decode step this way on the CPU: it checks every binding (argument order, weight concatenation, output
  splits, in-place state) against eager without a GPU; the GPU tests check the kernels themselves.

On CUDA each bucket's graph is captured once into a CUDA graph (first call: a real step that also warms
up; later calls: replay) over static token buffers; the state and weights are used in place, so a
replay reads the current state (never stale pointers or values). Batches below the bucket are padded;
the padding rows' state is saved and restored around the step (rows ``B..bucket-1`` of the state are
left exactly as eager leaves them), so the state needs at least ``bucket`` rows.

Every kernel launch is counted (:func:`launch_counts`; a graph replay counts the launches it holds),
and so is every dialect op that ran through its eager implementation instead (:func:`eager_fallbacks`).
``k3compile verify`` and the GPU tests prove with these counters that the fast path ran.
"""

from __future__ import annotations

import collections
import functools
import logging
import operator
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.fx

from . import comm, dialect
from .models.mxfp4 import mark_relaid, relaid_layout
from .templates.base import to_kernel_layout, to_kernel_layout_

log = logging.getLogger("k3compile")

_LAUNCHES: collections.Counter = collections.Counter()  # kernel name -> launches
_FALLBACKS: collections.Counter = collections.Counter()  # dialect op -> eager runs (fallbacks)
_COPIES: collections.Counter = collections.Counter()  # "kernel:argument" -> inputs copied to fit the kernel


def launch_counts() -> dict[str, int]:
    """Kernel name -> launches since the last :func:`reset_launch_counts` (graph replays included)."""
    return dict(_LAUNCHES)


def eager_fallbacks() -> dict[str, int]:
    """Dialect op name -> times it ran through its eager implementation instead of kernels."""
    return dict(_FALLBACKS)


def input_copies() -> dict[str, int]:
    """``"kernel:argument"`` -> times an input was copied before a launch because it was not the compact,
    aligned tensor the kernel takes (a strided or misaligned view): each copy is an extra torch kernel on the
    hot path, counted here rather than hidden. The fused front GEMVs write each entry as a compact block
    (gemv SEGMENTS), so their outputs need none. A weight in a kernel's own layout converted again (it came
    as a new view: ``_relaid``) counts here too."""
    return dict(_COPIES)


def reset_launch_counts() -> None:
    _LAUNCHES.clear()
    _FALLBACKS.clear()
    _COPIES.clear()
    _SHADOW.clear()


class RuntimeError_(RuntimeError):
    """The kernel runtime cannot run this graph as asked (missing kernel, bad state, ...)."""


# ------------------------------------------------------------------------------------------ kernel sources
class KernelSource:
    name = "?"
    l2_prefetch = None  # the GEMVs' L2 prefetch budget the kernels were named with (None: codegen's default)

    def function(self, point) -> Callable:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


class ReferenceKernels(KernelSource):
    """Each kernel's float64 template reference (slow; any device). Checks the bindings, not the kernels."""
    name = "reference"

    def function(self, point):
        args = point.args()

        def run(*tensors):
            d = {a.name: t for a, t in zip(args, tensors)}
            # the kernel's arguments as the kernel gets them: weights in its own layout, read back as the model's
            inputs = {a.name: to_kernel_layout(a, d[a.name].detach().cpu(), inverse=True).clone() for a in args
                      if a.role != "out"}
            for name, value in point.template.reference(point.c, inputs).items():
                d[name].copy_(value.to(d[name].dtype))
        return run


class PackageKernels(KernelSource):
    """Kernels of a prebuilt package (``tvm_ffi``, no compiler needed)."""
    name = "package"

    def __init__(self, package):
        from .package import KernelPackage

        self.package = package if isinstance(package, KernelPackage) else KernelPackage(package)
        self.l2_prefetch = self.package.manifest.get("l2_prefetch")  # as codegen --l2-prefetch built it

    def function(self, point):
        if point.name not in self.package.kernels:
            raise RuntimeError_(
                f"kernel {point.name} ({point.template.name}, bucket {point.c.get('M')}) is not in the package "
                f"{self.package.root}: it was built for other buckets, TP sizes, context capacity or template "
                f"sources. Fix: rebuild it with `k3compile codegen --config ... --tp ... --buckets ... "
                f"--max-context <state max_context> --package -o {self.package.root}` from this checkout, or "
                f"compile with kernels='jit'")
        return self.package.function(point.name)

    def describe(self) -> str:
        return f"package {self.package.root}"


def jit_package(points: dict, out: Path, *, workers: int | None = None):
    """Compile ``points`` (kernel name -> Point) into a package at ``out`` (disk-cached: a second run is a
    lookup). Needs the CuTe DSL compiler (``nvidia-cutlass-dsl``)."""
    from . import codegen

    try:
        import cutlass  # noqa: F401
    except ImportError:
        raise RuntimeError_("kernels='jit' needs the CuTe DSL compiler: pip install 'nvidia-cutlass-dsl[cu13]"
                            "==4.8.1', or pass a prebuilt package (kernels='package:DIR')") from None
    cg = codegen.Codegen("jit", next(iter(points.values())).arch, (), ())
    for name, p in points.items():
        cg.points[name] = p
        cg.params[name] = {c.name: c.value for c in p.constants}
    codegen.write(cg, Path(out), package=True, workers=workers, quiet=True)
    return PackageKernels(Path(out))


# ---------------------------------------------------------------------------------------------- kernels
class Kernel:
    """One compiled template point: allocates its outputs, fits its inputs, counts its launches."""

    relay_in_place = False  # a weight in a layout of the kernel's own is rewritten in its own memory (_relaid)

    def __init__(self, point, fn: Callable, device):
        self.point, self.fn, self.name = point, fn, point.name
        self.args = point.args()
        self.device = device

    def __call__(self, **given) -> dict[str, torch.Tensor]:
        tensors, outs = [], {}
        for a in self.args:
            if a.role in ("out", "scratch"):  # scratch: the kernel writes what it reads (no clearing)
                t = torch.empty(a.shape, dtype=a.torch_dtype, device=self.device)
                outs[a.name] = t
            else:
                t = _fit(self.name, a, given[a.name])
                if a.layout is not None:
                    t = _relaid(self.name, a, t, self.relay_in_place)
            tensors.append(t)
        _count(self.name)
        self.fn(*tensors)
        return outs


_RELAID_BYTES: dict = {}  # id of a weight's relaid copy -> its bytes (dropped when the copy dies)
_CONVERSIONS: collections.Counter = collections.Counter()  # (layout, pointer, version, shape) -> conversions


def _relaid(kernel: str, a, t: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """A weight in the layout its kernel reads (``Arg.layout``): made once and kept on the weight tensor itself
    (it lives and dies with the weight; remade if the weight is written in place), so a decode step does no
    conversion and a CUDA graph captures the kept copy. A weight that reaches the kernel as a new view each
    call is converted again every call: each repeat counts as an input copy, so it shows in ``input_copies()``.

    ``in_place`` (option ``relay_in_place``): the weight's own bytes are rewritten instead, once, and marked
    (``models.mxfp4.mark_relaid``), so no copy is kept: the model's eager ops read the codes back through the
    undo; a weight written after that is refused here and by them (its layout is unknown)."""
    layout = relaid_layout(t)  # (an error if the weight was written after an in-place conversion)
    if layout is not None:
        if layout != a.layout:
            raise RuntimeError_(f"{kernel}: weight {a.name} was rewritten in place into layout {layout!r}; this "
                                f"kernel reads {a.layout!r}. Fix: compile without relay_in_place")
        return t
    key = (a.layout, t.data_ptr(), t._version, tuple(t.shape))
    hit = getattr(t, "_k3_relaid", None)
    if hit is not None and hit[0] == key:
        if in_place and not getattr(t, "_k3_copy_kept", False):  # (an earlier step's CUDA graph may read the copy)
            t._k3_copy_kept = True
            log.warning("%s: weight %s already has a copy in the kernel's layout, made by a step compiled without "
                        "relay_in_place; that copy stays in use and no memory is saved. Fix: load the model afresh "
                        "for relay_in_place", kernel, a.name)
        return hit[1]
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError_(f"{kernel}: weight {a.name} would be converted to the kernel's layout inside a CUDA "
                            f"graph capture (then again at every replay); it changed since the warm-up step. "
                            f"Fix: do not write weights in place between steps, or recompile after loading them")
    if in_place:
        if hit is not None:  # a copy made before, now stale: dropped
            del t._k3_relaid
        to_kernel_layout_(a, t)
        mark_relaid(t, a.layout, functools.partial(to_kernel_layout, a, inverse=True))
        return t
    out = to_kernel_layout(a, t)
    t._k3_relaid = (key, out)
    _CONVERSIONS[key] += 1
    if _CONVERSIONS[key] > 1:
        _count(f"copy:{kernel}:{a.name}")
    _RELAID_BYTES[id(out)] = out.numel() * out.element_size()
    weakref.finalize(out, _RELAID_BYTES.pop, id(out), None)
    return out


def relaid_bytes(module: torch.nn.Module | None = None) -> int:
    """Bytes of weights kept in a kernel's own layout (``Arg.layout``: the routed experts' MXFP4 codes) beside
    the model's: in a deployment converted once at load in place of the checkpoint's layout. All of this
    process's, or only those kept on ``module``'s parameters and buffers."""
    if module is None:
        return sum(_RELAID_BYTES.values())
    kept = {id(h[1]): h[1] for t in (*module.parameters(), *module.buffers())
            if (h := getattr(t, "_k3_relaid", None)) is not None}
    return sum(c.numel() * c.element_size() for c in kept.values())


def _fit(kernel: str, a, t: torch.Tensor) -> torch.Tensor:
    """The tensor as the kernel takes it: static shape and dtype, compact row-major, aligned base."""
    if tuple(t.shape) != tuple(a.shape) or t.dtype != a.torch_dtype:
        raise RuntimeError_(f"{kernel}: argument {a.name} is {t.dtype}{list(t.shape)}, the kernel takes "
                            f"{a.torch_dtype}{list(a.shape)} (a binding bug: please report it)")
    if t.is_contiguous() and t.data_ptr() % a.align == 0:
        return t
    if a.role == "state":  # written in place: a copy would lose the update
        raise RuntimeError_(f"{kernel}: state argument {a.name} is not a compact, {a.align}-byte aligned view of "
                            f"the decode state; allocate the state with model.new_state(...)")
    if a.role == "comm":  # shared with the peer ranks: a copy would be invisible to them
        raise RuntimeError_(f"{kernel}: communication buffer {a.name} is not a compact, {a.align}-byte aligned "
                            f"tensor (a k3compile.comm bug: please report it)")
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    _count(f"copy:{kernel}:{a.name}")
    return out


_RECORDING: list | None = None  # kernel names launched while a CUDA graph is being captured


def _counter(name: str) -> tuple[collections.Counter, str]:
    """The counter a recorded name goes to: ``eager:op`` fallbacks, ``copy:kernel:arg`` input copies, else
    kernel launches."""
    for prefix, counter in (("eager:", _FALLBACKS), ("copy:", _COPIES)):
        if name.startswith(prefix):
            return counter, name.removeprefix(prefix)
    return _LAUNCHES, name


def _count(name: str) -> None:
    counter, key = _counter(name)
    counter[key] += 1
    if _RECORDING is not None:
        _RECORDING.append(name)


# --------------------------------------------------------------------------------------------- bindings
def _named(op, args, kwargs) -> dict:
    names = [a.name for a in op._schema.arguments]
    out = dict(zip(names, args))
    out.update(kwargs)
    return out


def emulating(tp: int) -> bool:
    """TP > 1 on a fake process group (one GPU standing in for rank 0): collectives are not run."""
    import torch.distributed as dist

    return tp > 1 and dist.is_initialized() and dist.get_backend() == "fake"


def _gather(x: torch.Tensor, group: str, tp: int) -> torch.Tensor:
    """All-gather of the ranks' shards along the last dim (NCCL / gloo through torch.distributed). In
    single-GPU emulation every rank's shard is taken to equal this rank's (communication excluded)."""
    if tp == 1:
        return x
    if emulating(tp):
        return x.repeat(1, tp)
    _count("collective:all_gather")
    return dialect._all_gather_last(x.contiguous(), group, tp)


def _reduce(x: torch.Tensor, group: str, tp: int) -> torch.Tensor:
    """All-reduce (sum) over the TP group; the identity at TP 1 and in single-GPU emulation."""
    if tp == 1 or emulating(tp):
        return x
    _count("collective:all_reduce")
    return dialect._all_reduce(x, group, tp)


class Binding:
    """A dialect node's kernels, called like the dialect op (same arguments, same outputs)."""

    def __init__(self, node, kernels: list[Kernel], tp: int, note: str, bucket: int):
        self.op = dialect.op_name(node)
        self.key = f"b{bucket}:{node.name}"
        self.target = node.target
        self.node = node.name
        self.kernels = kernels
        self.tp = tp
        self.note = note
        self._weights: dict = {}  # front_gemm: concatenated weights, keyed by the source tensors
        self.shadow = False  # also run the eager op and record the error (KernelDispatcher(shadow=True))
        self.oneshot_max_bytes = comm.ONESHOT_MAX_BYTES  # Options.oneshot_max_bytes
        self.__name__ = f"k3_{self.op}"

    def __repr__(self) -> str:
        return f"Binding[{self.op} -> {', '.join(k.name for k in self.kernels)}]"

    def __call__(self, *args, **kwargs):
        a = _named(self.target, args, kwargs)
        if not self.shadow:
            return getattr(self, "_" + self.op)(a, *self.kernels)
        ra, rk = _restacked(self.target, args, kwargs)
        ref = self.target(*ra, **rk)  # functional: reads the state before the kernels update it
        out = getattr(self, "_" + self.op)(a, *self.kernels)
        errs = [_rel(o, r) for o, r in zip(_as_list(out), _as_list(ref))]
        _SHADOW[self.key] = max([_SHADOW.get(self.key, 0.0), *errs])
        return out

    # -- GEMV family --------------------------------------------------------------------------------
    def _linear(self, a, g):
        return _single(g(w=a["weight"], x=a["x"]))

    def _linear_gather(self, a, g):
        w = a["weight"]
        n = w.shape[0] // self.tp
        y = _single(g(w=w[a["rank"] * n:(a["rank"] + 1) * n], x=a["x"]))
        return _gather(y, a["group"], self.tp)

    def _front_gemm(self, a, g):
        ws, fp32, gather, rank = a["weights"], a["fp32"], a["gather"], a["rank"]
        rows = [w.shape[0] // self.tp if gth and self.tp > 1 else w.shape[0] for w, gth in zip(ws, gather)]
        order = [i for i in range(len(ws)) if fp32[i]] + [i for i in range(len(ws)) if not fp32[i]]
        cat = _adjacent(ws, order, rows)
        if cat is None:  # first call (or sharded entries): concatenate once, keep it for the graph
            key = tuple((w.data_ptr(), w._version) for w in ws)
            cat = self._weights.get(key)
            if cat is None:
                cat = self._weights[key] = _concatenate(ws, order, rows, rank)
        out = g(w=cat, x=a["x"])
        c = g.point.c
        res: list = [None] * len(ws)
        off = {True: 0, False: 0}
        segs = reps = None
        if c["SEGMENTS"]:
            from .templates.gemv import out_blocks, segment_views

            segs = iter(segment_views(out["y_bf16"], out_blocks(c)))
            reps = iter(c["REPLICAS"] or (1,) * len(c["SEGMENTS"]))
        for i in order:
            copies = 1
            if segs is not None and not fp32[i]:  # the kernel wrote this entry as a compact [M, rows] block
                y, copies = next(segs), next(reps)
            elif fp32[i] and c["F32_REPLICAS"] > 1:  # the one fp32 entry, in every rank's slot
                y, copies = out["y_f32"], c["F32_REPLICAS"]
            else:
                src = out["y_f32"] if fp32[i] else out["y_bf16"]
                y = src.narrow(1, off[fp32[i]], rows[i])
                off[fp32[i]] += rows[i]
            if not (gather[i] and self.tp > 1):
                res[i] = y
            elif copies > 1 and emulating(self.tp):  # every rank's slot holds this rank's rows: the gathered
                res[i] = y  # layout of the emulation (communication excluded), with no copy kernel
            else:  # real ranks: this rank's slot to the all-gather
                res[i] = _gather(y.narrow(1, 0, rows[i]) if copies > 1 else y, a["group"], self.tp)
        return res

    @staticmethod
    def _normed_gemv(ks, w, x, norm_weight) -> dict:
        """GEMV of rms_norm(x): one kernel (RMSNorm in its prologue), or from bucket 8 the rms_norm kernel then
        a plain GEMV (codegen._split_prologues)."""
        if len(ks) == 2:
            return ks[1](w=w, x=ks[0](x=x, weight=norm_weight)["y"])
        return ks[0](w=w, x=x, norm_weight=norm_weight)

    def _rms_norm_linear(self, a, *ks):
        return _single(self._normed_gemv(ks, a["weight"], a["x"], a["norm_weight"]))

    def _lm_head(self, a, *ks):
        return self._normed_gemv(ks, a["weight"], a["h"], a["norm_weight"])["y_f32"]

    def _situ_linear(self, a, *ks):
        if len(ks) == 2:  # the situ_glu kernel, then a plain GEMV (codegen._lower_situ_linear)
            return _single(ks[1](w=a["weight"], x=ks[0](gate=a["gate"], up=a["up"])["h"]))
        return _single(ks[0](w=a["weight"], gate=a["gate"], up=a["up"]))

    # -- norms and residuals -----------------------------------------------------------------------
    def _rms_norm(self, a, k):
        return k(x=a["x"], weight=a["weight"])["y"]

    @staticmethod
    def _blocks(a) -> dict:
        """AttnRes inputs: the sealed blocks one tensor each (``block<b>``: the list ``_unstack_blocks`` put in
        place of the graph's ``torch.stack``; a stacked [M, NB, D] tensor is split into views, which the kernel
        call copies), the projection as a [D] vector (a [1, D] linear weight in the model)."""
        blocks = a["blocks"]
        blocks = blocks.unbind(1) if isinstance(blocks, torch.Tensor) else blocks
        return {**{f"block{b}": t for b, t in enumerate(blocks)}, "norm_weight": a["norm_weight"],
                "proj_weight": a["proj_weight"].reshape(-1)}

    def _attn_res(self, a, k):
        return k(prefix=a["prefix"], **self._blocks(a))["y"]

    def _attn_res_rms_norm(self, a, k):
        return k(prefix=a["prefix"], out_norm_weight=a["out_norm_weight"], **self._blocks(a))["y"]

    def _summed(self, k, x: torch.Tensor, group: str) -> dict:
        """Arguments that make residual kernel ``k`` add ``x`` summed over the TP ranks: the kernel's own
        one-shot all-reduce when it has one (TP > 1, :mod:`k3compile.comm`), else ``x`` as it is (TP 1)."""
        if k.point.c["TP"] == 1:
            return {"a": x}
        return comm.wire(k.point, x, group, self.tp, oneshot_max_bytes=self.oneshot_max_bytes, count=_count)

    def _residual(self, k, a, partial, prefix, **extra):
        blocks = self._blocks(a) if k.point.c["NB"] else {}
        o = k(prefix=prefix, out_norm_weight=a.get("out_norm_weight"), **self._summed(k, partial, a["group"]),
              **blocks, **extra)
        return o["y"], o["new_prefix"]

    def _oproj_residual_norm(self, a, g, res):
        return self._residual(res, a, _single(g(w=a["weight"], x=a["y"])), a["prefix"])

    def _ffn_sum(self, a, up) -> dict:
        """What the final residual kernel adds to the prefix: the partial, which that kernel all-reduces, and
        with a latent up-projection its output ``r`` (kernels ``up``: the GEMV with its RMSNorm prologue, or the
        rms_norm kernel and the GEMV), which the kernel adds to the summed partial first (add_r), as eager's
        ``prefix + (r + all_reduce(partial))``."""
        if a["latent_partial"] is None:
            return {}
        latent = _reduce(a["latent_partial"], a["group"], self.tp)
        w, rank = a["up_weight"], a.get("up_rank", -1)
        if rank is None or rank < 0 or self.tp == 1:
            return {"r": _single(self._normed_gemv(up, w, latent, a["latent_norm_weight"]))}
        # row-sharded (shard_routing): this rank's rows, which the GEMV writes into every rank's slot of the
        # gathered layout (REPLICAS): the emulation's all-gather as it is, real ranks all-gather slot 0
        n = w.shape[0] // self.tp
        r = _single(self._normed_gemv(up, w[rank * n:(rank + 1) * n], latent, a["latent_norm_weight"]))
        return {"r": r if emulating(self.tp) else _gather(r.narrow(1, 0, n), a["group"], self.tp)}

    def _ffn_tail_norm(self, a, *ks):
        return self._residual(ks[-1], a, a["partial"], a["prefix"], **self._ffn_sum(a, ks[:-1]))

    def _ffn_tail(self, a, *ks):
        return ks[-1](prefix=a["prefix"], **self._ffn_sum(a, ks[:-1]),
                      **self._summed(ks[-1], a["partial"], a["group"]))["new_prefix"]

    # -- experts and attention ---------------------------------------------------------------------
    def _routed_experts(self, a, *ks):
        """gate/up selects the experts itself (two kernels), or from ROUTE_MIN_BUCKET moe_route selects once and
        gate/up reads its ids (three); down reads gate/up's grouping of the pairs by expert."""
        *route, gate_up, down = ks
        w = {n: a[n] for n in ("w1_packed", "w1_scale", "w3_packed", "w3_scale")}
        if route:
            sel = route[0](logits=a["logits"], score_bias=a["score_bias"])
            gu = gate_up(z=a["z"], ids=sel["ids"], **w)
        else:
            sel = gu = gate_up(z=a["z"], logits=a["logits"], score_bias=a["score_bias"], **w)
        return down(h=gu["h"], groups=gu["groups"], weights=sel["weights"], w2_packed=a["w2_packed"],
                    w2_scale=a["w2_scale"])["y"]

    def _kda_decode_fb(self, a, k):
        names = ("q", "k", "v", "f_a", "f_b_weight", "beta_logits", "g", "conv_q", "conv_k", "conv_v",
                 "recurrent_state", "q_conv_weight", "k_conv_weight", "v_conv_weight", "a_log", "dt_bias",
                 "o_norm_weight")
        y = k(**{n: a[n] for n in names})["y"]  # conv and recurrent state updated in place
        return y, a["conv_q"], a["conv_k"], a["conv_v"], a["recurrent_state"]

    def _mla_decode_latent(self, a, k):
        o = k(q=a["q"], kv=a["kv"], kv_norm_weight=a["kv_norm_weight"], gate=a["gate"], cache=a["cache"],
              lengths=a["lengths"], kv_b_weight=a["kv_b_weight"])
        return o["out"], o["latent"]


def _restacked(op, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``op``'s arguments with the blocks list ``_unstack_blocks`` passes stacked back into the [M, NB, D]
    tensor the eager op takes."""
    names = [a.name for a in op._schema.arguments]
    i = names.index("blocks") if "blocks" in names else None
    if i is not None and i < len(args) and isinstance(args[i], list):
        args = args[:i] + (torch.stack(args[i], 1),) + args[i + 1:]
    if isinstance(kwargs.get("blocks"), list):
        kwargs = {**kwargs, "blocks": torch.stack(kwargs["blocks"], 1)}
    return args, kwargs


def _adjacent(ws, order, rows):
    """The weights (in kernel order) as one [sum(rows), K] view when they already lie back to back in one
    storage (what :func:`_concatenate` leaves behind), else None."""
    first = ws[order[0]]
    if any(rows[i] != ws[i].shape[0] or not ws[i].is_contiguous() for i in order):
        return None
    base, off = first.untyped_storage().data_ptr(), first.storage_offset()
    for i in order:
        w = ws[i]
        if w.untyped_storage().data_ptr() != base or w.storage_offset() != off:
            return None
        off += w.numel()
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                   (sum(rows[i] for i in order), first.shape[1]))


def _concatenate(ws, order, rows, rank: int) -> torch.Tensor:
    """Concatenate the weights once (fp32 entries first), then point every full (unsharded) weight at its
    rows of the result: the model keeps working, its values are unchanged, and no second copy stays in
    memory. The next call finds them adjacent (:func:`_adjacent`)."""
    parts = [ws[i][rank * rows[i]:(rank + 1) * rows[i]] if rows[i] != ws[i].shape[0] else ws[i] for i in order]
    cat = torch.cat(parts, 0).contiguous()
    if all(rows[i] == ws[i].shape[0] for i in order):
        off = 0
        with torch.no_grad():
            for i in order:
                ws[i].data = cat[off:off + rows[i]]
                off += rows[i]
    return cat


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _rel(o: torch.Tensor, r: torch.Tensor) -> float:
    r64, o64 = r.double(), o.double()
    return float((o64 - r64).norm() / r64.norm().clamp_min(1e-30))


_SHADOW: dict = {}  # node -> max relative error of its kernels against its eager op (shadow mode)


def shadow_errors() -> dict[str, float]:
    """``b<bucket>:<node>`` -> max ||kernels - eager op|| / ||eager op|| over the steps run with ``shadow=True``."""
    return dict(_SHADOW)


def _single(out: dict) -> torch.Tensor:
    return out.get("y_bf16", out.get("y_f32"))


class Collective:
    """A model-level collective node (``tp_all_reduce`` / ``tp_all_gather``): issued by the runtime through
    torch.distributed (NCCL, gloo); counted as ``collective:<kind>``; no-ops in single-GPU emulation."""

    def __init__(self, node):
        self.op, self.target, self.node = dialect.op_name(node), node.target, node.name
        self.kernels: list = []
        self.shadow = False
        self.__name__ = f"k3_{self.op}"

    def __repr__(self) -> str:
        return f"Collective[{self.op}]"

    def __call__(self, x, group, tp):
        return _reduce(x, group, tp) if self.op == "tp_all_reduce" else _gather(x, group, tp)


class EagerOp:
    """A dialect op run through its eager implementation (a fallback: counted, and verification fails)."""

    def __init__(self, node, why: str, planned: tuple = ()):
        self.op, self.target, self.node, self.why = dialect.op_name(node), node.target, node.name, why
        self.planned = tuple(planned)  # kernel names that should have run instead
        self.__name__ = f"eager_{self.op}"

    def __repr__(self) -> str:
        return f"EagerOp[{self.op}: {self.why}]"

    def __call__(self, *args, **kwargs):
        _FALLBACKS[self.op] += 1
        if _RECORDING is not None:
            _RECORDING.append("eager:" + self.op)
        return self.target(*args, **kwargs)


def _is_check(node) -> bool:
    return node.op == "call_function" and node.target in (torch.ops.k3model.check_decode_inputs,
                                                          torch.ops.k3model.check_decode_inputs.default)


def _positions(token_ids, lengths, vocab_size, max_context):
    """check_decode_inputs inside the graph: the check itself runs before the step (it synchronises)."""
    return lengths.clone()


# ------------------------------------------------------------------------------------------ graph rewrite
@dataclass
class BoundGraph:
    gm: torch.fx.GraphModule
    bucket: int
    bindings: list  # Binding | EagerOp, in graph order
    kernels: dict  # kernel name -> Kernel

    def planned(self) -> collections.Counter:
        """Kernel name -> launches one step of this graph makes."""
        c: collections.Counter = collections.Counter()
        for b in self.bindings:
            c.update(b.planned) if isinstance(b, EagerOp) else c.update(k.name for k in b.kernels)
        return c

    def table(self) -> str:
        return "\n".join(f"{b.node:<34} {b!r}" for b in self.bindings)


def bind(gm: torch.fx.GraphModule, *, bucket: int, tp: int, source: KernelSource, arch: str, device,
         disable: tuple = (), batch_invariant: bool = False) -> BoundGraph:
    """Rewrite a lowered graph so that every dialect node calls its kernels.

    ``disable``: dialect ops or kernel names forced to run eagerly (tests of the coverage proof).
    Model-level collectives become :class:`Collective` nodes (torch.distributed; no-ops in emulation)."""
    from .codegen import _LOWERING, last_bytes

    gm = torch.fx.GraphModule(gm, _copy_graph(gm.graph))
    kernels: dict[str, Kernel] = {}
    bindings: list = []
    prev = None  # bytes the kernel before moves: a GEMV's L2 prefetch depends on it (codegen.lower_node)
    for node in list(gm.graph.nodes):
        if _is_check(node):
            node.target = _positions
            continue
        if node.op != "call_function" or not dialect.is_k3(node):
            continue
        op = dialect.op_name(node)
        if op == "prefetch":
            node.target = _noop
            continue
        if op in ("tp_all_reduce", "tp_all_gather"):
            node.target = Collective(node)
            bindings.append(node.target)
            prev = None
            continue
        if op not in _LOWERING:
            raise RuntimeError_(f"{node.name}: no kernel template for {op}; the runtime cannot run this graph on "
                                f"kernels")
        points, note = node_points(node, bucket=bucket, tp=tp, arch=arch, batch_invariant=batch_invariant,
                                   prev=prev, l2_prefetch=source.l2_prefetch)
        prev = last_bytes(points)
        if op in disable or any(p.name in disable for p in points):
            b = EagerOp(node, "disabled by the caller", [p.name for p in points])
        else:
            ks = []
            for p in points:
                if p.name not in kernels:
                    kernels[p.name] = Kernel(p, source.function(p), device)
                ks.append(kernels[p.name])
            b = Binding(node, ks, tp, note, bucket)
        node.target = b
        bindings.append(b)
    _drop_self_copies(gm.graph)
    _drop_cache_writes(gm.graph)
    _unstack_blocks(gm.graph)
    gm.recompile()
    return BoundGraph(gm, bucket, bindings, kernels)


def node_points(node, *, bucket: int, tp: int, arch: str, batch_invariant: bool = False, prev: int | None = None,
                l2_prefetch: int | None = None) -> tuple[list, str]:
    """The template points (kernels) that implement one dialect node, in launch order, and a note. ``prev``:
    what the kernel before moves (``codegen.lower_node``; graph order, collectives reset it to None)."""
    from .codegen import _Uncovered, lower_node
    from .templates import get as get_template
    from .templates.base import TemplateError

    op = dialect.op_name(node)
    try:
        specs, note = lower_node(node, bucket, tp, batch_invariant=batch_invariant, prev=prev, arch=arch,
                                 l2_prefetch=l2_prefetch)
        return [get_template(t).point(arch=arch, **params) for t, params in specs], note
    except (_Uncovered, TemplateError) as e:
        raise RuntimeError_(f"{node.name} ({op}) at bucket {bucket}, TP {tp}: {e}") from None


def graph_points(gm: torch.fx.GraphModule, *, bucket: int, tp: int, arch: str, batch_invariant: bool = False,
                 l2_prefetch: int | None = None) -> dict:
    """Kernel name -> Point for every kernel a lowered graph needs (what ``kernels='jit'`` compiles; the
    same walk as ``bind``)."""
    from .codegen import _LOWERING, last_bytes

    out, prev = {}, None
    for node in gm.graph.nodes:
        if node.op != "call_function" or not dialect.is_k3(node) or dialect.op_name(node) == "prefetch":
            continue
        if dialect.op_name(node) not in _LOWERING:  # a collective
            prev = None
            continue
        points = node_points(node, bucket=bucket, tp=tp, arch=arch, batch_invariant=batch_invariant, prev=prev,
                             l2_prefetch=l2_prefetch)[0]
        out.update((p.name, p) for p in points)
        prev = last_bytes(points)
    return out


def _noop(*args, **kwargs):
    return None


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    new = torch.fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


def _slice_key(n):
    """(state placeholder, index) for ``placeholder[index]`` nodes, else None."""
    if isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target is operator.getitem \
            and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "placeholder":
        return n.args[0].name, repr(n.args[1])
    return None


def _drop_self_copies(graph: torch.fx.Graph) -> None:
    """``state[:B].copy_(new_state)`` where the kernel already updated ``state[:B]`` in place: drop it."""
    for node in list(graph.nodes):
        if node.op != "call_method" or node.target != "copy_" or node.users:
            continue
        dst, src = node.args[0], node.args[1]
        if not (isinstance(src, torch.fx.Node) and src.target is operator.getitem and
                isinstance(src.args[0].target, Binding) and src.args[0].target.op == "kda_decode_fb"):
            continue
        kda, idx = src.args[0], src.args[1]
        if idx == 0:
            continue
        state_arg = _named(dialect.k3_ops()["kda_decode_fb"], kda.args, kda.kwargs)[
            ("conv_q", "conv_k", "conv_v", "recurrent_state")[idx - 1]]
        if _slice_key(dst) is not None and _slice_key(dst) == _slice_key(state_arg):
            graph.erase_node(node)
            if not dst.users:
                graph.erase_node(dst)


def _drop_cache_writes(graph: torch.fx.Graph) -> None:
    """``cache.index_put_((arange(B), positions), latent.to(bf16))`` of the latent row a kernel-bound
    ``mla_decode_latent`` returned: drop it, and its ``.to`` and ``arange`` when nothing else uses them (the
    layers may share one ``arange``). The mla_decode absorb kernel writes that row itself, in place, so this is
    exact: the same rows (the op's cache argument is ``cache[:B]``, the slice ``arange(B)`` indexes), the same
    positions (the op's ``lengths`` argument is the node the index_put_ takes as positions), the same bf16
    values (``.to`` of the bf16 latent is the identity). Padding rows (a batch below its bucket) run with
    lengths 0: the kernel writes position 0 of their cache rows as the index_put_ did, and
    ``KernelDispatcher._save_padding_rows`` saves and restores that position around the step. An op run
    eagerly (``EagerOp``: a disabled kernel) does not write the cache: its index_put_ stays."""
    mla = dialect.k3_ops()["mla_decode_latent"]
    for node in list(graph.nodes):
        if node.op != "call_method" or node.target != "index_put_" or node.users or len(node.args) != 3 \
                or node.kwargs:
            continue
        dst, indices, value = node.args
        to = value if (isinstance(value, torch.fx.Node) and value.op == "call_method" and value.target == "to"
                       and (value.args[1:], value.kwargs) in (((torch.bfloat16,), {}),
                                                              ((), {"dtype": torch.bfloat16}))) else None
        src = to.args[0] if to is not None else value
        if not (isinstance(src, torch.fx.Node) and src.op == "call_function" and src.target is operator.getitem
                and src.args[1] == 1 and isinstance(src.args[0].target, Binding)
                and src.args[0].target.op == "mla_decode_latent"):
            continue
        a = _named(mla, src.args[0].args, src.args[0].kwargs)
        if not (isinstance(indices, (tuple, list)) and len(indices) == 2):
            continue
        rows, positions = indices
        key = _slice_key(a["cache"])
        if not (isinstance(rows, torch.fx.Node) and rows.op == "call_function" and rows.target is torch.arange
                and len(rows.args) == 1 and positions is a["lengths"] and isinstance(dst, torch.fx.Node)
                and dst.op == "placeholder" and key is not None and key[0] == dst.name
                and a["cache"].args[1] == slice(None, rows.args[0], None)):
            continue
        graph.erase_node(node)
        for n in (to, src, rows):
            if n is not None and not n.users:
                graph.erase_node(n)


def _unstack_blocks(graph: torch.fx.Graph) -> None:
    """``k3.op(..., torch.stack([b0, b1, ..], 1), ...)`` -> ``k3.op(..., [b0, b1, ..], ...)`` for kernel-bound
    AttnRes ops: the residual kernel takes each sealed block as its own tensor, so the [M, NB, D] copy the
    stack makes (one launch, NB rows per token) is not needed. The stack node goes when nothing else uses it;
    eager-run ops (``EagerOp``) keep the stacked tensor."""
    for node in list(graph.nodes):
        if not (node.op == "call_function" and isinstance(node.target, Binding)):
            continue
        names = [a.name for a in node.target.target._schema.arguments]
        if "blocks" not in names:
            continue
        i = names.index("blocks")
        src = node.args[i] if i < len(node.args) else node.kwargs.get("blocks")
        if not (isinstance(src, torch.fx.Node) and src.op == "call_function" and src.target is torch.stack
                and len(src.args) == 2 and src.args[1] == 1 and not src.kwargs):
            continue
        if i < len(node.args):
            node.args = node.args[:i] + (list(src.args[0]),) + node.args[i + 1:]
        else:
            node.kwargs = {**node.kwargs, "blocks": list(src.args[0])}
        if not src.users:
            graph.erase_node(src)


# ------------------------------------------------------------------------------------------ side streams
class OnStream:
    """A binding whose node the plan puts on a side stream (``meta["k3_stream"]``, passes/shared_expert_stream).

    Fork: the side stream first waits for everything the current (main) stream has queued, then the binding's
    kernels launch on it. Its tensor inputs are recorded on the side stream, so the caching allocator does not
    hand their memory to later main-stream work before the side kernels are done (inside a CUDA graph capture
    the allocator keeps such blocks until the capture ends). ``Join`` nodes make the main stream wait for it
    before the first consumer of its outputs. The side stream's next use is again after a fork, so memory of
    its outputs, freed on the main stream, is not reused before the main stream has read it.

    ``streams``: ``StreamOps`` (CUDA: torch.cuda streams; the tests pass fakes that log the order)."""

    def __init__(self, binding, stream, streams: "StreamOps"):
        self.binding, self.stream, self.streams = binding, stream, streams
        self.__name__ = getattr(binding, "__name__", "k3_side")

    def __repr__(self) -> str:
        return f"OnStream[{self.binding!r}]"

    def __call__(self, *args, **kwargs):
        self.stream.wait_stream(self.streams.current())
        with self.streams.use(self.stream):
            out = self.binding(*args, **kwargs)
        flat: list = []
        torch.fx.node.map_aggregate((args, kwargs), lambda x: flat.append(x) if isinstance(x, torch.Tensor) else x)
        for t in flat:
            if t.is_cuda:
                t.record_stream(self.stream)
        return out


class Join:
    """The main stream waits for a side stream's work (a node inserted before the first consumer)."""

    def __init__(self, stream, streams: "StreamOps"):
        self.stream, self.streams = stream, streams
        self.__name__ = "k3_join"

    def __call__(self):
        self.streams.current().wait_stream(self.stream)


class StreamOps:
    """The stream operations of ``route_streams``: one side stream per name (made on first use), the current
    stream, and a context that makes a stream current."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.side: dict = {}

    def stream(self, name: str):
        if name not in self.side:
            self.side[name] = torch.cuda.Stream(self.device)
        return self.side[name]

    def current(self):
        return torch.cuda.current_stream(self.device)

    def use(self, stream):
        return torch.cuda.stream(stream)


def _consumers(node: torch.fx.Node) -> list:
    """The nodes that read ``node``'s outputs, through tuple ``getitem`` nodes."""
    out = []
    for u in node.users:
        if u.op == "call_function" and u.target is operator.getitem:
            out += _consumers(u)
        else:
            out.append(u)
    return out


_STATE_WRITERS = ("kda_decode_fb", "mla_decode_latent")  # kernel-bound ops that write decode state in place


def _writes(node: torch.fx.Node) -> bool:
    """Whether a node writes memory in place: an in-place method (``copy_``, ``index_put_``) or a kernel-bound
    op that updates decode state."""
    if node.op == "call_method" and str(node.target).endswith("_"):
        return True
    t = node.target.binding if isinstance(node.target, OnStream) else node.target
    return isinstance(t, (Binding, EagerOp)) and t.op in _STATE_WRITERS


def route_streams(graph: torch.fx.Graph, streams: StreamOps) -> list:
    """Run the nodes the plan puts on a side stream there (see ``OnStream``): each is moved up to just after
    its last input (so that the main-stream work between, e.g. the routed experts after the MoE front GEMM, is
    queued after it and overlaps it), unless a node in between writes memory in place (``_writes``: then it
    stays where it is, still on the side stream); a ``Join`` goes before its first consumer. Returns the routed
    nodes' names."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    routed = []
    for node in list(graph.nodes):
        name = node.meta.get("k3_stream", "main")
        if name == "main" or node.op != "call_function" or not isinstance(node.target, (Binding, EagerOp)):
            continue
        inputs = node.all_input_nodes
        last = max(inputs, key=order.__getitem__) if inputs else None
        if last is not None and last.op != "placeholder" and not any(
                _writes(n) for n in graph.nodes if order[last] < order[n] < order[node]):
            last.append(node)
        stream = streams.stream(name)
        node.target = OnStream(node.target, stream, streams)
        order = {n: i for i, n in enumerate(graph.nodes)}
        consumers = _consumers(node)
        if consumers:
            with graph.inserting_before(min(consumers, key=order.__getitem__)):
                graph.call_function(Join(stream, streams), ())
        order = {n: i for i, n in enumerate(graph.nodes)}
        routed.append(node.name)
    return routed


# ------------------------------------------------------------------------------------------- dispatcher
class KernelDispatcher:
    """What the backend hands Dynamo on the kernel runtime: bucket lookup, padding, CUDA graphs.

    ``graphs``: the lowered graph per bucket; ``inputs``: what each placeholder is (capture.InputInfo)."""

    def __init__(self, graphs: dict[int, torch.fx.GraphModule], inputs, *, tp: int, source: KernelSource,
                 arch: str, device, options, fallback=None):
        self.buckets = tuple(sorted(graphs))
        self.lowered = graphs  # the pipeline's graphs (dialect ops), before binding
        self.options = options
        self.fallback = fallback
        self.device = torch.device(device)
        self.source = source
        disable = tuple(options.disable_kernels)
        self.bound = {b: bind(gm, bucket=b, tp=tp, source=source, arch=arch, device=self.device, disable=disable,
                              batch_invariant=options.batch_invariant)
                      for b, gm in graphs.items()}
        self.token_index = next(i for i, info in enumerate(inputs) if info.kind == "token_ids")
        self.sym_index = [i for i, info in enumerate(inputs) if info.kind == "symint"]
        self.state_index = [i for i, info in enumerate(inputs) if info.kind == "state"]
        gm = graphs[self.buckets[0]]
        ph = {n.name: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
        check = next(n for n in gm.graph.nodes if _is_check(n))
        self.lengths_index = ph[check.args[1].args[0].name]
        self.vocab_size, self.max_context = int(check.args[2]), int(check.args[3])
        self.cache_index = {ph[n.args[0].name] for n in gm.graph.nodes
                            if n.op == "call_method" and n.target == "index_put_"}
        # shadow: every dialect node also runs its eager op on the same inputs and the error is recorded
        # (runtime.shadow_errors()); it synchronises, so it runs without CUDA graphs
        self.shadow = bool(options.shadow)
        for bg in self.bound.values():
            for b in bg.bindings:
                b.shadow = self.shadow
                b.oneshot_max_bytes = options.oneshot_max_bytes
            for k in bg.kernels.values():
                k.relay_in_place = bool(options.relay_in_place)
        self.use_graphs = bool(options.cuda_graphs) and self.device.type == "cuda" and not self.shadow
        self.side_streams: dict = {}  # bucket -> the nodes run on a side stream (options.side_streams)
        side = options.side_streams
        if side is None:  # default: on for a CUDA step, except in shadow mode
            side = self.device.type == "cuda" and not self.shadow
        if side:
            if self.device.type != "cuda":
                raise RuntimeError_(f"side_streams=True runs the plan's side-stream kernels on CUDA streams; the step "
                                    f"runs on {self.device}. Fix: run it on a CUDA device, or leave side_streams at "
                                    f"None (the default: a second stream on CUDA only) or False")
            streams = StreamOps(self.device)
            for b, bg in self.bound.items():
                self.side_streams[b] = route_streams(bg.gm.graph, streams)
                bg.gm.recompile()
        self.calls: dict[int, int] = {b: 0 for b in self.buckets}
        self._graphs: dict = {}  # (bucket, state pointers) -> (CUDAGraph, static tokens, outputs, launches)
        self._warm: set = set()
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    @property
    def graphs(self) -> dict[int, torch.fx.GraphModule]:
        return {b: bg.gm for b, bg in self.bound.items()}

    def __call__(self, *args):
        from .compiler import above_largest_bucket, bucket_for

        tokens = args[self.token_index]
        B = tokens.shape[0]
        b = bucket_for(B, self.buckets)
        if b is None:
            above_largest_bucket(B, self.buckets, self.options)
            _FALLBACKS["whole_step"] += 1
            return self.fallback(*args)
        if tokens.device != self.device:
            raise RuntimeError_(f"token_ids are on {tokens.device}, the compiled step runs on {self.device}; "
                                f"pass token ids on the model's device")
        self.calls[b] += 1
        lengths = args[self.lengths_index]
        if self.options.check_inputs:  # the eager model's check (synchronises); check_inputs=False skips it
            torch.ops.k3model.check_decode_inputs(tokens, lengths[:B], self.vocab_size, self.max_context)
        args = list(args)
        saved = []
        if B < b:
            if lengths.shape[0] < b:
                raise RuntimeError_(
                    f"batch {B} runs in bucket {b}, but the state holds only {lengths.shape[0]} rows; the compiled "
                    f"step pads the batch to its bucket. Fix: allocate the state with model.new_state({b} or more, "
                    f"max_context) (rows past the batch are kept exactly as they were); model.generate does so "
                    f"with decode=k3compile.compile(model, ...)")
            saved = self._save_padding_rows(args, B, b)
            args[self.token_index] = torch.cat([tokens, tokens.new_zeros(b - B)])
        for i in self.sym_index:
            args[i] = b
        with torch.no_grad():
            out = self._run(self.bound[b], args)
        for dst, value in saved:
            dst.copy_(value)
        if B < b:
            out = type(out)(o[:B] if isinstance(o, torch.Tensor) else o for o in out)
        return out

    def _save_padding_rows(self, args, B: int, b: int) -> list:
        """The padding rows run real (throwaway) work: save what they change, zero their lengths so they
        write position 0 of their caches; restored after the step."""
        saved = []
        for i in self.state_index:
            t = args[i]
            view = t[B:b, 0] if i in self.cache_index else t[B:b]
            saved.append((view, view.clone()))
        args[self.lengths_index][B:b] = 0
        return saved

    def _run(self, bg: BoundGraph, args: list):
        if not self.use_graphs:
            return bg.gm(*args)
        key = (bg.bucket, tuple(args[i].data_ptr() for i in self.state_index))
        entry = self._graphs.get(key)
        if entry is None:
            if bg.bucket not in self._warm:  # first call: a real step that also warms up (module loads)
                self._warm.add(bg.bucket)
                return bg.gm(*args)
            entry = self._graphs[key] = self._capture(bg, args)
        graph, static_tokens, outputs, launches = entry
        static_tokens.copy_(args[self.token_index])
        graph.replay()
        for name in launches:
            counter, key = _counter(name)
            counter[key] += 1
        return type(outputs)(o.clone() if isinstance(o, torch.Tensor) else o for o in outputs)

    def _capture(self, bg: BoundGraph, args: list):
        global _RECORDING
        static_tokens = args[self.token_index].clone()
        args = list(args)
        args[self.token_index] = static_tokens
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        _RECORDING = []
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                outputs = bg.gm(*args)
            launches = _RECORDING
        finally:
            _RECORDING = None
        for name in launches:  # captured, not run: counted at each replay instead
            counter, key = _counter(name)
            counter[key] -= 1
        log.info("k3compile: captured bucket %d into a CUDA graph (%d kernel launches, %d input copies)", bg.bucket,
                 sum(_counter(n)[0] is _LAUNCHES for n in launches), sum(_counter(n)[0] is _COPIES for n in launches))
        return graph, static_tokens, outputs, launches

    def coverage(self, counts: dict | None = None, fallbacks: dict | None = None) -> dict:
        """The coverage proof: for every bucket that ran, each planned kernel's launches against what the
        steps require. ``problems`` names every planned kernel that never ran (or ran fewer times than the
        steps need) and every eager fallback; empty means the fast path ran everywhere it was planned."""
        counts = launch_counts() if counts is None else counts
        fallbacks = eager_fallbacks() if fallbacks is None else fallbacks
        need: collections.Counter = collections.Counter()
        rows = []
        for b, bg in self.bound.items():
            steps = self.calls[b]
            if not steps:
                continue
            for name, per_step in bg.planned().items():
                need[name] += per_step * steps
        problems = []
        for name, n in sorted(need.items()):
            got = counts.get(name, 0)
            rows.append({"kernel": name, "required": n, "launched": got})
            if got < n:
                problems.append(f"kernel {name} launched {got} times, the steps run need {n}"
                                + (" (never ran)" if not got else ""))
        for b, bg in self.bound.items():
            for e in bg.bindings:
                if isinstance(e, EagerOp) and self.calls[b]:
                    instead = f" instead of {', '.join(e.planned)}" if e.planned else ""
                    problems.append(f"bucket {b}: {e.node} ({e.op}) ran eagerly{instead}: {e.why}")
        for op, n in sorted(fallbacks.items()):
            problems.append(f"eager fallback {op}: {n} times")
        return {"kernels": rows, "calls": dict(self.calls), "problems": problems}
