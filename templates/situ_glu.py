"""Template ``situ_glu``: SiTU-GLU of [bucket, K] bf16 gate/up rows (kernel: kernels/situ_glu.py).

The GEMV's ``situ`` prologue as its own launch. From bucket 8 the lowering (``codegen.lower_node``) runs
it once before a plain GEMV instead of inside the GEMV, which would recompute it for every group of weight
rows (for batch 64 at K3 shapes, half a billion transcendental evaluations per dense FFN). Same fp32 ops and
fast-math flags as the prologue, so both give the same bf16 values.
"""

from __future__ import annotations

import torch

from .base import Arg, Template, const, need, need_bucket



class SituGlu(Template):
    name = "situ_glu"
    kernel_file = "situ_glu.py"
    doc = "SiTU-GLU of decode rows (gate, up -> h), 128-bit loads; the GEMV prologue as its own launch"

    def constants(self, *, bucket: int, k: int, beta: float, linear_beta: float) -> list:
        need_bucket("situ_glu", bucket)
        need(isinstance(k, int) and k > 0 and k % 8 == 0,
             f"situ_glu: row length k={k!r} must be a positive multiple of 8 (one 128-bit vector per thread); "
             f"pad the intermediate size")
        need(beta > 0 and linear_beta > 0, f"situ_glu: beta={beta} and linear_beta={linear_beta} must be > 0")
        vecs = k // 8
        threads = 128 if vecs >= 128 else max(32, -(-vecs // 32) * 32)
        return [const("M", bucket, "rows (the batch bucket)"), const("K", k, "row length"),
                const("BETA", float(beta), "SiTU gate beta"), const("LINEAR_BETA", float(linear_beta),
                                                                  "SiTU linear beta"),
                const("THREADS", threads, "threads per CTA (8 elements each)")]

    def examples(self):
        return {f"{cfg}_b{b}": {"bucket": b, "k": k, "beta": 4.0, "linear_beta": 25.0}
                for cfg, k in (("mini", 512), ("k3tp8", 4224)) for b in (1, 8, 64)}

    def args(self, c):
        m, k = c["M"], c["K"]
        return [Arg("gate", "bf16", (m, k), "act"), Arg("up", "bf16", (m, k), "act"),
                Arg("h", "bf16", (m, k), "out")]

    def random_inputs(self, c, gen):
        m, k = c["M"], c["K"]
        return {"gate": (3 * torch.randn(m, k, generator=gen)).to(torch.bfloat16),
                "up": (3 * torch.randn(m, k, generator=gen)).to(torch.bfloat16)}

    def torch_baseline(self, c, d):
        from k3compile.models.ops import situ_glu

        return lambda: d["h"].copy_(situ_glu(d["gate"], d["up"], c["BETA"], c["LINEAR_BETA"]))

    def reference(self, c, inputs):
        g, u = inputs["gate"].double(), inputs["up"].double()
        b, lb = c["BETA"], c["LINEAR_BETA"]
        return {"h": b * torch.tanh(g / b) * torch.sigmoid(g) * (lb * torch.tanh(u / lb))}

    def flops(self, c):
        return 8 * c["M"] * c["K"]

    def bytes(self, c):
        return 3 * 2 * c["M"] * c["K"]
