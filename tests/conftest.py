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


_RUN_DIR: list = []  # this run's scratch directory, when this process made it (it removes it at the end)


def _xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config):
    """Kernel compiles share one disk cache within a test run (fresh per run, so CI really compiles); set
    K3COMPILE_CACHE yourself to keep one across runs. The main process (a plain run, or pytest-xdist's
    controller) makes the run's scratch directory; xdist workers inherit it through the environment and run one
    intra-op thread each (``-n auto`` already gives every core a worker: more threads only spin-wait)."""
    if mini_codegen.RUN_ENV not in os.environ:
        _RUN_DIR.append(Path(tempfile.mkdtemp(prefix="k3compile_tests.")))
        os.environ[mini_codegen.RUN_ENV] = str(_RUN_DIR[0])
    os.environ.setdefault("K3COMPILE_CACHE", str(Path(os.environ[mini_codegen.RUN_ENV]) / "cache"))
    if _xdist_worker(config):
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """The tests that need the compiled k3-mini set run last: it compiles in the background meanwhile."""
    items.sort(key=lambda item: mini_codegen.FIXTURE in getattr(item, "fixturenames", ()))  # stable


def _start_mini_codegen(config, needed: bool) -> None:
    """Start the k3-mini compile (tests/mini_codegen.py), once per run, from the main process, if a selected test
    needs it: on every core, at low priority beside the tests."""
    if needed and not config.option.collectonly and _RUN_DIR and not (mini_codegen.out_dir() / "pid").exists():
        mini_codegen.start(mini_codegen.out_dir(), os.cpu_count() or 1)


def pytest_collection_finish(session):
    if not _xdist_worker(session.config):  # a plain run collects here; under xdist the workers do
        _start_mini_codegen(session.config, any(mini_codegen.FIXTURE in getattr(i, "fixturenames", ())
                                                for i in session.items))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """pytest-xdist's controller, once a worker has collected: the tests that need the k3-mini set are in
    mini_codegen.TEST_FILE (the controller sees test ids, not fixtures; a run of only that file's other tests
    starts a compile it does not wait for, killed at the end)."""
    _start_mini_codegen(node.config, any(f"{mini_codegen.TEST_FILE}::" in i for i in ids))


def pytest_unconfigure(config):
    mini_codegen.stop()
    if _RUN_DIR:
        shutil.rmtree(_RUN_DIR.pop(), ignore_errors=True)
