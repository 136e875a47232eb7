"""Check and time one compiled kernel on a GPU against its template's float64 reference.

``check``: fresh random inputs (a new seed each call), every ``out`` argument poisoned first (NaN for
floating outputs, -1 for integer ones), one call, then ``||out - ref|| / ||ref||`` per output and per
updated ``state`` argument against the template's tolerance (in float64, a slice of the leading dimension at a
time: a state tensor of GBs is never copied whole); any NaN or untouched element fails, and a tolerance of 0
means bit-exact.

``time_kernel``: the kernel inside a CUDA graph, replayed over several input sets whose combined weights
exceed the 60 MB L2 (so repeats are not served from cache), median of many replays; beside it, torch
doing the same math (``Template.torch_baseline`` if the template defines one) measured the same way.
"""

from __future__ import annotations

import math

import torch

from .templates.base import to_kernel_layout

L2_BYTES = 60 * 2**20
CHUNK = 1 << 24  # elements per float64 slice when comparing a result with its reference (128 MiB)


def _poison(a, device) -> torch.Tensor:
    t = a.empty(device)
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-1)
    return t


def device_args(point, inputs: dict, device: str = "cuda", shared: dict | None = None) -> dict[str, torch.Tensor]:
    """Device copies of the inputs (outputs and scratch poisoned: a kernel must write before it reads scratch);
    ``shared`` device tensors are used as they are."""
    out = {}
    for a in point.args():
        if shared and a.name in shared:
            out[a.name] = shared[a.name]
        elif a.role in ("out", "scratch"):
            out[a.name] = _poison(a, device)
        else:
            t = inputs[a.name]
            if tuple(t.shape) != tuple(a.shape) or t.dtype != a.torch_dtype:
                raise ValueError(f"{point.name}: random input {a.name} is {t.dtype}{list(t.shape)}, the kernel "
                                 f"takes {a.dtype}{list(a.shape)}")
            out[a.name] = t.to(device).contiguous().clone()
    return out


def kernel_args(point, dev: dict) -> list[torch.Tensor]:
    """The kernel's arguments in call order, from device tensors in the model's layout: a weight that declares a
    layout of its own (``Arg.layout``) converted to it (a new tensor), the rest as they are (outputs are
    written into ``dev``'s tensors)."""
    return [to_kernel_layout(a, dev[a.name]) for a in point.args()]


def check(point, fn, *, seed: int, device: str = "cuda") -> dict:
    """One correctness check on fresh inputs; returns {'ok', 'errors': {name: rel}, 'problems': [...]}."""
    gen = torch.Generator().manual_seed(seed)
    inputs = point.template.random_inputs(point.c, gen)
    dev = device_args(point, inputs, device)
    fn(*kernel_args(point, dev))
    torch.cuda.synchronize()
    return {**compare(point, inputs, dev), "seed": seed}


def check_local_wiring(point, fn, *, seed: int, device: str = "cuda") -> dict:
    """A fused residual kernel with TP > 1 (``residual_attn_res``) on the local wiring of
    :mod:`k3compile.comm` (single-GPU emulation, or after an NCCL all-reduce: ``a`` is the sum, ``peer0`` is
    ``a``, the other peers a zero block, every rank's flag pad this rank's own): y and the new prefix as the
    float64 reference with ``a`` as the sum, and the kernel must recognise the wiring and skip the exchange, so
    this rank's buffer ``comm`` and its flag pad come back untouched (the exchange would copy ``a`` into the
    one and advance the other)."""
    from . import comm

    c = point.c
    if point.template.name != "residual_attn_res" or c["TP"] == 1:
        raise ValueError(f"{point.name}: the local wiring is a residual_attn_res kernel's with TP > 1")
    inputs = point.template.random_inputs(c, torch.Generator().manual_seed(seed))
    m, d = inputs["a"].shape
    inputs["peer0"] = inputs["a"]
    for p in range(1, c["TP"]):
        inputs[f"peer{p}"] = torch.zeros(m, d, dtype=torch.bfloat16)
    wired = comm._Local(device).args(inputs["a"].to(device), c["TP"])  # its own buffers, not the cached ones
    wired["comm"].copy_(inputs["comm"])
    wired["signal"].copy_(inputs["signal"])
    dev = device_args(point, inputs, device, shared=wired)
    fn(*kernel_args(point, dev))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    expect = {"comm": inputs["comm"].double(), "signal": inputs["signal"]}
    return {**compare(point, inputs, dev, expect), "seed": seed}


def compare(point, inputs: dict, dev: dict, expect: dict | None = None) -> dict:
    """Kernel results in ``dev`` against the template's float64 reference for ``inputs`` (state arguments the
    kernel writes as copies of its own outputs: against ``Template.copied_state``, exactly); ``expect``
    replaces entries of the reference."""
    t, c = point.template, point.c
    ref = t.reference(c, {k: v.clone() for k, v in inputs.items()})
    ref.update(expect or {})
    ref.update(t.copied_state(c, inputs, {a.name: dev[a.name] for a in point.args() if a.role == "out"}))
    tol = t.tolerance(c)
    errors, problems = {}, []
    for name, r in ref.items():
        got = dev[name]
        if not got.is_floating_point():
            got = got.cpu()
            bad = int((got != r.to(got.dtype)).sum())
            errors[name] = bad
            if bad:
                problems.append(f"{name}: {bad} of {got.numel()} integer values differ")
            continue
        rel, nans, differ = relative_error(got, r)
        if nans:
            problems.append(f"{name}: {nans} of {got.numel()} values NaN (unwritten or invalid)")
            errors[name] = math.inf
            continue
        errors[name] = rel
        lim = tol[name] if isinstance(tol, dict) else tol
        if not rel <= lim:
            problems.append(f"{name}: {differ} of {got.numel()} values differ (exact comparison)" if lim == 0 else
                            f"{name}: relative error {rel:.3g} > {lim:g}")
    return {"ok": not problems, "errors": errors, "problems": problems}


def relative_error(got: torch.Tensor, ref: torch.Tensor, chunk: int | None = None) -> tuple[float, int, int]:
    """``(||got - ref|| / ||ref||, NaNs in got, elements that differ)`` in float64, summed over slices of the
    leading dimension of about ``chunk`` elements (default ``CHUNK``): a large state tensor (an MLA cache of
    several GB) is never one float64 copy, and ``got`` may stay on the device (each slice is copied to the
    host). ``ref`` may be of any floating dtype (a state reference is kept in the state's own dtype when its
    values are exact)."""
    chunk = CHUNK if chunk is None else chunk
    if got.numel() != ref.numel():
        raise ValueError(f"the kernel's result is {list(got.shape)}, its reference {list(ref.shape)} (a "
                         f"template bug: the reference must have the argument's elements)")
    ref = ref.reshape(got.shape)
    if got.dim() == 0:
        got, ref = got.reshape(1), ref.reshape(1)
    step = max(1, chunk // max(1, got[0].numel()))
    diff2, ref2, nans, differ = 0.0, 0.0, 0, 0
    for i in range(0, got.shape[0], step):
        g = got[i:i + step].detach().cpu().double()
        r = ref[i:i + step].detach().cpu().double()
        d = g - r
        nans += int(torch.isnan(g).sum())
        differ += int((d != 0).sum())
        diff2 += float(d.square().sum())
        ref2 += float(r.square().sum())
    return math.sqrt(diff2) / max(math.sqrt(ref2), 1e-30), nans, differ


def input_bytes(point) -> int:
    return sum(a.nbytes for a in point.args() if a.role != "out")


def measure_copy_bandwidth(device: str = "cuda", nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), median of 20."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.random_(0, 255)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return nbytes / times[len(times) // 2]


def graph_time_us(calls: list, *, replays: int = 50) -> float:
    """Median µs per call of ``calls`` (closures, one per input set) captured round-robin in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in calls:  # warm up (module load, first-call setup) outside the capture
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    reps = max(1, 64 // len(calls))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for f in calls:
                f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / (reps * len(calls)))
    times.sort()
    return times[len(times) // 2]


def input_sets(point, *, seed: int, device: str = "cuda") -> list[dict]:
    """Input sets for timing, so that repeats are not served from the L2: enough independent sets that the
    bytes one call moves, summed over the sets, exceed twice the L2 (at most 16 sets). When the weights are
    a pool much larger than what one call reads (routed experts: the activations pick the experts), the
    sets share the weights and differ in their activations, which then select other weights."""
    moved = max(1, point.template.bytes(point.c))
    n = max(2, min(16, math.ceil(2 * L2_BYTES / moved)))
    wbytes = sum(a.nbytes for a in point.args() if a.role == "weight")
    gen = torch.Generator().manual_seed(seed)
    first = device_args(point, point.template.random_inputs(point.c, gen), device)
    sets = [first]
    for i in range(1, n):
        gen = torch.Generator().manual_seed(seed + i)
        fresh = point.template.random_inputs(point.c, gen)
        shared = {a.name: first[a.name] for a in point.args() if a.role == "weight"} \
            if wbytes >= 8 * L2_BYTES else None
        sets.append(device_args(point, fresh, device, shared))
    return sets
