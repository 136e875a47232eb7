"""MXFP4 (E2M1 codes + E8M0 block scales) decode on sm_90a, shared by the routed-expert kernels.

Hopper has no FP4 conversion instruction, so codes are decoded in registers: byte-permute (``prmt``)
lookups against two 8-entry byte tables give the low and high bytes of bf16(|e2m1|) for 4 codes at once,
two more permutes interleave them into bf16x2 pairs, and a third gathers the sign bits. About 19 integer
ops per 8 weights. The E8M0 scale is applied once per 32-element block, to the block's dot product, as
two exact fp32 powers of two (every scale byte, 0 and 255 included, matches ``models.mxfp4.dequantize``).

These are plain Python helpers traced into the calling kernel (inlined). tests/templates/test_moe_experts.py
mirrors every integer operation in numpy and checks it bit-exactly against ``mxfp4.dequantize`` for all
256 code bytes x 256 scale bytes. Templates that import this file list it in ``Template.libs``, so it is
part of their kernels' identity (cache key, kernel names).
"""

import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass.experimental.primitives import PermuteMode, prmt

def _s32(v):
    """A 32-bit pattern as a signed Python int (an Int32 immediate)."""
    return v - (1 << 32) if v >= 1 << 31 else v


LUT_LO = (_s32(0xC0800000), _s32(0xC0804000))  # low bytes of bf16(|e2m1|), magnitude codes 0..3 | 4..7
LUT_HI = (_s32(0x3F3F3F00), _s32(0x40404040))  # high bytes (0, 0.5, 1, 1.5 | 2, 3, 4, 6)
SEL_PAIR = (0x5140, 0x7362)  # interleave low/high bytes of codes (0, 1) | (2, 3) into bf16x2
SEL_SIGN = (0x4400, 0x5511, 0x6622, 0x7733)  # byte b of (q << 4) -> byte 1, byte b of q -> byte 3


def _prmt(a, b, sel):
    return Uint32(prmt(Int32(a), Int32(sel), PermuteMode.DEFAULT, hi=Int32(b)))


def decode_e2m1x8(q):
    """8 E2M1 codes (one word; byte b = codes 2b (low nibble), 2b+1) -> 4 bf16x2 words (codes 2b, 2b+1)."""
    mag = q & Uint32(0x77777777)  # selector nibbles: magnitude codes (bit 3 would mean sign-replicate)
    mag_hi = mag >> Uint32(16)
    lo0 = _prmt(LUT_LO[0], LUT_LO[1], mag)
    hi0 = _prmt(LUT_HI[0], LUT_HI[1], mag)
    lo1 = _prmt(LUT_LO[0], LUT_LO[1], mag_hi)
    hi1 = _prmt(LUT_HI[0], LUT_HI[1], mag_hi)
    q4 = q << Uint32(4)
    out = []
    for b in range(4):
        lo, hi = (lo0, hi0) if b < 2 else (lo1, hi1)
        pair = _prmt(lo, hi, SEL_PAIR[b % 2])
        sign = _prmt(q4, q, SEL_SIGN[b]) & Uint32(0x80008000)
        out.append(pair | sign)
    return out


def bf16x2_lo(w):
    return (w << Uint32(16)).bitcast(Float32)


def bf16x2_hi(w):
    return (w & Uint32(0xFFFF0000)).bitcast(Float32)


def e8m0_factors(s):
    """2**(s - 127) as two normal fp32 powers of two (exact for every byte, 0 and 255 included)."""
    half = s >> Uint32(1)
    fa = ((half + Uint32(64)) << Uint32(23)).bitcast(Float32)  # 2**(s//2 - 63)
    fb = ((s - half + Uint32(63)) << Uint32(23)).bitcast(Float32)  # 2**(s - s//2 - 64)
    return fa, fb


def mx_block_dot(rWq, rXq, s):
    """sum_i deq(w_i) * x_i over one MX block: rWq 4 words of codes, rXq 16 bf16x2 words, s the scale byte."""
    d0, d1 = Float32(0.0), Float32(0.0)
    for wi in range(4):
        dec = decode_e2m1x8(rWq[wi])
        for p in range(4):
            xp = rXq[4 * wi + p]
            d0 = cute.math.fma(bf16x2_lo(dec[p]), bf16x2_lo(xp), d0)
            d1 = cute.math.fma(bf16x2_hi(dec[p]), bf16x2_hi(xp), d1)
    fa, fb = e8m0_factors(s)
    return ((d0 + d1) * fa) * fb
