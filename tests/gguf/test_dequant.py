"""brrr's torch dequantizers are bit-identical to gguf.quants.dequantize, per block type; its Q4_K/Q6_K
quantizers dequantize through gguf.quants to within the format's error."""
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants as gq

from brrr.gguf.dequant import BLOCK_DEQUANT, dequantize
from brrr.gguf.kquants import quantize_q4_k, quantize_q6_k

QUANTIZABLE = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)  # the types gguf.quants can quantize


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qtype", list(BLOCK_DEQUANT), ids=lambda q: q.name)
def test_random_blocks_dequantize_bit_identically(qtype):
    """Random bytes reach every code and scale bit pattern (NaN and inf scales included: same bits out)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(int(qtype)).integers(0, 256, (6, 4 * size), dtype=np.uint8)
    with np.errstate(all="ignore"):
        want = gq.dequantize(raw, qtype)
    assert _same_bits(dequantize(raw, qtype, (6, 4 * block)).numpy(), want)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda q: q.name)
def test_quantized_weights_dequantize_bit_identically(qtype):
    w = np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32)
    raw = gq.quantize(w, qtype)
    assert _same_bits(dequantize(raw, qtype, w.shape).numpy(), gq.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", (T.F32, T.F16, T.BF16), ids=lambda q: q.name)
def test_float_types(qtype):
    w = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    raw = gq.quantize(w, qtype)
    assert _same_bits(dequantize(raw, qtype, w.shape).numpy(), gq.dequantize(raw, qtype).reshape(w.shape))


@pytest.mark.parametrize("quantize, qtype, bits", [(quantize_q4_k, T.Q4_K, 4), (quantize_q6_k, T.Q6_K, 6)],
                         ids=["Q4_K", "Q6_K"])
def test_k_quants_round_trip_within_one_step(quantize, qtype, bits):
    """Each weight comes back within 1.25 quantization steps of its sub-block (step = range / (2^bits - 1); the
    scale search may clip the largest weight a little, and the super-scales round to fp16); the RMS error is below
    the uniform-rounding error of the range-filling scale, step / sqrt(12) (the search's point)."""
    torch.manual_seed(0)
    w = torch.randn(32, 512) * torch.rand(32, 1) * 3
    raw = quantize(w).numpy()
    assert raw.shape == (32, 512 // 256 * GGML_QUANT_SIZES[qtype][1])
    back = torch.from_numpy(gq.dequantize(raw, qtype))
    assert torch.equal(dequantize(raw, qtype, tuple(w.shape)), back)
    sub = 32 if qtype == T.Q4_K else 16
    groups = w.reshape(-1, sub)
    span = groups.amax(1) - groups.amin(1).clamp(max=0) if qtype == T.Q4_K else 2 * groups.abs().amax(1)
    step = (span / (2 ** bits - 1)).repeat_interleave(sub).reshape(w.shape)
    err = (back - w).abs()
    assert (err <= step * 1.25 + 1e-6).all()
    assert err.pow(2).mean().sqrt() < (step.pow(2).mean() / 12).sqrt()


def test_unknown_type_is_refused_by_name():
    with pytest.raises(ValueError, match="IQ2_XXS"):
        dequantize(np.zeros((1, 66), np.uint8), T.IQ2_XXS, (1, 256))
