"""select_kernels: pick the kernel family and parameters of every dialect op for this bucket.

The graph does not change shape; each kernel node gets ``meta["k3_kernel"]`` from
``k3compile/kernel_table.py`` and the graph text shows it::

    before                                   after
    ------                                   -----
    fg = k3.front_gemm(y, [...])  # ...      fg = k3.front_gemm(y, [...])  # ... @gemv(cores=fma)
    e  = k3.routed_experts(z, ...)           e  = k3.routed_experts(z, ...)  # ... @mxfp4_mma(decode=prepacked,...)
"""

from __future__ import annotations

import torch.fx

from k3compile import dialect
from k3compile.kernel_table import choose
from k3compile.pipeline import K3Pass, PassContext, PassResult, Stage, register_pass


@register_pass
class SelectKernels(K3Pass):
    name = "select_kernels"
    stage = Stage.SELECT

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        count = 0
        for n in gm.graph.nodes:
            if not dialect.is_k3(n):
                continue
            op = dialect.op_name(n)
            has_up = op.startswith("ffn_tail") and n.args[3] is not None
            choice = choose(op, ctx.bucket, has_up)
            if choice is not None:
                n.meta["k3_kernel"] = choice
                count += 1
        return PassResult(match_count=count, changed=count > 0)

    def ensures(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        for n in gm.graph.nodes:
            if dialect.is_k3(n) and not dialect.is_k3(n, "prefetch") and "k3_kernel" not in n.meta:
                raise self.fail("ensures", f"{n.name} has no kernel")
