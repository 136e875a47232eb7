"""Settings for the eager-model tests (fixtures shared with other suites live in tests/conftest.py)."""

import pytest
from cpu import one_thread


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """k3-mini's ops are tiny: one intra-op thread is as fast as two on an idle machine and avoids
    OpenMP spin-waiting, which slows these tests ~10x when the two cores are shared. Per test (and
    inside the larger-scoped fixtures that compute), so that other suites keep their setting."""
    with one_thread():
        yield


@pytest.fixture(scope="session")
def pinned_routing_ckpt(mini_ckpt, tmp_path_factory):
    """The k3-mini checkpoint with every MoE layer's e_score_correction_bias set to +1 on 4 experts
    (0 elsewhere). Sigmoid scores lie in (0, 1), so those 4 are always the top-4: the routing cannot
    flip. Used to compare bf16 runs, whose rounding otherwise flips near-tied top-k choices of the
    random router on some rows (an O(1) change of those rows' logits). The bias is selection-only, so
    the routing *weights* still come from the router and everything else is exercised as before."""
    import os
    import shutil

    import torch
    from k3ref import rewrite_safetensors

    dst = os.path.join(str(tmp_path_factory.mktemp("k3_mini_pinned")), "ckpt")
    shutil.copytree(mini_ckpt, dst)

    def pin(tensors):
        for name in tensors:
            if name.endswith("e_score_correction_bias"):
                layer = int(name.split(".layers.")[1].split(".")[0])
                bias = torch.zeros_like(tensors[name])
                bias[torch.randperm(bias.numel(), generator=torch.Generator().manual_seed(layer))[:4]] = 1.0
                tensors[name] = bias
        return tensors

    with one_thread():
        rewrite_safetensors(dst, pin)
    return dst
