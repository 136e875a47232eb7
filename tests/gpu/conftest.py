"""GPU tests (marker ``gpu``): run on the H200 host, against a prebuilt kernel package.

They need a CUDA GPU (skipped without one: a CPU machine cannot run kernels) and a package built on a CPU
machine with ``k3compile codegen --examples --package -o DIR``, named by ``K3_KERNEL_PACKAGE=DIR``. With a
GPU but no package the tests fail: a GPU run that checked nothing must not look green.
"""

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the H200 host: see README, GPU tests)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _package_dir(var: str, build: str) -> str:
    """The package directory named by the environment variable ``var``; a GPU run without it fails (a run
    that checked nothing must not look green)."""
    path = os.environ.get(var)
    if not path:
        pytest.fail(f"{var} is not set: build a package on a CPU machine with `{build}` and point {var} at it")
    return path


@pytest.fixture(scope="session")
def kernel_package():
    from k3compile.package import KernelPackage

    return KernelPackage(_package_dir("K3_KERNEL_PACKAGE", "k3compile codegen --examples --package -o DIR"))


@pytest.fixture(scope="session")
def decode_package() -> tuple[str, int]:
    """(directory, MLA cache capacity) of the package the decode tests compile the trained k3-mini with."""
    import json

    path = _package_dir("K3_DECODE_PACKAGE", "k3compile codegen --config checkpoints/k3_mini_text/config.json "
                                             "--tp 1 --max-context 4096 --package -o DIR")
    with open(os.path.join(path, "manifest.json")) as fh:
        return path, json.load(fh)["max_context"]
