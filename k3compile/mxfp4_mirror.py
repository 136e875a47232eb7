"""A numpy mirror of the MXFP4 decode the expert kernels run (``templates/kernels/mxfp4_lib.py``), op for op.

The kernels decode FP4 E2M1 codes to bf16 with byte permutes (``prmt``) over lookup words and apply the
E8M0 scale as two float factors. This mirror reads the kernels' own constants from the library source
(ast, no cutlass import) and replays the same integer operations in numpy, so the decode bit logic is
checked against ``models/mxfp4.dequantize`` on any machine (the template tests, ``k3compile verify``).
"""

from __future__ import annotations

import ast

import numpy as np
import torch

from .models import mxfp4
from .templates.base import KERNELS_DIR


def _decode_section() -> str:
    return (KERNELS_DIR / "mxfp4_lib.py").read_text()


def _decode_constants() -> dict:
    """LUT_LO, LUT_HI, SEL_PAIR, SEL_SIGN exactly as the kernels define them (ast, no cutlass import)."""
    env: dict = {}
    for node in ast.parse(_decode_section()).body:
        if isinstance(node, ast.FunctionDef) and node.name == "_s32" or \
                isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets):
            exec(compile(ast.Module([node], []), "<decode>", "exec"), env)
    return {k: v for k, v in env.items() if k.isupper()}


K = _decode_constants()
U32 = np.uint64(0xFFFFFFFF)


# ---------------------------------------------------------------------------------- numpy mirror of the kernel
def prmt(a, b, sel):
    """PTX prmt.b32 (default mode): result byte k = byte (sel nibble k & 7) of {b:a}; nibble bit 3 replicates
    that byte's msb. Only sel[15:0] is used. Works elementwise on uint64 arrays holding 32-bit values."""
    a, b, sel = (np.asarray(v, dtype=np.int64).astype(np.uint64) & U32 for v in (a, b, sel))
    src = [(a >> np.uint64(8 * k)) & np.uint64(0xFF) for k in range(4)] + \
          [(b >> np.uint64(8 * k)) & np.uint64(0xFF) for k in range(4)]
    shape = np.broadcast_shapes(a.shape, b.shape, sel.shape)
    src = np.stack([np.broadcast_to(v, shape) for v in src], axis=-1)
    out = np.zeros(shape, dtype=np.uint64)
    for k in range(4):
        nib = np.broadcast_to((sel >> np.uint64(4 * k)) & np.uint64(0xF), out.shape)
        byte = np.take_along_axis(src, (nib & np.uint64(7)).astype(np.int64)[..., None], -1)[..., 0]
        rep = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= np.where(nib & np.uint64(8), rep, byte) << np.uint64(8 * k)
    return out


def decode_e2m1x8(q):
    """The kernel's decode_e2m1x8, op for op: 8 codes per word -> 4 bf16x2 words."""
    q = np.asarray(q, dtype=np.uint64) & U32
    mag = q & np.uint64(0x77777777)
    mag_hi = mag >> np.uint64(16)
    lo0, hi0 = prmt(K["LUT_LO"][0], K["LUT_LO"][1], mag), prmt(K["LUT_HI"][0], K["LUT_HI"][1], mag)
    lo1, hi1 = prmt(K["LUT_LO"][0], K["LUT_LO"][1], mag_hi), prmt(K["LUT_HI"][0], K["LUT_HI"][1], mag_hi)
    q4 = (q << np.uint64(4)) & U32
    out = []
    for b in range(4):
        lo, hi = (lo0, hi0) if b < 2 else (lo1, hi1)
        pair = prmt(lo, hi, K["SEL_PAIR"][b % 2])
        sign = prmt(q4, q, K["SEL_SIGN"][b]) & np.uint64(0x80008000)
        out.append(pair | sign)
    return out


def _f32(bits):
    return (np.asarray(bits, dtype=np.uint64) & U32).astype(np.uint32).view(np.float32)


def bf16x2_lo(w):
    return _f32(w << np.uint64(16))


def bf16x2_hi(w):
    return _f32(w & np.uint64(0xFFFF0000))


def e8m0_factors(s):
    s = np.asarray(s, dtype=np.uint64)
    half = s >> np.uint64(1)
    return _f32((half + np.uint64(64)) << np.uint64(23)), _f32((s - half + np.uint64(63)) << np.uint64(23))


def decode_values(words):
    """[..., 4] words (one 16-byte MX block) -> [..., 32] fp32 code values in element order."""
    vals = []
    for wi in range(4):
        for p, w in enumerate(decode_e2m1x8(words[..., wi])):
            vals += [bf16x2_lo(w), bf16x2_hi(w)]
    return np.stack(vals, axis=-1)




def every_byte_every_scale() -> dict:
    """Decode every code byte at every position of a 16-byte block under every scale byte (256 x 256 x 32
    values) and compare bit for bit (fp32, signed zeros included) and after bf16 rounding with
    ``mxfp4.dequantize``. Returns {'ok', 'values', 'mismatches'}."""
    # block r holds byte (r + 37 * pos) % 256 at position pos: every byte value at every position of every
    # word, with different bytes side by side (so a selector that reads the wrong byte cannot hide)
    rows = ((np.arange(256)[:, None] + 37 * np.arange(16)[None, :]) % 256).astype(np.uint8)  # [256, 16]
    words = rows.view("<u4").astype(np.uint64)  # [256, 4] little-endian, as recast_tensor on the GPU
    vals = decode_values(words)  # [256, 32]
    fa, fb = e8m0_factors(np.arange(256, dtype=np.uint64))  # [256]
    with np.errstate(over="ignore"):
        got = (vals[None, :, :] * fa[:, None, None]) * fb[:, None, None]  # [scale, byte, 32] fp32, kernel order
    packed = torch.from_numpy(rows)[None].expand(256, -1, -1).contiguous()
    scale = torch.arange(256, dtype=torch.uint8)[:, None, None].expand(-1, 256, 1).contiguous()
    ref32 = mxfp4.dequantize(packed, scale, torch.float32).numpy()
    bad32 = int((got.view(np.uint32) != ref32.view(np.uint32)).sum())
    ref16 = mxfp4.dequantize(packed, scale, torch.bfloat16).view(torch.int16)
    bad16 = int((torch.from_numpy(got.copy()).to(torch.bfloat16).view(torch.int16) != ref16).sum())
    return {"ok": bad32 == 0 and bad16 == 0, "values": int(got.size), "mismatches": bad32 + bad16}
