"""The quantized weights' layouts as the kernels read them, and the plain-torch references.

  int4  qweight uint8 [N, K/2]. Within each group of g input columns, byte j holds column j in its low nibble and
        column j + g/2 in its high nibble: a group's two halves then multiply two contiguous slices of x, so the
        kernel never interleaves nibbles in registers. scales [K/g, N] (bf16 for bf16 models, else fp32), zeros
        uint8 [K/g, N] or None (symmetric, zero 8): w[n, k] = (q[n, k] - zeros[k/g, n]) * scales[k/g, n].
        QuantLinear stores it `chunk_major` (a view [N, K/128, 64]: every row's first 64 bytes, then the next 64);
        every int4 kernel reads either layout through a row stride and a chunk stride.
  int8  qweight int8 [N, K], scales fp32 [N]: w[n, k] = q[n, k] * scales[n]. Weight-only int8 is stored
        `chunk_major` too (W8A8's torch._int_mm needs rows).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

INT4_GROUPS = (32, 64, 128)
CHUNK = 64  # bytes of a row per block of the chunk-major layout (`chunk_major`)


def int4_params(w: torch.Tensor, symmetric: bool, clip: torch.Tensor | float = 1.0):
    """Scale and zero for each row of w [..., g] (the group's columns), shrinking the range by `clip`."""
    if symmetric:
        scale = (w.abs().amax(dim=-1) * clip / 7).clamp(min=1e-12)
        return scale, torch.full_like(scale, 8.0)
    hi, lo = (w.amax(dim=-1) * clip).clamp(min=0), (w.amin(dim=-1) * clip).clamp(max=0)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    return scale, torch.round(-lo / scale).clamp(0, 15)


def int4_round(w, scale, zero):
    """Quantize w with broadcastable scale/zero -> integer codes in [0, 15] (float)."""
    return torch.round(w / scale + zero).clamp(0, 15)


def pack_int4_kernel(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """codes [N, K] in [0, 15] -> uint8 [N, K/2] in the kernel layout (per group: low nibbles = first half)."""
    n, k = codes.shape
    halves = codes.to(torch.uint8).view(n, k // group_size, 2, group_size // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)


def chunk_major(packed: torch.Tensor) -> torch.Tensor:
    """A weight of N rows of bytes (int4 [N, K/2], int8 [N, K]) as a view [N, bytes / CHUNK, CHUNK] whose storage
    holds every row's first 64 bytes (128 int4 or 64 int8 codes), then every row's next 64, ...: at M = 1 a warp's
    loads (8 rows x 64 bytes) are one 512-byte run instead of 8 half-used lines a row apart, and each step of a
    program reads one contiguous block. Kernels take the layout from the strides (`packed_strides`); rows that are
    not whole chunks stay [N, bytes] by rows."""
    n = packed.shape[0]
    if math.prod(packed.shape[1:]) % CHUNK:
        return packed
    return packed.reshape(n, -1, CHUNK).transpose(0, 1).contiguous().transpose(0, 1)


def packed_strides(packed: torch.Tensor) -> tuple[int, int]:
    """(row stride, chunk stride) of a kernel-layout tensor, [N, K/2] by rows or `chunk_major`, in its elements
    (bytes, or words for an int32 view): column c of row n is at n * row + (c // per_chunk) * chunk + c % per_chunk."""
    if packed.dim() == 3:
        return packed.stride(0), packed.stride(1)
    return packed.stride(0), CHUNK // packed.element_size()


def int32_words(qweight: torch.Tensor):
    """The byte weights viewed as int32 words for the GEMV kernels, or None when the rows or chunks do not start on
    4-byte boundaries (then only the tensor-core configs are candidates)."""
    if (qweight.stride(-1) != 1 or qweight.shape[-1] % 4 or qweight.storage_offset() % 4
            or any(st % 4 for st in qweight.stride()[:-1])):
        return None
    return qweight.view(torch.int32)


def unpack_int4_kernel(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """uint8 [N, K/2] kernel layout (or its `chunk_major` view) -> codes uint8 [N, K]."""
    packed = packed.reshape(packed.shape[0], -1)
    n, half_k = packed.shape
    p = packed.view(n, 2 * half_k // group_size, group_size // 2)
    return torch.cat([p & 0xF, p >> 4], dim=2).reshape(n, 2 * half_k)


def dequantize_w4(qweight, scales, zeros, group_size) -> torch.Tensor:
    """float32 [N, K] from the int4 kernel layout."""
    codes = unpack_int4_kernel(qweight, group_size).float()
    n, k = codes.shape
    z = 8.0 if zeros is None else zeros.t().float()[:, :, None]
    return ((codes.view(n, k // group_size, group_size) - z) * scales.t().float()[:, :, None]).view(n, k)


def w4a16_matmul_ref(x, qweight, scales, zeros, group_size, bias=None):
    w = dequantize_w4(qweight, scales, zeros, group_size)
    return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))


def w8a16_matmul_ref(x, qweight, scales, bias=None):
    w = qweight.reshape(qweight.shape[0], -1).float() * scales.float()[:, None]
    return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
