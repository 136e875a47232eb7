"""The contract between codegen and a kernel template.

A template is two things:

* a **kernel file** in ``templates/kernels/<name>.py``: a real CuTe DSL module (one ``Kernel`` class,
  quack style: ``@cute.jit __call__`` launches, ``@cute.kernel kernel`` is the device body) whose
  compile-time constants sit in one block between the lines ``# >>> constants`` and ``# <<< constants``.
  The file as committed is importable with example values; rendering replaces that block with the
  constants of one (bucket, TP, arch) point, so a rendered file reads like a hand-written kernel;
* a :class:`Template` subclass (in ``templates/<name>.py``) that turns parameters into those constants
  (validating them, with errors that name the problem and the fix), lists the kernel's arguments in
  call order with their roles, and gives the float64 reference, random inputs, bytes and FLOPs that the
  GPU tests and the kernel benchmark use.

Argument roles: ``weight`` (static: may be loaded or prefetched before the kernel's dependency wait),
``act`` (activation input), ``state`` (decode state, read and written in place), ``out`` (written by
the kernel; the tests poison it with NaN first) and ``scratch`` (workspace the kernel owns, e.g. split-K
partials: its contents on entry are undefined, the kernel writes every element before reading it; the GPU tests
poison it like an output and the runtime never clears it).

A ``weight`` argument may declare a ``layout``: the kernel reads it in a layout of its own, made from the
model's tensor once (``to_kernel_layout``: the runtime keeps the result with the weight, the kernel tests and
benchmark convert their random inputs); references and baselines see the model's layout.

Templates know nothing of FX graphs or plans: codegen maps a plan launch to ``(template, params)``.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

KERNELS_DIR = Path(__file__).with_name("kernels")
BEGIN, END = "# >>> constants", "# <<< constants"
ROLES = ("weight", "act", "state", "out", "scratch", "comm")
# comm: a communication buffer or flag pad the runtime owns (symmetric memory shared with the peer ranks);
# passed as it is (never copied) and possibly written in place, like state.
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32, "u8": torch.uint8, "i32": torch.int32,
          "i64": torch.int64}
LAYOUTS = ("mxfp4_prepacked",)  # mxfp4_prepacked: MXFP4 code bytes, each 4-byte word's bits permuted
# (k3compile.mxfp4_mirror.prepack) for the expert kernels' decode


class TemplateError(ValueError):
    """A template cannot be instantiated at the requested point (the message says why and what to do)."""


@dataclass(frozen=True)
class Arg:
    name: str
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]  # static: the runtime pads the batch to the bucket
    role: str
    align: int = 16  # bytes the base pointer is assumed aligned to
    layout: str | None = None  # a weight the kernel reads in a layout of its own (LAYOUTS; to_kernel_layout)

    def __post_init__(self):
        if self.role not in ROLES:
            raise TemplateError(f"argument {self.name}: role {self.role!r} is not one of {ROLES}")
        if self.layout is not None and (self.layout not in LAYOUTS or self.role != "weight"):
            raise TemplateError(f"argument {self.name}: layout {self.layout!r} needs role 'weight' and one of "
                                f"{LAYOUTS}")
        if self.dtype not in DTYPES:
            raise TemplateError(f"argument {self.name}: dtype {self.dtype!r} is not one of {tuple(DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.torch_dtype).element_size()

    def empty(self, device="cpu") -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.torch_dtype, device=device)


def to_kernel_layout(a: Arg, t: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """The model's tensor ``t`` for argument ``a`` in the layout the kernel reads (a new tensor on t's device),
    or back to the model's layout with ``inverse``; ``t`` itself when the argument declares none."""
    if a.layout is None:
        return t
    from k3compile.mxfp4_mirror import prepack  # (mxfp4_mirror imports this module)

    return prepack(t, inverse=inverse)


def to_kernel_layout_(a: Arg, t: torch.Tensor) -> torch.Tensor:
    """:func:`to_kernel_layout` in ``t``'s own memory (returns ``t``; nothing to do without a layout)."""
    if a.layout is None:
        return t
    from k3compile.mxfp4_mirror import prepack_

    return prepack_(t)


@dataclass(frozen=True)
class Constant:
    name: str
    value: Any  # int, float, bool or str
    doc: str

    def line(self) -> str:
        return f"{self.name} = {self.value!r}  # {self.doc}"  # repr of a float round-trips exactly


@dataclass
class Point:
    """One instance of a template: its constants (everything baked in) and arch."""
    template: "Template"
    constants: tuple[Constant, ...]
    arch: str = "sm_90a"

    @property
    def c(self) -> dict[str, Any]:
        return {k.name: k.value for k in self.constants}

    def key(self) -> str:
        """Stable identity of the generated code: template source + constants + arch."""
        h = hashlib.sha256()
        h.update(self.template.source_hash().encode())
        h.update(repr([(k.name, k.value) for k in self.constants]).encode())
        h.update(self.arch.encode())
        return h.hexdigest()

    @property
    def name(self) -> str:
        return f"{self.template.name}_{self.key()[:10]}"

    @property
    def kernels(self) -> int:
        """GPU kernels one call launches: one per ``Template.kernel_params`` list, which the PTX audit checks
        against the compiled module's ``.entry`` count."""
        return len(self.template.kernel_params(self.c))

    def args(self) -> list[Arg]:
        return self.template.args(self.c)

    def render(self, header: list[str] = ()) -> str:
        return self.template.render(self, header)


class Template:
    """Base class: subclasses set ``name``, ``kernel_file`` and ``doc`` and implement the methods."""

    name: ClassVar[str]
    kernel_file: ClassVar[str]
    doc: ClassVar[str] = ""
    libs: ClassVar[tuple[str, ...]] = ()  # files in templates/kernels/ the kernel imports (part of its identity)
    check_spills: ClassVar[bool] = True  # decode kernels must not spill (checked from the ptxas report)
    archs: ClassVar[tuple[str, ...]] = ("sm_90a",)

    # -- to implement -------------------------------------------------------------------------------
    def constants(self, **params) -> list[Constant]:
        raise NotImplementedError

    def args(self, c: dict) -> list[Arg]:
        raise NotImplementedError

    def random_inputs(self, c: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """CPU tensors for every non-``out`` argument (scratch: any contents); realistic value ranges."""
        raise NotImplementedError

    def reference(self, c: dict, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """float64 results for every ``out`` argument (and every ``state`` argument, as written back; a large
        state whose new values are exact in its own dtype may be returned in that dtype)."""
        raise NotImplementedError

    def copied_state(self, c: dict, inputs: dict[str, torch.Tensor],
                     outs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` arguments the kernel updates with copies of its own outputs (``outs``: what it returned), as
        they must read after the call (``inputs``: the call's inputs, not to be written). ``kernel_check.compare``
        checks these instead of the reference's, bit for bit with a tolerance of 0: the outputs themselves are
        checked against the float64 reference, whose rounding to bf16 can differ from the kernel's in a rare tie
        (so a state holding a copy of them cannot be compared exactly with the reference). Default: none."""
        return {}

    def kernel_params(self, c: dict) -> list[list[str]]:
        """For each kernel entry of the compiled module (PTX order), the argument behind each of its
        parameters: what the memory-ordering audit (k3compile.audit) checks the PTX against. Default: one
        kernel taking every argument in order."""
        return [[a.name for a in self.args(c)]]

    def examples(self) -> dict[str, dict]:
        """Named parameter sets for the kernel tests and ``bench-kernels``: labels starting ``mini_`` use
        k3-mini shapes, ``k3tp8_`` the real K3 TP8 rank-0 shard shapes (append ``_b<bucket>``)."""
        raise NotImplementedError

    def tolerance(self, c: dict) -> float | dict[str, float]:
        """Bound on ||kernel - reference|| / ||reference||: one for every output, or one per output name
        (bf16 outputs: 1e-2; integer outputs are compared exactly)."""
        return 1e-2

    def flops(self, c: dict) -> int:
        return 0

    def torch_baseline(self, c: dict, d: dict[str, torch.Tensor]):
        """A closure doing the same math with torch ops on the device tensors ``d`` (what a user would
        write without k3compile), timed beside the kernel by ``bench-kernels``; None if there is none."""
        return None

    def bytes(self, c: dict) -> int:
        """Bytes that must move: every argument read once, every output written once."""
        return sum(a.nbytes * (2 if a.role == "state" else 1) for a in self.args(c)
                   if a.role not in ("scratch", "comm"))

    def bytes_of(self, c: dict, inputs: dict) -> int:
        """Bytes one call moves for these inputs (what ``bench-kernels`` takes as the floor): ``bytes(c)`` unless
        the inputs decide it (the MLA cache is read up to each row's length)."""
        return self.bytes(c)

    # -- provided -----------------------------------------------------------------------------------
    def point(self, arch: str = "sm_90a", **params) -> Point:
        if arch not in self.archs:
            raise TemplateError(f"template {self.name} is written for {', '.join(self.archs)}, not {arch}; "
                                f"pass --arch {self.archs[0]}")
        return Point(self, tuple(self.constants(**params)), arch)

    @classmethod
    def kernel_path(cls) -> Path:
        return KERNELS_DIR / cls.kernel_file

    @classmethod
    def source(cls) -> str:
        return cls.kernel_path().read_text()

    @classmethod
    def source_hash(cls) -> str:
        """Hash of the kernel file and the library files it imports: what decides the generated code."""
        h = hashlib.sha256(cls.source().encode())
        for lib in cls.libs:
            h.update((KERNELS_DIR / lib).read_bytes())
        return h.hexdigest()

    def render(self, point: Point, header: list[str] = ()) -> str:
        text = self.source()
        if text.count(BEGIN) != 1 or text.count(END) != 1:
            raise TemplateError(f"{self.kernel_path()}: needs exactly one '{BEGIN}' ... '{END}' block")
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        block = "\n".join(k.line() for k in point.constants)
        banner = [f"# Generated by k3compile from template {self.name} ({self.kernel_file}, "
                  f"sha256 {self.source_hash()[:16]}) for {point.arch}. Do not edit: regenerate.",
                  *[f"# {h}" for h in header]]
        head = _strip_example_note(head)
        return "\n".join(banner) + "\n" + head + f"# constants of this instance\n{block}\n\n" + tail.lstrip("\n")


def _strip_example_note(head: str) -> str:
    """The committed kernel file says its constants are examples; a rendered file must not."""
    return re.sub(r"\n# \(example values[^\n]*\)\n", "\n", head)


def const(name: str, value, doc: str) -> Constant:
    return Constant(name, value, doc)


def need(cond: bool, msg: str) -> None:
    if not cond:
        raise TemplateError(msg)


BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # the batch buckets every template compiles for (compiler.DEFAULT_BUCKETS)


def need_bucket(name: str, bucket) -> None:
    """The error every template gives for a batch that is not one of BUCKETS."""
    need(isinstance(bucket, int) and bucket in BUCKETS,
         f"{name}: bucket {bucket!r} is not one of {BUCKETS}; pad the batch to the next bucket")
