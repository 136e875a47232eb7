"""shared_expert_stream: the shared expert's down-projection runs on a side stream, joined by events.

After front_gemm the shared expert's gate/up come out of the MoE front GEMM; what is left of it is
one kernel (SiTU + down-projection, partial under TP) that only the FFN tail consumes. It overlaps
with the routed-expert kernels on the main stream::

    main:   front_gemm ──► routed_experts ───────────────────────► ffn_tail_norm
                 │ record(ev_fork)                                     ▲ wait(ev_join)
    shared:      └── wait(ev_fork) ─► situ_linear (shared down) ── record(ev_join)

Streams are node metadata (``meta["k3_stream"]``); the kernel plan turns every cross-stream edge into
an event record/wait. The kernel runtime runs them on a second CUDA stream (``runtime.route_streams``: the
node moves up to just after its inputs, a fork before it, a join before its consumer); ``side_streams=False``
launches every kernel on one stream in graph order instead.
Collectives always stay on the main stream: moving one to a side stream corrupts results under CUDA-graph
replay in other systems, and ``ensures`` rejects any graph that does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx

from k3compile import dialect
from k3compile.pipeline import K3Pass, PassConfig, PassContext, PassResult, Stage, register_pass

MAIN = "main"


@dataclass(frozen=True)
class SharedExpertStreamConfig(PassConfig):
    stream: str = "shared_expert"


@register_pass
class SharedExpertStream(K3Pass):
    name = "shared_expert_stream"
    stage = Stage.SCHEDULE
    config_cls = SharedExpertStreamConfig

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        count = 0
        for n in gm.graph.nodes:
            if not dialect.is_k3(n, "ffn_tail_norm") and not dialect.is_k3(n, "ffn_tail"):
                continue
            latent, partial = n.args[0], n.args[4]
            if latent is None or not dialect.is_k3(partial, "situ_linear") or len(partial.users) != 1:
                continue  # dense FFN (no routed experts to overlap with) or an unexpected shape
            partial.meta["k3_stream"] = self.config.stream
            count += 1
        return PassResult(match_count=count, changed=count > 0)

    def ensures(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        check_collectives_on_main(gm, self)


def check_collectives_on_main(gm: torch.fx.GraphModule, p: K3Pass) -> None:
    for n in gm.graph.nodes:
        stream = n.meta.get("k3_stream", MAIN)
        if stream != MAIN and (dialect.is_k3(n) and dialect.op_name(n) in dialect.COLLECTIVE_OPS
                               or dialect.communicates(n)):
            raise p.fail("ensures", f"collective {n.name} ({dialect.op_name(n)}) is on stream {stream!r}; "
                                    "collectives must stay on the main stream")
