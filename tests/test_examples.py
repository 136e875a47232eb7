"""The examples the README points to run as written."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_compile_example():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "compile.py"), "--steps", "3"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "max |logits - eager| = {'by_name': 0.0, 'explicit': 0.0}" in r.stdout
    assert "fuse_oproj_allreduce" in r.stdout and "select_kernels" in r.stdout
