"""What the build reports per kernel: registers and stack frame read from the cubin (``.nv.info``) instead
of the ptxas report, which would turn on the DSL's diagnostics and cost a third of every compile. Checked
against the ptxas report itself (compiled here with ``remarks{ptx}``), on a real template kernel and on a
kernel made to spill, which must show a frame and so fail every "no local memory" check."""

import json
import os
import subprocess
import sys
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

# compile one kernel file with the ptxas report on; print the report's figures and the cubin's
WITH_REPORT = textwrap.dedent("""
    import importlib.util, json, os, re, sys
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    import cutlass, cutlass.cute as cute
    from cutlass.cute import runtime as rt
    from k3compile import build
    src, args, log = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    spec = importlib.util.spec_from_file_location("k3kernel_probe", src)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["k3kernel_probe"] = mod
    spec.loader.exec_module(mod)
    fakes = [build._fake(cutlass, rt, d, s, a) for (_, d, s, a) in args]
    fd = os.open(log, os.O_WRONLY | os.O_CREAT)
    saved = os.dup(1), os.dup(2)
    os.dup2(fd, 1)
    os.dup2(fd, 2)  # the remarks go to stderr
    c = cute.compile(mod.Kernel(), *fakes, rt.make_fake_stream(use_tvm_ffi_env_stream=True),
                     options=f"--enable-tvm-ffi --keep-cubin --dump-dir {os.path.dirname(log)} remarks{{ptx}}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)
    text = open(log).read()
    frames = [tuple(map(int, m.groups())) for m in
              re.finditer(r"(\\d+) bytes stack frame, (\\d+) bytes spill stores, (\\d+) bytes spill loads", text)]
    regs = [int(m.group(1)) for m in re.finditer(r"Used (\\d+) registers", text)]
    print(json.dumps({"ptxas": {"registers": max(regs), "stack_bytes": max(f[0] for f in frames),
                                "spill_store_bytes": max(f[1] for f in frames)},
                      "cubin": build.cubin_resources(c.artifacts.CUBIN)}))
""")


def _with_report(tmp_path, source: str, args) -> dict:
    src = tmp_path / "kernel.py"
    src.write_text(source)
    res = subprocess.run([sys.executable, "-c", WITH_REPORT, str(src), json.dumps(args), str(tmp_path / "log")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cutlass_installed():
    pytest.importorskip("cutlass", reason="the CuTe DSL compiler is not installed")


def test_cubin_figures_are_the_ptxas_report_for_a_template_kernel(tmp_path, cutlass_installed):
    from templates import get

    point = get("rms_norm").point(**get("rms_norm").examples()["k3tp8_b1"])
    job = build.job_for(point)
    got = _with_report(tmp_path, job.source, job.args)
    assert got["ptxas"]["registers"] > 0 and got["ptxas"]["spill_store_bytes"] == 0
    assert got["cubin"] == {k: got["ptxas"][k] for k in ("registers", "stack_bytes")}


def test_a_kernel_that_spills_shows_a_stack_frame(tmp_path, cutlass_installed):
    got = _with_report(tmp_path, SPILLS, SPILL_ARGS)
    assert got["ptxas"]["spill_store_bytes"] > 0  # the probe does spill ...
    assert got["cubin"] == {k: got["ptxas"][k] for k in ("registers", "stack_bytes")}
    assert got["cubin"]["registers"] == 255 and got["cubin"]["stack_bytes"] > 0  # ... and the cubin shows it
    # and the build (no ptxas report) records the frame every "no local memory" check reads
    rep = build.build([build.Job("spill_probe", SPILLS, SPILL_ARGS, "sm_90a", False)], tmp_path / "b",
                      workers=1)["spill_probe"]
    assert rep["stack_bytes"] == got["cubin"]["stack_bytes"] and "spill_store_bytes" not in rep


def test_not_a_cubin_is_refused():
    with pytest.raises(build.BuildError, match="ELF"):
        build.cubin_resources(b"// PTX text, not a cubin")
    elf = bytearray(64)
    elf[:5] = b"\x7fELF\x02"
    with pytest.raises(build.BuildError, match="register count"):
        build.cubin_resources(bytes(elf))
