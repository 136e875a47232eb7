"""Load a prebuilt kernel package (``k3compile codegen --package``) without the CuTe DSL compiler.

A package is a directory::

    manifest.json                 kernels, their template/parameters/arguments, the plan entries they serve
    kernels/<name>/kernel.py      the rendered CuTe DSL source (readable; what the .so was built from)
    kernels/<name>/kernel.so      TVM-FFI module exporting one function, ``<name>``
    kernels/<name>/kernel.ptx/.cubin/report.json
    runtime/libcute_dsl_runtime.so

A GPU host needs only ``apache-tvm-ffi`` and this directory: the runtime library is loaded with
``RTLD_GLOBAL`` first (the kernel ``.so`` files link against it), then each kernel through
``tvm_ffi.load_module``. Calling the loaded function directly avoids the keyword-argument wrapper of
``cute.compile`` results (about 5 us per call instead of 15-50).
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path


class PackageError(RuntimeError):
    pass


class KernelPackage:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        mf = self.root / "manifest.json"
        if not mf.exists():
            raise PackageError(f"{self.root} is not a kernel package (no manifest.json). Fix: build one with "
                               f"`k3compile codegen ... -o {self.root} --package`")
        self.manifest = json.loads(mf.read_text())
        if not self.manifest.get("packaged"):
            raise PackageError(f"{self.root} holds kernel sources only (built without --package): no .so files "
                               f"to load. Fix: rerun codegen with --package")
        self._runtime_loaded = False
        self._functions: dict = {}

    @property
    def kernels(self) -> dict[str, dict]:
        return self.manifest["kernels"]

    def point(self, name: str):
        """The template point a kernel was built from, rebuilt from the manifest with this checkout's
        templates. A package built from other template sources is refused (its kernel would be checked
        against the wrong reference)."""
        from .templates import get

        entry = self.kernels[name]
        p = get(entry["template"]).point(arch=entry["arch"], **entry["parameters"])
        if p.name != name:
            raise PackageError(f"kernel {name} was built from other template sources than this checkout's "
                               f"{entry['template']} (rebuilt point is {p.name}). Fix: rebuild the package with "
                               f"this checkout (k3compile codegen ... --package)")
        return p

    def _load_runtime(self) -> None:
        if self._runtime_loaded:
            return
        lib = self.root / "runtime" / "libcute_dsl_runtime.so"
        if not lib.exists():
            raise PackageError(f"{lib} is missing: the package is incomplete. Fix: rerun codegen with --package")
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
        self._runtime_loaded = True

    def function(self, name: str):
        """The kernel's TVM-FFI function: call it with torch CUDA tensors in the template's argument order
        (the current torch stream is used)."""
        if name not in self.kernels:
            raise PackageError(f"kernel {name!r} is not in {self.root}; it has {len(self.kernels)} kernels "
                               f"(see manifest.json)")
        fn = self._functions.get(name)
        if fn is None:
            try:
                import tvm_ffi
            except ImportError:
                raise PackageError("apache-tvm-ffi is not installed: loading prebuilt kernels needs it. "
                                   "Fix: pip install apache-tvm-ffi") from None
            self._load_runtime()
            so = self.root / "kernels" / name / "kernel.so"
            fn = self._functions[name] = tvm_ffi.load_module(str(so))[name]
        return fn
