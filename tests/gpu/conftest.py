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


@pytest.fixture(scope="session")
def kernel_package():
    from k3compile.package import KernelPackage

    path = os.environ.get("K3_KERNEL_PACKAGE")
    if not path:
        pytest.fail("K3_KERNEL_PACKAGE is not set: build a package on a CPU machine with `k3compile codegen "
                    "--examples --package -o DIR` and point K3_KERNEL_PACKAGE at it")
    return KernelPackage(path)
