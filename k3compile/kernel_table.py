"""Which kernel family (and parameters) each dialect op becomes, per batch bucket: the label the
``select_kernels`` pass puts on every node (``@gemv(cores=fma)`` in the graph text) and the plan reports.

The label names the template family and its bucket-level choice; which template points and how many GPU
kernels a launch really becomes is codegen's lowering (``codegen.lower_node``, shown per launch by
``k3compile plan``). The rules here follow the templates': every GEMM op of the decode step is the ``gemv``
template, an FMA loop below ``gemv.MMA_MIN_BUCKET`` and ``mma.sync`` tensor-core tiles (the batch as the MMA
N dimension) from there (one-warp-per-row GEMVs fell to 2.9 TB/s at batch 4 on the H200: docs/gpu.md); the
MXFP4 experts decode their prepacked codes in registers and run ``mma.sync`` m16n8k16 at every bucket
(``moe_gate_up`` / ``moe_down_combine``), with the router selection a launch of its own from
``ROUTE_MIN_BUCKET``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .templates.gemv import MMA_MIN_BUCKET
from .templates.moe_experts import ROUTE_MIN_BUCKET


@dataclass(frozen=True)
class KernelChoice:
    family: str
    launches: tuple[str, ...]  # kernel launches this op becomes, in order
    params: dict = field(default_factory=dict, compare=False)

    def __str__(self) -> str:
        p = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.family}({p})" if p else self.family


# dialect op -> (what the op is, its launch names)
GEMM_OPS = {"linear", "front_gemm", "linear_gather", "situ_linear", "rms_norm_linear", "oproj_residual_norm",
            "lm_head"}
ROW_OPS = {"rms_norm", "add_rms_norm", "attn_res", "attn_res_rms_norm", "situ_glu", "moe_select", "moe_route",
           "allreduce_rms_norm", "tp_all_reduce", "tp_all_gather"}


def gemm_family(bucket: int) -> tuple[str, dict]:
    return "gemv", {"cores": "mma.sync" if bucket >= MMA_MIN_BUCKET else "fma"}


def choose(op: str, bucket: int, has_up: bool = False) -> KernelChoice | None:
    """The kernel for one dialect op at ``bucket`` (None for ops that launch nothing: the prefetch hints of
    passes/prefetch_weights, which no kernel issues yet)."""
    if op in GEMM_OPS:
        fam, params = gemm_family(bucket)
        return KernelChoice(fam, (op,), params)
    if op in ("ffn_tail", "ffn_tail_norm"):
        if has_up:
            fam, params = gemm_family(bucket)
            return KernelChoice(fam, (op,), params)
        return KernelChoice("one_shot_allreduce", (op,))
    if op in ("latent_moe_experts", "routed_experts"):
        fam, params = "mxfp4_mma", {"decode": "prepacked", "mma": "m16n8k16"}
        route = (f"{op}_route",) if op == "routed_experts" and bucket >= ROUTE_MIN_BUCKET else ()
        return KernelChoice(fam, (*route, f"{op}_gate_up", f"{op}_down_combine"), params)
    if op in ("kda_decode", "kda_decode_fb"):
        return KernelChoice("kda_decode", (op,), {"heads_per_cta": 1})
    if op in ("mla_decode", "mla_decode_latent"):
        return KernelChoice("mla_decode_split_kv", (op,), {"kv_split": "by_context"})
    if op in ROW_OPS:
        return KernelChoice("rowwise", (op,))
    if op == "prefetch":
        return None
    raise KeyError(f"no kernel table row for dialect op {op!r}")
