"""brrr's own Q4_K and Q6_K quantizers (the gguf package dequantizes K-quants but cannot make them).

Both work on 256-weight super-blocks. Q6_K: 16 sub-blocks of 16, w = d * sc_j * q with q in [-32, 31] (stored
+32 as 6 bits), sc_j an int8, d one fp16 per super-block. Q4_K: 8 sub-blocks of 32, w = d * sc_j * q - dmin * m_j
with q in [0, 15], sc_j and m_j 6-bit, d and dmin fp16. Each sub-block's scale (and Q4_K's offset) is searched:
candidates from 75% to 100% of the range-filling scale each round the codes, a least-squares fit of the scale
(and offset) to those codes follows, and the least squared error wins (llama.cpp's make_qkx2_quants searches the
same way, over more candidates and with weights). The super-scales make the largest sub-block scale use all 6
or 8 bits, and the final codes round against the scales as stored (fp16 d times the integer sc), which is what
the reader will multiply by. tests/gguf/test_dequant.py bounds the error per weight and its RMS."""
from __future__ import annotations

import torch

QK_K = 256


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(x.shape[0], 2)


def _super_blocks(w: torch.Tensor) -> torch.Tensor:
    if w.shape[-1] % QK_K:
        raise ValueError(f"K-quants need rows of a multiple of {QK_K} weights; got {w.shape[-1]}")
    return w.float().reshape(-1, QK_K)


def quantize_q6_k(w: torch.Tensor) -> torch.Tensor:
    """[rows, cols] float -> the Q6_K blocks as uint8 [rows, cols / 256 * 210]."""
    x = _super_blocks(w)
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = _search(sub, lambda c: sub.abs().amax(-1) * c / 31, lambda s: (-32, 31), None)  # [n, 16], >= 0
    d = (scale.amax(-1) / 127).to(torch.float16).float()          # [n]
    inv_d = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    sc = torch.round(scale * inv_d[:, None]).clamp(-128, 127)     # int8 sub-block scales
    step = d[:, None] * sc                                        # the scales as stored
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    q = (torch.round(sub * inv[..., None]).clamp(-32, 31) + 32).to(torch.uint8).reshape(n, QK_K)
    low, high = q & 15, q >> 4
    low = low.reshape(n, 2, 2, 64)                                # [half, nibble, 64]
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    high = high.reshape(n, 2, 4, 32)                              # [half, bit pair, 32]
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    scales = sc.to(torch.int8).view(torch.uint8)
    out = torch.cat([ql, qh, scales, _f16_bytes(d)], dim=1)
    return out.reshape(w.shape[0], -1)


SEARCH = torch.linspace(0.75, 1.0, 11)  # sub-block scale candidates, as fractions of the range-filling scale


def _search(sub, scale_of, code_range, lo):
    """Per sub-block, the scale (and for Q4_K the offset) of least squared error among SEARCH's candidates: each
    candidate rounds the codes, then a least-squares fit of scale (and offset) to those codes (llama.cpp's
    make_qkx2_quants idea: clipping the largest weights a little often lowers the error of all the others)."""
    best_err = best_scale = best_lo = None
    qmin, qmax = code_range(None)
    for c in SEARCH.tolist():
        scale = scale_of(c).clamp(min=1e-30)
        if lo is None:
            q = torch.round(sub / scale[..., None]).clamp(qmin, qmax)
            fit = ((sub * q).sum(-1) / (q * q).sum(-1).clamp(min=1e-30)).clamp(min=0)  # w ~ fit q
            cand_lo = None
            err = (sub - fit[..., None] * q).pow(2).sum(-1)
        else:
            q = torch.round((sub - lo[..., None]) / scale[..., None]).clamp(qmin, qmax)
            qm, xm = q.mean(-1), sub.mean(-1)
            var = (q - qm[..., None]).pow(2).sum(-1)
            fit = ((q - qm[..., None]) * (sub - xm[..., None])).sum(-1) / var.clamp(min=1e-30)
            fit = torch.where(var > 0, fit, scale).clamp(min=0)
            cand_lo = (xm - fit * qm).clamp(max=0)                  # w ~ fit q + lo, lo <= 0
            err = (sub - (fit[..., None] * q + cand_lo[..., None])).pow(2).sum(-1)
        if best_err is None:
            best_err, best_scale, best_lo = err, fit, cand_lo
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, fit, best_scale)
            if lo is not None:
                best_lo = torch.where(better, cand_lo, best_lo)
    return best_scale if lo is None else (best_scale, best_lo)


def pack_k_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and mins per super-block -> Q4_K/Q5_K's 12 bytes (the inverse of dequant.k_scale_min)."""
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    d_bytes = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    m_bytes = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    md = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return torch.cat([d_bytes, m_bytes, md], dim=1)


def quantize_q4_k(w: torch.Tensor) -> torch.Tensor:
    """[rows, cols] float -> the Q4_K blocks as uint8 [rows, cols / 256 * 144]."""
    x = _super_blocks(w)
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = sub.amin(-1).clamp(max=0)                                # the offset only ever lowers (m >= 0)
    hi = sub.amax(-1)
    scale, lo = _search(sub, lambda c: (hi - lo) * c / 15, lambda s: (0, 15), lo)
    mins = -lo
    d = (scale.amax(-1) / 63).to(torch.float16).float()
    dmin = (mins.amax(-1) / 63).to(torch.float16).float()
    inv_d = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    inv_dmin = torch.where(dmin > 0, 1 / dmin, torch.zeros_like(dmin))
    sc = torch.round(scale * inv_d[:, None]).clamp(0, 63)
    m = torch.round(mins * inv_dmin[:, None]).clamp(0, 63)
    step, offset = d[:, None] * sc, dmin[:, None] * m             # the scales as stored
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    q = torch.round((sub + offset[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    out = torch.cat([_f16_bytes(d), _f16_bytes(dmin), pack_k_scales(sc, m), qs], dim=1)
    return out.reshape(w.shape[0], -1)
