"""Golden graph text of k3-mini (TP1, bucket 1) after capture and after the whole pipeline.

(Every pass's own diff is pinned in tests/passes/golden/, at TP 2 where the collectives show.)

A change to capture or to a pass shows up here as a reviewable text diff. To accept a change,
regenerate the files and review them in the commit:

    K3_UPDATE_GOLDEN=1 python -m pytest tests/compiler/test_golden.py
"""

from pathlib import Path

from golden import check_golden

from k3compile.compiler import Options, lower
from k3compile.graph_text import graph_text

GOLDEN = Path(__file__).parent / "golden"


def _check(name: str, text: str) -> None:
    check_golden(GOLDEN / name, text, "graph text")


def test_golden_capture(mini_capture):
    gm = mini_capture.graph_module
    gm.meta["k3_inputs"] = mini_capture.inputs
    _check("k3_mini_tp1_b1_00_capture.txt", graph_text(gm))


def test_golden_after_pipeline(mini_capture):
    gm = lower(mini_capture.graph_module, mini_capture.inputs, tp_size=1, bucket=1, options=Options.make())
    _check("k3_mini_tp1_b1_lowered.txt", graph_text(gm))
