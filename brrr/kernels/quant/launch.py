"""How a quantized matmul kernel is launched: split K resolved from a config, the output and split-K workspace
allocated, the PDL mode chosen, and a config's keys passed as the kernel's constexprs."""
from __future__ import annotations

import os

import torch

from brrr.kernels.dispatch import arrival_counts, num_sms
from brrr.kernels.pdl import pdl_on
from brrr.kernels.quant.configs import LIMITS

try:
    import triton
except Exception:  # the dispatcher takes the reference when triton is missing
    triton = None

# Triton's interpreter (tests on the CPU): `triton.jit` reads the variable when it defines a kernel, at import, so
# it is read once here too. Under it the kernels take their portable paths: plain casts, fp32 dot products.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def fast_dequant(dtype: torch.dtype) -> bool:
    """The `FAST` constexpr: the inline-PTX conversions, for 16-bit outputs on the GPU; plain casts give the same
    values under the interpreter and for fp32."""
    return dtype in (torch.bfloat16, torch.float16) and not INTERPRETED


def rows(x):
    """x as a [M, K] matrix with unit column stride."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def split_k(cfg: dict, m: int, n: int, k_steps: int, device) -> int:
    """The config's SPLIT_K as a number of K slices: "auto", "auto4", "auto8" give about 2, 4, 8 programs per SM,
    at most 16 slices and k_steps; with KW warps splitting a program's K range, every slice the same length."""
    split = cfg["SPLIT_K"]
    if isinstance(split, str):
        tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
        sms = num_sms(device.index or 0) if device.type == "cuda" else 4
        split = max(1, min(16, (int(split[4:] or 2) * sms) // tiles))
    split = max(1, min(split, k_steps))
    kw = cfg.get("KW", 1)
    if k_steps % kw:
        raise ValueError(f"KW = {kw} warps cannot split {k_steps} K steps evenly")
    return max(s for s in range(1, split + 1) if k_steps % (s * kw) == 0) if kw > 1 else split


def launch(kernel, x2, n, k_steps, out_dtype, cfg, args, consts, extra=()):
    """Launch `kernel` with config `cfg` (split K resolved here); returns y [M, N]. `extra`: arguments after
    split_k. A config's keys are the kernel's constexprs and override `consts` (tests set FAST=False to run the
    portable conversions on the GPU)."""
    cfg = dict(cfg)
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    m = x2.shape[0]
    split = split_k(cfg, m, n, k_steps, x2.device)
    del cfg["SPLIT_K"]
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    y = torch.empty(m, n // 2 if consts.get("GATED") else n, dtype=out_dtype, device=x2.device)
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x2.device) if split > 1 else y
    locks = arrival_counts(x2.device, tiles) if split > 1 else y
    x_arg, w_arg, s_arg, *rest = args
    # PDL (brrr/kernels/pdl.py): at M <= gemv_m the next kernel may launch from the epilogue (3); above, not early
    # at all (1): an early launch after a 16-row W8A16 GEMM made the decode step slower
    pdl = pdl_on(x2)
    pdl = 3 if pdl == 2 and m <= LIMITS.gemv_m else min(pdl, 1)
    kernel[(tiles, split)](x_arg, w_arg, s_arg, *rest, y, ws, locks, m, n, x2.shape[1], x2.stride(0),
                           w_arg.stride(0), y.stride(0), split, *extra, SPLIT=split > 1, num_warps=warps,
                           num_stages=stages, PDL=pdl, launch_pdl=pdl > 0, **{**consts, **cfg})
    return y
