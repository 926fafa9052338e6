"""Batch-invariant attention: each query row over its own keys in fixed chunks of KV_CHUNK absolute key positions,
an online softmax over the chunks in order. A decode row, the same row inside a prefill chunk, after a prefix-cache
hit, or inside a trainer's full-sequence forward runs the same sums in the same order, so its output is the same
bits whatever else is in the step.

Why the usual kernels are not: SDPA's CPU kernel blocks the query rows and keys by the call's shape (a decode's
single row and the last row of a causal prefill differ in fp32), and on CUDA split-KV decoding cuts a context into
parts by the batch's size (plan.py), so the combine's order moves with the batch. Here the split is fixed (chunk c
holds keys c*KV_CHUNK .. (c+1)*KV_CHUNK - 1 of the sequence, whatever its length): a chunk past a row's last key
is all masked, and the online update leaves (max, sum, acc) exactly as they were (x * 1 + 0).

`attention_invariant_ref` (plain torch, CPU; fp32 math): the dot products are elementwise products summed over the
head dim, the softmax sums over a chunk's KV_CHUNK keys: every reduction is over the last dim of a contiguous
tensor whose length never changes, which torch's CPU reductions run in one order per row. `attention_invariant_triton`
(CUDA): one program a (query row, head), the same chunk loop. Both write the new K/V to the cache first.
"""
from __future__ import annotations

import torch

from brrr.kernels.attention.meta import AttnMeta
from brrr.kernels.attention.reference import attention_ref, write_kv_ref
from brrr.kernels.dispatch import next_power_of_2, triton_on

KV_CHUNK = 64  # keys a chunk holds: the fixed split
ROW_BLOCK = 64  # query rows the torch form takes at once (memory: rows x heads x KV_CHUNK x head_dim fp32)


def _rows(q: torch.Tensor, meta: AttnMeta, block_size: int | None):
    """Per query row: (its sequence, its key count, where its keys start in k when there is no cache)."""
    device = q.device
    cu = meta.cu_seqlens_q.to(device).long()
    row = torch.arange(q.shape[0], device=device)
    seq = torch.searchsorted(cu[1:], row, right=True)
    offset = row - cu[seq]
    if meta.kv_caches is None:
        return seq, offset + 1, cu[seq]
    q_len = cu[1:] - cu[:-1]
    ctx = meta.device_context_lens(device).long()
    return seq, (ctx - q_len)[seq] + offset + 1, None


def _bound(meta: AttnMeta, block_size: int | None) -> int:
    """Keys any row may have, known on the host (the chunk loop's length)."""
    return meta.max_seqlen_q if meta.kv_caches is None else meta.context_bound(block_size)


def _gather(src, pos, length, seq, start, tables, block_size):
    """src rows at key positions pos [R, C] of each row (clamped inside its keys): [R, C, KVH, D]."""
    pos = torch.minimum(pos, (length - 1).clamp(min=0)[:, None])
    if tables is None:
        idx = start[:, None] + pos
    else:
        blocks = tables.long()[seq[:, None], pos // block_size]
        idx = blocks * block_size + pos % block_size
        src = src.view(-1, *src.shape[2:])
    return src.index_select(0, idx.flatten()).view(*pos.shape, *src.shape[1:])


def attention_invariant_ref(q, k, v, meta: AttnMeta, layer: int, scale: float, sliding_window: int | None = None):
    """q [N, H, D], k/v [N, KVH, D] (rotated) -> [N, H * D]; with a cache, k/v are written into it first."""
    n, n_heads, dim = q.shape
    n_kv = k.shape[1]
    groups = n_heads // n_kv
    block_size, tables = None, None
    if meta.kv_caches is not None:
        k_src, v_src = meta.kv_caches[layer]
        write_kv_ref(k, v, k_src, v_src, meta.slot_mapping)
        block_size, tables = k_src.shape[1], meta.block_tables
    else:
        k_src, v_src = k, v
    seq, length, start = _rows(q, meta, block_size)
    bound = _bound(meta, block_size)
    out = torch.empty(n, n_heads * dim, dtype=q.dtype, device=q.device)
    chunk_len = KV_CHUNK
    chunk = torch.arange(chunk_len, device=q.device)
    for r0 in range(0, n, ROW_BLOCK):
        r1 = min(n, r0 + ROW_BLOCK)
        qf = q[r0:r1].float().view(r1 - r0, n_kv, groups, 1, dim)
        rs, rl = seq[r0:r1], length[r0:r1]
        st = None if start is None else start[r0:r1]
        m = torch.full((r1 - r0, n_kv, groups), float("-inf"), device=q.device)
        den = torch.zeros_like(m)
        acc = torch.zeros(r1 - r0, n_kv, groups, dim, device=q.device)
        for c0 in range(0, max(bound, 1), chunk_len):
            pos = (c0 + chunk)[None, :].expand(r1 - r0, chunk_len)
            valid = pos < rl[:, None]
            if sliding_window is not None:
                valid &= pos >= rl[:, None] - sliding_window
            kc = _gather(k_src, pos, rl, rs, st, tables, block_size).float()  # [R, C, KVH, D]
            vc = _gather(v_src, pos, rl, rs, st, tables, block_size).float()
            kc = kc.permute(0, 2, 1, 3).unsqueeze(2)  # [R, KVH, 1, C, D]
            s = torch.mul(qf, kc).contiguous().sum(-1) * scale  # [R, KVH, G, C]
            s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
            alpha = torch.exp(m - m_safe)
            p = torch.exp(s - m_safe[..., None])
            den = den * alpha + p.sum(-1)
            vt = vc.permute(0, 2, 3, 1).contiguous().unsqueeze(2)  # [R, KVH, 1, D, C]
            acc = acc * alpha[..., None] + torch.mul(p[:, :, :, None, :], vt).contiguous().sum(-1)
            m = m_new
        o = torch.where(den[..., None] > 0, acc / den[..., None].clamp(min=1e-30), torch.zeros_like(acc))
        out[r0:r1] = o.reshape(r1 - r0, n_heads * dim).to(q.dtype)
    return out


try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:
    @triton.jit
    def _invariant_attention_kernel(Q, K, V, O, SEQ, LEN, START, TABLES, stride_q, stride_qh, stride_kt, stride_kh,
                                    stride_o, stride_table, scale, window, GROUPS: tl.constexpr, DIM: tl.constexpr,
                                    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                                    PAGED: tl.constexpr, WINDOW: tl.constexpr):
        """Program (row, head): its keys in BLOCK_N chunks from key 0, an online softmax in fp32. PAGED: keys by the
        row's block table (BLOCK_SIZE keys a block), else at START[row] + position in K."""
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        kvh = head // GROUPS
        d = tl.arange(0, BLOCK_D)
        dmask = d < DIM
        q = tl.load(Q + row * stride_q + head * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
        n_keys = tl.load(LEN + row)
        seq = tl.load(SEQ + row)
        start = tl.load(START + row)
        lo = 0
        if WINDOW:
            lo = tl.maximum(n_keys - window, 0)
        m = tl.full((), float("-inf"), tl.float32)
        den = tl.zeros((), tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        # every chunk from key 0 (not from the window's start): a chunk before the window is all masked, an identity
        for c0 in range(0, n_keys, BLOCK_N):
            pos = c0 + tl.arange(0, BLOCK_N)
            valid = (pos < n_keys) & (pos >= lo)
            if PAGED:
                blk = tl.load(TABLES + seq * stride_table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
                tok = blk * BLOCK_SIZE + pos % BLOCK_SIZE
            else:
                tok = (start + pos).to(tl.int64)
            kmask = valid[:, None] & dmask[None, :]
            kt = tl.load(K + tok[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=kmask, other=0.0)
            s = tl.sum(kt.to(tl.float32) * q[None, :], axis=1) * scale
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp(-inf - -inf) would be nan
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe)
            den = den * alpha + tl.sum(p, 0)
            vt = tl.load(V + tok[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=kmask, other=0.0)
            acc = acc * alpha + tl.sum(p[:, None] * vt.to(tl.float32), axis=0)
            m = m_new
        out = tl.where(den > 0, acc / tl.maximum(den, 1e-30), 0.0)
        tl.store(O + row * stride_o + head * DIM + d, out.to(O.dtype.element_ty), mask=dmask)


def attention_invariant_triton(q, k, v, meta: AttnMeta, layer: int, scale: float, sliding_window: int | None = None):
    """The Triton form of `attention_invariant_ref`: same arguments, the same chunks (its own rounding)."""
    n, n_heads, dim = q.shape
    out = torch.empty(n, n_heads * dim, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    if meta.kv_caches is not None:
        k_src, v_src = meta.kv_caches[layer]
        write_kv_ref(k, v, k_src, v_src, meta.slot_mapping)
        block_size, tables = k_src.shape[1], meta.block_tables
        k_src, v_src = k_src.view(-1, *k_src.shape[2:]), v_src.view(-1, *v_src.shape[2:])
    else:
        k_src, v_src = k.contiguous(), v.contiguous()
        block_size, tables = 1, None
    seq, length, start = _rows(q, meta, block_size)
    start = torch.zeros_like(seq) if start is None else start
    q = q if q.stride(-1) == 1 else q.contiguous()
    _invariant_attention_kernel[(n, n_heads)](
        q, k_src, v_src, out, seq, length, start, seq if tables is None else tables, q.stride(0), q.stride(1),
        k_src.stride(0), k_src.stride(1), out.stride(0), 0 if tables is None else tables.stride(0), scale,
        sliding_window or 0, GROUPS=n_heads // k.shape[1], DIM=dim, BLOCK_D=next_power_of_2(dim), BLOCK_N=KV_CHUNK,
        BLOCK_SIZE=block_size, PAGED=tables is not None, WINDOW=sliding_window is not None, num_warps=4,
        enable_fp_fusion=False)  # no FMA contraction: the paged and cache-less variants round alike
    return out


class _TritonAttention(torch.autograd.Function):
    """The kernel forward (no cache: a trainer's forward); the backward is SDPA's (attention_ref under autograd).
    Only the forward's values must not depend on the batch (they are the log-probs compared with the engine's);
    the gradient is the same function's, rounded another way. Through the torch form's autograd instead (a
    chunk loop per 64 rows) one GRPO train step of a 0.6B model took 34x as long on an H200."""

    @staticmethod
    def forward(ctx, q, k, v, meta, scale, sliding_window):
        ctx.save_for_backward(q, k, v)
        ctx.meta, ctx.scale, ctx.window = meta, scale, sliding_window
        return attention_invariant_triton(q, k, v, meta, 0, scale, sliding_window)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = attention_ref(q, k, v, ctx.meta, 0, ctx.scale, ctx.window)
        gq, gk, gv = torch.autograd.grad(out, (q, k, v), grad)
        return gq, gk, gv, None, None, None


def attention_invariant(q, k, v, meta: AttnMeta, layer: int, scale: float, sliding_window: int | None = None):
    """q [N, H, D], k/v [N, KVH, D] (rotated) -> [N, H * D], each row independent of the rest of the step."""
    if triton_on(q, k, v) and q.shape[-1] <= 256:
        if meta.kv_caches is None and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return _TritonAttention.apply(q, k, v, meta, scale, sliding_window)
        return attention_invariant_triton(q, k, v, meta, layer, scale, sliding_window)
    return attention_invariant_ref(q, k, v, meta, layer, scale, sliding_window)
