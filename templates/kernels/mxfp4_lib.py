"""MXFP4 (E2M1 codes + E8M0 block scales) decode on sm_90a for the tensor cores, and the MMA itself; shared
by the routed-expert kernels (through moe_lib.py); the GEMV's and the MLA decode's tensor-core paths use the MMA.

Hopper has no FP4 conversion instruction, so codes are decoded in registers, from the kernels' own layout of
the code bytes: ``k3compile.mxfp4_mirror.prepack`` permutes the 32 bits of every 4-byte word of a weight row
once, at load (a bijection inside the word; the bytes stay where they were). In that layout codes 2j and
2j+1 of a word (adjacent k, so the activations pair as they lie in memory, bf16x2 words) decode to one
bf16x2 word with two operations: a shift or rotate and an AND with PACK_MASK (pair 3: two shifts, two masks).
Each half then holds its code's 3 magnitude bits in bf16 bits 6-8 (the low exponent bits and the top mantissa
bit) and its sign in bit 15. That bit pattern is e2m1 * 2**-126 exactly, the subnormal 0.5 included (bf16
subnormals are exact). Multiplying by 2**(s-1) (s the E8M0 byte) in packed bf16 gives the dequantised bf16
weight: one multiply when s <= 128, a second by 2**(s-128) above, so every scale byte, 0 and 255 included,
matches ``models.mxfp4.dequantize``. 9 integer ops and 4 packed multiplies per 8 weights (decoding the
checkpoint's nibble order took 15 integer ops and 4 byte permutes of the activations; a prmt lookup table 23).

These are plain Python helpers traced into the calling kernel (inlined). ``k3compile.mxfp4_mirror`` replays
every integer operation in numpy, derives ``prepack`` from them, and tests/templates/test_moe_experts.py checks
prepack + decode bit-exactly against ``mxfp4.dequantize`` for every code byte at every byte position x every
scale byte. Templates that import this file list it in ``Template.libs``, so it is part of their kernels'
identity (cache key, kernel names).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _s32(v):
    """A 32-bit pattern as a signed Python int (an Int32 immediate)."""
    return v - (1 << 32) if v >= 1 << 31 else v


PACK_MASK = _s32(0x81C081C0)  # bf16 bits 6-8 and 15 of both halves: where a pair's magnitude and sign bits go
PACK_SHL = (4, 6)  # pair 1: q << 4; pair 3 (with PACK_LO): q << 6
PACK_ROT = (10, 14)  # pair 2: rotl(q, 10); pair 3 (with PACK_HI): rotl(q, 14)
PACK_LO = _s32(0x80C080C0)  # pair 3: bits 6, 7 and 15 of each half come from q << 6 ...
PACK_HI = 0x01000100  # ... and bit 8 of each half from rotl(q, 14)


def _rotl(q, n):
    """q rotated left by n bits (one ``shf.l.wrap``)."""
    return (q << Uint32(n)) | (q >> Uint32(32 - n))


def decode_e2m1x8_packed(q):
    """One word of 8 codes in the prepacked layout -> 4 bf16x2 words: word j = (code 2j, code 2j + 1), each
    e2m1 * 2**-126 (pair 0: q & PACK_MASK)."""
    m = Uint32(PACK_MASK)
    return [q & m, (q << Uint32(PACK_SHL[0])) & m, _rotl(q, PACK_ROT[0]) & m,
            ((q << Uint32(PACK_SHL[1])) & Uint32(PACK_LO)) | (_rotl(q, PACK_ROT[1]) & Uint32(PACK_HI))]


def scale_bf16x2(s):
    """The E8M0 byte s as two bf16x2 factors (2**min(s-1, 127), 2**max(s-128, 0)), each in both halves;
    their product with a decode_e2m1x8_packed word is the dequantised weight."""
    e1 = cutlass.min(s + Uint32(126), Uint32(254)) << Uint32(7)
    e2 = (cutlass.max(s, Uint32(128)) - Uint32(1)) << Uint32(7)
    return e1 | (e1 << Uint32(16)), e2 | (e2 << Uint32(16))


SCALE_FAST_BIAS = (126 << 7) | (126 << 23)  # scale_fast: (s + 126) << 7 in both halves, as x * 128 + this
SCALE_SEL_BASE = 0x4040  # scale_pair_selector: result bytes 1 and 3 from byte 4 (the zero operand) ...
SCALE_SEL_STEP = 0x101  # ... and bytes 0 and 2 from byte t of the scale word


@dsl_user_op
def prmt(a, b, sel, *, loc=None, ip=None):
    """``prmt.b32``: byte i of the result is byte (sel >> 4i) & 7 of the pair (a: bytes 0-3, b: 4-7)."""
    res = llvm.inline_asm(T.i32(), [Int32(v).ir_value(loc=loc, ip=ip) for v in (a, b, sel)],
                          "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", has_side_effects=False, loc=loc, ip=ip)
    return Uint32(Int32(res))


def scale_pair_selector(t):
    """The prmt selector taking byte t (0..3) of a scale word into both halves of a scale pair (scale_pair)."""
    return Uint32(SCALE_SEL_BASE) | (Uint32(t) * Uint32(SCALE_SEL_STEP))


def scale_pair(word, sel):
    """A scale pair x = s | s << 16 from byte t of a word of 4 E8M0 bytes (one prmt; sel: scale_pair_selector);
    block_mma takes its scales in this form."""
    return prmt(word, Uint32(0), sel)


def scale_fast(x):
    """The scale pair x as the bf16x2 factor 2**(s-1) (each half), exact for s <= 128: scale_bf16x2's first
    factor without its clamp, one multiply-add. s > 128 is flagged by scale_big_bits."""
    return x * Uint32(128) + Uint32(SCALE_FAST_BIAS)


def scale_big_bits(x):
    """Bit 8 set iff the scale pair's byte s exceeds 128 (s + 127 >= 256; the high half cannot carry into it):
    OR these over a task and test bit 8 once."""
    return x + Uint32(127)


def bf16x2_mul(a, f):
    """a * f per bf16 half, round to nearest even (subnormals kept): fma.rn.bf16x2 with a zero addend."""
    return Uint32(cute.arch.fma_packed_bf16x2(Int32(a), Int32(f), Int32(0)))


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
