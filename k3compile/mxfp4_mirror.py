"""A numpy mirror of the MXFP4 decode the expert kernels run (``templates/kernels/mxfp4_lib.py``), op for op.

The expert kernels shift FP4 E2M1 codes into bf16 subnormal bit patterns and multiply by one or two packed bf16
powers of two (the E8M0 scale) before the MMA. This mirror reads the kernels' own constants from the library source
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
    """SUB_MAG, SUB_SIGN, SUB_SHIFT, SIGN_SHIFT exactly as the kernels define them (ast, no cutlass import)."""
    env: dict = {}
    for node in ast.parse(_decode_section()).body:
        if isinstance(node, ast.FunctionDef) and node.name == "_s32" or \
                isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets):
            exec(compile(ast.Module([node], []), "<decode>", "exec"), env)
    return {k: v for k, v in env.items() if k.isupper()}


K = _decode_constants()
U32 = np.uint64(0xFFFFFFFF)


# ---------------------------------------------------------------------------------- numpy mirror of the kernel
def _shift(q, n):
    return ((q << np.uint64(n)) if n > 0 else (q >> np.uint64(-n))) & U32


def decode_e2m1x8_sub(q):
    """The kernel's decode_e2m1x8_sub: 8 codes -> 4 bf16x2 words, word j = (code j, code j + 4) * 2**-126."""
    q = np.asarray(q, dtype=np.uint64) & U32
    return [(_shift(q, K["SUB_SHIFT"][j]) & np.uint64(K["SUB_MAG"])) |
            (_shift(q, K["SIGN_SHIFT"][j]) & np.uint64(K["SUB_SIGN"] & 0xFFFFFFFF)) for j in range(4)]


def scale_bf16x2(s):
    """The kernel's scale_bf16x2: (2**min(s-1, 127), 2**max(s-128, 0)) as bf16 bit patterns (one half)."""
    s = np.asarray(s, dtype=np.uint64)
    return np.minimum(s + np.uint64(126), np.uint64(254)) << np.uint64(7), \
        (np.maximum(s, np.uint64(128)) - np.uint64(1)) << np.uint64(7)


def _bf16_bits_to_f64(b):
    return torch.from_numpy((np.asarray(b, dtype=np.uint64) & np.uint64(0xFFFF)).astype(np.int16)).view(
        torch.bfloat16).double()


def _bf16_mul(a_bits, f_bits):
    """fma.rn.bf16x2 with a zero addend on one half: the exact product rounded once to bf16 (subnormals kept)."""
    return (_bf16_bits_to_f64(a_bits) * _bf16_bits_to_f64(f_bits)).to(torch.bfloat16)


def every_byte_every_scale() -> dict:
    """The tensor-core decode (shift/LOP3 subnormal pattern, then x 2**(s-1) in one or two bf16 multiplies,
    the second only when s > 128) for every code byte at every position x every scale byte, against
    ``mxfp4.dequantize`` in bf16, bit for bit. Also checks the k order: word j pairs codes j and j+4."""
    rows = ((np.arange(256)[:, None] + 37 * np.arange(16)[None, :]) % 256).astype(np.uint8)  # [256, 16]
    words = rows.view("<u4").astype(np.uint64)  # [256, 4]
    halves = []  # [256, 32] bf16 bit patterns in kernel order (word wi, pair j, low half then high half)
    order = []  # the element index of each
    for wi in range(4):
        for j, w in enumerate(decode_e2m1x8_sub(words[:, wi])):
            halves += [w & np.uint64(0xFFFF), w >> np.uint64(16)]
            order += [8 * wi + j, 8 * wi + j + 4]
    sub = np.stack(halves, -1)  # [256, 32]
    f1, f2 = scale_bf16x2(np.arange(256, dtype=np.uint64))
    got = _bf16_mul(sub[None], f1[:, None, None])  # [scale, byte, 32]
    big = torch.from_numpy(np.arange(256) > 128)[:, None, None]
    got2 = (got.double() * _bf16_bits_to_f64(f2)[:, None, None]).to(torch.bfloat16)
    got = torch.where(big, got2, got)
    packed = torch.from_numpy(rows)[None].expand(256, -1, -1).contiguous()
    scale = torch.arange(256, dtype=torch.uint8)[:, None, None].expand(-1, 256, 1).contiguous()
    ref = mxfp4.dequantize(packed, scale, torch.bfloat16)[..., order]
    bad = int((got.view(torch.int16) != ref.view(torch.int16)).sum())
    return {"ok": bad == 0 and sorted(order) == list(range(32)), "values": int(got.numel()), "mismatches": bad}
