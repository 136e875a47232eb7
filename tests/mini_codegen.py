"""The k3-mini kernel set that tests/compiler/test_codegen.py checks, compiled in a background process.

Compiling every distinct k3-mini kernel (about 760, TP 1/2/4/8 x every bucket) costs about 22 CPU-minutes,
while the rest of the suite keeps one core busy (one intra-op thread). So tests/conftest.py starts this
compile as soon as collection is done, on the cores the suite leaves idle, into the run's shared kernel cache,
and moves the tests that need it to the end; their fixture waits for it and writes the set again from the
warm cache. The compile is real either way: the cache is fresh per run unless K3COMPILE_CACHE is set.

As a script: ``python mini_codegen.py OUT WORKERS`` (what the background process runs).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

TPS = (1, 2, 4, 8)
FIXTURE = "mini_build"  # tests that use this fixture need the compiled set

_job: dict = {}  # the background compile: proc, out, log


def points():
    """Every k3-mini plan launch at TP 1/2/4/8 and every default bucket, mapped to template points."""
    from k3compile.codegen import plan_points
    from k3compile.compiler import DEFAULT_BUCKETS
    from k3compile.models import k3_mini

    return plan_points(k3_mini(), tps=TPS, buckets=DEFAULT_BUCKETS)


def start(out: Path, workers: int) -> None:
    """Compile :func:`points` into ``out`` (and the kernel cache) in a background process."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "background.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, __file__, str(out), str(workers)], stdout=fh,
                                stderr=subprocess.STDOUT, env=os.environ.copy())
    _job.update(proc=proc, out=out, log=log)


def wait() -> float | None:
    """Wait for the background compile; its duration in seconds (None if none was started). Raises with the
    end of its log if it failed."""
    if not _job:
        return None
    rc = _job["proc"].wait()
    if rc != 0:
        raise RuntimeError(f"the background k3-mini codegen failed (exit {rc}); the end of {_job['log']}:\n"
                           + _job["log"].read_text()[-6000:])
    return float((_job["out"] / "seconds").read_text())


def stop() -> None:
    """Kill the background compile if it is still running (the session ended early)."""
    proc = _job.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    from k3compile.codegen import write

    os.nice(10)  # the tests in the foreground first when they need both cores (gloo ranks, compile pools)
    t0 = time.time()
    write(points(), Path(sys.argv[1]), compile=True, quiet=True, workers=int(sys.argv[2]))
    (Path(sys.argv[1]) / "seconds").write_text(f"{time.time() - t0:.1f}")
