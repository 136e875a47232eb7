"""A numpy mirror of the MXFP4 decode the expert kernels run (``templates/kernels/mxfp4_lib.py``), op for op,
and the kernels' weight layout derived from it (``prepack``).

The expert kernels turn two FP4 E2M1 codes of a word into one bf16x2 word of subnormal bit patterns with a shift
or rotate and a mask, then multiply by one or two packed bf16 powers of two (the E8M0 scale) before the MMA.
That works on a layout of the code bytes of their own: ``prepack`` permutes the 32 bits of every 4-byte word
(8 codes) once, at load, so that each pair's bits sit where the decode's shifts take them from. This mirror
reads the kernels' own constants from the library source (ast, no cutlass import), replays the same integer
operations in numpy, and derives the permutation from them (which source bit each output bit reads), so the
layout and the decode cannot drift apart; ``every_byte_every_scale`` checks prepack + decode against
``models/mxfp4.dequantize`` on any machine (the template tests).
"""

from __future__ import annotations

import ast
import functools

import numpy as np
import torch

from .models import mxfp4
from .templates.base import KERNELS_DIR


def _decode_section() -> str:
    return (KERNELS_DIR / "mxfp4_lib.py").read_text()


def _decode_constants() -> dict:
    """PACK_MASK, PACK_SHL, PACK_ROT, PACK_LO, PACK_HI exactly as the kernels define them (ast, no cutlass)."""
    env: dict = {}
    for node in ast.parse(_decode_section()).body:
        if isinstance(node, ast.FunctionDef) and node.name == "_s32" or \
                isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets):
            exec(compile(ast.Module([node], []), "<decode>", "exec"), env)
    return {k: v for k, v in env.items() if k.isupper()}


K = _decode_constants()
U32 = np.uint64(0xFFFFFFFF)
BF16_BITS = (6, 7, 8, 15)  # where a code's mantissa bit, exponent bits and sign land in its bf16 half


# ---------------------------------------------------------------------------------- numpy mirror of the kernel
def _u(v):
    return np.uint64(v & 0xFFFFFFFF)


def _rotl(q, n):
    return ((q << np.uint64(n)) | (q >> np.uint64(32 - n))) & U32


def decode_e2m1x8_packed(q):
    """The kernel's decode_e2m1x8_packed: one prepacked word -> 4 bf16x2 words, word j = (code 2j, code 2j + 1)
    * 2**-126."""
    q = np.asarray(q, dtype=np.uint64) & U32
    m = _u(K["PACK_MASK"])
    return [q & m, ((q << np.uint64(K["PACK_SHL"][0])) & U32) & m, _rotl(q, K["PACK_ROT"][0]) & m,
            (((q << np.uint64(K["PACK_SHL"][1])) & U32) & _u(K["PACK_LO"])) | (_rotl(q, K["PACK_ROT"][1])
                                                                                & _u(K["PACK_HI"]))]


@functools.lru_cache(maxsize=None)
def packed_source_bits() -> tuple[int, ...]:
    """For packed bit i (0..31), the bit of the checkpoint's word it holds: code c's bit b (nibble order, code 0
    in the low nibble of byte 0; b = 0 mantissa, 1-2 exponent, 3 sign) is bit 4c + b. Read off the decode: the
    single set bit of word 1 << i must come out as exactly one bit of one pair, the pair (j) and its half giving
    the code, the bf16 position the code bit; every (code, bit) must be reached once (a bijection)."""
    src = []
    for i in range(32):
        hits = [(j, p) for j, w in enumerate(decode_e2m1x8_packed(np.uint64(1 << i))) for p in range(32)
                if (int(w) >> p) & 1]
        if len(hits) != 1 or hits[0][1] % 16 not in BF16_BITS:
            raise AssertionError(f"mxfp4 decode: packed bit {i} reaches {hits}, not exactly one code bit")
        j, p = hits[0]
        src.append(4 * (2 * j + p // 16) + BF16_BITS.index(p % 16))
    if sorted(src) != list(range(32)):
        raise AssertionError(f"mxfp4 decode: the packed layout is not a permutation of the word's bits: {src}")
    return tuple(src)


@functools.lru_cache(maxsize=None)
def _byte_tables(inverse: bool) -> np.ndarray:
    """[4, 256] uint32: the bits of the output word that each value of each byte of the input word sets
    (checkpoint -> packed, or packed -> checkpoint when ``inverse``)."""
    src = packed_source_bits()  # packed bit i holds checkpoint bit src[i]
    dst = dict(enumerate(src)) if inverse else {s: i for i, s in enumerate(src)}
    t = np.zeros((4, 256), dtype=np.uint64)
    for k in range(4):
        for v in range(256):
            t[k, v] = sum(1 << dst[8 * k + b] for b in range(8) if (v >> b) & 1)
    return t.astype(np.uint32)


def prepack(codes: torch.Tensor, *, inverse: bool = False, chunk_words: int = 1 << 26) -> torch.Tensor:
    """MXFP4 code bytes (uint8, 2 codes per byte, the last dim a multiple of 4: whole words of a row) in the
    expert kernels' layout: the bits of every 4-byte word permuted (``packed_source_bits``), on the tensor's
    device, in chunks of ``chunk_words`` words; ``inverse`` undoes it. A new tensor; the input is unchanged
    (:func:`prepack_` converts in place)."""
    if codes.dtype != torch.uint8:  # (checked before the copy; prepack_ checks the rest)
        raise ValueError(f"prepack: expected uint8 codes with a last dim that is a multiple of 4 (whole 32-bit "
                         f"words), got {codes.dtype}{list(codes.shape)}")
    out = torch.empty_like(codes, memory_format=torch.contiguous_format).copy_(codes)
    return prepack_(out, inverse=inverse, chunk_words=chunk_words)


def prepack_(codes: torch.Tensor, *, inverse: bool = False, chunk_words: int = 1 << 26) -> torch.Tensor:
    """:func:`prepack` in the tensor's own memory (a compact uint8 tensor on a 4-byte boundary): each chunk of
    ``chunk_words`` words is read whole before it is written back, so the extra memory is a chunk's, not the
    tensor's. Returns ``codes``."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 4:
        raise ValueError(f"prepack_: expected uint8 codes with a last dim that is a multiple of 4 (whole 32-bit "
                         f"words), got {codes.dtype}{list(codes.shape)}")
    if not codes.is_contiguous() or codes.storage_offset() % 4:
        raise ValueError("prepack_: converting in place needs a compact tensor that starts on a 4-byte boundary; "
                         "pass the weight itself, not a strided view of it (or use prepack, which copies)")
    tab = torch.from_numpy(_byte_tables(inverse).view(np.int32)).to(codes.device)
    src = codes.view(-1, 4)
    words = codes.view(-1).view(torch.int32)
    for a in range(0, src.shape[0], chunk_words):
        b = src[a:a + chunk_words].long()
        words[a:a + chunk_words] = tab[0][b[:, 0]] | tab[1][b[:, 1]] | tab[2][b[:, 2]] | tab[3][b[:, 3]]
    return codes


def scale_bf16x2(s):
    """The kernel's scale_bf16x2: (2**min(s-1, 127), 2**max(s-128, 0)) as bf16 bit patterns (one half)."""
    s = np.asarray(s, dtype=np.uint64)
    return np.minimum(s + np.uint64(126), np.uint64(254)) << np.uint64(7), \
        (np.maximum(s, np.uint64(128)) - np.uint64(1)) << np.uint64(7)


def prmt(a, b, sel):
    """PTX ``prmt.b32`` (default mode): result byte i is byte (sel >> 4i) & 7 of b:a (a bytes 0-3, b 4-7);
    sel's bit 4i + 3 (sign replication) is not used by the kernels and must be clear."""
    a, b, sel = (np.asarray(v, dtype=np.uint64) for v in (a, b, sel))
    assert not (sel & np.uint64(0x8888)).any(), "prmt: sign-replicating selectors are not mirrored"
    both = (b << np.uint64(32)) | a
    out = np.zeros(np.broadcast(a, b, sel).shape, dtype=np.uint64)
    for i in range(4):
        src = (sel >> np.uint64(4 * i)) & np.uint64(7)
        out |= ((both >> (np.uint64(8) * src)) & np.uint64(0xFF)) << np.uint64(8 * i)
    return out


def scale_pair(word, t):
    """The kernels' scale_pair of byte t of a scale word: prmt(word, 0, SCALE_SEL_BASE | t * SCALE_SEL_STEP)."""
    return prmt(word, 0, np.uint64(K["SCALE_SEL_BASE"]) | np.uint64(t) * np.uint64(K["SCALE_SEL_STEP"]))


def scale_fast(x):
    """The kernels' scale_fast: x * 128 + SCALE_FAST_BIAS (32 bits)."""
    return (np.asarray(x, dtype=np.uint64) * np.uint64(128) + np.uint64(K["SCALE_FAST_BIAS"])) & U32


def scale_big_bits(x):
    """The kernels' scale_big_bits: x + 127 (32 bits); bit 8 flags a byte above 128."""
    return (np.asarray(x, dtype=np.uint64) + np.uint64(127)) & U32


def _bf16_bits_to_f64(b):
    return torch.from_numpy((np.asarray(b, dtype=np.uint64) & np.uint64(0xFFFF)).astype(np.int16)).view(
        torch.bfloat16).double()


def _bf16_mul(a_bits, f_bits):
    """fma.rn.bf16x2 with a zero addend on one half: the exact product rounded once to bf16 (subnormals kept)."""
    return (_bf16_bits_to_f64(a_bits) * _bf16_bits_to_f64(f_bits)).to(torch.bfloat16)


def every_byte_every_scale() -> dict:
    """prepack, then the tensor-core decode (shift/rotate + mask to the subnormal pattern, then x 2**(s-1) in
    one or two bf16 multiplies, the second only when s > 128), for every code byte at every byte position x
    every scale byte, against ``mxfp4.dequantize`` in bf16, bit for bit; pair j of word wi must be elements
    8wi + 2j and 8wi + 2j + 1 (adjacent k: the activations pair as they lie)."""
    rows = ((np.arange(256)[:, None] + 37 * np.arange(16)[None, :]) % 256).astype(np.uint8)  # [256, 16]
    words = prepack(torch.from_numpy(rows)).numpy().view("<u4").astype(np.uint64)  # [256, 4]
    halves = []  # [256, 32] bf16 bit patterns in kernel order (word wi, pair j, low half then high half)
    for wi in range(4):
        for w in decode_e2m1x8_packed(words[:, wi]):
            halves += [w & np.uint64(0xFFFF), w >> np.uint64(16)]
    sub = np.stack(halves, -1)  # [256, 32]
    f1, f2 = scale_bf16x2(np.arange(256, dtype=np.uint64))
    got = _bf16_mul(sub[None], f1[:, None, None])  # [scale, byte, 32]
    big = torch.from_numpy(np.arange(256) > 128)[:, None, None]
    got2 = (got.double() * _bf16_bits_to_f64(f2)[:, None, None]).to(torch.bfloat16)
    got = torch.where(big, got2, got)
    packed = torch.from_numpy(rows)[None].expand(256, -1, -1).contiguous()
    scale = torch.arange(256, dtype=torch.uint8)[:, None, None].expand(-1, 256, 1).contiguous()
    ref = mxfp4.dequantize(packed, scale, torch.bfloat16)
    bad = int((got.view(torch.int16) != ref.view(torch.int16)).sum())
    return {"ok": bad == 0, "values": int(got.numel()), "mismatches": bad}
