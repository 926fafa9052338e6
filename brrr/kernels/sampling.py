"""The sampler's draw: token = argmax(logits / T + Gumbel noise), the Gumbel-max trick (the same law as drawing from
softmax(logits / T); -inf logits, filtered out, are never drawn).

The noise is a counter-based hash of (row key, vocabulary index), not a stateful generator: a row's key comes from its
request's seed and how many tokens it has generated, so a seeded request draws the same tokens whatever else is in
the batch, on any device, and the Triton kernel reads the logits once with no generator calls per row.
  h = fmix32(fmix32(key ^ (col * 0x9E3779B9)) + key)      (MurmurHash3's finalizer; a bijection of col per key)
  u = min((h >> 8 + 0.5) / 2^24, 1 - 2^-24)                (uniform in (0, 1))
  noise = -log(-log(u))
The min: in fp32 the top value (2^24 - 0.5) / 2^24 rounds to 1, whose noise is +inf: that column would win whatever
its logit, and a filtered-out one (-inf + inf = NaN) too.
"""
from __future__ import annotations

import numpy as np
import torch

from brrr.kernels.dispatch import use_triton
from brrr.kernels.pdl import pdl_on

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
ONE_BELOW = 1 - 2**-24  # the largest fp32 below 1


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
    u = (((h >> 8).float() + 0.5) * (1.0 / 16777216)).clamp_(max=ONE_BELOW)
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
    def _argmax_part_kernel(L, T, KEYS, VALS, IDX, vocab, stride, chunk, NOISE: tl.constexpr, BLOCK: tl.constexpr,
                            PDL: tl.constexpr):
        """Columns [part * chunk, (part + 1) * chunk) of one row: the best value (NOISE: logits / T + the row's
        Gumbel noise, else the logits) and its first column, into VALS / IDX [rows, parts]."""
        wait_previous(PDL)
        row, part = tl.program_id(0), tl.program_id(1)
        if NOISE:
            key = tl.load(KEYS + row).to(tl.int64)
            temp = tl.load(T + row)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.full([BLOCK], vocab, tl.int32)
        end = tl.minimum(part * chunk + chunk, vocab)
        for start in range(part * chunk, end, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < end
            x = tl.load(L + row.to(tl.int64) * stride + cols, mask=mask, other=float("-inf"))
            if NOISE:
                h = _fmix32_tl((_fmix32_tl(key ^ ((cols.to(tl.int64) * 0x9E3779B9) & 0xFFFFFFFF)) + key) & 0xFFFFFFFF)
                u = tl.minimum(((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216), 0.99999994)  # ONE_BELOW
                x = x / temp - tl.log(-tl.log(u))
            v = tl.where(mask, x, float("-inf"))
            take = (v > best) | (best_i == vocab)  # strict after a lane's first column: the first of a tie wins
            best = tl.where(take, v, best)
            best_i = tl.where(take, cols, best_i)
        top = tl.max(best, 0)
        tl.store(VALS + row * tl.num_programs(1) + part, top)
        tl.store(IDX + row * tl.num_programs(1) + part, tl.min(tl.where(best == top, best_i, vocab), 0))

    @triton.jit
    def _argmax_reduce_kernel(VALS, IDX, OUT, parts, vocab, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """One row: the best of its parts; parts are in column order, so the smallest index among equal bests is
        the first column, as in one pass."""
        wait_previous(PDL)
        row = tl.program_id(0)
        p = tl.arange(0, BLOCK)
        vals = tl.load(VALS + row * parts + p, mask=p < parts, other=float("-inf"))
        idx = tl.load(IDX + row * parts + p, mask=p < parts, other=vocab)
        top = tl.max(vals, 0)
        tl.store(OUT + row, tl.min(tl.where(vals == top, idx, vocab), 0).to(tl.int64))


# Columns per program: a 128k vocabulary row is 126 programs, each one load (BLOCK) deep. Wider chunks (8192: 16
# programs, eight dependent loads each) made the part kernel a large share of the gap between two decode graphs.
ARGMAX_CHUNK = 1024


def _argmax_triton(logits, temperature, keys, noise: bool) -> torch.Tensor:
    rows, vocab = logits.shape
    parts = triton.cdiv(vocab, ARGMAX_CHUNK)
    vals = torch.empty(rows, parts, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    pdl = pdl_on(logits)
    _argmax_part_kernel[(rows, parts)](logits, temperature, keys, vals, idx, vocab, logits.stride(0), ARGMAX_CHUNK,
                                       NOISE=noise, BLOCK=1024, num_warps=4, PDL=pdl, launch_pdl=pdl > 0)
    _argmax_reduce_kernel[(rows,)](vals, idx, out, parts, vocab, BLOCK=max(16, triton.next_power_of_2(parts)),
                                   num_warps=1, PDL=pdl, launch_pdl=pdl > 0)
    return out


def gumbel_argmax_triton(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return _argmax_triton(logits, temperature, keys, True)


def argmax_triton(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) for fp32 rows without NaN (the first column of a tie), split over ARGMAX_CHUNK-column
    programs instead of one a row."""
    return _argmax_triton(logits, logits, logits, False)


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    if (logits.dtype == temperature.dtype == torch.float32 and logits.stride(-1) == 1 and logits.shape[0] > 0
            and use_triton(logits, temperature, keys)):
        return gumbel_argmax_triton(logits, temperature, keys)
    return gumbel_argmax_ref(logits, temperature, keys)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The greedy rows' tokens: logits.argmax(-1). torch reduces a row in one thread block (slow for a 128k
    vocabulary); the Triton kernels split it."""
    if logits.dtype == torch.float32 and logits.stride(-1) == 1 and logits.shape[0] > 0 and use_triton(logits):
        return argmax_triton(logits)
    return logits.argmax(-1)
