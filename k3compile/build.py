"""Compile rendered kernel files with the CuTe DSL: in parallel worker processes, through a disk cache.

``cute.compile`` is not thread-safe and reads ``CUTE_DSL_ARCH`` once, at ``import cutlass``; so every
compile runs in a *spawned* worker process whose environment names the arch before anything imports
``cutlass``. Each worker imports the rendered ``.py`` file (the DSL reads kernel source, so kernels are
real files), builds fake tensors from the template's argument list (static shapes: the runtime pads to
the bucket) and compiles with ``--enable-tvm-ffi``, keeping the PTX and the cubin, and reads what ptxas
allocated per kernel from the cubin's ``.nv.info`` attributes (registers, stack frame: a frame means
register spills or a local array). With ``package=True`` it also exports the host code (``export_to_c``) and links a
``.so`` against the CuTe runtime and ``tvm_ffi``, loadable on a GPU host without the compiler.

The cache (``$K3COMPILE_CACHE`` or ``~/.cache/k3compile``) is keyed by the kernel's rendered source
(template source + constants + arch), the Python version and the versions of the CuTe DSL and tvm-ffi:
a second run of the same codegen is a directory lookup per kernel.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import importlib.metadata
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ARTIFACTS = ("kernel.py", "kernel.ptx", "kernel.cubin", "report.json")
BUILD_FORMAT = "2"  # compile options and report fields; part of the cache key (2: resources from the cubin)


class BuildError(RuntimeError):
    pass


MODULE_PREFIX = "k3kernel_"  # a kernel's module name is this + its package name; the profiler shows it


def versions() -> dict[str, str]:
    out = {"python": f"{sys.version_info.major}.{sys.version_info.minor}", "k3compile-build": BUILD_FORMAT}
    for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            raise BuildError(f"{dist} is not installed: compiling kernels needs it. "
                             f"Fix: pip install 'nvidia-cutlass-dsl[cu13]==4.8.1' apache-tvm-ffi") from None
    return out


def cache_root() -> Path:
    return Path(os.environ.get("K3COMPILE_CACHE") or Path.home() / ".cache" / "k3compile") / "kernels"


@dataclass
class Job:
    name: str  # kernel (and exported function) name
    source: str  # rendered kernel file text
    args: list  # [(name, dtype, shape, align)]
    arch: str
    package: bool
    ident: str = ""  # identity of the generated code (templates.base.Point.key); default: the source text
    options: str = ""  # more cute.compile options, e.g. "remarks{ptx}" (the ptxas report, into compile.log)

    def key(self, vers: dict) -> str:
        """Cache key: the code's identity (not its header comments), arguments, arch, tool versions, options."""
        h = hashlib.sha256((self.ident or self.source).encode())
        h.update(json.dumps([self.args, self.arch, vers] + ([self.options] if self.options else []),
                            sort_keys=True).encode())
        return h.hexdigest()


# ------------------------------------------------------------------------------------------ worker side
def _init_worker(arch: str) -> None:
    if "cutlass" in sys.modules:  # cannot happen in a spawned worker; guards against fork
        raise BuildError("cutlass was imported before CUTE_DSL_ARCH was set")
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


_EIATTR = {0x2F: "registers", 0x11: "stack_bytes"}  # EIATTR_REGCOUNT, EIATTR_FRAME_SIZE: [symbol, value]


def cubin_resources(cubin: bytes) -> dict:
    """Registers and stack frame ptxas gave each kernel, read from the cubin's ``.nv.info*`` sections (the
    max over functions). A stack frame > 0 means local memory: register spills or a local array.

    This replaces the ptxas report (``remarks{ptx}``), which turns on the DSL's diagnostics collection
    and costs about a third of every compile; tests/compiler/test_build.py checks the two agree and that
    a kernel that spills shows a frame."""
    def u16(o):
        return int.from_bytes(cubin[o:o + 2], "little")

    def u32(o):
        return int.from_bytes(cubin[o:o + 4], "little")

    def u64(o):
        return int.from_bytes(cubin[o:o + 8], "little")

    if cubin[:5] != b"\x7fELF\x02":
        raise BuildError("not a 64-bit ELF cubin")
    shoff, shentsize, shnum, shstrndx = u64(0x28), u16(0x3A), u16(0x3C), u16(0x3E)
    secs = [(u32(shoff + i * shentsize), u32(shoff + i * shentsize + 4), u64(shoff + i * shentsize + 24),
             u64(shoff + i * shentsize + 32)) for i in range(shnum)]  # name, type, offset, size

    def cstr(at):
        return cubin[at:cubin.index(b"\0", at)].decode()

    out = {"registers": 0, "stack_bytes": 0}
    seen = set()
    for name, _, off, size in secs:
        if not cstr(secs[shstrndx][2] + name).startswith(".nv.info"):
            continue
        p = off
        while p < off + size:  # attributes: u8 format, u8 id, then by format nothing / u16 / u16 size + bytes
            fmt, attr = cubin[p], cubin[p + 1]
            if fmt == 4:  # EIFMT_SVAL
                n = u16(p + 2)
                if attr in _EIATTR and n == 8:
                    out[_EIATTR[attr]] = max(out[_EIATTR[attr]], u32(p + 8))
                    seen.add(attr)
                p += 4 + n
            elif fmt in (1, 2, 3):  # EIFMT_NVAL / BVAL / HVAL
                p += 2 if fmt == 1 else 4
            else:
                raise BuildError(f"unknown .nv.info attribute format {fmt} in the cubin")
    if 0x2F not in seen:
        raise BuildError("the cubin has no register count (EIATTR_REGCOUNT): not a ptxas output?")
    return out


def _fake(cutlass, cute_runtime, dtype: str, shape, align: int):
    dt = {"bf16": cutlass.BFloat16, "f32": cutlass.Float32, "u8": cutlass.Uint8, "i32": cutlass.Int32,
          "i64": cutlass.Int64}[dtype]
    order = tuple(reversed(range(len(shape))))  # row-major, like torch
    return cute_runtime.make_fake_compact_tensor(dt, tuple(shape), stride_order=order, assumed_align=align)


def _compile_in_worker(job: Job, out_dir: str) -> dict:
    """Compile one kernel into out_dir (kernel.py/.ptx/.cubin[/.so], report.json). Runs in a worker."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = out / "kernel.py"
    src.write_text(job.source)
    log_path = out / "compile.log"
    t0 = time.time()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            import importlib.util

            import cutlass
            import cutlass.cute as cute
            from cutlass.cute import runtime as cute_runtime

            mod_name = f"{MODULE_PREFIX}{job.name}"
            spec = importlib.util.spec_from_file_location(mod_name, src)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = mod
            spec.loader.exec_module(mod)
            fakes = [_fake(cutlass, cute_runtime, d, s, a) for (_, d, s, a) in job.args]
            stream = cute_runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
            try:  # --keep-* files land in --dump-dir (default: the directory cutlass was imported from)
                opts = f"--enable-tvm-ffi --keep-ptx --keep-cubin --dump-dir {out} {job.options}"
                compiled = cute.compile(mod.Kernel(), *fakes, stream, options=opts)
                ptx, cubin = compiled.artifacts.PTX, compiled.artifacts.CUBIN
                if job.package:
                    compiled.export_to_c(str(out / "kernel.o"), function_name=job.name)
            finally:
                for f in out.glob("cutlass_*"):
                    f.unlink()
        except Exception as e:  # reported with the log, in the parent (the finally below restores stdout)
            import traceback

            raise BuildError(f"compiling {job.name} failed: {type(e).__name__}: {e}\n"
                             f"{traceback.format_exc()}\n--- compile log ({log_path}) ---\n"
                             f"{log_path.read_text()[-4000:]}") from None
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    (out / "kernel.ptx").write_text(ptx)
    (out / "kernel.cubin").write_bytes(cubin)
    report = {"name": job.name, "arch": job.arch, "compile_s": round(time.time() - t0, 3),
              **cubin_resources(cubin)}
    if job.package:
        report["so"] = _link(out / "kernel.o", out / "kernel.so")
        (out / "kernel.o").unlink()
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def _link(obj: Path, so: Path) -> str:
    from cutlass.cute.runtime import find_runtime_libraries

    libs = find_runtime_libraries(enable_tvm_ffi=True)
    cmd = ["gcc", "-shared", "-o", str(so), str(obj)]
    for lib in libs:
        cmd += [f"-L{Path(lib).parent}", f"-l{Path(lib).name[3:].split('.so')[0]}"]
    cmd += ["-Wl,-rpath,$ORIGIN/../runtime"]
    if shutil.which("gcc") is None:
        raise BuildError("gcc is not on PATH: linking a kernel package needs a C linker. Fix: install gcc, "
                         "or run codegen without --package")
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise BuildError(f"linking {so.name} failed: {' '.join(cmd)}\n{res.stderr}")
    return so.name


# ------------------------------------------------------------------------------------------ parent side
def runtime_library() -> Path:
    """The CuTe DSL runtime library a package ships (``libcute_dsl_runtime.so`` of the cu13 flavour)."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError("nvidia-cutlass-dsl is not installed. Fix: pip install 'nvidia-cutlass-dsl[cu13]==4.8.1'")
    for root in spec.submodule_search_locations:
        for flavour in ("cu13", "cu12"):
            p = Path(root) / flavour / "lib" / "libcute_dsl_runtime.so"
            if p.exists():
                return p
    raise BuildError("libcute_dsl_runtime.so not found in nvidia-cutlass-dsl; reinstall with the [cu13] extra")


def build(jobs: list[Job], dest: Path, *, workers: int | None = None, progress=None) -> dict[str, dict]:
    """Compile every job (cache first), copy its artifacts to ``dest/<name>/``; returns name -> report.

    Raises BuildError listing every kernel that failed (the others are still built and cached)."""
    vers = versions()
    root = cache_root()
    reports: dict[str, dict] = {}
    todo: list[tuple[Job, Path]] = []
    for job in jobs:
        entry = root / job.key(vers)
        if _complete(entry, job.package):
            rep = json.loads((entry / "report.json").read_text())
            rep["cached"] = True
            reports[job.name] = rep
            _copy(entry, dest / job.name, job.package)
            if progress:
                progress(job.name, rep, len(reports), len(jobs))
        else:
            todo.append((job, entry))
    failures = []
    if todo:
        by_arch: dict[str, list] = {}
        for job, entry in todo:
            by_arch.setdefault(job.arch, []).append((job, entry))
        n_workers = max(1, min(workers or os.cpu_count() or 1, len(todo)))
        for arch, items in by_arch.items():
            ctx = multiprocessing.get_context("spawn")
            with cf.ProcessPoolExecutor(n_workers, mp_context=ctx, initializer=_init_worker,
                                        initargs=(arch,)) as pool:
                futs = {}
                for job, entry in items:
                    tmp = Path(tempfile.mkdtemp(prefix=f".{job.name}.", dir=_mkdir(root)))
                    futs[pool.submit(_compile_in_worker, job, str(tmp))] = (job, entry, tmp)
                for fut in cf.as_completed(futs):
                    job, entry, tmp = futs[fut]
                    try:
                        rep = fut.result()
                    except Exception as e:  # noqa: BLE001 - collected and raised together below
                        failures.append(str(e))
                        shutil.rmtree(tmp, ignore_errors=True)
                        continue
                    rep["cached"] = False
                    if _complete(entry, job.package):  # another run filled it meanwhile
                        shutil.rmtree(tmp, ignore_errors=True)
                    else:
                        shutil.rmtree(entry, ignore_errors=True)  # e.g. cached before without the .so
                        os.replace(tmp, entry)  # atomic publish
                    reports[job.name] = rep
                    _copy(entry, dest / job.name, job.package)
                    if progress:
                        progress(job.name, rep, len(reports), len(jobs))
    if failures:
        raise BuildError(f"{len(failures)} of {len(jobs)} kernels failed to compile:\n\n" + "\n\n".join(failures))
    return reports


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def _complete(entry: Path, package: bool) -> bool:
    need = ARTIFACTS + (("kernel.so",) if package else ())
    return all((entry / f).exists() for f in need)


def _copy(entry: Path, dest: Path, package: bool) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for f in ARTIFACTS + (("kernel.so",) if package else ()):
        shutil.copy2(entry / f, dest / f)


def job_for(point, *, package: bool = False, header: list[str] = ()) -> Job:
    """A build job for one template point (``templates.base.Point``)."""
    return Job(point.name, point.render(list(header)), [(a.name, a.dtype, list(a.shape), a.align) for a in point.args()],
               point.arch, package, point.key())
