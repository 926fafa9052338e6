"""Group-wise weight-only matmuls for GGUF's common block types (Q8_0, Q4_K, Q5_K, Q6_K), held in layouts that keep
every value of the file exactly: y = x @ W^T with W dequantized in registers.

  w[n, k] = scale[n, g] * q[n, k] - offset[n, g],   g = k // GROUP
  scale  = scales[n, g]                        (Q8_0: the block's fp16 d; no offset)
         = d[n, k // 256] * scales[n, g]       (K-quants: fp16 super-block d times the sub-block's small integer)
  offset = dmin[n, k // 256] * mins[n, g]      (Q4_K, Q5_K: fp16 super-block dmin times the 6-bit min)
All products in fp32, in the order gguf.quants computes them, so `dequantize_groupwise` is its values bit for bit:
a fp16 times a <= 8-bit integer is exact in fp32, so the super-block factors stay fp16 and the sub-block factors
stay integers (an fp16 or bf16 copy of d * sc would round it).

  fmt    codes                                      scales        group  d / dmin        mins
  q8_0   int8 [N, K]                                fp16 [N, K/32]   32    -               -
  q6_k   int8 [N, K] (q - 32)                       int8 [N, K/16]   16    fp16 [N, K/256] -
  q5_k   int8 [N, K] (0..31)                        uint8 [N, K/32]  32    fp16 [N, K/256] uint8 [N, K/32]
  q4_k   uint8 [N, K/2]: per 64 columns 32 bytes,   uint8 [N, K/32]  32    fp16 [N, K/256] uint8 [N, K/32]
         low nibbles columns 0-31, high 32-63 (the file's own order, copied; = layouts.py's int4 order, group 64)

One Triton kernel serves every type: a program owns BLOCK_M rows of x and BLOCK_N rows of W and walks a K range
of BLOCK_K columns (whole groups; the int4 codes as their two 32-column halves per 64). M <= GEMV_M: CUDA-core
products summed in fp32 (no tensor cores), split along K over programs when N alone leaves SMs idle; above:
tl.dot tiles. The launch shape is tuned per (format, N, K, dtype, M bucket) at warm-up among groupwise_configs.py's
candidates, the fixed plan `groupwise_config` one of them and what runs untuned. The torch reference (CPU and the
tests' oracle) dequantizes in fp32 then F.linear in x's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from brrr.kernels.dispatch import use_triton
from brrr.kernels.quant.groupwise_configs import (GROUPWISE_GROUPS, SUPER, config_error, groupwise_candidates,
                                                  groupwise_config, groupwise_family)
from brrr.kernels.quant.tune import TUNED_CONFIGS

try:
    import triton
    import triton.language as tl
except Exception:  # the dispatcher takes the reference when triton is missing
    triton = None


def _codes(fmt: str, qweight: torch.Tensor) -> torch.Tensor:
    """The integer codes [N, K] as fp32."""
    if fmt != "q4_k":
        return qweight.float()
    n = qweight.shape[0]
    p = qweight.reshape(n, -1, 1, 32)
    return torch.cat([p & 0x0F, p >> 4], dim=2).reshape(n, -1).float()


def dequantize_groupwise(fmt: str, qweight, scales, d=None, mins=None, dmin=None) -> torch.Tensor:
    """float32 [N, K] from a group-wise layout (module docstring), in gguf.quants' operation order."""
    group = GROUPWISE_GROUPS[fmt]
    q = _codes(fmt, qweight)
    n, k = q.shape
    s = scales.float()
    if d is not None:
        s = d.float().repeat_interleave(SUPER // group, dim=1) * s
    w = s[:, :, None] * q.view(n, k // group, group)
    if mins is not None:
        w = w - (dmin.float().repeat_interleave(SUPER // group, dim=1) * mins.float())[:, :, None]
    return w.view(n, k)


def groupwise_matmul_ref(x, fmt, qweight, scales, d=None, mins=None, dmin=None, bias=None):
    w = dequantize_groupwise(fmt, qweight, scales, d, mins, dmin)
    return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))


def groupwise_bytes(fmt: str, n: int, k: int) -> int:
    """Bytes of the layout for an [n, k] weight (what a decode GEMV reads)."""
    group = GROUPWISE_GROUPS[fmt]
    codes = n * k // 2 if fmt == "q4_k" else n * k
    scales = n * k // group * (2 if fmt == "q8_0" else 1)
    supers = 0 if fmt == "q8_0" else n * k // SUPER * (4 if fmt in ("q4_k", "q5_k") else 2)
    mins = n * k // group if fmt in ("q4_k", "q5_k") else 0
    return codes + scales + supers + mins


if triton is not None:
    @triton.jit
    def _scaled(q, S, D, MN, DM, rows, n_mask, g0, stride_sn, stride_dn, BLOCK_N: tl.constexpr, NG: tl.constexpr,
                G: tl.constexpr, GSTEP: tl.constexpr, TWO_LEVEL: tl.constexpr, HAS_MIN: tl.constexpr):
        """fp32 codes q [BLOCK_N, NG * G] of the NG groups g0, g0 + GSTEP, ... -> their fp32 weights."""
        gi = g0 + tl.arange(0, NG) * GSTEP
        m2 = n_mask[:, None] & (gi[None, :] >= 0)
        s = tl.load(S + rows[:, None] * stride_sn + gi[None, :], mask=m2, other=0).to(tl.float32)
        sb = (gi * G) // 256
        if TWO_LEVEL:
            s = tl.load(D + rows[:, None] * stride_dn + sb[None, :], mask=m2, other=0).to(tl.float32) * s
        w = s[:, :, None] * tl.reshape(q, (BLOCK_N, NG, G))
        if HAS_MIN:
            mn = tl.load(MN + rows[:, None] * stride_sn + gi[None, :], mask=m2, other=0).to(tl.float32)
            dm = tl.load(DM + rows[:, None] * stride_dn + sb[None, :], mask=m2, other=0).to(tl.float32)
            w = w - (dm * mn)[:, :, None]
        return tl.reshape(w, (BLOCK_N, NG * G))

    @triton.jit
    def _accumulate(acc, x, w, DOT: tl.constexpr, IEEE: tl.constexpr):
        """acc [BM, BN] + x [BM, BK] @ w [BN, BK]^T: tensor cores (DOT) or fp32 products on CUDA cores."""
        if DOT:
            if IEEE:
                return tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            return tl.dot(x, tl.trans(w), acc)
        return acc + tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)

    @triton.jit
    def _groupwise_kernel(X, Q, S, D, MN, DM, Y, M, N, K, stride_xm, stride_qn, stride_sn, stride_dn, stride_ym,
                          k_per_split, GROUP: tl.constexpr, CODE4: tl.constexpr, TWO_LEVEL: tl.constexpr,
                          HAS_MIN: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Y [M, N] fp32 (SPLIT: atomically summed over the K splits) += X [M, K] @ W^T over columns
        [program_id(2) * k_per_split, +k_per_split). BLOCK_K: whole groups (CODE4: whole 64-column pairs); K and
        k_per_split are multiples of it."""
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask, n_mask = offs_m < M, offs_n < N
        rows = offs_n.to(tl.int64)
        dtype = X.dtype.element_ty
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_begin = pid_k * k_per_split
        if CODE4:
            HALF: tl.constexpr = BLOCK_K // 2
            h = tl.arange(0, HALF)
            hcol = (h // 32) * 64 + h % 32  # the low nibbles' columns within the step; the high ones are +32
            for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
                p = tl.load(Q + rows[:, None] * stride_qn + (k0 // 2 + h)[None, :], mask=n_mask[:, None], other=0)
                lo = _scaled((p & 15).to(tl.float32), S, D, MN, DM, rows, n_mask, k0 // GROUP, stride_sn, stride_dn,
                             BLOCK_N, HALF // GROUP, GROUP, 2, TWO_LEVEL, HAS_MIN)
                hi = _scaled((p >> 4).to(tl.float32), S, D, MN, DM, rows, n_mask, k0 // GROUP + 1, stride_sn,
                             stride_dn, BLOCK_N, HALF // GROUP, GROUP, 2, TWO_LEVEL, HAS_MIN)
                xp = X + offs_m[:, None] * stride_xm + (k0 + hcol)[None, :]
                x_lo = tl.load(xp, mask=m_mask[:, None], other=0)
                x_hi = tl.load(xp + 32, mask=m_mask[:, None], other=0)
                acc = _accumulate(acc, x_lo, lo.to(dtype), DOT, IEEE)
                acc = _accumulate(acc, x_hi, hi.to(dtype), DOT, IEEE)
        else:
            c = tl.arange(0, BLOCK_K)
            for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
                q = tl.load(Q + rows[:, None] * stride_qn + (k0 + c)[None, :], mask=n_mask[:, None], other=0)
                w = _scaled(q.to(tl.float32), S, D, MN, DM, rows, n_mask, k0 // GROUP, stride_sn, stride_dn,
                            BLOCK_N, BLOCK_K // GROUP, GROUP, 1, TWO_LEVEL, HAS_MIN)
                x = tl.load(X + offs_m[:, None] * stride_xm + (k0 + c)[None, :], mask=m_mask[:, None], other=0)
                acc = _accumulate(acc, x, w.to(dtype), DOT, IEEE)
        y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT:
            tl.atomic_add(y_ptrs, acc, mask=mask)
        else:
            tl.store(y_ptrs, acc, mask=mask)


def groupwise_matmul_triton(x, fmt, qweight, scales, d=None, mins=None, dmin=None, bias=None,
                            config: dict | None = None):
    """x [..., K] -> [..., N] in x's dtype. `config` forces a launch shape (tests); else `_config`'s."""
    k, n = x.shape[-1], qweight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)

    def run(cfg, qweight=qweight):  # qweight: a copy of the weight when the tuner times a chain
        return _launch(x2, fmt, qweight, scales, d, mins, dmin, cfg)

    y = run(config or _config(x2, fmt, n, k, run, qweight))
    y = y if bias is None else y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], n)


def _config(x2, fmt: str, n: int, k: int, run, qweight) -> dict:
    """The fixed plan for fp32 (tests, CPU-made models on a GPU: no tuning cost), else `TUNED_CONFIGS`': timed
    among `groupwise_candidates` inside `quant_tuning`, the plan for a shape never tuned. The key holds the format:
    q4_k and q6_k layers of one shape (a Q4_K_M file) are tuned apart."""
    m, sms = x2.shape[0], _sms(x2.device)
    plan = groupwise_config(m, n, k, fmt, sms)
    if x2.dtype == torch.float32:
        return plan
    return TUNED_CONFIGS.config(x2.device, ("gguf", fmt, n, k, x2.dtype), m,
                                lambda: groupwise_candidates(m, n, k, fmt, sms), run, qweight, default=plan,
                                family=groupwise_family)


def _launch(x2, fmt, qweight, scales, d, mins, dmin, cfg: dict) -> torch.Tensor:
    """y [M, N] fp32 for one config (`groupwise_configs.config_error` says which run)."""
    m, k, n = x2.shape[0], x2.shape[1], qweight.shape[0]
    error = config_error(cfg, fmt, k)
    if error is not None:
        raise ValueError(error)
    cfg = dict(cfg)
    block_m, block_n, block_k, split = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K"), cfg.pop("SPLIT")
    dot = cfg.pop("DOT")
    y = (torch.zeros if split > 1 else torch.empty)(m, n, dtype=torch.float32, device=x2.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    _groupwise_kernel[grid](
        x2, qweight, scales, scales if d is None else d, scales if mins is None else mins,
        scales if dmin is None else dmin, y, m, n, k, x2.stride(0), qweight.stride(0), scales.stride(0),
        0 if d is None else d.stride(0), y.stride(0), k // split, GROUP=GROUPWISE_GROUPS[fmt], CODE4=fmt == "q4_k",
        TWO_LEVEL=d is not None, HAS_MIN=mins is not None, DOT=dot, IEEE=x2.dtype == torch.float32, SPLIT=split > 1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **cfg)
    return y


def _sms(device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def groupwise_matmul(x, fmt, qweight, scales, d=None, mins=None, dmin=None, bias=None):
    """x @ W^T (+ bias) for a group-wise GGUF layout: Triton on CUDA, the torch reference elsewhere."""
    tensors = [x, qweight, scales] + [t for t in (d, mins, dmin, bias) if t is not None]
    if x.dtype in (torch.bfloat16, torch.float16, torch.float32) and use_triton(*tensors):
        return groupwise_matmul_triton(x, fmt, qweight, scales, d, mins, dmin, bias)
    return groupwise_matmul_ref(x, fmt, qweight, scales, d, mins, dmin, bias)
