"""Every kernel of the package against its template's float64 reference, on fresh random inputs with
NaN-poisoned outputs (three different seeds per kernel; one when the inputs exceed 256 MB), and inside a captured CUDA graph replayed after
its inputs changed (a graph must not bake stale pointers or values)."""

import json
import os
import random

import pytest
import torch

from k3compile import kernel_check as kc
from k3compile.templates.base import to_kernel_layout

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _manifest() -> dict:
    """The kernels of the package named by K3_KERNEL_PACKAGE (collection time)."""
    path = os.environ.get("K3_KERNEL_PACKAGE")
    if not path or not os.path.exists(os.path.join(path, "manifest.json")):
        return {}
    with open(os.path.join(path, "manifest.json")) as fh:
        return json.load(fh)["kernels"]


MANIFEST = _manifest()
KERNELS = {n: k.get("example", n) for n, k in MANIFEST.items()} or {"<no package>": ""}  # name -> example label


@pytest.mark.parametrize("name", sorted(KERNELS, key=KERNELS.get), ids=lambda n: KERNELS[n] or n)
def test_kernel_matches_float64_reference(kernel_package, name):
    point = kernel_package.point(name)
    fn = kernel_package.function(name)
    big = kc.input_bytes(point) > 2**28  # real-shape expert pools and caches: inputs and references are slow
    for _ in range(1 if big else 3):
        res = kc.check(point, fn, seed=random.randrange(2**31))
        assert res["ok"], f"{KERNELS[name]} seed {res['seed']}: {res['problems']}"


# the fused residual kernels with an in-kernel all-reduce (TP > 1), which also serve the local wiring
NO_LOCAL = "<no residual_attn_res kernel with TP > 1 in the package>"
LOCAL = sorted(n for n, k in MANIFEST.items()
               if k["template"] == "residual_attn_res" and k["constants"]["TP"] > 1) or [NO_LOCAL]


@pytest.mark.parametrize("name", LOCAL, ids=lambda n: KERNELS.get(n, n))
def test_local_wiring_skips_the_exchange(kernel_package, name):
    """Single-GPU emulation and the NCCL path hand the kernel the sum and one flag pad for every rank: its
    results are the reference's for that sum, and its buffer and flags stay untouched (no exchange ran)."""
    if name == NO_LOCAL:
        pytest.skip(f"{NO_LOCAL}: build one with `k3compile codegen --examples --templates residual_attn_res`")
    point = kernel_package.point(name)
    fn = kernel_package.function(name)
    for _ in range(3):
        res = kc.check_local_wiring(point, fn, seed=random.randrange(2**31))
        assert res["ok"], f"{KERNELS[name]} seed {res['seed']}: {res['problems']}"


# moe_gate_up with DIAG (batch 1, and 2 / 4 at K3 shapes): a scale byte above DIAG_MAX_SCALE makes the task run
# again with two factors
NO_DIAG = "<no moe_gate_up kernel with DIAG in the package>"
DIAG = sorted(n for n, k in MANIFEST.items()
              if k["template"] == "moe_gate_up" and k["constants"].get("DIAG")) or [NO_DIAG]


@pytest.mark.parametrize("name", DIAG, ids=lambda n: KERNELS.get(n, n))
def test_gate_up_diag_scale_bytes_past_one_factor(kernel_package, name):
    """Every expert's first MX block of every row of W1 and W3 gets scale bytes 161-164 (weights of 2**34 to
    2**37), every task runs moe_gate_up's second DIAG pass, and every token's first 32 activations are scaled by
    2**-36 (exact) so that the sums stay of the usual size: a saturated SiTU-GLU would hide an error."""
    if name == NO_DIAG:
        pytest.skip(f"{NO_DIAG}: build one with `k3compile codegen --examples mini_b1 --templates moe_gate_up`")
    point = kernel_package.point(name)
    fn = kernel_package.function(name)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        inputs = point.template.random_inputs(point.c, gen)
        for w in ("w1_scale", "w3_scale"):
            inputs[w][:, :, 0] = torch.randint(161, 165, inputs[w][:, :, 0].shape, generator=gen, dtype=torch.uint8)
        inputs["z"][:, :32] = (inputs["z"][:, :32].double() * 2.0**-36).to(torch.bfloat16)
        dev = kc.device_args(point, inputs)
        fn(*kc.kernel_args(point, dev))
        torch.cuda.synchronize()
        res = kc.compare(point, inputs, dev)
        assert res["ok"], f"{KERNELS[name]} seed {seed}: {res['problems']}"


REPLAY = sorted(n for n, ex in KERNELS.items() if ex.endswith(":mini_b8")) or sorted(KERNELS)[:1]


@pytest.mark.parametrize("name", REPLAY, ids=lambda n: KERNELS[n] or n)
def test_graph_replay_sees_new_inputs(kernel_package, name):
    point = kernel_package.point(name)
    fn = kernel_package.function(name)
    args = point.args()
    d = kc.device_args(point, point.template.random_inputs(point.c, torch.Generator().manual_seed(1)))
    k = kc.kernel_args(point, d)  # the tensors the graph captures (weights in the kernel's layout)
    fn(*k)  # first call (module load) outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(*k)
    for seed in (2, 3):
        fresh = point.template.random_inputs(point.c, torch.Generator().manual_seed(seed))
        for a, t in zip(args, k):
            if a.role == "out":
                t.fill_(float("nan") if t.is_floating_point() else -1)
            else:
                d[a.name].copy_(fresh[a.name])
                if t is not d[a.name]:
                    t.copy_(to_kernel_layout(a, d[a.name]))
        g.replay()
        torch.cuda.synchronize()
        res = kc.compare(point, fresh, d)
        assert res["ok"], f"replay with seed {seed}: {res['problems']}"
