"""CuTe DSL kernel templates, rendered per (bucket, TP, arch) point by codegen.

Every module in this package (other than ``base``) that defines a :class:`Template` subclass with a
``name`` registers it: ``TEMPLATES`` maps name -> instance. Importing this package does not import the
CuTe DSL: only compiling a rendered kernel file does (in a worker process with ``CUTE_DSL_ARCH`` set).
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import Arg, Constant, Point, Template, TemplateError


def _discover() -> dict[str, Template]:
    found: dict[str, Template] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name in ("base", "kernels") or info.ispkg:
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, Template) and obj is not Template \
                    and obj.__module__ == mod.__name__ and getattr(obj, "name", None):
                if obj.name in found:
                    raise TemplateError(f"two templates named {obj.name!r}")
                found[obj.name] = obj()
    return found


TEMPLATES: dict[str, Template] = _discover()


def get(name: str) -> Template:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise TemplateError(f"no kernel template named {name!r}; known: {', '.join(sorted(TEMPLATES))}") from None


__all__ = ["Arg", "Constant", "Point", "Template", "TemplateError", "TEMPLATES", "get"]
