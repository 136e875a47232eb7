"""Memory-ordering audit of generated kernels, read from their PTX (not from the template source).

Every decode kernel is launched with programmatic dependent launch (PDL): it starts while the kernel
before it is still running; only after ``griddepcontrol.wait`` are that kernel's writes visible (and its
reads done). So before the wait a kernel may touch **static weights only** (load them, prefetch them into
L2): an activation, decode state, output or workspace read earlier can see stale data, and a store
earlier can overwrite what the previous kernel still reads. That is exactly the bug a compiler once introduced by
hoisting an activation read above a synchronization wait; it passes every test that happens to run the
kernels back to back slowly enough. A kernel also releases its dependents (``griddepcontrol.launch_dependents``)
only after its wait: then a kernel that starts early finds every kernel before its predecessor complete, and
the waits form one chain.

How the audit decides, per kernel entry in the PTX:

1. each entry parameter is one kernel argument (its role comes from the template: ``weight`` or not);
2. registers carry the set of parameters they were computed from (``ld.param`` starts it; every
   instruction's destinations get the union of its sources' sets, loads included);
3. every global memory access (``ld``/``st`` outside param/shared/local/const space, ``cp.async``,
   ``prefetch``, ``atom``/``red``) that appears before the entry's first ``griddepcontrol.wait`` must use an address
   computed from weight parameters only;
4. an entry that reads any non-weight argument must contain a ``griddepcontrol.wait`` at all;
5. no ``griddepcontrol.launch_dependents`` comes before the entry's first ``griddepcontrol.wait``.

It is a static, conservative check of program text order: straight-line prologues are what it judges.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_ENTRY = re.compile(r"\.entry\s+(\S+)\s*\((.*?)\)\s*(?:\.\w+[^{]*)?\{", re.S)
_PARAM = re.compile(r"\.param\s+[^\n,]*?\s(\S+_param_(\d+))")
_REG = re.compile(r"%[a-zA-Z_][\w]*")
_PARAM_REF = re.compile(r"_param_(\d+)\b")
_NON_GLOBAL = ("param", "shared", "local", "const")


@dataclass
class Violation:
    entry: str
    line: int
    instruction: str
    args: list[str]

    def __str__(self) -> str:
        if self.instruction.startswith("griddepcontrol.launch_dependents"):
            return (f"{self.entry}: line {self.line}: `{self.instruction}` releases the next kernel before "
                    f"griddepcontrol.wait (it could start before the kernel ahead of this one completed)")
        verb = ("writes" if self.instruction.startswith("st.") else
                "accesses" if self.instruction.startswith("(") else "reads")
        return (f"{self.entry}: line {self.line}: `{self.instruction}` {verb} {', '.join(self.args)} before "
                f"griddepcontrol.wait")


@dataclass
class EntryReport:
    name: str
    params: list[str]  # argument name of each entry parameter
    has_wait: bool
    weight_accesses_before_wait: int = 0
    violations: list[Violation] = field(default_factory=list)


@dataclass
class AuditReport:
    entries: list[EntryReport]

    @property
    def ok(self) -> bool:
        return all(not e.violations for e in self.entries)

    def problems(self) -> list[str]:
        return [str(v) for e in self.entries for v in e.violations]

    def as_dict(self) -> dict:
        return {"ok": self.ok, "problems": self.problems(),
                "entries": [{"params": e.params, "has_wait": e.has_wait,
                             "weight_accesses_before_wait": e.weight_accesses_before_wait} for e in self.entries]}


def _entries(ptx: str):
    for m in _ENTRY.finditer(ptx):
        params = [int(p[1]) for p in _PARAM.findall(m.group(2))]
        depth, i = 1, m.end()
        while depth and i < len(ptx):  # the body: up to the matching brace
            depth += {"{": 1, "}": -1}.get(ptx[i], 0)
            i += 1
        yield m.group(1), len(params), ptx[m.end():i - 1], ptx.count("\n", 0, m.end()) + 1


def _operands(text: str) -> list[str]:
    """Top-level comma-separated operands (braces and brackets kept together)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _is_global_access(op: str) -> tuple[bool, int]:
    """Whether an opcode accesses global memory, and which operand holds the address."""
    parts = op.split(".")
    head = parts[0]
    if head in ("ld", "ldu"):
        return (not any(s in parts for s in _NON_GLOBAL)), 1
    if head == "st":
        return (not any(s in parts for s in _NON_GLOBAL)), 0
    if head == "cp" and len(parts) > 1 and parts[1] == "async":
        if "prefetch" in parts:
            return True, 0  # cp.async.bulk.prefetch(.tensor).L2.global [src], size: no destination
        return True, 1  # cp.async(.bulk...) dst, [src]: the source is global
    if head == "prefetch" or head == "prefetchu":
        return not any(s in parts for s in ("local", "shared")), 0
    if head in ("atom", "red"):
        return not any(s in parts for s in _NON_GLOBAL), (1 if head == "atom" else 0)
    return False, -1


def audit_ptx(ptx: str, entry_params: list[list[str]], weights: set[str]) -> AuditReport:
    """Audit every ``.entry`` of ``ptx``. ``entry_params[i]`` names the arguments of entry i's parameters
    in order; ``weights`` are the argument names that are static weights."""
    reports = []
    entries = list(_entries(ptx))
    if len(entries) != len(entry_params):
        raise ValueError(f"the PTX has {len(entries)} kernel entries but {len(entry_params)} parameter lists were "
                         f"declared (Template.kernel_params)")
    for (name, n_params, body, first_line), names in zip(entries, entry_params):
        if n_params != len(names):
            raise ValueError(f"entry {name} has {n_params} parameters but {len(names)} argument names were declared "
                             f"({names}); fix Template.kernel_params")
        rep = EntryReport(name, list(names), has_wait="griddepcontrol.wait" in body)
        taint: dict[str, frozenset] = {}
        waited = False
        read_non_weight: set = set()
        for k, raw in enumerate(body.split("\n")):
            line = raw.split("//")[0].strip().rstrip(";").strip()
            if not line or line.endswith(":") or line.startswith((".", "{", "}")):
                continue
            if line.startswith("griddepcontrol.wait"):
                waited = True
                continue
            if line.startswith("griddepcontrol.launch_dependents") and not waited:
                rep.violations.append(Violation(name, first_line + k, "griddepcontrol.launch_dependents", []))
                continue
            line = re.sub(r"^@!?%\w+\s+", "", line)
            op, _, rest = line.partition(" ")
            ops = _operands(rest)
            srcs: set = set()
            for o in ops[1:] if ops else []:
                srcs |= {int(p) for p in _PARAM_REF.findall(o)}
                for r in _REG.findall(o):
                    srcs |= taint.get(r, frozenset())
            is_global, addr_i = _is_global_access(op)
            if is_global and 0 <= addr_i < len(ops):
                addr = set()
                for r in _REG.findall(ops[addr_i]):
                    addr |= taint.get(r, frozenset())
                addr |= {int(p) for p in _PARAM_REF.findall(ops[addr_i])}
                touched = sorted({names[i] for i in addr if i < len(names)})
                bad = [a for a in touched if a not in weights]
                read_non_weight |= set(bad)
                if not waited:
                    if bad:
                        rep.violations.append(Violation(name, first_line + k, " ".join(line.split()), bad))
                    elif touched:
                        rep.weight_accesses_before_wait += 1
            if ops and not op.startswith(("st.", "bar", "bra", "ret", "exit", "red.", "prefetch", "griddepcontrol",
                                          "fence", "membar", "cp.async")):
                for r in _REG.findall(ops[0]):  # destination register(s), vector braces included
                    taint[r] = frozenset(srcs)
        if read_non_weight and not rep.has_wait:
            rep.violations.append(Violation(name, first_line, "(no griddepcontrol.wait in the kernel)",
                                            sorted(read_non_weight)))
        reports.append(rep)
    return AuditReport(reports)


def audit_point(point, ptx: str) -> AuditReport:
    """Audit a compiled template point's PTX with the roles its template declares."""
    c = point.c
    weights = {a.name for a in point.args() if a.role == "weight"}
    return audit_ptx(ptx, point.template.kernel_params(c), weights)
