"""Golden graph text of k3-mini (TP1, bucket 1) after capture and after the whole pipeline.

(Every pass's own diff is pinned in tests/passes/golden/, at TP 2 where the collectives show.)

A change to capture or to a pass shows up here as a reviewable text diff. To accept a change,
regenerate the files and review them in the commit:

    K3_UPDATE_GOLDEN=1 python -m pytest tests/compiler/test_golden.py
"""

import os
from pathlib import Path

import pytest

from k3compile.compiler import Options, lower
from k3compile.graph_text import graph_text

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("K3_UPDATE_GOLDEN") == "1"


def _check(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text)
        return
    assert path.exists(), f"missing golden file {path}; create it with K3_UPDATE_GOLDEN=1"
    expected = path.read_text()
    if text != expected:
        import difflib

        diff = "".join(list(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), str(path),
                                                 "now"))[:80])
        pytest.fail(f"graph text differs from {path.name} (K3_UPDATE_GOLDEN=1 to accept after review):\n{diff}")


def test_golden_capture(mini_capture):
    gm = mini_capture.graph_module
    gm.meta["k3_inputs"] = mini_capture.inputs
    _check("k3_mini_tp1_b1_00_capture.txt", graph_text(gm))


def test_golden_after_pipeline(mini_capture):
    gm = lower(mini_capture.graph_module, mini_capture.inputs, tp_size=1, bucket=1, options=Options.make())
    _check("k3_mini_tp1_b1_lowered.txt", graph_text(gm))
