"""The k3-mini kernel set that tests/compiler/test_codegen.py checks, compiled in a background process.

Compiling every distinct k3-mini kernel (TP 1/2/4/8 x every bucket; README gives the count) costs about 16
CPU-minutes. So tests/conftest.py starts this compile as soon as collection is done, at low priority (nice 10)
beside the tests, into the run's shared kernel cache, and moves the tests that need it to the end; their fixture
waits for it and writes the set again from the warm cache. Under pytest-xdist the controller starts it and owns it,
and the worker that runs those tests waits for the files it writes. The compile is real either way: the cache is
fresh per run unless K3COMPILE_CACHE is set.

As a script: ``python mini_codegen.py OUT WORKERS`` (what the background process runs).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

TPS = (1, 2, 4, 8)
FIXTURE = "mini_build"  # tests that use this fixture need the compiled set
TEST_FILE = "test_codegen.py"  # the file of those tests (what pytest-xdist's controller sees: test ids)
RUN_ENV = "K3COMPILE_TEST_RUN"  # the run's scratch directory (tests/conftest.py), shared with pytest-xdist workers

_job: dict = {}  # the background compile this process started: proc, log


def points():
    """Every k3-mini plan launch at TP 1/2/4/8 and every default bucket, mapped to template points."""
    from k3compile.codegen import plan_points
    from k3compile.compiler import DEFAULT_BUCKETS
    from k3compile.models import k3_mini

    return plan_points(k3_mini(), tps=TPS, buckets=DEFAULT_BUCKETS)


def shared_points():
    """:func:`points`, as the run's background compile computed them (it writes them to ``out/points.pickle``
    before compiling): planning every (TP, bucket) costs about a CPU-minute, and the compile shares the run's two
    cores with the tests. Computed here when no background compile was started."""
    out = out_dir() if RUN_ENV in os.environ else None
    if out is None or not (out / "pid").exists():
        return points()
    pid = int((out / "pid").read_text())
    while not (out / "points.pickle").exists() and not (out / "failed").exists() and _alive(pid):
        time.sleep(0.5)
    if not (out / "points.pickle").exists():
        wait(out)  # raises with the end of the background log
    with open(out / "points.pickle", "rb") as fh:
        return pickle.load(fh)


def out_dir() -> Path:
    """Where this run's background compile writes (the same in every process of the run)."""
    return Path(os.environ[RUN_ENV]) / "mini_codegen"


def start(out: Path, workers: int) -> None:
    """Compile :func:`points` into ``out`` (and the kernel cache) in a background process owned by this one.
    ``out/pid`` says that it started (what :func:`wait` in any process of the run looks for); the compile writes
    ``out/seconds`` when done, or ``out/failed`` if it raised."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "background.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, __file__, str(out), str(workers)], stdout=fh,
                                stderr=subprocess.STDOUT, env=os.environ.copy())
    (out / "pid").write_text(str(proc.pid))
    _job.update(proc=proc, log=log)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True


def wait(out: Path | None = None) -> float | None:
    """Wait for the background compile into ``out``, started by this process or another of the run (pytest-xdist:
    the controller starts it, a worker runs the tests that need it); its duration in seconds (None if none was
    started). Raises with the end of its log if it failed."""
    out = out or out_dir()
    if not (out / "pid").exists():
        return None
    proc = _job.get("proc")
    if proc is not None:
        proc.wait()
    else:
        pid = int((out / "pid").read_text())
        while not (out / "seconds").exists() and not (out / "failed").exists() and _alive(pid):
            time.sleep(0.5)
    if not (out / "seconds").exists():
        raise RuntimeError(f"the background k3-mini codegen failed; the end of {out / 'background.log'}:\n"
                           + (out / "background.log").read_text()[-6000:])
    return float((out / "seconds").read_text())


def stop() -> None:
    """Kill the background compile this process started if it is still running (the session ended early)."""
    proc = _job.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    from k3compile.codegen import write

    os.nice(10)  # the tests in the foreground first when they need both cores (gloo ranks, compile pools)
    t0 = time.time()
    try:
        cg, out = points(), Path(sys.argv[1])
        with open(out / "points.pickle.tmp", "wb") as fh:
            pickle.dump(cg, fh)
        os.replace(out / "points.pickle.tmp", out / "points.pickle")  # whole or absent (shared_points)
        write(cg, out, compile=True, quiet=True, workers=int(sys.argv[2]))
    except BaseException:
        (Path(sys.argv[1]) / "failed").write_text("see background.log")
        raise
    (Path(sys.argv[1]) / "seconds").write_text(f"{time.time() - t0:.1f}")
