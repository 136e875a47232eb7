"""MXFP4 (compressed-tensors mxfp4-pack-quantized, k3-architecture.md §1.5 / §7): nibble order, E2M1
code values, E8M0 scales for every byte, and the quantizer used to write random checkpoints."""

import pytest
import torch
from k3ref import dequant_mxfp4, e2m1_value

from k3compile.models import mxfp4

# The E2M1 table of §1.5, written out by hand.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_e2m1_table_is_the_spec():
    assert mxfp4.e2m1_table().tolist() == E2M1
    assert e2m1_value(torch.arange(16)).tolist() == E2M1  # the reference's bit decoding agrees


def test_pack_unpack_every_code_pair_exact():
    # Every ordered pair of codes (a, b) -> one byte with a in the low nibble, b in the high nibble.
    a, b = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    codes = torch.stack([a.flatten(), b.flatten()], -1).reshape(1, -1).to(torch.uint8)  # [1, 512]
    packed = mxfp4.pack_codes(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 256)
    assert packed[0].tolist() == [int(x) + 16 * int(y) for x, y in zip(a.flatten(), b.flatten())]
    assert torch.equal(mxfp4.unpack_codes(packed), codes)
    assert torch.equal(mxfp4.pack_codes(mxfp4.unpack_codes(torch.arange(256, dtype=torch.uint8))),
                       torch.arange(256, dtype=torch.uint8))


def test_low_nibble_is_even_element():
    # byte 0x21: low nibble 1 (0.5) is element 0, high nibble 2 (1.0) is element 1.
    packed = torch.full((1, 16), 0x21, dtype=torch.uint8)
    scale = torch.full((1, 1), 127, dtype=torch.uint8)
    w = mxfp4.dequantize(packed, scale, torch.float32)
    assert w[0, :4].tolist() == [0.5, 1.0, 0.5, 1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_every_code_and_every_scale_byte(dtype):
    # Row e: the 16 codes twice (one group of 32) with scale byte e, for e = 0..255.
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)[None].expand(256, 32)
    packed = mxfp4.pack_codes(codes)
    scale = torch.arange(256, dtype=torch.uint8)[:, None]
    got = mxfp4.dequantize(packed, scale, dtype)
    # W[o, j] = e2m1(code) * 2**(e - 127), evaluated exactly in float64, then rounded once to dtype.
    want = torch.tensor(E2M1, dtype=torch.float64).repeat(2)[None] * torch.pow(
        2.0, torch.arange(256, dtype=torch.float64) - 127)[:, None]
    want = want.to(dtype)
    assert got.dtype == dtype
    assert not torch.isnan(got).any()
    assert torch.equal(got, want), (got != want).nonzero()[:5]


def test_scale_applies_per_32_consecutive_inputs():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 128), generator=g, dtype=torch.uint8)
    scale = torch.randint(100, 140, (5, 4), generator=g, dtype=torch.uint8)
    w = mxfp4.dequantize(mxfp4.pack_codes(codes), scale, torch.float32)
    table = torch.tensor(E2M1)
    for o in range(5):
        for j in range(128):
            assert w[o, j] == table[codes[o, j].long()] * 2.0 ** (int(scale[o, j // 32]) - 127)
    # and the independent reference decoder of the test suite agrees on the whole tensor
    assert torch.equal(w.double(), dequant_mxfp4(mxfp4.pack_codes(codes), scale))


def test_dequantize_batched_leading_dims():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (3, 4, 32), generator=g, dtype=torch.uint8)
    scale = torch.randint(110, 125, (3, 4, 2), generator=g, dtype=torch.uint8)
    w = mxfp4.dequantize(packed, scale, torch.float32)
    for e in range(3):
        assert torch.equal(w[e].double(), dequant_mxfp4(packed[e], scale[e]))


def test_bad_inputs_rejected():
    with pytest.raises(TypeError):
        mxfp4.unpack_codes(torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError):
        mxfp4.pack_codes(torch.zeros(1, 3, dtype=torch.uint8))
    for bad in (16, 256, -1):
        with pytest.raises(ValueError):
            mxfp4.pack_codes(torch.tensor([[0, bad]]))
    with pytest.raises(TypeError):
        mxfp4.dequantize(torch.zeros(1, 16, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError):
        mxfp4.dequantize(torch.zeros(1, 16, dtype=torch.uint8), torch.zeros(1, 2, dtype=torch.uint8))


def test_quantize_error_bounded():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-3, 1, 64)[:, None]  # many magnitudes
    packed, scale = mxfp4.quantize(w)
    assert packed.shape == (64, 128) and scale.shape == (64, 8)
    assert packed.dtype == scale.dtype == torch.uint8
    dq = mxfp4.dequantize(packed, scale, torch.float32)
    s = torch.pow(2.0, scale.float() - 127).repeat_interleave(32, 1)  # the group's scale
    amax = w.abs().unflatten(1, (8, 32)).amax(-1).repeat_interleave(32, 1)
    # No clipping: the group max fits 6*s, and s is the smallest such power of two.
    assert (amax <= 6 * s).all() and (amax > 3 * s).all()
    # Round to nearest on the grid {0,.5,1,1.5,2,3,4,6}*s: half a grid step at most.
    err = (dq - w).abs()
    assert (err <= torch.maximum(0.25 * s, w.abs() / 4) * (1 + 1e-6)).all()
    rel = float((dq - w).norm() / w.norm())
    assert rel < 0.12, rel


def test_quantize_representable_weights_is_exact():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (8, 64), generator=g, dtype=torch.uint8)
    scale = torch.randint(110, 130, (8, 2), generator=g, dtype=torch.uint8)
    w = mxfp4.dequantize(mxfp4.pack_codes(codes), scale, torch.float32)
    p2, s2 = mxfp4.quantize(w)
    assert torch.equal(mxfp4.dequantize(p2, s2, torch.float32), w)
    # quantize never emits negative zero (code 8)
    assert not (mxfp4.unpack_codes(p2) == 8).any()
