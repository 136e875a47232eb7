"""Shared fixtures.

The eager-model tests (tests/models) share ONE random k3-mini checkpoint written once per session,
and models loaded from it once. Tests must treat the session models as read-only: a test that
changes weights loads its own copy.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
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


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache(tmp_path_factory):
    """Kernel compiles share one disk cache within a test run (fresh per run, so CI really compiles);
    set K3COMPILE_CACHE yourself to keep one across runs."""
    if "K3COMPILE_CACHE" not in os.environ:
        os.environ["K3COMPILE_CACHE"] = str(tmp_path_factory.mktemp("k3compile_cache"))
    yield
