"""Template ``situ_glu`` on the CPU: every example compiles for sm_90a without spills, with 128-bit loads
and the PDL wait before any load; rendering is deterministic; bad parameters name the fix; the float64
reference is ops.situ_glu; and the kernel's fp32 math is the GEMV situ prologue's, op for op (the two
give the same bits, which keeps a bucket that splits the prologue off equal to one that fuses it)."""

from __future__ import annotations

import re

import pytest
import torch

from k3compile.models import ops
from k3compile.templates.base import KERNELS_DIR
from template_checks import compile_examples, rel, rendered_constants
from templates import TemplateError, get

T = get("situ_glu")


def test_examples_render_and_cover_every_vector():
    for label, params in T.examples().items():
        env = rendered_constants(T, params)
        assert env["CTAS"] * env["THREADS"] * 8 >= env["K"] > (env["CTAS"] - 1) * env["THREADS"] * 8, label


def test_examples_compile_without_spills(tmp_path):
    for label, (point, rep, ptx) in compile_examples(T, tmp_path).items():
        assert rep["stack_bytes"] == 0, (label, rep)
        assert "ld.global.v4" in ptx and "st.global.v4" in ptx, label
        wait = ptx.find("griddepcontrol.wait")
        assert 0 <= wait < ptx.find("griddepcontrol.launch_dependents") and "ld.global" not in ptx[:wait], label


@pytest.mark.parametrize("bad,msg", [({"bucket": 3}, "bucket"), ({"k": 100}, "multiple of 8"),
                                     ({"beta": 0.0}, "beta")])
def test_bad_params(bad, msg):
    with pytest.raises(TemplateError, match=msg):
        T.point(**{**T.examples()["mini_b1"], **bad})


def test_reference_is_the_eager_op():
    c = T.point(**T.examples()["mini_b8"]).c
    inp = T.random_inputs(c, torch.Generator().manual_seed(0))
    ref = T.reference(c, inp)["h"]
    eager = ops.situ_glu(inp["gate"], inp["up"], c["BETA"], c["LINEAR_BETA"])
    assert rel(eager, ref) < 1e-2


def test_same_math_as_the_gemv_prologue():
    def math_lines(text):
        return [ln.strip() for ln in text.splitlines() if re.match(r"\s*(sig|act|lin) = ", ln)]

    mine = math_lines((KERNELS_DIR / "situ_glu.py").read_text())
    gemv = math_lines((KERNELS_DIR / "gemv.py").read_text())
    assert len(mine) == 3 and mine == gemv
    assert "rH.store((act * lin).to(BFloat16))" in (KERNELS_DIR / "situ_glu.py").read_text()
