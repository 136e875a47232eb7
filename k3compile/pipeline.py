"""Pass infrastructure: stages, a registry of passes by name, typed configs, requires -> apply -> ensures.

A pass implements ``apply(gm, ctx) -> PassResult`` (and optionally ``requires``/``ensures``); the base
class's ``__call__`` owns timing, the before/after node sets, graph linting, the dump of
``NN_<pass>.{before.py,after.py,diff}`` and the per-pass record kept on the graph module
(``gm.meta["k3_records"]``). A pass that is not applicable to the bucket being compiled is recorded as
skipped, never silently dropped.

The order of passes is ``k3compile/pipeline_table.py``: the compiler's table of contents.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import hashlib
import inspect
import os
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.fx

from .graph_text import graph_lines


class Stage(enum.IntEnum):
    LIFT = 1  # torch-level capture -> K3 dialect
    CLEANUP = 2  # dead code, canonical form
    SHARD = 3  # split replicated work across TP ranks
    FUSE = 4  # fusions of dialect ops
    SCHEDULE = 5  # streams, prefetch, ordering
    SELECT = 6  # kernel choice per bucket


class PassConditionError(RuntimeError):
    """A pass's ``requires`` or ``ensures`` does not hold: the pipeline stops here."""


@dataclass(frozen=True)
class PassConfig:
    """Options every pass has. Subclass (frozen dataclass) to add typed options for one pass."""

    enabled: bool = True
    buckets: tuple[int, ...] | None = None  # None: every bucket


@dataclass
class PassResult:
    match_count: int
    changed: bool
    notes: str = ""


@dataclass
class PassContext:
    """What a pass may know besides the graph: the point being compiled and the inputs' roles."""

    bucket: int
    tp_size: int
    inputs: list  # list[capture.InputInfo]
    tp_rank: int = 0
    batch_symbol: Any = None
    dump_dir: str | None = None

    def weight_names(self) -> set[str]:
        return {i.name for i in self.inputs if i.kind == "weight"}

    def state_names(self) -> set[str]:
        return {i.name for i in self.inputs if i.kind == "state"}

    def label(self, node) -> str:
        """The model name of a graph input node ("" for anything else)."""
        for i in self.inputs:
            if i.name == getattr(node, "name", None):
                return i.label
        return ""


@dataclass
class PassRecord:
    index: int
    name: str
    stage: str
    uuid: str
    bucket: int
    applied: bool
    changed: bool = False
    match_count: int = 0
    nodes_added: int = 0
    nodes_removed: int = 0
    time_s: float = 0.0
    notes: str = ""
    before: str = field(default="", repr=False)
    after: str = field(default="", repr=False)
    before_provenance: list = field(default_factory=list, repr=False)  # one entry per line of `before`
    after_provenance: list = field(default_factory=list, repr=False)

    def diff(self) -> str:
        return "".join(difflib.unified_diff(self.before.splitlines(True), self.after.splitlines(True),
                                            f"{self.index:02d}_{self.name}.before.py",
                                            f"{self.index:02d}_{self.name}.after.py"))

    def summary(self) -> str:
        if not self.applied:
            return f"{self.index:02d} {self.name:<28} skipped ({self.notes})"
        return (f"{self.index:02d} {self.name:<28} matches={self.match_count:<4} "
                f"+{self.nodes_added}/-{self.nodes_removed} nodes  {'changed' if self.changed else 'unchanged'}"
                f"  {1e3 * self.time_s:.1f} ms" + (f"  ({self.notes})" if self.notes else ""))


PASS_REGISTRY: dict[str, type["K3Pass"]] = {}


def register_pass(cls: type["K3Pass"]) -> type["K3Pass"]:
    """Class decorator: make a pass available by its ``name``."""
    if cls.name in PASS_REGISTRY and PASS_REGISTRY[cls.name] is not cls:
        raise ValueError(f"two passes are named {cls.name!r}")
    PASS_REGISTRY[cls.name] = cls
    return cls


class K3Pass:
    name: ClassVar[str]
    stage: ClassVar[Stage]
    config_cls: ClassVar[type[PassConfig]] = PassConfig
    version: ClassVar[str] = "1"

    def __init__(self, config: PassConfig | None = None, **overrides):
        cfg = config or self.config_cls()
        if not isinstance(cfg, self.config_cls):
            raise TypeError(f"{self.name} takes a {self.config_cls.__name__}, got {type(cfg).__name__}")
        self.config = dataclasses.replace(cfg, **overrides) if overrides else cfg

    # ----------------------------------------------------------------- to implement
    def requires(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        """Raise PassConditionError if the graph is not in the form this pass expects."""

    def apply(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        raise NotImplementedError

    def ensures(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        """Raise PassConditionError if the pass left the graph in a state it promised not to."""

    # ----------------------------------------------------------------- infrastructure
    def applies_to(self, bucket: int) -> tuple[bool, str]:
        if not self.config.enabled:
            return False, "disabled by config"
        if self.config.buckets is not None and bucket not in self.config.buckets:
            return False, f"not applicable to bucket {bucket} (buckets {list(self.config.buckets)})"
        return True, ""

    def uuid(self) -> str:
        """Feeds the compile cache key: pass name, version, config and the pass's source."""
        src = inspect.getsource(type(self))
        h = hashlib.sha256(f"{self.name}:{self.version}:{self.config!r}:{src}".encode())
        return h.hexdigest()[:16]

    def fail(self, when: str, what: str) -> PassConditionError:
        return PassConditionError(f"pass '{self.name}' {when} violated: {what}")

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext, index: int,
                 before: tuple[str, list[str]] | None = None, recompile: bool = True) -> PassRecord:
        """Apply the pass to ``gm`` and record it. ``before``: the text and provenance of ``gm`` as it is now,
        when the caller has them (the previous pass's ``after``), else printed here. ``recompile=False`` leaves
        ``gm``'s Python code stale (a pipeline regenerates it once, after its last pass: ~75 ms each)."""
        rec = PassRecord(index=index, name=self.name, stage=self.stage.name, uuid=self.uuid(), bucket=ctx.bucket,
                         applied=False)
        ok, why = self.applies_to(ctx.bucket)
        if before is None:
            lines = graph_lines(gm)
            before = ("".join(line + "\n" for line, _ in lines), [p for _, p in lines])
        before, rec.before_provenance = before
        rec.before = rec.after = before
        rec.after_provenance = rec.before_provenance
        if not ok:
            rec.notes = why
            return rec
        self.requires(gm, ctx)
        nodes_before = {id(n): n for n in gm.graph.nodes}
        t0 = time.perf_counter()
        result = self.apply(gm, ctx)
        gm.graph.lint()
        if recompile:
            gm.recompile()
        rec.time_s = time.perf_counter() - t0
        self.ensures(gm, ctx)
        nodes_after = {id(n) for n in gm.graph.nodes}
        rec.applied = True
        rec.match_count = result.match_count
        rec.nodes_added = len(nodes_after - nodes_before.keys())
        rec.nodes_removed = len(nodes_before.keys() - nodes_after)
        lines = graph_lines(gm)
        rec.after = "".join(line + "\n" for line, _ in lines)
        rec.after_provenance = [p for _, p in lines]
        rec.changed = result.changed or rec.after != before
        rec.notes = result.notes
        return rec


class Pipeline:
    """An ordered list of passes; ``run`` applies them to one graph for one (bucket, TP) point."""

    def __init__(self, passes: list[K3Pass]):
        stages = [p.stage for p in passes]
        if stages != sorted(stages):
            order = ", ".join(f"{p.name}({p.stage.name})" for p in passes)
            raise ValueError(f"passes must be ordered by stage: {order}")
        self.passes = passes

    def cache_key(self) -> str:
        return hashlib.sha256("|".join(p.uuid() for p in self.passes).encode()).hexdigest()[:16]

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        """Run every pass in order (records on ``gm.meta['k3_records']``); dump diffs if ``ctx.dump_dir``."""
        records: list[PassRecord] = gm.meta.setdefault("k3_records", [])
        rec = None
        for i, p in enumerate(self.passes, start=1):
            rec = p(gm, ctx, i, before=(rec.after, rec.after_provenance) if rec else None, recompile=False)
            records.append(rec)
            if ctx.dump_dir:
                write_dump(ctx.dump_dir, rec)
        gm.recompile()
        return gm


def write_dump(dump_dir: str, rec: PassRecord) -> None:
    os.makedirs(dump_dir, exist_ok=True)
    stem = os.path.join(dump_dir, f"{rec.index:02d}_{rec.name}")
    for suffix, text in ((".before.py", rec.before), (".after.py", rec.after), (".diff", rec.diff())):
        with open(stem + suffix, "w") as fh:
            fh.write(text)


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A fresh GraphModule over a copy of the graph (passes mutate graphs in place)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    new = torch.fx.GraphModule(gm, graph)
    new.meta = {k: v for k, v in gm.meta.items() if k != "k3_records"}
    new.meta["k3_records"] = []
    return new
