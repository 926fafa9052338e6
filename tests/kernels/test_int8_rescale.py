"""SmoothQuant's fused epilogue against torch's expression: bit for bit in fp32 (and on the GPU in 16 bits; the
interpreter truncates fp32 -> bf16, so there one unit apart)."""
import pytest
import torch

from brrr.kernels.quant.int8_rescale import int8_rescale_ref, int8_rescale_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_int8_rescale_matches_reference(device, dtype, with_bias):
    g = torch.Generator().manual_seed(0)
    m, n = 37, 200  # neither a multiple of the 32 x 128 tile
    acc = torch.randint(-(2 ** 26), 2 ** 26, (m + 3, n), generator=g, dtype=torch.int32)[:m]  # past 2^24: rounds
    sx = torch.rand(m, 1, generator=g) * 1e-2 + 1e-4
    sw = (torch.rand(n, generator=g) * 1e-3 + 1e-5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    args = [t if t is None else t.to(device) for t in (acc, sx, sw, bias)]
    got = int8_rescale_triton(*args, dtype).cpu()
    want = int8_rescale_ref(acc, sx, sw, bias, dtype)
    assert got.dtype == dtype
    if dtype == torch.float32 or device == "cuda":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0)


def test_int8_rescale_no_rows(device):
    acc = torch.zeros(0, 8, dtype=torch.int32, device=device)
    out = int8_rescale_triton(acc, torch.zeros(0, 1, device=device), torch.ones(8, device=device), None, torch.float32)
    assert out.shape == (0, 8)
