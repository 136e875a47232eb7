"""MXFP4 in the compressed-tensors ``mxfp4-pack-quantized`` layout (k3-architecture.md §1.5, §7).

For a logical weight ``W [out, in]``:

* ``weight_packed`` uint8 ``[out, in/2]``: byte j holds element 2j in the **low** nibble and element
  2j+1 in the high nibble (pitfall 11).
* E2M1 code: sign = bit 3, magnitude = {0, 0.5, 1, 1.5, 2, 3, 4, 6}[bits 0-2].
* ``weight_scale`` uint8 E8M0 ``[out, in/32]``: multiplier ``2 ** (e - 127)`` per 32 consecutive inputs.

A kernel runtime may rewrite a ``weight_packed`` tensor's bytes in place into its kernels' own layout (k3compile's
``relay_in_place`` option: one copy of the experts instead of two) and mark it with :func:`mark_relaid`. Every
reader of codes that may see such a tensor goes through :func:`checkpoint_codes`, which undoes the layout of
what it reads; a write to the tensor after the mark makes every later read an error (its layout is unknown).
A traced graph (``torch.compile``, fake tensors) cannot see the mark, so while any such tensor lives, tracing
a read of codes is an error too, except inside :func:`relaid_traces_allowed` (k3compile's own capture, whose
graph reads the experts through kernels that take that layout).
"""

from __future__ import annotations

import contextlib
import weakref

import torch

GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_table(dtype=torch.float32, device=None) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of each E2M1 code (0..15), from its bits: sign | 2-bit exponent | 1-bit mantissa.

    Computed arithmetically (no lookup-table constant) so it also runs on meta/fake tensors.
    """
    c = codes.to(torch.int32)
    exp = ((c >> 1) & 3).float()
    man = (c & 1).float()
    mag = torch.where(exp == 0, 0.5 * man, torch.exp2(exp - 1) * (1 + 0.5 * man))
    return torch.where((c & 8) != 0, -mag, mag)


RELAID_ATTR = "_mxfp4_relaid"  # on a codes tensor rewritten in place: (layout, version after it, undo)


class RelaidCodesError(RuntimeError):
    """Codes rewritten in place into a kernel layout were written again: their layout is unknown."""


_RELAID: "weakref.WeakSet[torch.Tensor]" = weakref.WeakSet()  # the live tensors mark_relaid marked
_TRACES_ALLOWED = [0]  # depth of relaid_traces_allowed()


def mark_relaid(packed: torch.Tensor, layout: str, undo) -> None:
    """Record that ``packed``'s bytes were just rewritten in place into ``layout``; ``undo(t)`` maps codes of
    that layout (``packed`` or rows gathered from it) back to the checkpoint's, as a new tensor."""
    setattr(packed, RELAID_ATTR, (layout, packed._version, undo))
    _RELAID.add(packed)


@contextlib.contextmanager
def relaid_traces_allowed():
    """Inside, tracing a read of codes is allowed while relaid tensors live: for a tracer whose graph never
    reads codes through :func:`checkpoint_codes` at run time (k3compile's capture: its runtime feeds the
    experts to kernels that take the relaid layout, and its eager fallbacks run the model's ops on the real
    tensors)."""
    _TRACES_ALLOWED[0] += 1
    try:
        yield
    finally:
        _TRACES_ALLOWED[0] -= 1


def relaid_layout(packed: torch.Tensor) -> str | None:
    """The kernel layout ``packed``'s bytes are in (None: the checkpoint's); an error if it was written after it
    was rewritten in place."""
    tag = getattr(packed, RELAID_ATTR, None)
    if tag is None:
        return None
    layout, version, _ = tag
    if packed._version != version:
        raise RelaidCodesError(
            f"MXFP4 codes {list(packed.shape)} were rewritten in place into the kernels' layout {layout!r} and then "
            f"written again, so which layout their bytes are in is unknown. Fix: load the weights (the whole "
            f"tensor) before compiling with relay_in_place=True, or compile without it (the runtime then keeps a "
            f"converted copy beside the checkpoint's codes)")
    return layout


def checkpoint_codes(packed: torch.Tensor, index=None) -> torch.Tensor:
    """``packed`` (or ``packed[index]``) in the checkpoint's layout: the tensor (view) itself, or, if a runtime
    rewrote it in place (:func:`mark_relaid`), the rows read through the undo (a new tensor)."""
    from torch._subclasses.fake_tensor import is_fake

    rows = packed if index is None else packed[index]
    if is_fake(packed) or torch.compiler.is_compiling() or packed.device.type == "meta":
        if len(_RELAID) and not _TRACES_ALLOWED[0]:  # a traced graph sees no mark: it would read them raw
            raise RelaidCodesError(
                f"tracing a read of MXFP4 codes while {len(_RELAID)} codes tensor(s) of this process are rewritten "
                f"in place into a kernel layout (k3compile relay_in_place): the traced graph cannot tell them from "
                f"the checkpoint's and would read them wrongly. Fix: trace (torch.compile) a model that was not "
                f"compiled with relay_in_place=True, or free that model first")
        return rows
    if relaid_layout(packed) is None:
        return rows
    return getattr(packed, RELAID_ATTR)[2](rows)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> uint8 codes [..., n]; low nibble is the even element."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"weight_packed must be uint8, got {packed.dtype}")
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] (n even, values 0..15) -> packed uint8 [..., n/2]."""
    if codes.shape[-1] % 2:
        raise ValueError(f"the packed dimension must be even, got {codes.shape[-1]}")
    if bool(((codes < 0) | (codes > 15)).any()):  # check before the uint8 cast wraps e.g. 256 to 0
        raise ValueError("E2M1 codes must lie in 0..15")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """Reference dequant: ``W[o, j] = e2m1(code[o, j]) * 2**(scale[o, j // 32] - 127)``.

    Works on any leading batch dims (e.g. ``[E, out, in/2]``). Exact in fp32; the result is cast to
    ``dtype`` (every product of an E2M1 value and a power of two is exact in bf16 within its range).
    """
    if scale.dtype != torch.uint8:
        raise TypeError(f"weight_scale must be uint8 (E8M0), got {scale.dtype}")
    n_in = packed.shape[-1] * 2
    if scale.shape[-1] * GROUP != n_in or scale.shape[:-1] != packed.shape[:-1]:
        raise ValueError(f"weight_scale shape {tuple(scale.shape)} does not match weight_packed "
                         f"{tuple(packed.shape)} (expected [..., in/{GROUP}] = [..., {n_in // GROUP}])")
    # One lookup per byte gives both of its elements (low nibble first). The 256x2 table is built per call
    # from the code bits, so this also runs on meta/fake tensors.
    byte = torch.arange(256, device=packed.device)
    table = torch.stack((e2m1_values(byte & 15), e2m1_values(byte >> 4)), dim=-1)  # [256, 2]
    vals = table[packed.long()].flatten(-2)
    # 2**(e-127) applied as two powers of two, each finite in fp32: a single factor overflows for
    # e = 255 (2**128), which turned code 0 into NaN and 0.5 * 2**128 = 2**127 into inf. Both
    # products are exact, so every representable result is exact.
    ex = scale.float() - 127.0
    half = torch.floor(ex / 2)
    w = vals.unflatten(-1, (n_in // GROUP, GROUP)) * torch.exp2(half)[..., None] * torch.exp2(ex - half)[..., None]
    return w.flatten(-2).to(dtype)


_DEQUANT_CACHE: dict[int, tuple] = {}  # id(packed) -> (weakref to packed, key, dequantised)


def dequantize_static(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """:func:`dequantize` for static weights, memoised per (packed tensor, version, scale, dtype).

    Only the eager reference uses this, for small expert sets it dequantises whole (a CPU speed-up: the
    weights never change between steps). An in-place change of either tensor bumps its version and
    invalidates the entry; fake/meta tensors (graph capture) are never cached.
    """
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(packed) or packed.device.type == "meta" or torch.compiler.is_compiling():
        return dequantize(checkpoint_codes(packed), scale, dtype)
    key = (packed._version, id(scale), scale._version, dtype)
    hit = _DEQUANT_CACHE.get(id(packed))
    if hit is not None and hit[0]() is packed and hit[1] == key:
        return hit[2]
    out = dequantize(checkpoint_codes(packed), scale, dtype)
    ident = id(packed)
    _DEQUANT_CACHE[ident] = (weakref.ref(packed, lambda _: _DEQUANT_CACHE.pop(ident, None)), key, out)
    return out


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest MXFP4 quantization of ``w [..., out, in]`` -> (weight_packed, weight_scale).

    The scale of each group of 32 is the smallest power of two that makes the group's absmax fit 6.0.
    Used to write random checkpoints; it is not meant to match any particular training recipe.
    """
    wf = w.float()
    n_in = wf.shape[-1]
    if n_in % GROUP:
        raise ValueError(f"input dimension {n_in} is not a multiple of {GROUP}")
    g = wf.unflatten(-1, (n_in // GROUP, GROUP))
    amax = g.abs().amax(-1).clamp_min(2.0 ** -126)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scale = (e + 127).to(torch.uint8)
    x = g / torch.exp2(e)[..., None]
    mags = e2m1_table()[:8]
    idx = (x.abs()[..., None] - mags).abs().argmin(-1)
    codes = idx + 8 * (x < 0).long()
    codes = torch.where(idx == 0, torch.zeros_like(codes), codes)  # no negative zero
    return pack_codes(codes.flatten(-2)), scale
