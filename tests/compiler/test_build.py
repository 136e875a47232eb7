"""What the build reports per kernel: registers and stack frame read from the cubin (``.nv.info``) instead
of the ptxas report, which would turn on the DSL's diagnostics and cost a third of every compile. Checked
against the ptxas report itself (compiled here with ``remarks{ptx}``), on a real template kernel and on a
kernel made to spill, which must show a frame and so fail every "no local memory" check."""

import dataclasses
import re
import textwrap

import pytest

from k3compile import build

# 320 fp32 values live at once per thread: more than the 255 registers a thread may hold, so ptxas spills
SPILLS = textwrap.dedent("""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32

    N = 320


    class Kernel:
        @cute.jit
        def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stream):
            self.kernel(mX, mY).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mY: cute.Tensor):
            tid = cute.arch.thread_idx()[0]
            vals = []
            ss = Float32(0.0)
            for i in cutlass.range_constexpr(N):
                vals.append(mX[tid, i])
                ss = ss + vals[i] * vals[i]
            r = cute.math.rsqrt(ss)
            for i in cutlass.range_constexpr(N):
                mY[tid, i] = vals[N - 1 - i] * r + vals[i]
""")
SPILL_ARGS = [("x", "f32", [32, 320], 16), ("y", "f32", [32, 320], 16)]

REPORT = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _with_report(tmp_path, job: build.Job) -> dict:
    """Build ``job`` with the ptxas report on (``remarks{ptx}``, which lands in the build's compile.log): the
    report's figures beside what the build read from the cubin."""
    job = dataclasses.replace(job, options="remarks{ptx}")
    rep = build.build([job], tmp_path / "b", workers=1)[job.name]
    text = (build.cache_root() / job.key(build.versions()) / "compile.log").read_text()
    frames = [tuple(map(int, m.groups())) for m in REPORT.finditer(text)]
    regs = [int(m.group(1)) for m in re.finditer(r"Used (\d+) registers", text)]
    assert frames and regs, text[-2000:]
    return {"ptxas": {"registers": max(regs), "stack_bytes": max(f[0] for f in frames),
                      "spill_store_bytes": max(f[1] for f in frames)},
            "cubin": {k: rep[k] for k in ("registers", "stack_bytes")}}


@pytest.fixture(scope="module")
def cutlass_installed():
    pytest.importorskip("cutlass", reason="the CuTe DSL compiler is not installed")


def test_cubin_figures_are_the_ptxas_report_for_a_template_kernel(tmp_path, cutlass_installed):
    from templates import get

    point = get("rms_norm").point(**get("rms_norm").examples()["k3tp8_b1"])
    got = _with_report(tmp_path, build.job_for(point))
    assert got["ptxas"]["registers"] > 0 and got["ptxas"]["spill_store_bytes"] == 0
    assert got["cubin"] == {k: got["ptxas"][k] for k in ("registers", "stack_bytes")}


def test_a_kernel_that_spills_shows_a_stack_frame(tmp_path, cutlass_installed):
    job = build.Job("spill_probe", SPILLS, SPILL_ARGS, "sm_90a", False)
    got = _with_report(tmp_path, job)
    assert got["ptxas"]["spill_store_bytes"] > 0  # the probe does spill ...
    assert got["cubin"] == {k: got["ptxas"][k] for k in ("registers", "stack_bytes")}
    assert got["cubin"]["registers"] == 255 and got["cubin"]["stack_bytes"] > 0  # ... and the cubin shows it
    # and the build without the report (what codegen runs) records the frame every "no local memory" check reads
    rep = build.build([job], tmp_path / "plain", workers=1)["spill_probe"]
    assert rep["stack_bytes"] == got["cubin"]["stack_bytes"] and "spill_store_bytes" not in rep


def test_not_a_cubin_is_refused():
    with pytest.raises(build.BuildError, match="ELF"):
        build.cubin_resources(b"// PTX text, not a cubin")
    elf = bytearray(64)
    elf[:5] = b"\x7fELF\x02"
    with pytest.raises(build.BuildError, match="register count"):
        build.cubin_resources(bytes(elf))
