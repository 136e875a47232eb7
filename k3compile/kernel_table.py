"""Which kernel family (and parameters) each dialect op becomes, per batch bucket.

One table, read by the ``select_kernels`` pass, the kernel plan and codegen. The thresholds come from
the measured starting points on the H200 (docs/gpu.md): a one-warp-per-row bf16 GEMV reaches the copy
ceiling at batch 1 but an FMA-loop GEMV falls to 2.9 TB/s at batch 4, so GEMV is used for buckets 1-2,
split-K for small batches and tensor cores from there; MXFP4 experts decode in registers and switch to
``mma.sync`` with dequantised weights (batch as the MMA N dimension) from bucket 4. Benchmarks refine
these rows; the table is the one place to change them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .templates.moe_experts import ROUTE_MIN_BUCKET

GEMV_MAX_BUCKET = 2
SPLITK_MAX_BUCKET = 16
MXFP4_GEMV_MAX_BUCKET = 2


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


def gemm_family(bucket: int, k: int) -> tuple[str, dict]:
    if bucket <= GEMV_MAX_BUCKET:
        return "gemv", {"warps_per_row": 1, "vec_bytes": 16}
    if bucket <= SPLITK_MAX_BUCKET:
        return "splitk_gemm", {"split_k": max(1, min(8, math.ceil(k / 1024)))}
    return "wgmma_gemm", {"tile_m": 64, "tile_n": 128, "swap_ab": True}


def choose(op: str, bucket: int, k_dim: int = 0, has_up: bool = False) -> KernelChoice | None:
    """The kernel for one dialect op at ``bucket`` (None for ops that launch nothing, e.g. prefetch hints
    are issued by the kernel before them)."""
    if op in GEMM_OPS:
        fam, params = gemm_family(bucket, k_dim)
        return KernelChoice(fam, (op,), params)
    if op in ("ffn_tail", "ffn_tail_norm"):
        if has_up:
            fam, params = gemm_family(bucket, k_dim)
            return KernelChoice(fam, (op,), params)
        return KernelChoice("one_shot_allreduce", (op,))
    if op in ("latent_moe_experts", "routed_experts"):
        fam = "mxfp4_gemv" if bucket <= MXFP4_GEMV_MAX_BUCKET else "mxfp4_mma"
        params = {"decode": "prmt_lut"} if fam == "mxfp4_gemv" else {"mma": "m16n8k16", "n": min(64, bucket)}
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
