"""MXFP4 (E2M1 codes + E8M0 block scales) decode on sm_90a for the tensor cores, and the MMA itself; shared
by the routed-expert kernels (through moe_lib.py) and the GEMV's tensor-core path.

Hopper has no FP4 conversion instruction, so codes are decoded in registers. Codes j and j+4 of a word go
to the low and high half of one bf16x2 word with two shifts and a LOP3: the 3 magnitude bits land in bf16
bits 6-8 (the low exponent bits and the top mantissa bit), the sign in bit 15. That bit pattern is
e2m1 * 2**-126 exactly, the subnormal 0.5 included (bf16 subnormals are exact). Multiplying by 2**(s-1)
(s the E8M0 byte) in packed bf16 gives the dequantised bf16 weight: one multiply when s <= 128, a second
by 2**(s-128) above, so every scale byte, 0 and 255 included, matches ``models.mxfp4.dequantize``. About
15 integer ops and 4 packed multiplies per 8 weights (the prmt lookup-table decode it replaced: 23).

These are plain Python helpers traced into the calling kernel (inlined). ``k3compile.mxfp4_mirror`` replays
every integer operation in numpy, and tests/templates/test_moe_experts.py checks it bit-exactly against
``mxfp4.dequantize`` for all 256 code bytes x 256 scale bytes. Templates that import this file list it in
``Template.libs``, so it is part of their kernels' identity (cache key, kernel names).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.experimental.primitives import PermuteMode, prmt

def _s32(v):
    """A 32-bit pattern as a signed Python int (an Int32 immediate)."""
    return v - (1 << 32) if v >= 1 << 31 else v


SUB_MAG = 0x01C001C0  # magnitude bits of both halves
SUB_SIGN = _s32(0x80008000)
SUB_SHIFT = (6, 2, -2, -6)  # codes (j, j+4) magnitude bits 4j..4j+2 -> bits 6..8
SIGN_SHIFT = (12, 8, 4, 0)  # sign bit 4j+3 -> bit 15


def _prmt(a, b, sel):
    return Uint32(prmt(Int32(a), Int32(sel), PermuteMode.DEFAULT, hi=Int32(b)))


def _shift(q, n):
    if n > 0:
        return q << Uint32(n)
    if n < 0:
        return q >> Uint32(-n)
    return q


def decode_e2m1x8_sub(q):
    """8 E2M1 codes (one word) -> 4 bf16x2 words: word j = (code j, code j + 4), each e2m1 * 2**-126."""
    return [(_shift(q, SUB_SHIFT[j]) & Uint32(SUB_MAG)) | (_shift(q, SIGN_SHIFT[j]) & Uint32(SUB_SIGN))
            for j in range(4)]


def scale_bf16x2(s):
    """The E8M0 byte s as two bf16x2 factors (2**min(s-1, 127), 2**max(s-128, 0)), each in both halves;
    their product with a decode_e2m1x8_sub word is the dequantised weight."""
    e1 = cutlass.min(s + Uint32(126), Uint32(254)) << Uint32(7)
    e2 = (cutlass.max(s, Uint32(128)) - Uint32(1)) << Uint32(7)
    return e1 | (e1 << Uint32(16)), e2 | (e2 << Uint32(16))


def bf16x2_mul(a, f):
    """a * f per bf16 half, round to nearest even (subnormals kept): fma.rn.bf16x2 with a zero addend."""
    return Uint32(cute.arch.fma_packed_bf16x2(Int32(a), Int32(f), Int32(0)))


def pair_lo4(a, b):
    """(low half of a, low half of b) as one bf16x2 word."""
    return _prmt(a, b, 0x5410)


def pair_hi4(a, b):
    """(high half of a, high half of b) as one bf16x2 word."""
    return _prmt(a, b, 0x7632)


@dsl_user_op
def mma_bf16_16816(a, b, c, *, loc=None, ip=None):
    """One ``mma.sync.m16n8k16`` (bf16 inputs, fp32 accumulate): a 4 bf16x2 words, b 2, c 4 fp32; returns
    the 4 fp32 accumulators (sm_80+ register fragment layout)."""
    ops = [Int32(v).ir_value(loc=loc, ip=ip) for v in (*a, *b)] + [Float32(v).ir_value(loc=loc, ip=ip) for v in c]
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4), ops,
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
        "{$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]
