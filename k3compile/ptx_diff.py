"""``k3compile ptx-diff OLD NEW``: which kernels a source change really changed.

A kernel's name is the hash of its template source (kernel file and libraries), constants and arch, so any edit
of a kernel file renames every kernel of the template, a pure refactor too, and a GPU check passed under the old
names no longer counts by name (``--skip-passed``). This pairs the kernels of two codegen outputs (not pruned:
each kernel's ``kernel.ptx`` is there) by template, constants and arch (a constant only one output has, a knob a
template gained, is left out of the pairing), and compares each pair's PTX with the old name written as the new
one. Same PTX is the same program for ptxas: a check the old kernel passed holds
for the new one. Given the GPU checks' JSONs (``--passed``), it lists the NEW kernels that neither passed by
name nor have the PTX of one that passed: the ones a GPU check still has to run.

    OLD/manifest.json, OLD/kernels/<name>/kernel.ptx        (k3compile codegen -o OLD at the old commit)
    NEW/manifest.json, NEW/kernels/<name>/kernel.ptx        (the same codegen at the new one)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class PtxDiff:
    same: list = field(default_factory=list)  # (old, new) pairs, the PTX identical but for the name
    changed: list = field(default_factory=list)  # (old, new) pairs whose PTX differs
    only_old: list = field(default_factory=list)  # no kernel of NEW has these constants
    only_new: list = field(default_factory=list)
    unchecked: list = field(default_factory=list)  # with passed: NEW kernels no GPU check covers

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("same", "changed", "only_old", "only_new", "unchecked")}


def _kernels(out: str) -> dict:
    path = Path(out) / "manifest.json"
    try:
        with open(path) as fh:
            return json.load(fh)["kernels"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: not a codegen output ({e}). Fix: give the -o directory of `k3compile codegen`")


def _key(entry: dict, names: dict) -> str:
    """(template, constants, arch), the constants limited to the names both outputs give the template."""
    c = {k: v for k, v in entry["constants"].items() if k in names[entry["template"]]}
    return json.dumps([entry["template"], c, entry["arch"]], sort_keys=True)


def _common_names(*outputs: dict) -> dict:
    """Per template, the constant names every kernel of every output has: a constant a template gained (a new
    knob) is left out of the pairing, and the PTX comparison decides whether its kernels changed."""
    names: dict = {}
    for kernels in outputs:
        for e in kernels.values():
            have = set(e["constants"])
            names[e["template"]] = names.get(e["template"], have) & have
    return names


def _ptx(out: str, name: str) -> str:
    path = Path(out) / "kernels" / name / "kernel.ptx"
    try:
        return path.read_text()
    except OSError as e:
        raise ValueError(f"{path}: no PTX ({e.strerror}). Fix: compare codegen outputs that were compiled and "
                         f"not pruned (no --no-compile; tests/gpu/ab_prepare.sh deletes kernel.ptx)") from e


def ptx_diff(old: str, new: str, passed: set[str] | None = None) -> PtxDiff:
    """Pair OLD's and NEW's kernels by (template, constants, arch) and compare their PTX (old name as new)."""
    ko, kn = _kernels(old), _kernels(new)
    names = _common_names(ko, kn)
    by_key = {}
    for name, e in kn.items():
        by_key.setdefault(_key(e, names), []).append(name)
    d = PtxDiff()
    paired = set()
    for name, e in sorted(ko.items()):
        match = by_key.get(_key(e, names), [])
        if len(match) != 1:  # none, or (not in a real codegen: names are unique per key) several
            d.only_old.append(name)
            continue
        (other,) = match
        paired.add(other)
        same = other == name or _ptx(old, name).replace(name, other) == _ptx(new, other)
        (d.same if same else d.changed).append((name, other))
    d.only_new = sorted(set(kn) - paired)
    if passed is not None:
        carried = {n for o, n in d.same if o in passed}
        d.unchecked = sorted(n for n in kn if n not in passed and n not in carried)
    return d


def report(d: PtxDiff, passed: bool) -> str:
    renamed = sum(o != n for o, n in d.same)
    lines = [f"{len(d.same)} kernels with the same PTX ({renamed} of them renamed), {len(d.changed)} changed, "
             f"{len(d.only_old)} only in OLD, {len(d.only_new)} only in NEW"]
    lines += [f"  changed: {o} -> {n}" for o, n in d.changed]
    lines += [f"  only in OLD: {o}" for o in d.only_old]
    lines += [f"  only in NEW: {n}" for n in d.only_new]
    if passed:
        lines.append(f"{len(d.unchecked)} kernels of NEW not covered by a passed GPU check (by name or by the PTX of "
                     f"one that passed)" + (": " + ", ".join(d.unchecked) if d.unchecked else ""))
    return "\n".join(lines)


def main(args) -> int:
    passed = None
    if args.passed:
        from .bench_kernels import passed_in

        passed = passed_in(args.passed)
    d = ptx_diff(args.old, args.new, passed)
    print(report(d, passed is not None))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(d.as_dict(), fh, indent=1)
    return 1 if d.changed or d.only_old or d.only_new or d.unchecked else 0
