"""The memory-ordering audit (k3compile.audit) on real compiled PTX: a kernel with an activation read
hoisted above griddepcontrol.wait (the planted bug) is caught, so is an output store hoisted above it
(under PDL the previous kernel may still read that buffer), the same kernel with the read after the wait
passes, a kernel that reads activations without any wait is caught, and so is one that releases its
dependents before its wait. (That every generated
k3-mini kernel passes is checked in test_codegen.py.)"""


import pytest

from k3compile import build
from k3compile.audit import audit_ptx

KERNEL = '''
import cutlass
import cutlass.cute as cute
from cutlass import Float32


class Kernel:
    @cute.jit
    def __call__(self, mW: cute.Tensor, mX: cute.Tensor, mY: cute.Tensor, stream):
        self.kernel(mW, mX, mY).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mX: cute.Tensor, mY: cute.Tensor):
        i = cute.arch.thread_idx()[0]
        w = mW[i].to(Float32)  # a static weight: may be read before the wait
{before}
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
{after}
{store}
        mY[i] = (w * x).to(mY.element_type)
'''
READ_X = "        x = mX[i].to(Float32)"
STORE_Y = "        mY[i] = w.to(mY.element_type)  # an output written while the previous kernel may still run"
ARGS = [("w", "bf16", [32], 16), ("x", "bf16", [32], 16), ("y", "bf16", [32], 16)]
PARAMS, WEIGHTS = [["w", "x", "y"]], {"w"}


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    variants = {"hoisted": KERNEL.format(before=READ_X, after="", store=""),
                "clean": KERNEL.format(before="", after=READ_X, store=""),
                "store_hoisted": KERNEL.format(before=READ_X.replace("mX[i]", "mW[i + 1]") + "\n" + STORE_Y, after="",
                                               store=""),
                "no_wait": KERNEL.format(before="", after=READ_X, store="").replace(
                    "        cute.arch.griddepcontrol_wait()\n", ""),
                "early_release": KERNEL.format(before="", after=READ_X, store="").replace(
                    "        cute.arch.griddepcontrol_wait()\n        cute.arch.griddepcontrol_launch_dependents()\n",
                    "        cute.arch.griddepcontrol_launch_dependents()\n        cute.arch.griddepcontrol_wait()\n")}
    jobs = [build.Job(f"audit_{k}", src, ARGS, "sm_90a", False) for k, src in variants.items()]
    out = tmp_path_factory.mktemp("audit")
    build.build(jobs, out)
    return {k: (out / f"audit_{k}" / "kernel.ptx").read_text() for k in variants}


def test_planted_hoisted_activation_read_is_caught(ptx):
    rep = audit_ptx(ptx["hoisted"], PARAMS, WEIGHTS)
    assert not rep.ok
    (problem,) = rep.problems()
    assert "reads x before griddepcontrol.wait" in problem and "ld.global" in problem


def test_planted_hoisted_output_store_is_caught(ptx):
    rep = audit_ptx(ptx["store_hoisted"], PARAMS, WEIGHTS)
    assert not rep.ok
    (problem,) = rep.problems()
    assert "writes y before griddepcontrol.wait" in problem and problem.split("`")[1].startswith("st.global")


def test_clean_kernel_passes_and_its_weight_read_is_allowed(ptx):
    rep = audit_ptx(ptx["clean"], PARAMS, WEIGHTS)
    assert rep.ok, rep.problems()
    assert rep.entries[0].has_wait and rep.entries[0].weight_accesses_before_wait == 1


def test_activation_reads_without_any_wait_are_caught(ptx):
    rep = audit_ptx(ptx["no_wait"], PARAMS, WEIGHTS)
    assert not rep.ok
    assert any("(no griddepcontrol.wait in the kernel)` accesses x, y before" in p for p in rep.problems())


def test_releasing_dependents_before_the_wait_is_caught(ptx):
    """A kernel that releases its dependents before its own wait lets the next kernel start before the kernel
    ahead of this one completed: caught."""
    assert "launch_dependents;\n" in ptx["early_release"].split("griddepcontrol.wait")[0]
    rep = audit_ptx(ptx["early_release"], PARAMS, WEIGHTS)
    (problem,) = rep.problems()
    assert "`griddepcontrol.launch_dependents` releases the next kernel before griddepcontrol.wait" in problem


def test_roles_matter(ptx):
    # the same clean PTX with x declared a weight and w an activation: now w's early read is the violation
    rep = audit_ptx(ptx["clean"], PARAMS, {"x"})
    assert not rep.ok and "reads w before" in rep.problems()[0]


def test_declared_parameters_must_match_the_ptx(ptx):
    with pytest.raises(ValueError, match="3 parameters but 2 argument names"):
        audit_ptx(ptx["clean"], [["w", "x"]], WEIGHTS)
    with pytest.raises(ValueError, match="1 kernel entries but 2 parameter lists"):
        audit_ptx(ptx["clean"], PARAMS * 2, WEIGHTS)


def test_taint_follows_address_arithmetic():
    ptx = """
.visible .entry k(
	.param .align 8 .b8 k_param_0[8],
	.param .align 8 .b8 k_param_1[8]
)
{
	ld.param.b64 	%rd1, [k_param_0];
	ld.param.b64 	%rd2, [k_param_1];
	mov.u32 	%r1, %tid.x;
	mul.wide.u32 	%rd3, %r1, 2;
	add.s64 	%rd4, %rd2, %rd3;
	cvta.to.global.u64 	%rd5, %rd4;
	prefetch.global.L2 	[%rd1];
	ld.global.nc.v4.b32 	{%r2, %r3, %r4, %r5}, [%rd5+16];
	griddepcontrol.wait;
	ret;
}
"""
    rep = audit_ptx(ptx, [["w", "x"]], {"w"})
    assert rep.problems() == ["k: line 14: `ld.global.nc.v4.b32 {%r2, %r3, %r4, %r5}, [%rd5+16]` reads x before "
                              "griddepcontrol.wait"]
    assert rep.entries[0].weight_accesses_before_wait == 1  # the prefetch of w


def test_bulk_prefetch_address_is_its_first_operand():
    """``cp.async.bulk.prefetch.L2.global [src], size`` has no destination: the address is operand 0 (a
    cp.async copy's is operand 1). A bulk prefetch of an activation before the wait is caught; of a weight, it
    counts as a weight access."""
    body = """
.visible .entry k(
	.param .align 8 .b8 k_param_0[8],
	.param .align 8 .b8 k_param_1[8]
)
{
	ld.param.b64 	%rd1, [k_param_0];
	ld.param.b64 	%rd2, [k_param_1];
	mov.u32 	%r1, 3328;
	cp.async.bulk.prefetch.L2.global [%rd1], %r1;
	cp.async.bulk.prefetch.L2.global [%rd2], %r1;
	griddepcontrol.wait;
	ret;
}
"""
    rep = audit_ptx(body, [["w", "x"]], {"w"})
    assert rep.problems() == ["k: line 11: `cp.async.bulk.prefetch.L2.global [%rd2], %r1` reads x before "
                              "griddepcontrol.wait"]
    assert rep.entries[0].weight_accesses_before_wait == 1


def test_every_template_launch_asks_for_pdl():
    """The audit above is what makes PDL safe; this is what makes it happen: every kernel launch of every
    template passes ``use_pdl=True`` (without it the overlap is silently lost, and the wait and trigger are
    no-ops), and every kernel lets its dependents start (``griddepcontrol_launch_dependents``) only after
    its own wait."""
    import ast
    from pathlib import Path

    import k3compile.templates as templates

    kernels_dir = Path(templates.__file__).parent / "kernels"
    launches = 0
    for path in sorted(kernels_dir.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "launch":
                launches += 1
                pdl = [k for k in node.keywords if k.arg == "use_pdl"]
                assert pdl and isinstance(pdl[0].value, ast.Constant) and pdl[0].value.value is True, \
                    f"{path.name}:{node.lineno}: launch without use_pdl=True"
            if isinstance(node, ast.FunctionDef) and any(
                    ast.unparse(d).endswith("cute.kernel") for d in node.decorator_list):
                calls = [ast.unparse(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)]
                where = f"{path.name}: kernel {node.name}"
                assert "cute.arch.griddepcontrol_wait" in calls, where
                wait_line = min(n.lineno for n in ast.walk(node) if isinstance(n, ast.Call)
                                and ast.unparse(n.func) == "cute.arch.griddepcontrol_wait")
                trig = [n.lineno for n in ast.walk(node) if isinstance(n, ast.Call)
                        and ast.unparse(n.func) == "cute.arch.griddepcontrol_launch_dependents"]
                assert trig and min(trig) > wait_line, where
    assert launches >= 10  # every template's kernels (mla_decode launches three)
