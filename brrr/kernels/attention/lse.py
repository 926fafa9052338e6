"""One block of attention with its log-sum-exp, forward and backward in plain torch: the unit that ring attention
(brrr/train/parallel/ring_attention.py) computes per (query chunk, key chunk) pair and combines across blocks.

out_j = softmax(S_j) V_j and lse_j = log sum exp(S_j) per query row, S_j = scale * Q K_j^T (masked to -inf). Blocks
combine exactly: lse = log(sum_j exp(lse_j)), out = sum_j exp(lse_j - lse) out_j. The backward of a block needs only
the combined out and lse (FlashAttention's recomputation): P_j = exp(S_j - lse), dV_j = P_j^T dO,
dS_j = P_j * (dO V_j^T - rowsum(dO * out)), dQ += scale * dS_j K_j, dK_j = scale * dS_j^T Q.

Layout: q [B, KVH, G, Tq, D] (G query heads per KV head: GQA without repeating K/V), k/v [B, KVH, Tk, D]; mask
[Tq, Tk] bool (True: the key is visible) or None (every key visible). Math in fp32 (fp64 inputs: fp64).
"""
from __future__ import annotations

import torch


def _up(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


def _scores(q, k, scale, mask):
    s = torch.einsum("bkgqd,bktd->bkgqt", _up(q), _up(k)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def attention_lse_ref(q, k, v, scale: float, mask: torch.Tensor | None = None):
    """(out [B, KVH, G, Tq, D], lse [B, KVH, G, Tq], fp32); a row that sees no key has out 0, lse -inf."""
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))  # an all-masked row: exp(-inf) = 0
    return torch.einsum("bkgqt,bktd->bkgqd", p, _up(v)), lse


def merge_lse(out, lse, out_j, lse_j):
    """Two partial results over disjoint key sets -> the result over their union (lse finite in `lse`)."""
    new = torch.logaddexp(lse, lse_j)
    return out * torch.exp(lse - new).unsqueeze(-1) + out_j * torch.exp(lse_j - new).unsqueeze(-1), new


def attention_lse_backward_ref(q, k, v, scale: float, mask, out, lse, dout):
    """Gradients of one block (dq [B, KVH, G, Tq, D], dk, dv [B, KVH, Tk, D], fp32) given the combined `out` and
    `lse` of its query rows over all blocks and dout = d(loss)/d(out)."""
    p = torch.exp(_scores(q, k, scale, mask) - lse.unsqueeze(-1))
    dout = _up(dout)
    dv = torch.einsum("bkgqt,bkgqd->bktd", p, dout)
    dp = torch.einsum("bkgqd,bktd->bkgqt", dout, _up(v))
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    dq = torch.einsum("bkgqt,bktd->bkgqd", ds, _up(k)) * scale
    dk = torch.einsum("bkgqt,bkgqd->bktd", ds, _up(q)) * scale
    return dq, dk, dv
