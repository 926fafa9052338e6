"""The sampler's draw: token = argmax(logits / T + Gumbel noise), the Gumbel-max trick (the same law as drawing from
softmax(logits / T); -inf logits, filtered out, are never drawn).

The noise is a counter-based hash of (row key, vocabulary index), not a stateful generator: a row's key comes from its
request's seed and how many tokens it has generated, so a seeded request draws the same tokens whatever else is in
the batch, on any device, and the Triton kernel reads the logits once with no generator calls per row.
  h = fmix32(fmix32(key ^ (col * 0x9E3779B9)) + key)      (MurmurHash3's finalizer; a bijection of col per key)
  u = (h >> 8 + 0.5) / 2^24                                 (uniform in (0, 1))
  noise = -log(-log(u))
"""
from __future__ import annotations

import numpy as np
import torch

from brrr.kernels.dispatch import use_triton
from brrr.kernels.pdl import pdl_on

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9


def _splitmix64(z: np.ndarray) -> np.ndarray:
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_keys(seeds, steps) -> np.ndarray:
    """32-bit keys (int64) for rows drawing their `step`-th token from a stream seeded with `seed` (any ints)."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps on purpose
        s = np.array([x & (2**64 - 1) for x in seeds], dtype=np.uint64)
        z = _splitmix64(_splitmix64(s) ^ np.array(steps, dtype=np.uint64))
    return (z >> np.uint64(32)).astype(np.int64)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32  # int64 products wrap past 2^63; their low 32 bits stay exact
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def gumbel_noise_ref(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    cols = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    k = keys[:, None]
    h = _fmix32((_fmix32(k ^ ((cols * GOLDEN) & MASK32)) + k) & MASK32)
    u = ((h >> 8).float() + 0.5) * (1.0 / 16777216)
    return -torch.log(-torch.log(u))


def gumbel_argmax_ref(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """logits [B, V] fp32, temperature [B] fp32 (> 0), keys [B] int64 -> tokens [B] int64."""
    return (logits / temperature[:, None] + gumbel_noise_ref(keys, logits.shape[1])).argmax(-1)


try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:
    from brrr.kernels.pdl import wait_previous

    @triton.jit
    def _fmix32_tl(h):
        h = h ^ (h >> 16)
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h = h ^ (h >> 13)
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    @triton.jit
    def _gumbel_argmax_kernel(L, T, KEYS, OUT, vocab, stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_previous(PDL)
        row = tl.program_id(0)
        key = tl.load(KEYS + row).to(tl.int64)
        temp = tl.load(T + row)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab
            x = tl.load(L + row.to(tl.int64) * stride + cols, mask=mask, other=float("-inf"))
            h = _fmix32_tl((_fmix32_tl(key ^ ((cols.to(tl.int64) * 0x9E3779B9) & 0xFFFFFFFF)) + key) & 0xFFFFFFFF)
            u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216)
            v = tl.where(mask, x / temp - tl.log(-tl.log(u)), float("-inf"))
            take = v > best  # strict: the first column of a tie wins, as torch.argmax
            best = tl.where(take, v, best)
            best_i = tl.where(take, cols, best_i)
        top = tl.max(best, 0)
        tl.store(OUT + row, tl.min(tl.where(best == top, best_i, vocab), 0).to(tl.int64))


def gumbel_argmax_triton(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    pdl = pdl_on(logits)
    _gumbel_argmax_kernel[(logits.shape[0],)](logits, temperature, keys, out, logits.shape[1], logits.stride(0),
                                              BLOCK=2048, num_warps=8, PDL=pdl, launch_pdl=pdl > 0)
    return out


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    if (logits.dtype == temperature.dtype == torch.float32 and logits.stride(-1) == 1 and logits.shape[0] > 0
            and use_triton(logits, temperature, keys)):
        return gumbel_argmax_triton(logits, temperature, keys)
    return gumbel_argmax_ref(logits, temperature, keys)
