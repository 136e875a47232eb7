"""k3compile: a compiler for the Kimi K3 decode step.

Three ways in: the ``torch.compile`` backend (``backend="k3compile"``), offline codegen of kernel
sources and packages, and pass-diff inspection (``k3compile diff``).
"""

__version__ = "0.1.0"

from .compiler import BucketError, CompiledDecode, Options, compile  # noqa: E402

__all__ = ["BucketError", "CompiledDecode", "Options", "compile", "__version__"]
