"""GGUF blocks repacked into the group-wise layouts: exact against gguf.quants, and the Triton kernel (GEMV and
tensor-core paths) against the torch reference."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, quants

from brrr.gguf.repack import repack_groupwise
from brrr.kernels.quant.groupwise import dequantize_groupwise, groupwise_matmul_ref, groupwise_matmul_triton

N, K = 32, 512
TYPES = [T.Q8_0, T.Q6_K, T.Q5_K, T.Q4_K]


def _blocks(qtype, seed=0):
    """Random valid block bytes (fp16 d / dmin set to finite values) for an [N, K] tensor."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(N * K // block, size), dtype=np.uint8)
    fp16_at = {T.Q8_0: [0], T.Q6_K: [208], T.Q5_K: [0, 2], T.Q4_K: [0, 2]}[qtype]
    for off in fp16_at:
        b[:, off:off + 2] = rng.uniform(0.001, 0.02, size=(b.shape[0], 1)).astype(np.float16).view(np.uint8)
    return b


@pytest.mark.parametrize("qtype", TYPES)
def test_repacked_values_equal_gguf_dequantize(qtype):
    b = _blocks(qtype)
    want = torch.from_numpy(quants.dequantize(b.reshape(N, -1), qtype).astype(np.float32))
    fmt, t = repack_groupwise(torch.from_numpy(b), qtype, N, K)
    got = dequantize_groupwise(fmt, **t)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m, dtype", [(1, torch.float32), (3, torch.bfloat16), (16, torch.float32)])
def test_kernel_matches_reference(device, qtype, m, dtype):
    fmt, t = repack_groupwise(torch.from_numpy(_blocks(qtype, 1)), qtype, N, K)
    t = {k: v.to(device) for k, v in t.items()}
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    bias = torch.randn(N).to(device, dtype)
    want = groupwise_matmul_ref(x, fmt, **t, bias=bias).float()
    got = groupwise_matmul_triton(x, fmt, **t, bias=bias).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert ((got - want).norm() / want.norm()).item() < tol
