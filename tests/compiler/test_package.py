"""A prebuilt kernel package: built on this CPU-only machine, loaded with tvm_ffi alone (no cutlass import,
as on a GPU host without the compiler), and a CPU tensor is refused with a clear error before any CUDA
call."""

import json
import subprocess
import sys
import textwrap

import pytest

from k3compile.codegen import example_points, write
from k3compile.package import KernelPackage, PackageError


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    out = tmp_path_factory.mktemp("pkg")
    cg = example_points(["rms_norm"], ["mini_b1", "mini_b8"])
    write(cg, out, compile=True, package=True, quiet=True)
    return out


def test_package_layout(package):
    m = json.loads((package / "manifest.json").read_text())
    assert m["packaged"] and len(m["kernels"]) == 2
    assert (package / "runtime" / "libcute_dsl_runtime.so").stat().st_size > 1e6
    for name in m["kernels"]:
        for f in ("kernel.py", "kernel.so", "kernel.ptx", "kernel.cubin", "report.json"):
            assert (package / "kernels" / name / f).exists(), (name, f)


def test_loads_without_cutlass_and_rejects_cpu_tensors(package):
    code = textwrap.dedent(f"""
        import sys, torch
        from k3compile.package import KernelPackage
        pkg = KernelPackage({str(package)!r})
        for name, k in pkg.kernels.items():
            fn = pkg.function(name)
            args = [torch.zeros(a["shape"], dtype=torch.bfloat16) for a in k["arguments"]]
            try:
                fn(*args)
            except ValueError as e:
                assert "cuda" in str(e).lower(), e
                print("refused:", e)
            else:
                raise SystemExit("a CPU tensor was accepted")
        assert "cutlass" not in sys.modules, "loading a package must not need the compiler"
        print("ok", len(pkg.kernels))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ok 2" in res.stdout and "refused:" in res.stdout


def test_errors_name_the_fix(tmp_path, package):
    with pytest.raises(PackageError, match="codegen"):
        KernelPackage(tmp_path)
    src_only = tmp_path / "src"
    write(example_points(["rms_norm"], ["mini_b1"]), src_only, compile=False, quiet=True)
    with pytest.raises(PackageError, match="--package"):
        KernelPackage(src_only)
    with pytest.raises(PackageError, match="not in"):
        KernelPackage(package).function("no_such_kernel")


def test_point_is_rebuilt_from_the_manifest_and_must_match(package, tmp_path):
    import shutil

    pkg = KernelPackage(package)
    for name in pkg.kernels:
        assert pkg.point(name).name == name
    other = tmp_path / "other"
    shutil.copytree(package, other)
    m = json.loads((other / "manifest.json").read_text())
    name = next(iter(m["kernels"]))
    m["kernels"][name]["parameters"]["eps"] = 1e-3  # as if built from other sources than this checkout's
    (other / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PackageError, match="rebuild the package"):
        KernelPackage(other).point(name)
