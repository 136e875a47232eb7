"""Template ``rms_norm``: KimiRMSNorm of [bucket, N] bf16 rows (kernel: kernels/rms_norm.py)."""

from __future__ import annotations

import torch

from .base import Arg, Template, const, need


class RmsNorm(Template):
    name = "rms_norm"
    kernel_file = "rms_norm.py"
    doc = "RMSNorm of decode rows, one CTA per row, 128-bit loads"

    def constants(self, *, bucket: int, n: int, eps: float) -> list:
        need(n % 256 == 0, f"rms_norm: row length {n} must be a multiple of 256 (8 elements x 32 threads); "
                           f"pad the hidden size or use the eager reference")
        threads = max(32, min(256, n // 8 // 32 * 32))
        while n % (8 * threads):
            threads -= 32
        return [const("M", bucket, "rows (the batch bucket)"), const("N", n, "row length"),
                const("EPS", float(eps), "variance epsilon"),
                const("THREADS", threads, "threads per CTA (one row per CTA)")]

    def examples(self):
        return {f"{cfg}_b{b}": {"bucket": b, "n": n, "eps": 1e-5}
                for cfg, n in (("mini", 256), ("k3tp8", 7168)) for b in (1, 8, 64)}

    def args(self, c):
        return [Arg("x", "bf16", (c["M"], c["N"]), "act"), Arg("weight", "bf16", (c["N"],), "weight"),
                Arg("y", "bf16", (c["M"], c["N"]), "out")]

    def random_inputs(self, c, gen):
        return {"x": torch.randn(c["M"], c["N"], generator=gen).to(torch.bfloat16),
                "weight": (1 + 0.1 * torch.randn(c["N"], generator=gen)).to(torch.bfloat16)}

    def torch_baseline(self, c, d):
        from k3compile.models.ops import rms_norm

        return lambda: d["y"].copy_(rms_norm(d["x"], d["weight"], c["EPS"]))

    def reference(self, c, inputs):
        x = inputs["x"].double()
        normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c["EPS"]))
        return {"y": inputs["weight"].double() * normed}
