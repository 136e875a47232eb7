"""Golden text files: compare, or rewrite with K3_UPDATE_GOLDEN=1 (then review the change in the diff)."""

import difflib
import os
from pathlib import Path

import pytest

UPDATE = os.environ.get("K3_UPDATE_GOLDEN") == "1"


def check_golden(path: Path, text: str, what: str = "text") -> None:
    """Fail with a unified diff when ``text`` differs from the golden file at ``path``."""
    if UPDATE:
        path.write_text(text)
        return
    assert path.exists(), f"missing golden file {path}; create it with K3_UPDATE_GOLDEN=1 and review it"
    expected = path.read_text()
    if text != expected:
        diff = "".join(list(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), str(path),
                                                 "now"))[:80])
        pytest.fail(f"{what} differs from {path.name} (K3_UPDATE_GOLDEN=1 to accept after review):\n{diff}")
