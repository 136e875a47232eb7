"""The compiler's table of contents: every pass, in order, one line each.

Stages run in order (k3compile.pipeline.Stage); a pass may be restricted to some buckets through its
config (``buckets=(...)``), in which case it is recorded as skipped for the others.
"""

from __future__ import annotations

from k3compile.passes.eliminate_dead_code import EliminateDeadCode
from k3compile.passes.front_gemm import FrontGemm
from k3compile.passes.fuse_attn_res_norm import FuseAttnResNorm
from k3compile.passes.fuse_elementwise import FuseElementwise
from k3compile.passes.fuse_oproj_allreduce import FuseOprojAllreduce
from k3compile.passes.lift_dialect import LiftDialect
from k3compile.passes.prefetch_weights import PrefetchWeights
from k3compile.passes.select_kernels import SelectKernels
from k3compile.passes.shard_routing import ShardRouting
from k3compile.passes.shared_expert_stream import SharedExpertStream

from .pipeline import PASS_REGISTRY, PassConfig, Pipeline


def default_passes() -> list:
    return [
        # --- LIFT: torch-level capture -> K3 dialect ops (with provenance)
        LiftDialect(),            # semantic calls, linears and collectives -> k3.* ops
        # --- CLEANUP
        EliminateDeadCode(),      # unused nodes; state writes and collectives always stay
        # --- SHARD: no duplicated work across TP ranks
        ShardRouting(),           # router scoring + latent down-/up-projections split across ranks, all-gathered
        # --- FUSE
        FuseAttnResNorm(),        # AttnRes read + the RMSNorm consuming it -> one op
        FuseOprojAllreduce(),     # o_proj -> all-reduce -> residual -> AttnRes -> norm; the MoE/MLP tails
        FrontGemm(),              # GEMMs reading the same input -> one front GEMM
        FuseElementwise(),        # SiTU, norms, f_b, expert selection into their neighbours
        # --- SCHEDULE
        SharedExpertStream(),     # shared expert on a side stream; collectives stay on main
        PrefetchWeights(),        # L2 prefetch of the next weights before each collective
        # --- SELECT
        SelectKernels(),          # kernel family + parameters per bucket (kernel_table.py)
    ]


def build_pipeline(pass_options: dict[str, dict] | None = None) -> Pipeline:
    """The default pipeline; ``pass_options = {"<pass name>": {"enabled": False, "buckets": (1, 2)}}``."""
    passes = default_passes()
    pass_options = dict(pass_options or {})
    unknown = set(pass_options) - {p.name for p in passes}
    if unknown:
        raise KeyError(f"unknown pass(es) {sorted(unknown)}; known: {sorted(PASS_REGISTRY)}")
    out = []
    for p in passes:
        opts = pass_options.get(p.name)
        if opts:
            cfg = p.config
            if isinstance(opts, PassConfig):
                cfg = opts
            else:
                if "buckets" in opts and opts["buckets"] is not None:
                    opts = {**opts, "buckets": tuple(opts["buckets"])}
                cfg = type(cfg)(**{**cfg.__dict__, **opts})
            p = type(p)(cfg)
        out.append(p)
    return Pipeline(out)
