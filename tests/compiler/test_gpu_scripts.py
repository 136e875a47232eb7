"""The GPU host's entry points (tests/gpu/*.sh) are run only on the H200, where a mistake costs device time
(30 minutes a session): here each must at least parse, and name only test files and scripts that exist."""

import re
import subprocess
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[1] / "gpu"
SCRIPTS = sorted(GPU.glob("*.sh"))


def test_there_are_gpu_scripts():
    assert {"session.sh", "ab.sh", "ab_prepare.sh", "setup.sh", "run.sh", "run_decode.sh"} <= {s.name for s in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_gpu_script_parses_and_names_existing_files(script):
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    root = GPU.parents[1]
    for ref in set(re.findall(r"tests/gpu/[\w.]+\.(?:py|sh)", script.read_text())):
        assert (root / ref).is_file(), f"{script.name} names {ref}, which does not exist"


def test_gpu_scripts_name_only_bench_systems_that_exist():
    """A misspelt system is refused only on the GPU host, after the machine's start: check every --systems list."""
    from k3compile.bench import SYSTEMS

    lists = [m for s in SCRIPTS for m in re.findall(r"--systems ([\w,-]+)", s.read_text())]
    assert any("inductor-graph" in x for x in lists)  # table.sh's Inductor stage
    for x in lists:
        unknown = set(x.split(",")) - set(SYSTEMS)
        assert not unknown, f"--systems {x} names {sorted(unknown)}: not among {SYSTEMS}"
