"""Every template's torch baseline (``Template.torch_baseline``, the "torch" column of ``k3compile
bench-kernels``) must be capturable in a CUDA graph: no op that reads a device value back to the host. A
baseline that synchronises fails inside the capture and loses its column (``ref_groups`` once counted experts
with ``torch.bincount``, which reads the largest id back). Checked on the CPU by recording the aten ops the
baseline runs, at every k3-mini example point."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3compile import kernel_check as kc
from k3compile.templates import TEMPLATES

# aten ops whose CUDA kernels copy a device value to the host (a sync; not allowed during graph capture)
HOST_SYNCING = {"bincount", "nonzero", "_local_scalar_dense", "unique", "_unique", "_unique2", "unique_consecutive",
                "unique_dim", "masked_select", "item", "is_nonzero", "equal", "allclose"}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append((func.overloadpacket.__name__, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _syncing(seen) -> list[str]:
    bad = [name for name, _ in seen if name in HOST_SYNCING]
    # repeat_interleave with a tensor of repeats sizes its output from their sum unless output_size is given
    bad += [name for name, kw in seen if name == "repeat_interleave" and kw.get("output_size") is None
            and any(isinstance(v, torch.Tensor) for v in kw.values())]
    return bad


POINTS = [(name, label) for name, t in sorted(TEMPLATES.items()) for label in t.examples() if label.startswith("mini_")]


@pytest.mark.parametrize("name,label", POINTS)
def test_torch_baseline_has_no_host_sync(name, label):
    t = TEMPLATES[name]
    point = t.point(**t.examples()[label])
    d = kc.device_args(point, t.random_inputs(point.c, torch.Generator().manual_seed(0)), "cpu")
    run = t.torch_baseline(point.c, d)
    if run is None:
        pytest.skip(f"{name} has no torch baseline")
    with _Ops() as ops:
        run()
    assert ops.seen, f"{name}:{label}: the baseline ran no torch op"
    assert not _syncing(ops.seen), f"{name}:{label}: host-syncing ops {sorted(set(_syncing(ops.seen)))}"


def test_the_guard_catches_bincount():
    with _Ops() as ops:
        torch.bincount(torch.tensor([1, 3]), minlength=4)
    assert _syncing(ops.seen) == ["bincount"]
