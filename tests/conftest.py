"""Shared fixtures.

The eager-model tests (tests/models) share ONE random k3-mini checkpoint written once per session,
and models loaded from it once. Tests must treat the session models as read-only: a test that
changes weights loads its own copy.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import mini_codegen
from cpu import one_thread


@pytest.fixture(scope="session")
def mini_ckpt(tmp_path_factory) -> str:
    """Path of a random k3-mini checkpoint (seed 0, single model.safetensors)."""
    from k3compile.models import k3_mini, save_random_checkpoint

    path = str(tmp_path_factory.mktemp("k3_mini_ckpt"))
    with one_thread():
        save_random_checkpoint(path, k3_mini(), seed=0)
    return path


@pytest.fixture(scope="session")
def mini_config_dict(mini_ckpt) -> dict:
    with open(os.path.join(mini_ckpt, "config.json")) as fh:
        return json.load(fh)


@pytest.fixture(scope="session")
def mini_tensors(mini_ckpt) -> dict:
    """Every tensor of the checkpoint, read directly with safetensors (no loader involved)."""
    from safetensors.torch import load_file

    return load_file(os.path.join(mini_ckpt, "model.safetensors"))


@pytest.fixture(scope="session")
def model_f32(mini_ckpt):
    from k3compile.models import load_pretrained

    with one_thread():
        return load_pretrained(mini_ckpt, dtype=torch.float32)


@pytest.fixture(scope="session")
def model_bf16(mini_ckpt):
    from k3compile.models import load_pretrained

    with one_thread():
        return load_pretrained(mini_ckpt)


@pytest.fixture
def ckpt_copy(mini_ckpt, tmp_path):
    """A private, editable copy of the k3-mini checkpoint folder."""
    dst = tmp_path / "ckpt"
    shutil.copytree(mini_ckpt, dst)
    return str(dst)


@pytest.fixture(scope="session")
def mini_model(model_bf16):
    """The k3-mini model the compiler tests compile (bf16, read-only)."""
    return model_bf16


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts and ends with Dynamo's caches and counters cleared (recompile counts are asserted)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # reset() keeps them
    yield
    torch._dynamo.reset()
    counters.clear()


_RUN_DIR: list = []  # this run's scratch directory (the kernel cache unless K3COMPILE_CACHE is set)


def pytest_configure(config):
    """Kernel compiles share one disk cache within a test run (fresh per run, so CI really compiles); set
    K3COMPILE_CACHE yourself to keep one across runs."""
    _RUN_DIR.append(Path(tempfile.mkdtemp(prefix="k3compile_tests.")))
    os.environ.setdefault("K3COMPILE_CACHE", str(_RUN_DIR[0] / "cache"))


def pytest_collection_modifyitems(config, items):
    """The tests that need the compiled k3-mini set run last: it compiles in the background meanwhile."""
    items.sort(key=lambda item: mini_codegen.FIXTURE in getattr(item, "fixturenames", ()))  # stable


def pytest_collection_finish(session):
    """Start the k3-mini compile (tests/mini_codegen.py) if a selected test needs it: on every core but the one
    the other tests use, or on all of them when nothing else was selected."""
    need = [i for i in session.items if mini_codegen.FIXTURE in getattr(i, "fixturenames", ())]
    if need and not session.config.option.collectonly:
        cores = os.cpu_count() or 1
        workers = cores if len(need) == len(session.items) else max(1, cores - 1)
        mini_codegen.start(_RUN_DIR[0] / "mini_codegen", workers)


def pytest_unconfigure(config):
    mini_codegen.stop()
    if _RUN_DIR:
        shutil.rmtree(_RUN_DIR.pop(), ignore_errors=True)
