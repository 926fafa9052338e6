"""GGUF block types dequantized in torch, bit-identical to `gguf.quants.dequantize` (tests/gguf/test_dequant.py).

A quantized row is a run of blocks; each block stores its codes and the scale(s) that turn them into weights.
  Q8_0  32 weights: fp16 d, 32 int8 q                          w = d q
  Q4_0  32 weights: fp16 d, 16 bytes of nibbles                w = d (q - 8)
  Q4_1  32 weights: fp16 d, fp16 m, nibbles                    w = d q + m
  Q5_0 / Q5_1: as Q4_0 / Q4_1 plus a 32-bit word of fifth bits (q - 16 for Q5_0)
  K-quants: a 256-weight super-block of 16 or 8 sub-blocks, each with a small integer scale (and min) that an
  fp16 super-scale d (and dmin) multiplies: w = (d sc) q - (dmin m). Q2_K 2-bit codes, 4-bit sc/m; Q3_K 3-bit
  (2 low bits + a high-bit mask), 6-bit signed sc; Q4_K/Q5_K 4/5-bit codes, 6-bit sc/m packed in 12 bytes;
  Q6_K 6-bit codes (4 low + 2 high), int8 sc.
The arithmetic follows the reference's float32 operation order (products, then sums), so every value matches it
exactly. docs/gguf.md has the layouts and the bits per weight."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from brrr.errors import BrrrError

QK_K = 256


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] bytes -> [n, 1] float32 from their little-endian fp16."""
    return b.contiguous().view(torch.float16).float()


def _u8(values, like: torch.Tensor) -> torch.Tensor:
    """Shift amounts as a uint8 tensor on the blocks' device (dequantization runs where the weights go)."""
    return torch.tensor(list(values), dtype=torch.uint8, device=like.device)


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """[n, groups * 16k] bytes -> [n, groups, 2, 16k]: each group's low nibbles, then its high nibbles."""
    qs = qs.reshape(qs.shape[0], groups, 1, -1)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2)


def _bits(words: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """[n, ..., 1] integers -> [n, ..., count] fields of `width` bits, lowest first."""
    shifts = torch.arange(0, count * width, width, dtype=words.dtype, device=words.device)
    return (words >> shifts) & ((1 << width) - 1)


def q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def q4_0(b):
    q = _nibbles(b[:, 2:], 1).reshape(b.shape[0], -1).to(torch.int8) - 8
    return _f16(b[:, :2]) * q.float()


def q4_1(b):
    q = _nibbles(b[:, 4:], 1).reshape(b.shape[0], -1).float()
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _q5(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    high = _bits(qh.contiguous().view(torch.int32), 32, 1).to(torch.uint8)  # [n, 32]
    low = _nibbles(qs, 1).reshape(qs.shape[0], -1)
    return low | (high << 4)


def q5_0(b):
    q = _q5(b[:, 2:6], b[:, 6:]).to(torch.int8) - 16
    return _f16(b[:, :2]) * q.float()


def q5_1(b):
    q = _q5(b[:, 4:8], b[:, 8:]).float()
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def q2_k(b):
    n = b.shape[0]
    scales, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    shifts = _u8([0, 2, 4, 6], b).reshape(1, 1, 4, 1)
    q = ((qs.reshape(n, -1, 1, 32) >> shifts) & 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def q3_k(b):
    n = b.shape[0]
    hmask, qs, scales, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = torch.cat([scales[:, :8].reshape(n, 1, 8) & 0x0F, scales[:, :8].reshape(n, 1, 8) >> 4], 1).reshape(n, 16)
    hs = scales[:, 8:].reshape(n, 1, 4) >> _u8([0, 2, 4, 6], b).reshape(1, 4, 1)
    sc = (low | ((hs.reshape(n, 16) & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * sc.float()).reshape(n, 16, 1)
    ql = (qs.reshape(n, -1, 1, 32) >> _u8([0, 2, 4, 6], b).reshape(1, 1, 4, 1))
    qh = hmask.reshape(n, -1, 1, 32) >> _u8(range(8), b).reshape(1, 1, 8, 1)
    ql = ql.reshape(n, 16, 16) & 3
    qh = (qh.reshape(n, 16, 16) & 1) ^ 1  # a set mask bit means no -4 offset
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], -1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], -1)
    return sc, mn


def q4_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = k_scale_min(b[:, 4:16])
    d = (d * sc.float()).reshape(n, -1, 1)
    dm = (dmin * m.float()).reshape(n, -1, 1)
    q = _nibbles(b[:, 16:], 4).reshape(n, -1, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def q5_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = k_scale_min(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:]
    d = (d * sc.float()).reshape(n, -1, 1)
    dm = (dmin * m.float()).reshape(n, -1, 1)
    ql = _nibbles(qs, 4).reshape(n, -1, 32)
    high = ((qh.reshape(n, -1, 1, 32) >> _u8(range(8), b).reshape(1, 1, 8, 1)) & 1).reshape(n, -1, 32)
    q = (ql | (high << 4)).float()
    return (d * q - dm).reshape(n, QK_K)


def q6_k(b):
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    d = (d * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    low = _nibbles(ql, 2).reshape(n, -1, 32)
    high = ((qh.reshape(n, -1, 1, 32) >> _u8([0, 2, 4, 6], b).reshape(1, 1, 4, 1)) & 3)
    q = (low | (high.reshape(n, -1, 32) << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, 16, -1).float()).reshape(n, QK_K)


BLOCK_DEQUANT = {T.Q8_0: q8_0, T.Q4_0: q4_0, T.Q4_1: q4_1, T.Q5_0: q5_0, T.Q5_1: q5_1, T.Q2_K: q2_k,
                 T.Q3_K: q3_k, T.Q4_K: q4_k, T.Q5_K: q5_k, T.Q6_K: q6_k}
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
SUPPORTED = FLOAT_TYPES + tuple(BLOCK_DEQUANT)


def dequantize(data, qtype: T, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 tensor of `shape` (torch order) that a GGUF tensor's data (numpy or torch; float values for
    F32/F16, raw bytes otherwise) stands for."""
    t = torch.from_numpy(np.asarray(data)) if isinstance(data, np.ndarray) else data
    if qtype == T.F32:
        return t.view(torch.float32).reshape(shape)
    if qtype == T.F16:
        return t.view(torch.float16).float().reshape(shape)
    if qtype == T.BF16:  # the reader maps BF16 as raw bytes
        return t.reshape(-1).view(torch.bfloat16).float().reshape(shape)
    if qtype not in BLOCK_DEQUANT:
        raise BrrrError(f"GGUF tensor type {qtype.name} is not one brrr dequantizes (brrr reads "
                        f"{', '.join(q.name for q in SUPPORTED)})")
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = t.reshape(-1).view(torch.uint8).reshape(-1, type_size)
    return BLOCK_DEQUANT[qtype](blocks).reshape(shape)
