import pytest
import torch

from brrr.errors import BrrrError
from brrr.quant import formats


def _w(out=48, n=256, seed=0):
    return torch.randn(out, n, generator=torch.Generator().manual_seed(seed))


def test_int4_pack_unpack_is_exact_and_puts_even_columns_in_the_low_nibble():
    q = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(1))
    packed = formats.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 32)
    assert torch.equal(packed[:, 0] & 0xF, q[:, 0].to(torch.uint8))
    assert torch.equal(packed[:, 0] >> 4, q[:, 1].to(torch.uint8))
    assert torch.equal(formats.unpack_int4(packed), q.to(torch.uint8))


def test_int8_round_trip_error_is_at_most_half_a_step():
    w = _w()
    t = formats.quantize_int8(w)
    assert t["qweight"].dtype == torch.int8
    err = (formats.dequantize_int8(t) - w).abs()
    assert (err <= t["scales"][:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_round_trip_error_is_at_most_half_a_step_per_group(group_size, symmetric):
    w = _w()
    t = formats.quantize_int4(w, group_size, symmetric)
    assert t["scales"].shape == (48, 256 // group_size) and t["qweight"].shape == (48, 128)
    if symmetric:
        assert (t["zeros"] == 8).all()
    err = (formats.dequantize_int4(t) - w).abs().view(48, -1, group_size)
    assert (err <= t["scales"][..., None] / 2 + 1e-5).all()
    # and 4 bits really are 16 levels: relative error of a gaussian weight is a few percent, not zero
    rel = (formats.dequantize_int4(t) - w).norm() / w.norm()
    assert 0.03 < rel < 0.15


def test_nf4_with_double_quantization_round_trips_within_half_the_widest_level_gap():
    w = _w(64, 192)
    t = formats.quantize_nf4(w)
    assert t["absmax_q"].dtype == torch.int8 and t["absmax_q"].numel() == 64 * 192 // 64
    assert t["absmax_scales"].numel() == 1  # 192 absmaxes: one second-level block of 256
    back = formats.dequantize_nf4(t)
    assert back.shape == w.shape
    absmax = w.flatten().view(-1, 64).abs().amax(1)
    widest_gap = (formats.NF4_LEVELS[1:] - formats.NF4_LEVELS[:-1]).max()
    # half a level gap of the block's absmax, plus the 8-bit error of the absmax itself
    bound = absmax * widest_gap / 2 + t["absmax_scales"][0] / 2 + 1e-5
    assert ((back - w).flatten().view(-1, 64).abs() <= bound[:, None]).all()
    # the double-quantized absmaxes cost 8 bits per 64 weights plus a float per 256 blocks: ~4.13 bits total
    assert formats.bits_per_weight("nf4", t, w.numel()) < 4.2


@pytest.mark.parametrize("per_row", [True, False])
def test_fp8_e4m3_round_trip_relative_error_is_within_e4m3_precision(per_row):
    w = _w()
    t = formats.quantize_fp8(w, per_row)
    assert t["qweight"].dtype == torch.float8_e4m3fn
    assert t["scales"].numel() == (48 if per_row else 1)
    back = formats.dequantize_fp8(t)
    # E4M3 has 3 mantissa bits: relative rounding error <= 2^-4 for normal values
    scale = t["scales"][:, None] if per_row else t["scales"]
    normal = (w / scale).abs() >= 2 ** -6
    assert ((back - w).abs()[normal] <= w.abs()[normal] * 2 ** -4 + 1e-6).all()


def test_bad_group_sizes_and_shapes_are_clear_errors():
    with pytest.raises(BrrrError, match="group_size must be one of 32, 64, 128"):
        formats.quantize_int4(_w(), group_size=48)
    with pytest.raises(BrrrError, match="does not divide the input dimension 96"):
        formats.quantize_int4(_w(8, 96), group_size=64)
    with pytest.raises(BrrrError, match="divisible by 64"):
        formats.quantize_nf4(_w(3, 7))
