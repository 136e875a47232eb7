"""``k3compile bench-kernels``: check and time every kernel of a prebuilt package on the GPU.

For each kernel: the template point is rebuilt from the manifest (template name + parameters) and must
have the same name as the packaged kernel (same template source, constants and arch), so a package built
from other template sources is refused rather than checked against the wrong reference. Then:

1. correctness, ``--seeds`` times, each on fresh random inputs with NaN-poisoned outputs, against the
   template's float64 reference (``kernel_check.check``); ``--seed S`` draws check i's inputs from seed S + i
   for every kernel instead, so that two packages' kernels of one example see the same experts and tokens
   (an A/B under a profiler with ``--check-only``) and a failing check can be run again;
2. time per call inside a CUDA graph over input sets rotated past the L2 (``kernel_check.graph_time_us``),
   drawn from one fixed seed: two packages are timed on the same inputs;
3. the floor: the bytes the kernel must move for the timed inputs (``Template.bytes_of``, averaged over the
   input sets) / the device-to-device copy bandwidth measured at the start of the same run; reported as
   floor/time = "% of copy bandwidth";
4. beside it, torch doing the same math (``Template.torch_baseline``), timed the same way.
"""

from __future__ import annotations

import json
import platform
import random
import sys
import time

from .package import KernelPackage


def selected(kernels: dict, only: str | None) -> list[str]:
    """The package's kernel names to run, in example-label order: all, or with ``only`` (comma-separated
    substrings, e.g. ``moe_down_combine:k3tp8_b8,gemv``) those whose name or example label contains one."""
    pats = [p.strip() for p in (only or "").split(",") if p.strip()]
    return [n for n, k in sorted(kernels.items(), key=lambda kv: (kv[1].get("example", ""), kv[0]))
            if not pats or any(p in n or p in k.get("example", "") for p in pats)]


def shard_of(names: list[str], sizes: dict[str, int], shard: str | None) -> list[str]:
    """Shard ``"I/N"`` (1-based) of ``names``: the kernels split over N processes by input bytes (the largest
    first, each to the shard with the fewest bytes so far; ties by name), so the shards of one package take
    about equal time and every process computes the same split. ``None``: all of them."""
    if shard is None:
        return names
    try:
        i, n = (int(x) for x in shard.split("/"))
    except ValueError:
        i = n = 0
    if not 1 <= i <= n:
        raise ValueError(f"--shard {shard!r} is not I/N with 1 <= I <= N (e.g. 2/4: the second of four processes)")
    load = [0] * n
    owner = {}
    for name in sorted(names, key=lambda k: (-sizes[k], k)):
        j = min(range(n), key=lambda x: (load[x], x))
        owner[name] = j
        load[j] += sizes[name]
    return [k for k in names if owner[k] == i - 1]


def passed_in(paths: list[str]) -> set[str]:
    """The kernels that passed in earlier ``bench-kernels`` JSONs (``--skip-passed``: a whole-package check cut
    off by its time limit goes on where it stopped). A kernel's name is the hash of its template source,
    constants and arch, so a name passed before is the same kernel; a failed or unreached one is checked again."""
    done = set()
    for p in paths:
        try:
            with open(p) as fh:
                res = json.load(fh)
        except (OSError, ValueError) as e:
            raise ValueError(f"--skip-passed {p}: unreadable ({e}). Fix: give the JSON of an earlier bench-kernels "
                             f"run (e.g. a shard file from check_package_shards.tgz)") from e
        done.update(r["kernel"] for r in res.get("kernels", []) if r.get("ok"))
    return done


def check_seeds(n: int, seed: int | None) -> list[int]:
    """The input seeds of a kernel's n correctness checks: seed, seed + 1, ... when given, else fresh ones."""
    if seed is not None:
        return [seed + i for i in range(n)]
    return [random.SystemRandom().randrange(2**31) for _ in range(n)]


def run(package_dir: str, *, out_json: str, seeds: int = 2, only: str | None = None, timing: bool = True,
        seed: int | None = None, shard: str | None = None, skip_passed: list[str] | None = None) -> int:
    import torch

    from . import kernel_check as kc

    if not torch.cuda.is_available():
        print("k3compile bench-kernels: error: no CUDA GPU visible (torch.cuda.is_available() is False). Fix: run "
              "it on the GPU host; CPU machines can only build packages (codegen --package)", file=sys.stderr)
        return 2
    pkg = KernelPackage(package_dir)
    names = selected(pkg.kernels, only)
    if not names:
        print(f"k3compile bench-kernels: error: no kernel of {package_dir} matches --only {only!r}. Fix: give a "
              f"substring of a kernel name or example label (comma-separated for several)", file=sys.stderr)
        return 2
    try:
        done = passed_in(skip_passed or [])
        names = [k for k in names if k not in done]
        names = shard_of(names, {k: kc.input_bytes(pkg.point(k)) for k in names}, shard)
    except ValueError as e:
        print(f"k3compile bench-kernels: error: {e}", file=sys.stderr)
        return 2
    if done:
        print(f"skipping {len(done)} kernels that passed in {', '.join(skip_passed)}")
    bw = kc.measure_copy_bandwidth() if timing else None
    rows, failed = [], 0

    def save() -> dict:  # after every kernel: a run cut off keeps what it did
        result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(),
                  "torch": torch.__version__, "host": platform.node(), "package": str(package_dir), "shard": shard,
                  "copy_bandwidth_Bps": bw, "kernels": rows, "failed": failed, "not_run": names[len(rows):],
                  "skipped_passed": len(done)}
        with open(out_json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
        return result

    result = save()  # a shard left with nothing to check (all passed before) still writes its file
    for name in names:
        entry = pkg.kernels[name]
        point = pkg.point(name)
        fn = pkg.function(name)
        row = {"kernel": name, "example": entry.get("example", ""), "template": entry["template"],
               "bytes": point.template.bytes(point.c), "flops": point.template.flops(point.c)}
        t0 = time.perf_counter()
        try:
            n_checks = 1 if kc.input_bytes(point) > 2**29 else seeds  # inputs drawn on the CPU: keep big ones to one
            checks = [kc.check(point, fn, seed=s) for s in check_seeds(n_checks, seed)]
            row["checks"] = checks
            row["ok"] = all(c["ok"] for c in checks)
        except Exception as e:  # noqa: BLE001 - a crashing kernel is a failed row, the run goes on
            row["ok"], row["error"] = False, f"{type(e).__name__}: {e}"
        row["check_s"] = round(time.perf_counter() - t0, 2)
        if timing and row["ok"]:
            try:
                sets = kc.input_sets(point, seed=7)
                kargs = [kc.kernel_args(point, d) for d in sets]  # weights in the kernel's own layout, once
                row["us"] = kc.graph_time_us([lambda k=k: fn(*k) for k in kargs])
                # the bytes these inputs make the kernel move (e.g. the MLA cache up to each row's length)
                row["bytes"] = sum(point.template.bytes_of(point.c, d) for d in sets) / len(sets)
                row["floor_us"] = row["bytes"] / bw * 1e6
                row["pct_of_copy_bw"] = 100 * row["floor_us"] / row["us"]
                try:  # a baseline that cannot be timed loses its column, not the kernel's figures
                    base = [point.template.torch_baseline(point.c, d) for d in sets]
                    if all(b is not None for b in base):
                        row["torch_us"] = kc.graph_time_us(base)
                except Exception as e:  # noqa: BLE001
                    row["torch_error"] = f"{type(e).__name__}: {e}"
                del sets, kargs
            except Exception as e:  # noqa: BLE001
                row["timing_error"] = f"{type(e).__name__}: {e}"
        failed += not row["ok"]
        rows.append(row)
        _print_row(row)
        torch.cuda.empty_cache()
        result = save()
    print(table(result))
    return 1 if failed else 0


def _print_row(r: dict) -> None:
    status = "ok" if r["ok"] else "FAIL"
    errs = ""
    if r.get("checks"):
        worst = {}
        for c in r["checks"]:
            for k, v in c["errors"].items():
                worst[k] = max(worst.get(k, 0), v)
        errs = " ".join(f"{k}={v:.2g}" for k, v in worst.items())
    extra = r.get("error") or "; ".join(p for c in r.get("checks", []) for p in c["problems"])
    print(f"{status:4} {r['example'] or r['kernel']:<42} {errs} {extra}", flush=True)


def table(result: dict) -> str:
    bw = result["copy_bandwidth_Bps"]
    lines = [f"bench-kernels on {result['device']} ({result['date']}); copy bandwidth "
             + (f"{bw / 1e12:.2f} TB/s" if bw else "not measured"),
             f"{'example':<34} {'MB':>8} {'floor us':>9} {'kernel us':>10} {'% copy bw':>10} {'torch us':>9} "
             f"{'check':>6}"]
    for r in result["kernels"]:
        us = f"{r['us']:.1f}" if "us" in r else "-"
        pct = f"{r['pct_of_copy_bw']:.0f}%" if "pct_of_copy_bw" in r else "-"
        fl = f"{r['floor_us']:.1f}" if "floor_us" in r else "-"
        tu = f"{r['torch_us']:.1f}" if "torch_us" in r else "-"
        lines.append(f"{(r['example'] or r['kernel'])[:34]:<34} {r['bytes'] / 1e6:>8.2f} {fl:>9} {us:>10} {pct:>10} "
                     f"{tu:>9} {'ok' if r['ok'] else 'FAIL':>6}")
    lines.append(f"{len(result['kernels']) - result['failed']} of {len(result['kernels'])} kernels correct")
    for r in result["kernels"]:  # a '-' above says why here
        for key, what in (("timing_error", "not timed"), ("torch_error", "torch baseline not timed")):
            if key in r:
                lines.append(f"{(r['example'] or r['kernel'])}: {what}: {r[key]}")
    return "\n".join(lines)


def merge_shards(results: list[dict], package_kernels: dict) -> dict:
    """One report from the ``--shard`` runs of a package (``results``: their JSONs, ``package_kernels``: the
    manifest's kernels): per template, kernels passed / failed / not checked (a shard cut off by its time limit,
    or one that never wrote its file, leaves its kernels unchecked: they are listed, not counted as passed; so does
    a check that ran out of GPU memory, listed also under ``out_of_memory``). A kernel in several results (a run
    that went on with ``--skip-passed``) counts as the latest says (by the results' dates, else their order)."""
    results = sorted(results, key=lambda res: res.get("date", ""))  # stable: undated ones keep their order
    rows = {r["kernel"]: r for res in results for r in res["kernels"]}
    per, oom = {}, []
    for name, entry in sorted(package_kernels.items()):
        t = per.setdefault(entry["template"], {"kernels": 0, "passed": 0, "failed": [], "not_checked": []})
        t["kernels"] += 1
        r = rows.get(name)
        if r is not None and not r["ok"] and r.get("error", "").startswith("OutOfMemoryError"):
            oom.append(name)  # shards side by side filled the GPU: the kernel never ran against its reference
            r = None
        if r is None:
            t["not_checked"].append(name)
        elif r["ok"]:
            t["passed"] += 1
        else:
            t["failed"].append(name)
    worst = {}
    for r in rows.values():
        for c in r.get("checks", []):
            for k, v in c["errors"].items():
                key = (r["template"], k)
                worst[key] = max(worst.get(key, 0.0), float(v))
    return {"kernels": len(package_kernels), "passed": sum(t["passed"] for t in per.values()),
            "failed": sorted(n for t in per.values() for n in t["failed"]),
            "not_checked": sorted(n for t in per.values() for n in t["not_checked"]), "out_of_memory": oom,
            "per_template": per, "worst_error": {f"{t}.{k}": v for (t, k), v in sorted(worst.items())},
            "device": next((res["device"] for res in results), None),
            "devices": sorted({res["device"] for res in results if res.get("device")}),
            "check_s": round(sum(r.get("check_s", 0.0) for r in rows.values()), 1)}


def merge_table(report: dict) -> str:
    lines = [f"{'template':<20} {'kernels':>7} {'passed':>7} {'failed':>7} {'not checked':>11}"]
    for name, t in report["per_template"].items():
        lines.append(f"{name:<20} {t['kernels']:>7} {t['passed']:>7} {len(t['failed']):>7} "
                     f"{len(t['not_checked']):>11}")
    lines.append(f"{'all':<20} {report['kernels']:>7} {report['passed']:>7} {len(report['failed']):>7} "
                 f"{len(report['not_checked']):>11}")
    lines += [f"FAILED {n}" for n in report["failed"]]
    if report.get("out_of_memory"):
        lines.append(f"{len(report['out_of_memory'])} kernels not checked: out of GPU memory with the shards side by "
                     f"side. Fix: run again with fewer SHARDS and DONE=<this run's check_package_shards.tgz>")
    lines += [f"worst relative error {k}: {v:.3g}" for k, v in report["worst_error"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m k3compile.bench_kernels merge PACKAGE OUT.json SHARD.json...``: the report of
    :func:`merge_shards`, printed and written; exit 1 unless every kernel of the package passed."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m k3compile.bench_kernels")
    ap.add_argument("cmd", choices=["merge"])
    ap.add_argument("package")
    ap.add_argument("out")
    ap.add_argument("shards", nargs="*")
    a = ap.parse_args(argv)
    results = []
    for p in a.shards:
        try:
            with open(p) as fh:
                results.append(json.load(fh))
        except (OSError, ValueError) as e:
            print(f"merge: {p} unreadable ({e}); its kernels count as not checked", file=sys.stderr)
    with open(f"{a.package}/manifest.json") as fh:
        report = merge_shards(results, json.load(fh)["kernels"])
    with open(a.out, "w") as fh:
        json.dump(report, fh, indent=1)
    print(merge_table(report))
    return 0 if report["passed"] == report["kernels"] else 1


if __name__ == "__main__":
    sys.exit(main())
