"""Causal attention over a flattened varlen batch, optionally through a paged KV cache.

Every path describes a step with one `AttnMeta`. A contiguous per-sequence cache is the paged layout with one
block per sequence (block_size = its capacity), so the reference generator and the paged engine share this op.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from brrr.kernels.dispatch import arrival_counts, next_power_of_2, num_sms, use_triton
from brrr.kernels import pdl as pdl_mod
from brrr.kernels.pdl import pdl_on
from brrr.kernels.rotary import apply_rotary, apply_rotary_triton, rotary_triton_ok


@dataclass
class AttnMeta:
    cu_seqlens_q: torch.Tensor  # [B+1] int32: where each sequence's new tokens start in the flattened batch
    seqlens_q: list[int]  # host copy of the query lengths (the reference loops over sequences)
    context_lens: list[int] | None = None  # tokens of K/V each sequence attends to, new ones included
    slot_mapping: torch.Tensor | None = None  # [N] int64: cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer (k, v): [blocks, block_size, kv_heads, hd]
    # For the Triton kernels (optional: derived from the fields above on first use when left None).
    # A CUDA-graph decode step must set both, since nothing may be copied from the host inside a captured step:
    context_lens_t: torch.Tensor | None = None  # [B] int32 on the device: context_lens (a 0 row outputs zeros)
    max_context_len: int | None = None  # >= every context length; sizes the decode kernel's split-KV grid
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # per-step host facts

    @classmethod
    def causal(cls, seqlens: list[int], device) -> "AttnMeta":
        """No cache: each sequence attends causally to its own tokens (training, one-shot scoring)."""
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(seqlens).cumsum(0)
        return cls(cu_seqlens_q=cu.to(device), seqlens_q=list(seqlens))

    @property
    def max_seqlen_q(self) -> int:
        if "max_q" not in self._derived:
            self._derived["max_q"] = max(self.seqlens_q)
        return self._derived["max_q"]

    @property
    def has_single_token_rows(self) -> bool:
        """Whether some sequence has exactly one new token (a decode): those go to the decode kernel."""
        if "single" not in self._derived:
            self._derived["single"] = min(self.seqlens_q) == 1
        return self._derived["single"]

    def device_context_lens(self, device) -> torch.Tensor:
        if self.context_lens_t is None:
            self.context_lens_t = torch.tensor(self.context_lens, dtype=torch.int32, device=device)
        return self.context_lens_t

    def context_bound(self, block_size: int) -> int:
        """An upper bound of the context lengths, known on the host."""
        if self.max_context_len is not None:
            return self.max_context_len
        if self.context_lens is not None:
            if "max_ctx" not in self._derived:
                self._derived["max_ctx"] = max(self.context_lens)
            return self._derived["max_ctx"]
        return self.block_tables.shape[1] * block_size


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping):
    # index_copy_/index_select rather than advanced indexing: on CPU (torch 2.13) the latter costs ~8 ms a call.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def attention_ref(q, k, v, meta: AttnMeta, layer: int, scale: float, sliding_window: int | None = None):
    """q [N, H, D], k/v [N, KVH, D] for the new tokens -> [N, H * D]."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    if meta.kv_caches is None and len(set(meta.seqlens_q)) == 1 and len(meta.seqlens_q) > 1:
        return _causal_uniform(q, k, v, len(meta.seqlens_q), scale, n_heads // n_kv, sliding_window)
    if meta.kv_caches is not None:
        k_cache, v_cache = meta.kv_caches[layer]
        write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        block_size = k_cache.shape[1]
    out = torch.empty(q.shape[0], n_heads * q.shape[2], dtype=q.dtype, device=q.device)
    start = 0
    for b, q_len in enumerate(meta.seqlens_q):
        end = start + q_len
        if meta.kv_caches is None:
            kb, vb = k[start:end], v[start:end]
        else:
            ctx = meta.context_lens[b]
            blocks = meta.block_tables[b, : -(-ctx // block_size)].long()
            kb = k_cache.index_select(0, blocks).flatten(0, 1)[:ctx]
            vb = v_cache.index_select(0, blocks).flatten(0, 1)[:ctx]
        out[start:end] = _sdpa_one(q[start:end], kb, vb, scale, n_heads // n_kv, sliding_window)
        start = end
    return out


def _causal_uniform(q, k, v, batch, scale, groups, sliding_window):
    """No cache, equal lengths (training batches): one batched SDPA call instead of a loop over sequences."""
    t = q.shape[0] // batch
    q, k, v = (x.view(batch, t, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    mask = None
    if sliding_window is not None and t > sliding_window:
        pos = torch.arange(t, device=q.device)
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - sliding_window)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    return o.transpose(1, 2).reshape(batch * t, -1)


def _sdpa_one(q, k, v, scale, groups, sliding_window):
    """One sequence: q [Tq, H, D] are the last Tq of the Tk positions in k/v [Tk, KVH, D]."""
    tq, tk = q.shape[0], k.shape[0]
    if groups > 1:  # GQA: kv head j serves query heads j*groups .. (j+1)*groups-1
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    mask, causal = None, False
    if sliding_window is not None and tk > sliding_window or (tq > 1 and tq != tk):
        q_pos = torch.arange(tk - tq, tk, device=q.device)[:, None]
        k_pos = torch.arange(tk, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
    elif tq > 1:
        causal = True
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    return o.squeeze(0).transpose(0, 1).reshape(tq, -1)


def paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None):
    """One query token per sequence, vectorised over the batch: q [B, H, D] attends to the first
    context_lens[b] cached tokens of its block table. Reads block_tables.shape[1] whole blocks per sequence."""
    batch, n_heads, _ = q.shape
    n_kv = k_cache.shape[2]
    flat = block_tables.long().flatten()
    k = k_cache.index_select(0, flat).view(batch, -1, *k_cache.shape[2:])  # [B, max_blocks * block_size, KVH, D]
    v = v_cache.index_select(0, flat).view(batch, -1, *v_cache.shape[2:])
    pos = torch.arange(k.shape[1], device=q.device)
    mask = pos[None, :] < context_lens[:, None]
    if sliding_window is not None:
        mask &= pos[None, :] >= context_lens[:, None] - sliding_window
    groups = n_heads // n_kv
    k, v = (t.transpose(1, 2).repeat_interleave(groups, dim=1) for t in (k, v))
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return o.reshape(batch, -1)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels. Softmax in base 2: scores are scaled by scale * log2(e) and exponentiated with exp2, the running
# max m and sum l rescaled by exp2(m_old - m_new) (FlashAttention-2's online softmax). fp32 inputs take exact
# ("ieee") dot products; fp16/bf16 ones the tensor cores, with p cast to the input dtype for the P @ V product.
# ---------------------------------------------------------------------------------------------------------------
LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
MAX_SPLITS = 64

try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:
    from brrr.kernels.pdl import release_dependents, wait_previous

    @triton.jit
    def _write_kv_kernel(K, V, KC, VC, SLOTS, stride_kn, stride_kh, stride_vn, stride_vh,
                         stride_cb, stride_ct, stride_ch, block_size, n_kv,
                         HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        wait_previous(PDL)
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(SLOTS + t).to(tl.int64)
        if slot < 0:  # a padded row (CUDA-graph batches): nothing to write
            return
        heads = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (heads < n_kv)[:, None] & (d < HEAD_DIM)[None, :]
        dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct
        dst = dst + heads[:, None] * stride_ch + d[None, :]
        k = tl.load(K + t * stride_kn + heads[:, None] * stride_kh + d[None, :], mask=mask)
        tl.store(KC + dst, k, mask=mask)
        v = tl.load(V + t * stride_vn + heads[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(VC + dst, v, mask=mask)

    @triton.jit
    def _online_softmax_step(s, m_i, l_i, acc, v, PREC: tl.constexpr):
        """Fold one tile of base-2 scores s [M, N] (masked entries -inf) and its values v [N, D] into (m, l, acc).
        A row with every score masked so far keeps m = -inf without producing NaN."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        return m_new, l_i, acc

    @triton.jit
    def _phase(TRACE, slot: tl.constexpr, after, GLOBAL: tl.constexpr = False):
        """Benchmarks' phase stamps (`DECODE_TRACE`: int64 [programs, 8], None in the engine): the SM's cycle counter
        (GLOBAL: the global ns clock), read once `after` (a value of the phase) is ready, in this program's slot."""
        if TRACE is not None:
            if GLOBAL:
                t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [after.to(tl.int32)],
                                              dtype=tl.int64, is_pure=False, pack=1)
            else:
                t = tl.inline_asm_elementwise("mov.u64 $0, %clock64; // $1", "=l,r", [after.to(tl.int32)],
                                              dtype=tl.int64, is_pure=False, pack=1)
            pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
            tl.store(TRACE + pid * 8 + slot, t)

    @triton.jit
    def _paged_rows(BT, b, stride_bt, n, mask, kvh, block_size, stride_cb, stride_ct, stride_ch):
        """Element offset of key position n's row (one kv head) in a paged cache [blocks, block_size, kvh, D]."""
        blk = tl.load(BT + b * stride_bt + n // block_size, mask=mask, other=0).to(tl.int64)
        return blk * stride_cb + (n % block_size) * stride_ct + kvh * stride_ch

    @triton.jit
    def _rope_factors(COS, SIN, row, stride_cos, d, dm, HEAD_DIM: tl.constexpr):
        """cos and sin at the token's position over the head's dims, the partner dim (d + D/2 mod D) and the sign
        of rotate-half: x_rot[d] = x[d] * cos[d] + sign[d] * x[partner] * sin[d]."""
        HALF: tl.constexpr = HEAD_DIM // 2
        c = tl.load(COS + row * stride_cos + d, mask=dm, other=0.0).to(tl.float32)
        sn = tl.load(SIN + row * stride_cos + d, mask=dm, other=0.0).to(tl.float32)
        return c, sn, (d + HALF) % HEAD_DIM, tl.where(d < HALF, -1.0, 1.0)

    @triton.jit
    def _mul_rn(a, b):
        """a * b rounded on its own: PTX's mul.rn is never contracted into an FMA."""
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @triton.jit
    def _store_in_place(ptrs, v, mask, ASM: tl.constexpr):
        """tl.store(ptrs, v, mask) (v fp32 or 16-bit), each element stored by the threads that hold it (ASM, a GPU
        launch: PTX st.global). tl.store lets Triton's coalescing pick the store's layout: for the lean kernel's
        [W] maxima and totals (each held by every lane of its warp) and its output, a conversion through shared
        memory before each store; in place the step took ~10 us less (H200, pdl_decode_lean_stores_h200.jsonl)."""
        if ASM:
            if v.dtype == tl.float32:
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.global.f32 [$1], $2; mov.u32 $0, 0; }", "=r,l,f,r",
                    [ptrs.to(tl.int64), v, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.global.b16 [$1], $2; mov.u32 $0, 0; }", "=r,l,h,r",
                    [ptrs.to(tl.int64), v.to(tl.int16, bitcast=True), mask.to(tl.int32)], dtype=tl.int32, is_pure=False,
                    pack=1)
        else:
            tl.store(ptrs, v, mask=mask)

    @triton.jit
    def _rope(ptrs, d, mask, c, sn, swap, sign, MUL_RN: tl.constexpr = False):
        """The rotated rows at ptrs (+ d): each product rounded to the activation dtype, then the sum, as torch's
        `x * cos + rotate_half(x) * sin` and the rotary kernel round: the launch turns FMA contraction off, or
        (MUL_RN, a GPU launch with it on) the products are `_mul_rn`'s."""
        dt = ptrs.dtype.element_ty
        x = tl.load(ptrs + d, mask=mask, other=0.0).to(tl.float32)
        xs = tl.load(ptrs + swap, mask=mask, other=0.0).to(tl.float32)
        if MUL_RN:
            xc, xss = _mul_rn(x, c), _mul_rn(sign * xs, sn)
        else:
            xc, xss = x * c, sign * xs * sn
        return (xc.to(dt).to(tl.float32) + xss.to(dt).to(tl.float32)).to(dt)

    @triton.jit
    def _decode_kernel(Q, KC, VC, O, OP, MLP, COUNTS, CU_Q, CTX, BT, K, V, COS, SIN, SLOTS, TRACE,
                       stride_qn, stride_qh, stride_on, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
                       stride_kn, stride_kh, stride_vn, stride_vh, stride_cos,
                       qk_scale, window, n_heads, num_splits, wave, min_part, long_part, BLOCK_SIZE: tl.constexpr,
                       GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_N: tl.constexpr, UNROLL: tl.constexpr, SPLIT: tl.constexpr,
                       SLIDING: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
                       ROPE: tl.constexpr, WHOLE: tl.constexpr):
        """One program: one sequence with a single new token, one kv head (its GROUP query heads as the rows of
        the dot products), one part of the context. The grid has num_splits parts a sequence (a bound fixed on the
        host, so graphs keep it); each sequence cuts its own context into `_decode_parts` of them, read from its
        length on the device, and the programs past those return. A sequence in one part writes its output; in
        several, each part stores (acc, m, l) and the last to arrive combines them. One launch, no host sync.
        ROPE: q and the new k/v come unrotated from this step's projection (K, V, COS, SIN, SLOTS): each program
        rotates its q heads, and the last part rotates the new key, writes it and v to the cache at the token's slot
        and folds it in from registers (its loop stops one key short), the rotary kernel's work in this one."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        _phase(TRACE, 7, b, True)
        if not EARLY:
            wait_previous(PDL)
        # The step's lengths and block table are inputs, not the previous kernel's outputs: with EARLY they and the
        # first tile's cache rows are read before the wait. No program returns before it (a kernel must not
        # complete before the one it follows).
        q_row = tl.load(CU_Q + b)
        single = tl.load(CU_Q + b + 1) - q_row == 1
        ctx = tl.load(CTX + b)
        lo = 0
        if SLIDING:  # the query sits at ctx - 1 and sees keys > ctx - 1 - window
            lo = tl.maximum(0, ctx - window)
        parts, part = 1, ctx - lo
        if SPLIT:
            parts, part = _decode_parts(ctx - lo, num_splits, wave, min_part, long_part, BLOCK_N, WHOLE)
        lo += split * part
        hi = tl.minimum(ctx, lo + part)
        n = lo + tl.arange(0, BLOCK_N)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        dm = d < HEAD_DIM
        if ROPE:  # cos/sin and the slot are inputs too (made at the start of the forward)
            c, sn, swap, sign = _rope_factors(COS, SIN, q_row, stride_cos, d, dm, HEAD_DIM)
            slot = tl.load(SLOTS + q_row).to(tl.int64)
            new_key = (split == parts - 1) & (ctx > 0)  # this part ends at the new token's position ctx - 1
            hi = tl.where(new_key, hi - 1, hi)  # the new key comes from registers, after the loop
            if EARLY:  # so every cached key is an input too: the part's first tile is read before the wait
                nm0 = n < hi
                rows = _paged_rows(BT, b, stride_bt, n, nm0, kvh, BLOCK_SIZE, stride_cb, stride_ct, stride_ch)
                kt0 = tl.load(KC + rows[None, :] + d[:, None], mask=nm0[None, :] & dm[:, None], other=0.0)
                v0 = tl.load(VC + rows[:, None] + d[None, :], mask=nm0[:, None] & dm[None, :], other=0.0)
        if EARLY:
            wait_previous(PDL)
        _phase(TRACE, 0, ctx, True)
        _phase(TRACE, 1, ctx)
        if PDL == 3:  # a sequence in one part lets the next kernel launch now, a split one from its epilogue
            if parts == 1:
                release_dependents(PDL)
        if not single:  # a prefill chunk: the prefill kernel's
            return
        if split >= parts:
            return
        heads = kvh * GROUP + g
        gm = g < GROUP
        q_ptrs = Q + q_row.to(tl.int64) * stride_qn + heads[:, None] * stride_qh
        if ROPE:
            q = _rope(q_ptrs, d, gm[:, None] & dm[None, :], c[None, :], sn[None, :], swap[None, :], sign[None, :])
            # the new key and value load beside q: one round trip to L2 after the wait, not a second after the loop
            nkm = dm & (d < tl.where(new_key, HEAD_DIM, 0))  # (dm & new_key is int32 under the interpreter)
            k_new = _rope(K + q_row.to(tl.int64) * stride_kn + kvh * stride_kh, d, nkm, c, sn, swap, sign)
            v_new = tl.load(V + q_row.to(tl.int64) * stride_vn + kvh * stride_vh + d, mask=nkm, other=0.0)
        else:
            q = tl.load(q_ptrs + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
        _phase(TRACE, 2, tl.sum(q.to(tl.float32)))
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        if ROPE:
            if EARLY:  # the first tile, loaded before the wait
                s0 = tl.dot(q, kt0, input_precision=PREC) * qk_scale
                s0 = tl.where(nm0[None, :], s0, float("-inf"))
                m_i, l_i, acc = _online_softmax_step(s0, m_i, l_i, acc, v0, PREC)
                lo += BLOCK_N
                n += BLOCK_N
                _phase(TRACE, 3, tl.sum(l_i))
        for start in range(lo, hi, BLOCK_N):
            nm = n < hi
            rows = _paged_rows(BT, b, stride_bt, n, nm, kvh, BLOCK_SIZE, stride_cb, stride_ct, stride_ch)
            kt = tl.load(KC + rows[None, :] + d[:, None], mask=nm[None, :] & dm[:, None], other=0.0)
            s = tl.dot(q, kt, input_precision=PREC) * qk_scale
            s = tl.where(nm[None, :], s, float("-inf"))
            v = tl.load(VC + rows[:, None] + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
            m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, PREC)
            n += BLOCK_N
        if ROPE:
            if new_key:
                if slot >= 0:  # a padded row has none
                    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + kvh * stride_ch + d
                    tl.store(KC + dst, k_new, mask=dm)
                    tl.store(VC + dst, v_new, mask=dm)
                # the new key as one more online-softmax step, from registers (p rounded as the dot's input is)
                s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * qk_scale
                m_new = tl.maximum(m_i, s_new)
                alpha = tl.math.exp2(m_i - m_new)
                p_new = tl.math.exp2(s_new - m_new).to(v_new.dtype).to(tl.float32)
                l_i = l_i * alpha + p_new
                acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
                m_i = m_new
        _phase(TRACE, 4, tl.sum(l_i))
        if PDL == 3:
            if parts > 1:
                release_dependents(PDL)
        o_ptrs = O + q_row.to(tl.int64) * stride_on + heads[:, None] * stride_oh + d[None, :]
        o_mask = gm[:, None] & dm[None, :]
        if not SPLIT:  # its own branch: unsplit launches pass no counters, so the atomics below must not compile
            _write_out(acc, l_i, o_ptrs, o_mask)
        elif parts == 1:
            _write_out(acc, l_i, o_ptrs, o_mask)
        else:
            base = (b * n_heads + heads).to(tl.int64) * num_splits  # partials [B, H, S]
            tl.store(OP + (base + split)[:, None] * BLOCK_D + d[None, :], acc, mask=gm[:, None])
            tl.store(MLP + 2 * (base + split), m_i, mask=gm)
            tl.store(MLP + 2 * (base + split) + 1, l_i, mask=gm)
            tl.debug_barrier()  # every thread's partial is written before the count says so (acq_rel below)
            count = COUNTS + b * tl.num_programs(1) + kvh
            if tl.atomic_add(count, 1, sem="acq_rel") == parts - 1:
                _combine_parts(OP, MLP, base, parts, o_ptrs, o_mask, gm, d, BLOCK_G, BLOCK_D, UNROLL)
                tl.atomic_xchg(count, 0, sem="relaxed")  # the next launch reads it after this one ends
        _phase(TRACE, 5, ctx)
        _phase(TRACE, 6, ctx, True)

    @triton.jit
    def _warp_keys(c: tl.constexpr, R: tl.constexpr, W: tl.constexpr):
        """Context positions of chunk c as [2, W, R]. Triton orders a tile's axes after the head's (the last) by
        index, so a [2, W, R, 128] tile of 16-bit keys puts 16 lanes on the head, 2 on axis 0 and the W warps on
        axis 1: a warp's keys are (0-1, w, r), its R rows in each thread's registers."""
        j = tl.arange(0, 2)[:, None, None]
        w = tl.arange(0, W)[None, :, None]
        r = tl.arange(0, R)[None, None, :]
        return c * (R * W * 2) + r * (2 * W) + w * 2 + j

    @triton.jit
    def _warp_tile(KC, VC, BT, b, n, lo, hi, d4, dm4, kvh, stride_bt, stride_cb, stride_ct, stride_ch,
                   BLOCK_SIZE: tl.constexpr):
        """Keys and values [2, W, R, D] at positions n [2, W, R] (masked outside [lo, hi)) of kv head kvh."""
        nm = (n >= lo) & (n < hi)
        rows = _paged_rows(BT, b, stride_bt, n, nm, kvh, BLOCK_SIZE, stride_cb, stride_ct, stride_ch)[:, :, :, None]
        mask = nm[:, :, :, None] & dm4
        return tl.load(KC + rows + d4, mask=mask, other=0.0), tl.load(VC + rows + d4, mask=mask, other=0.0), nm

    @triton.jit
    def _warp_s(q4, k, nm, qk_scale):
        """Base-2 scores [2, W, R] of one chunk (-inf where masked); the sum over the head is inside each warp."""
        return tl.where(nm, tl.sum(q4 * k.to(tl.float32), 3) * qk_scale, float("-inf"))

    @triton.jit
    def _warp_max(s):
        """Each warp's max over its keys of a chunk: [W]."""
        return tl.max(tl.max(s, 2), 0)

    @triton.jit
    def _warp_p(s, v, m, total, acc):
        """Softmax weights of one chunk at each warp's max m [W], added to the running sums (total [2, W, R], acc
        [2, W, R, D])."""
        p = tl.math.exp2(s - m[None, :, None])
        return total + p, acc + p[:, :, :, None] * v.to(tl.float32)

    @triton.jit
    def _decode_row(CU_Q, CTX, b, window, SLIDING: tl.constexpr):
        """Sequence b of a decode step: its query row, whether it has one new token, its context, and the cached
        keys [lo, hi) it attends to besides the new one (position hi = ctx - 1, from registers)."""
        q_row = tl.load(CU_Q + b)
        single = tl.load(CU_Q + b + 1) - q_row == 1
        ctx = tl.load(CTX + b)
        lo = 0
        if SLIDING:
            lo = tl.maximum(0, ctx - window)
        return q_row, single, ctx, lo, tl.maximum(ctx - 1, 0)

    @triton.jit
    def _lean_decode_kernel(Q, KC, VC, O, SCR, CU_Q, CTX, BT, K, V, COS, SIN, SLOTS, TRACE,
                            stride_qn, stride_qh, stride_on, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
                            stride_kn, stride_kh, stride_vn, stride_vh, stride_cos, qk_scale, window,
                            BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, W: tl.constexpr,
                            SLIDING: tl.constexpr, PDL: tl.constexpr, FUSED: tl.constexpr,
                            ASM_STORES: tl.constexpr = False):
        """One program: one query head of a sequence with one new token, its whole context (< BLOCK_N cached keys)
        read before the PDL wait (the cache is an input) in CHUNKS (1, 2 or 4) chunks, scores and weighted sums on
        CUDA cores in fp32: no split, so no partials between programs, and no MMA operand round trips through shared
        memory. After the wait only q and the new k/v are loaded (unrotated, as `_decode_kernel`'s ROPE; the first
        query head of each kv head writes the new key and value to the cache), and chunks past the context are
        skipped (a branch a context level, its chunks computed together).

        A chunk is a [2, W, R, D] tile with the W axis on the program's W warps (`_warp_keys`), so each warp keeps a
        softmax of its own: its scores, max, weights and weighted sums never leave it (shuffles only). The warps'
        partials (weighted sums, max, sum of weights) then go to this program's slice of SCR [D + 2, W], transposed,
        and after a barrier each thread merges its columns' W partials itself. A `tl.sum` across 8 warps of the
        [W, D] sums took ~2400 cycles on the H200 (Triton's scratch for it puts a warp's columns on one shared-memory
        bank), the round trip through L1/L2 ~350 (bench/warp_reduce.py). q, the new key and value are [2, W, 1, D]
        tiles of the chunks' layout (as 1-D vectors they took another, a conversion through shared memory each);
        the new key counts in every warp's max and in warp 0's sums. ASM_STORES (a GPU launch): the warps' maxima
        and totals, and the output, are stored in the layouts they are in (`_store_in_place`), without the
        conversions through shared memory Triton put before their stores. FUSED (a GPU launch): FMA contraction
        on, so the dot products are FFMAs (the rotation's products stay rounded, `_rope`'s MUL_RN). TRACE: `_phase`
        stamps (7 before the wait, 0-1 after it, 2 q loaded, 3 each warp's sums, 4 merged, 5-6 the end)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        _phase(TRACE, 7, b, True)
        kvh = h // GROUP
        q_row, single, ctx, lo, hi = _decode_row(CU_Q, CTX, b, window, SLIDING)
        lane = _warp_keys(0, 1, W)  # [2, W, 1]: 0 is warp 0's first lane pair
        d = (lane * 0)[:, :, :, None] + tl.arange(0, BLOCK_D)[None, None, None, :]  # [2, W, 1, D]
        dm = d < HEAD_DIM
        c, sn, swap, sign = _rope_factors(COS, SIN, q_row, stride_cos, d, dm, HEAD_DIM)
        slot = tl.load(SLOTS + q_row).to(tl.int64)
        C: tl.constexpr = BLOCK_N // CHUNKS
        R: tl.constexpr = C // (2 * W)
        args = (lo, hi, d, dm, kvh, stride_bt, stride_cb, stride_ct, stride_ch, BLOCK_SIZE)
        k0, v0, nm0 = _warp_tile(KC, VC, BT, b, _warp_keys(0, R, W), *args)
        if CHUNKS > 1:
            k1, v1, nm1 = _warp_tile(KC, VC, BT, b, _warp_keys(1, R, W), *args)
        if CHUNKS > 2:
            k2, v2, nm2 = _warp_tile(KC, VC, BT, b, _warp_keys(2, R, W), *args)
            k3, v3, nm3 = _warp_tile(KC, VC, BT, b, _warp_keys(3, R, W), *args)
        wait_previous(PDL)
        _phase(TRACE, 0, ctx, True)
        _phase(TRACE, 1, ctx)
        if single:  # else a prefill chunk: the prefill kernel's
            q = _rope(Q + q_row.to(tl.int64) * stride_qn + h * stride_qh, d, dm, c, sn, swap, sign,
                      FUSED).to(tl.float32)
            nkm = dm & (d < tl.where(ctx > 0, HEAD_DIM, 0))
            k_new = _rope(K + q_row.to(tl.int64) * stride_kn + kvh * stride_kh, d, nkm, c, sn, swap, sign, FUSED)
            v_new = tl.load(V + q_row.to(tl.int64) * stride_vn + kvh * stride_vh + d, mask=nkm, other=0.0)
            _phase(TRACE, 2, tl.sum(q))
            s_new = tl.where(ctx > 0, tl.sum(q * k_new.to(tl.float32), 3) * qk_scale, float("-inf"))  # [2, W, 1]
            s1 = tl.full([2, W, R], float("-inf"), tl.float32)
            s2, s3 = s1, s1
            if CHUNKS > 2:
                if hi > 2 * C:
                    s0, s1 = _warp_s(q, k0, nm0, qk_scale), _warp_s(q, k1, nm1, qk_scale)
                    s2, s3 = _warp_s(q, k2, nm2, qk_scale), _warp_s(q, k3, nm3, qk_scale)
                elif hi > C:
                    s0, s1 = _warp_s(q, k0, nm0, qk_scale), _warp_s(q, k1, nm1, qk_scale)
                else:
                    s0 = _warp_s(q, k0, nm0, qk_scale)
            elif CHUNKS > 1:
                if hi > C:
                    s0, s1 = _warp_s(q, k0, nm0, qk_scale), _warp_s(q, k1, nm1, qk_scale)
                else:
                    s0 = _warp_s(q, k0, nm0, qk_scale)
            else:
                s0 = _warp_s(q, k0, nm0, qk_scale)
            m = tl.maximum(_warp_max(tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3))), _warp_max(s_new))  # [W]
            m = tl.where(m == float("-inf"), 0.0, m)  # no key at all (padding): zeros out
            total = tl.zeros([2, W, R], tl.float32)
            acc = tl.zeros([2, W, R, BLOCK_D], tl.float32)
            total, acc = _warp_p(s0, v0, m, total, acc)
            if CHUNKS > 2:
                if hi > 2 * C:
                    total, acc = _warp_p(s1, v1, m, total, acc)
                    total, acc = _warp_p(s2, v2, m, total, acc)
                    total, acc = _warp_p(s3, v3, m, total, acc)
                elif hi > C:
                    total, acc = _warp_p(s1, v1, m, total, acc)
            elif CHUNKS > 1:
                if hi > C:
                    total, acc = _warp_p(s1, v1, m, total, acc)
            first = lane == 0
            p_new = tl.where(first, tl.math.exp2(s_new - m[None, :, None]), 0.0)  # [2, W, 1]
            total = tl.sum(tl.sum(total, 2), 0) + tl.sum(tl.sum(p_new, 2), 0)  # [W]
            acc = tl.sum(tl.sum(acc, 2), 0) + tl.sum(tl.sum(p_new[:, :, :, None] * v_new.to(tl.float32), 2), 0)
            _phase(TRACE, 3, tl.sum(total))
            base = SCR + (b * tl.num_programs(1) + h) * (BLOCK_D + 2) * W
            wi = tl.arange(0, W)
            # the sums through tl.store's conversion: stored in place, as 8 scalar stores a thread, the step took ~25 us
            # longer; by rows in 16-byte stores (then read across rows), ~45 (H200, pdl_decode_lean_stores_h200.jsonl)
            tl.store(base + tl.arange(0, BLOCK_D)[None, :] * W + wi[:, None], acc)
            _store_in_place(base + BLOCK_D * W + wi, m, wi < W, ASM_STORES)
            _store_in_place(base + (BLOCK_D + 1) * W + wi, total, wi < W, ASM_STORES)
            tl.debug_barrier()  # the CTA's global writes are visible to its threads after it
            cols = tl.arange(0, BLOCK_D)[:, None]
            ws = tl.arange(0, W)[None, :]
            m_t = tl.load(base + BLOCK_D * W + ws + cols * 0)  # [D, W], each row every warp's max
            scale = tl.math.exp2(m_t - tl.max(m_t, 1)[:, None])
            total = tl.sum(tl.load(base + (BLOCK_D + 1) * W + ws + cols * 0) * scale, 1)
            acc = tl.sum(tl.load(base + cols * W + ws) * scale, 1)
            _phase(TRACE, 4, tl.sum(acc))
            if (h % GROUP == 0) & (slot >= 0) & (ctx > 0):  # a padded row has no slot
                dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + kvh * stride_ch + d
                one = first[:, :, :, None] & dm  # one lane's columns each
                tl.store(KC + dst, k_new, mask=one)
                tl.store(VC + dst, v_new, mask=one)
            out = acc / tl.where(total == 0.0, 1.0, total)
            dd = tl.arange(0, BLOCK_D)
            _store_in_place(O + q_row.to(tl.int64) * stride_on + h * stride_oh + dd, out.to(O.dtype.element_ty),
                            dd < HEAD_DIM, ASM_STORES)
            _phase(TRACE, 5, ctx)
            _phase(TRACE, 6, ctx, True)

    @triton.jit
    def _write_out(acc, l_i, o_ptrs, o_mask):
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # an empty context (padding) gives zeros
        tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=o_mask)

    @triton.jit
    def _decode_parts(span, num_splits, wave, min_part, long_part, BLOCK_N: tl.constexpr, WHOLE: tl.constexpr):
        """(parts, keys a part) for a context of `span` keys: parts of min_part keys up to one wave of programs
        (batch x kv heads x wave fill the GPU once), past that parts of long_part keys up to num_splits. Up to WHOLE
        parts' worth is read by one program (2: one program over two tiles beat two and their combine on the H200,
        loads after the PDL wait). A part is whole key tiles, and no part is empty."""
        parts = tl.maximum(tl.minimum(wave, tl.cdiv(span, min_part)), tl.cdiv(span, long_part))
        parts = tl.where(span <= WHOLE * min_part, 1, tl.minimum(parts, num_splits))
        part = tl.maximum(BLOCK_N, tl.cdiv(tl.cdiv(span, parts), BLOCK_N) * BLOCK_N)
        return tl.maximum(1, tl.cdiv(span, part)), part

    @triton.jit
    def _combine_parts(OP, MLP, base, parts, o_ptrs, o_mask, gm, d, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                       UNROLL: tl.constexpr):
        """The output of GROUP heads from their `parts` partials (acc, m, l), in one pass: a running max rescales
        what is summed so far (as the online softmax does), so no load waits on another and UNROLL parts' loads are
        in flight together. Against reading every part's m first (two passes), the batch-1 step on the H200 was
        2.2-3.0% shorter (bench/results/pdl_decode_combine_h200.jsonl); UNROLL 4 against one part at a time: 1 x 32k
        keys in 63 parts 58 us against 61. Read through L2 (.cg): other programs wrote them. Tiles stay [BLOCK_G,
        BLOCK_D], the main loop's: a [heads, parts, dim] one cost every launch ~1 us, combining or not."""
        m_run = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        out = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for c in range(0, parts, UNROLL):
            for u in tl.static_range(UNROLL):
                t = base * 0 + c + u  # part c + u, one per row
                ok = gm & (t < parts)
                m_t = tl.load(MLP + 2 * (base + t), mask=ok, other=float("-inf"), cache_modifier=".cg")
                l_t = tl.load(MLP + 2 * (base + t) + 1, mask=ok, other=0.0, cache_modifier=".cg")
                acc = tl.load(OP + (base + t)[:, None] * BLOCK_D + d[None, :], mask=ok[:, None], other=0.0,
                              cache_modifier=".cg")
                m_new = tl.maximum(m_run, m_t)
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no keys yet: every weight 0
                alpha, beta = tl.math.exp2(m_run - m_ref), tl.math.exp2(m_t - m_ref)
                out = out * alpha[:, None] + acc * beta[:, None]
                total = total * alpha + l_t * beta
                m_run = m_new
        out = out / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=o_mask)

    @triton.jit
    def _prefill_kernel(Q, K, V, KC, VC, O, CU_Q, CTX, BT,
                        stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
                        stride_cb, stride_ct, stride_ch, stride_bt, block_size, qk_scale, window, max_q_bucket,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CACHE: tl.constexpr,
                        SKIP_SINGLE: tl.constexpr, SLIDING: tl.constexpr, PREC: tl.constexpr):
        """One program: BLOCK_M new tokens of one sequence, one query head. Keys come in two parts: the cached
        prefix (HAS_CACHE: ctx - q_len tokens through the block table, all visible) and the new tokens themselves
        (contiguous k/v, causal: tiles left of the diagonal unmasked, the diagonal tiles masked)."""
        m_blk = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (most keys) query blocks start first
        b = tl.program_id(1)
        h = tl.program_id(2)
        q_start = tl.load(CU_Q + b)
        q_len = tl.load(CU_Q + b + 1) - q_start
        if m_blk * BLOCK_M >= q_len:
            return
        if SKIP_SINGLE and q_len == 1:  # decodes: the decode kernel's
            return
        prefix = 0
        if HAS_CACHE:
            prefix = tl.load(CTX + b) - q_len
        kvh = h // GROUP
        offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        dm = d < HEAD_DIM
        q_rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(Q + q_rows[:, None] * stride_qn + h * stride_qh + d[None, :],
                    mask=(offs_m < q_len)[:, None] & dm[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        first_q = m_blk * BLOCK_M  # index (within the new tokens) of this block's first query
        if HAS_CACHE:
            lo = 0
            if SLIDING:
                lo = tl.maximum(0, (prefix + first_q - window + 1) // BLOCK_N * BLOCK_N)
            for start in range(lo, prefix, BLOCK_N):
                n = start + tl.arange(0, BLOCK_N)
                nm = n < prefix
                rows = _paged_rows(BT, b, stride_bt, n, nm, kvh, block_size, stride_cb, stride_ct, stride_ch)
                kt = tl.load(KC + rows[None, :] + d[:, None], mask=nm[None, :] & dm[:, None], other=0.0)
                s = tl.dot(q, kt, input_precision=PREC) * qk_scale
                visible = nm[None, :]
                if SLIDING:
                    visible = visible & (n[None, :] > (prefix + offs_m)[:, None] - window)
                s = tl.where(visible, s, float("-inf"))
                v = tl.load(VC + rows[:, None] + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
                m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, PREC)
        lo = 0
        if SLIDING:
            lo = tl.maximum(0, (first_q - window + 1) // BLOCK_N * BLOCK_N)
        k_base = K + kvh * stride_kh
        v_base = V + kvh * stride_vh
        for start in range(lo, first_q, BLOCK_N):  # fully visible tiles (BLOCK_N divides BLOCK_M)
            n = start + tl.arange(0, BLOCK_N)
            k_rows = (q_start + n).to(tl.int64)
            kt = tl.load(k_base + k_rows[None, :] * stride_kn + d[:, None], mask=dm[:, None], other=0.0)
            s = tl.dot(q, kt, input_precision=PREC) * qk_scale
            if SLIDING:
                s = tl.where(n[None, :] > offs_m[:, None] - window, s, float("-inf"))
            v = tl.load(v_base + k_rows[:, None] * stride_vn + d[None, :], mask=dm[None, :], other=0.0)
            m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, PREC)
        hi = tl.minimum(q_len, first_q + BLOCK_M)
        for start in range(first_q, hi, BLOCK_N):  # the diagonal: causal mask
            n = start + tl.arange(0, BLOCK_N)
            nm = n < q_len
            k_rows = (q_start + n).to(tl.int64)
            kt = tl.load(k_base + k_rows[None, :] * stride_kn + d[:, None], mask=nm[None, :] & dm[:, None], other=0.0)
            s = tl.dot(q, kt, input_precision=PREC) * qk_scale
            visible = nm[None, :] & (n[None, :] <= offs_m[:, None])
            if SLIDING:
                visible = visible & (n[None, :] > offs_m[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            v = tl.load(v_base + k_rows[:, None] * stride_vn + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
            m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, PREC)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # (rows past q_len under a sliding window)
        tl.store(O + q_rows[:, None] * stride_on + h * stride_oh + d[None, :], out.to(O.dtype.element_ty),
                 mask=(offs_m < q_len)[:, None] & dm[None, :])

    # Autotuned tiles (BLOCK_M, BLOCK_N, warps, stages) by padded head dim; K and V tiles are pipelined `stages`
    # deep in shared memory, so hd256 takes shallower pipelines and narrower key tiles.
    PREFILL_TILES = {
        64: [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3)],
        128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
        256: [(64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2)],
    }

    def _tile_bucket(block_d):
        return 64 if block_d <= 64 else 128 if block_d <= 128 else 256

    def _prune_prefill(configs, named_args, **kwargs):
        block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
        allowed = set(PREFILL_TILES[_tile_bucket(block_d)])
        return [c for c in configs
                if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in allowed]

    _prefill_kernel_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
                 for tiles in PREFILL_TILES.values() for bm, bn, w, st in dict.fromkeys(tiles)],
        key=["BLOCK_D", "GROUP", "HAS_CACHE", "SLIDING", "max_q_bucket"],
        prune_configs_by={"early_config_prune": _prune_prefill})(_prefill_kernel)


AUTOTUNE_MIN_TOKENS = 1024  # shorter prefill steps take a fixed tile: tuning each shape would cost more than it saves


def prefill_config(dim: int, dtype: torch.dtype) -> dict:
    """The fixed tile for fp32 and for short steps: a safe fit for the head dim, not the fastest."""
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=16 if dim > 128 else 32, num_warps=4, num_stages=2)
    if dim > 128:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)


def write_kv_triton(k, v, k_cache, v_cache, slot_mapping):
    """Scatter the new tokens' K/V [N, KVH, D] into the paged cache; negative slots (padding) are skipped."""
    n, n_kv, dim = k.shape
    if n == 0:
        return
    pdl = pdl_on(k)
    _write_kv_kernel[(n,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1], n_kv,
                           HEAD_DIM=dim, BLOCK_H=next_power_of_2(n_kv), BLOCK_D=next_power_of_2(dim),
                           num_warps=4, PDL=pdl, launch_pdl=pdl > 0)


def _precision(q):
    return "ieee" if q.dtype == torch.float32 else "tf32"


# Keys a part of a split context holds at least: up to one wave of programs (DECODE_MIN_PART, one 128-key tile),
# past it (DECODE_LONG_PART). From the H200 sweeps (bench/results/decode_attention_splits_h200.jsonl): batch 1 x
# 500-2000 keys ran fastest in 128-key parts up to 16 (one wave), 4-8k in 16 parts, 32k in 64 of 512.
DECODE_MIN_PART, DECODE_LONG_PART = 128, 512
# A step of decodes only rotates q/k and writes the new K/V inside the decode kernel (one launch fewer a layer), its
# parts ROPE_PART keys (one tile, read before the PDL wait) up to a wave. It pays when the kernel before attention
# releases it early (a Triton GEMV: W4A16 + lm_head step -4.9%, W8A16 -2.4% on the H200); after a cuBLAS GEMM, which
# does not, the rotary kernel and the plain decode kernel were 0.8% faster (bf16), so callers say which
# (`decode_rope`). Benchmarks set DECODE_ROPE False for the A/B (bench/results/pdl_decode_rope_h200.jsonl).
DECODE_ROPE = True
ROPE_PART = 64
# Where the decode kernel lets the next kernel launch under PDL: "wait" right after its wait; "parts" there when the
# sequence is one part, after its keys are folded in when split. "parts" looked 12-19 us better at 100-204 keys in
# graphs replayed out of the engine (engine_step_gap_settings_h200.jsonl), but the engine itself, the two
# alternating, ran faster with "wait": W8A16 + lm_head 417.9 against 416.2 tok/s, W4A16 589.4 against 586.4
# (engine_ab_h200.jsonl; docs/quantization.md, "a replay's two levels", on why the two measurements disagree).
DECODE_RELEASE = "wait"
ROPE_TILE_WARPS: int | None = None  # warps of a RoPE-path decode program, split or not (benchmarks' A/B)
DECODE_MAXNREG: int | None = None  # a register cap for the decode kernel (benchmarks' A/B)
DECODE_TRACE: torch.Tensor | None = None  # bench/decode_phases.py: the decode kernel stamps its phases here (`_phase`)
# Warps of a decode program on the RoPE path when a sequence is split (batch 1 on the H200): 8, the engine's W4A16 +
# lm_head 591.3 against 586.4 tok/s with 4, 593.9 with "wait" too (engine_ab_h200.jsonl); other launches keep 4.
SPLIT_ROPE_WARPS = 8


# Steps of decodes on the RoPE path whose contexts are all at most LEAN_CONTEXT keys and whose batch x query heads
# fit one wave take `_lean_decode_kernel`: one program a query head, the whole context in one tile read before the
# PDL wait, no split to combine. The engine captures a graph bounded by it beside the others (model_runner). On the
# H200 (bench/results/pdl_decode_lean_h200.jsonl, batch 1, contexts 6-204) the graph step against the split kernel:
# W4A16 + lm_head 1633.3 against 1658.9 us, W8A16 + lm_head 2306.0 against 2328.8; 4 warps 1779, 16 warps 1703. The
# plain path (bf16, after a cuBLAS GEMM) keeps the split kernel: lean 4405 against 4393 us. LEAN_DECODE False: the
# split kernel everywhere (benchmarks' A/B); LEAN_WARPS: warps of a lean program (None: 8 past 128 keys, else 4).
LEAN_CONTEXT = 256
LEAN_DECODE = True
LEAN_WARPS: int | None = None
LEAN_CHUNKS = 4  # chunks of the lean kernel's tile (1, 2 or 4): those past a step's context are skipped
LEAN_FMA = True  # the warps kernel with FMA contraction (its rotation stays exact); False: the A/B's
LEAN_ASM_STORES = True  # its maxima, totals and output stored where they sit (`_store_in_place`); False: tl.store's
# Steps whose contexts exceed LEAN_MMA_ABOVE keys (up to LEAN_CONTEXT), with heads of dim 128 in 16 bits (<= 8
# query heads a kv head), take the lean kernel on tensor cores (attention_mma.py, one program a kv head); the engine
# then captures lean graphs at LEAN_MMA_GRAPH too, whose steps keep the CUDA-core kernel. On the H200 the tensor-core
# kernel wins at 205 keys (W4A16 + lm_head step 1563.3 / 1563.7 us against 1590.6 / 1590.5) and loses at short
# contexts (bench/results/pdl_decode_shared_merge_h200.jsonl, pdl_decode_mma_graphs_h200.jsonl; docs/kernels.md,
# "The lean kernel on tensor cores").
LEAN_MMA = True
LEAN_MMA_ABOVE = 128
LEAN_MMA_GRAPH = 128  # with LEAN_MMA, the engine's extra lean graphs are bounded here (the kernel computes its bound)


def _sms(device) -> int:
    return num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 132


def lean_decode_ok(batch: int, n_heads: int, head_dim: int, max_context: int, device) -> bool:
    """Whether a decode step of `batch` sequences takes the lean kernel (see LEAN_CONTEXT)."""
    return LEAN_DECODE and max_context <= LEAN_CONTEXT and head_dim <= 128 and batch * n_heads <= _sms(device)


def decode_splits(batch: int, n_kv: int, max_context: int, device, min_part: int = DECODE_MIN_PART,
                  whole: int = 2) -> tuple[int, int]:
    """(grid parts a sequence, parts that fill one wave) for the decode kernel. When batch x kv_heads programs
    already fill a wave of the GPU, no split (splitting a full batch only adds the reduction: 93% -> 88% of copy
    bandwidth at 64 x 4k on the H200). Otherwise at most one wave under a short bound (a grid's idle parts still
    cost: 8 x 16-1000 keys took 1.4-1.9x longer in a grid of 9 parts a sequence than of 2), up to ~4 programs an
    SM under a long one; never more than the bound has min_part-key parts, at most MAX_SPLITS. The kernel
    picks each sequence's own count from its length (`_decode_parts`); these bounds depend only on host-known
    sizes, so a captured graph keeps them."""
    programs = batch * n_kv
    sms = _sms(device)
    if programs >= sms or max_context <= whole * min_part:  # the kernel reads `whole` parts' worth in one
        return 1, 1
    wave = sms // programs
    most = wave if max_context <= SHORT_CONTEXT else -(-4 * sms // programs)
    return max(1, min(most, -(-max_context // min_part), MAX_SPLITS)), wave


# Full batches (not split) whose contexts are all this short take 128-key tiles: 3.95-3.97 vs 3.69 TB/s at 256
# sequences of 100-2000 keys, 3.78 vs 3.59 at 128 x 1k; at 64 x 4k they lose (3.48 vs 4.15), so longer contexts keep
# 64 (bench/results/decode_tiles_h200.jsonl). CUDA graphs capture both and replay by the batch's longest context.
SHORT_CONTEXT = 2048


def decode_tile(splits: int, block_d: int, max_context: int) -> tuple[int, int]:
    """(keys a tile, pipeline stages) of the decode kernel. Split grids (fewer sequences than a wave) and short full
    batches: 128 x 3 (H200, bench/results/decode_attention_splits_h200.jsonl: batch 1-4 at 500-8000 keys 25-45%
    faster than 64-key tiles, 9% slower at 1 x 32k); long full batches 64 x 2 (bench/results/
    decode_layout_h200.jsonl); head dim 256 32 x 2 (what fits in shared memory)."""
    if block_d >= 256:
        return 32, 2
    return (128, 3) if splits > 1 or max_context <= SHORT_CONTEXT else (64, 2)


@functools.lru_cache(maxsize=256)
def _part_tiles(bound: int, splits: int, wave: int, min_part: int, block_n: int, whole: int) -> int:
    """The most key tiles one program of the decode kernel reads for any context up to `bound` (what
    `_decode_parts` gives). Two at most: no software pipeline (one stage). Its shared memory kept the programs from
    being placed beside the kernel before them: batch-1 step at 8-204 keys, W8A16 + lm_head 15-49 us shorter
    with one stage than three, W4A16 18-40, bf16 18-52 (bench/results/engine_step_gap_settings_h200.jsonl)."""
    most = 0
    for span in range(block_n, bound + block_n, block_n):
        span = min(span, bound)
        parts = max(min(wave, -(-span // min_part)), -(-span // DECODE_LONG_PART))
        parts = 1 if span <= whole * min_part or splits == 1 else min(parts, splits)
        most = max(most, -(-span // parts))
    return -(-most // block_n)


def decode_attention_triton(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                            sliding_window=None, max_context_len=None, out=None, num_splits=None,
                            block_n=None, num_warps=None, num_stages=None, min_part=DECODE_MIN_PART, rope=None):
    """Sequences with one new token: q [N, H, D] (row cu_seqlens_q[b] is sequence b's query when it has one new
    token; other sequences are skipped), paged k/v cache, context_lens [B] int32 on the device -> out [N, H, D].
    No host synchronisation and a grid fixed by (B, kv heads, max_context_len): CUDA-graph capturable.
    num_splits: the parts a sequence may be cut into (default `decode_splits`); each sequence takes as many of
    them as its own length asks, parts of at least min_part keys. rope: (k, v, cos, sin, slot_mapping) of this step
    when q and k are not rotated yet and k/v not in the cache (every sequence one new token): the kernel does both."""
    batch = cu_seqlens_q.shape[0] - 1
    n_heads, dim = q.shape[1], q.shape[2]
    n_kv = k_cache.shape[2]
    block_size = k_cache.shape[1]
    if out is None:
        out = torch.empty_like(q)
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    block_d = next_power_of_2(dim)
    if (rope is not None and num_splits is None and block_n is None and num_warps is None
            and lean_decode_ok(batch, n_heads, dim, max_context_len, q.device)):
        return _lean_decode(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window,
                            max_context_len, out, rope)
    # With rope (and PDL's early loads) every part's first tile is read before the wait, so short contexts are cut
    # into one-tile parts of ROPE_PART keys: more programs, each with its keys in flight during the previous kernel.
    early = rope is not None and pdl_mod.EARLY_LOADS and block_d <= 128
    if early:
        min_part = block_n = block_n or ROPE_PART
    whole = 1 if early else 2
    splits, wave = (num_splits, num_splits) if num_splits else decode_splits(
        batch, n_kv, max_context_len, q.device, min_part=min_part if early else DECODE_MIN_PART, whole=whole)
    splits = min(splits, MAX_SPLITS)
    tile, stages = decode_tile(splits, block_d, max_context_len)
    block_n = block_n or tile
    min_part = max(min_part, 1)  # as the kernel gets it
    if _part_tiles(max_context_len, splits, wave, min_part, block_n, whole) <= 2:
        stages = 1
    num_stages = num_stages or stages
    num_warps = num_warps or (ROPE_TILE_WARPS if early and ROPE_TILE_WARPS else
                              SPLIT_ROPE_WARPS if early and splits > 1 else 4)
    group = n_heads // n_kv
    if splits > 1:
        partial = torch.empty(batch * n_heads * splits * block_d, dtype=torch.float32, device=q.device)
        max_sum = torch.empty(batch * n_heads * splits * 2, dtype=torch.float32, device=q.device)
        counts = arrival_counts(q.device, batch * n_kv)
    else:
        partial = max_sum = counts = out  # unused
    k, v, cos, sin, slots = rope if rope is not None else (q, q, q, q, cu_seqlens_q)
    pdl = pdl_on(q)
    if pdl == 2 and DECODE_RELEASE == "parts":
        pdl = 3
    # with rope, no FMA contraction: the rotation rounds where torch and the rotary kernel round
    _decode_kernel[(batch, n_kv, splits)](
        q, k_cache, v_cache, out, partial, max_sum, counts, cu_seqlens_q, context_lens, block_tables,
        k, v, cos, sin, slots, DECODE_TRACE, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        scale * LOG2E, sliding_window or 0, n_heads, splits, wave, min_part, DECODE_LONG_PART, BLOCK_SIZE=block_size,
        GROUP=group, HEAD_DIM=dim, BLOCK_G=max(16, next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        UNROLL=4, SPLIT=splits > 1, SLIDING=sliding_window is not None,
        PREC=_precision(q), num_warps=num_warps, num_stages=num_stages, PDL=pdl,
        EARLY=pdl_mod.EARLY_LOADS and (early or rope is None), ROPE=rope is not None, WHOLE=whole,
        enable_fp_fusion=rope is None, launch_pdl=pdl > 0, **({"maxnreg": DECODE_MAXNREG} if DECODE_MAXNREG else {}))
    return out


def _lean_decode(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window,
                 max_context_len, out, rope):
    """`decode_attention_triton` with rope through `_lean_decode_kernel` (grid: sequences x query heads)."""
    batch, (n_heads, dim), n_kv = cu_seqlens_q.shape[0] - 1, q.shape[1:], k_cache.shape[2]
    from brrr.kernels.attention_mma import lean_mma_decode, lean_mma_ok
    if (LEAN_MMA and max_context_len > LEAN_MMA_ABOVE and rope[2].dtype == q.dtype
            and lean_mma_ok(dim, q.dtype, n_heads // n_kv, k_cache.shape[1])):
        return lean_mma_decode(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window,
                               max_context_len, out, rope, DECODE_TRACE)
    block_n = max(16, next_power_of_2(max_context_len))
    k, v, cos, sin, slots = rope
    pdl = pdl_on(q)
    warps, chunks = LEAN_WARPS or (8 if block_n > 128 else 4), min(LEAN_CHUNKS, max(1, block_n // 32))
    assert block_n // chunks >= 2 * warps, "a lean chunk holds a row of keys a warp"
    scratch = torch.empty(batch * n_heads * (next_power_of_2(dim) + 2) * warps, dtype=torch.float32, device=q.device)
    fused = q.is_cuda and LEAN_FMA
    _lean_decode_kernel[(batch, n_heads)](
        q, k_cache, v_cache, out, scratch, cu_seqlens_q, context_lens, block_tables, k, v, cos, sin, slots,
        DECODE_TRACE,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        scale * LOG2E, sliding_window or 0, BLOCK_SIZE=k_cache.shape[1], GROUP=n_heads // n_kv, HEAD_DIM=dim,
        BLOCK_D=next_power_of_2(dim), BLOCK_N=block_n, CHUNKS=chunks, SLIDING=sliding_window is not None,
        W=warps, PDL=min(pdl, 2), FUSED=fused, ASM_STORES=q.is_cuda and LEAN_ASM_STORES, num_warps=warps,
        num_stages=1, enable_fp_fusion=fused, launch_pdl=pdl > 0)
    return out


def prefill_attention_triton(q, k, v, cu_seqlens_q, max_seqlen_q, scale, k_cache=None, v_cache=None,
                             context_lens=None, block_tables=None, sliding_window=None, skip_single=False,
                             out=None, config=None):
    """Varlen causal attention for the new tokens q/k/v [N, H|KVH, D] of B sequences (cu_seqlens_q [B+1]).
    With a cache (k_cache, context_lens [B] on the device, block_tables), sequence b's first
    context_lens[b] - q_len keys come from the paged cache; the new tokens' own k/v are read from k and v.
    config: {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} to skip autotuning (tests, the interpreter); else
    16-bit steps of >= AUTOTUNE_MIN_TOKENS new tokens are autotuned (per head dim, GQA group and length bucket)."""
    batch = cu_seqlens_q.shape[0] - 1
    n_heads, dim = q.shape[1], q.shape[2]
    if out is None:
        out = torch.empty_like(q)
    has_cache = k_cache is not None
    if not has_cache:
        k_cache = v_cache = k
        context_lens = block_tables = cu_seqlens_q
        cache_strides, bt_stride, block_size = (0, 0, 0), 0, 1
    else:
        cache_strides, bt_stride, block_size = k_cache.stride()[:3], block_tables.stride(0), k_cache.shape[1]
    block_d = next_power_of_2(dim)
    args = (q, k, v, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
            out.stride(1), *cache_strides, bt_stride, block_size, scale * LOG2E, sliding_window or 0,
            min(next_power_of_2(max_seqlen_q), 8192))
    meta = dict(GROUP=n_heads // k.shape[1], HEAD_DIM=dim, BLOCK_D=block_d, HAS_CACHE=has_cache,
                SKIP_SINGLE=skip_single, SLIDING=sliding_window is not None, PREC=_precision(q))
    if config is None and os.environ.get("TRITON_INTERPRET") == "1":
        config = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if config is None and (q.dtype == torch.float32 or max_seqlen_q < AUTOTUNE_MIN_TOKENS):
        config = prefill_config(dim, q.dtype)
    if config is None:
        def grid(c):
            return (triton.cdiv(max_seqlen_q, c["BLOCK_M"]), batch, n_heads)
        _prefill_kernel_tuned[grid](*args, **meta)
    else:
        assert config["BLOCK_M"] % config["BLOCK_N"] == 0, "BLOCK_N must divide BLOCK_M"
        grid = (triton.cdiv(max_seqlen_q, config["BLOCK_M"]), batch, n_heads)
        _prefill_kernel[grid](*args, **meta, **config)
    return out


def attention_triton(q, k, v, meta: AttnMeta, layer: int, scale: float, sliding_window: int | None = None,
                     rope=None, decode_rope: bool = True):
    """The Triton path of `attention`: same arguments, same result (up to fp32 summation order). rope (with a
    cache only): (cos, sin), applied by the kernel that writes the cache: the decode kernel itself when every
    sequence has one new token and decode_rope, else the rotary kernel."""
    n_tokens, n_heads, dim = q.shape
    out = torch.empty_like(q)
    if meta.kv_caches is None:
        prefill_attention_triton(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, scale,
                                 sliding_window=sliding_window, out=out)
        return out.view(n_tokens, n_heads * dim)
    k_cache, v_cache = meta.kv_caches[layer]
    context_lens = meta.device_context_lens(q.device)
    if (rope is not None and meta.max_seqlen_q == 1 and decode_rope and DECODE_ROPE
            and rope[0].stride(0) == rope[1].stride(0)):  # all decodes: rotation and cache write in one kernel
        decode_attention_triton(q, k_cache, v_cache, meta.cu_seqlens_q, context_lens, meta.block_tables, scale,
                                sliding_window, meta.context_bound(k_cache.shape[1]), out=out,
                                rope=(k, v, *rope, meta.slot_mapping))
        return out.view(n_tokens, n_heads * dim)
    if rope is not None and k.shape[0]:
        apply_rotary_triton(q, k, *rope, cache=(v, k_cache, v_cache, meta.slot_mapping))
    else:
        write_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.has_single_token_rows:
        decode_attention_triton(q, k_cache, v_cache, meta.cu_seqlens_q, context_lens, meta.block_tables, scale,
                                sliding_window, meta.context_bound(k_cache.shape[1]), out=out)
    if meta.max_seqlen_q > 1:
        prefill_attention_triton(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, scale, k_cache, v_cache,
                                 context_lens, meta.block_tables, sliding_window, skip_single=True, out=out)
    return out.view(n_tokens, n_heads * dim)


def _triton_ok(q, k, v, meta: AttnMeta) -> bool:
    dim = q.shape[-1]
    if not (q.dim() == 3 and q.shape[0] > 0 and dim <= MAX_HEAD_DIM and k.shape[-1] == dim and v.shape[-1] == dim
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32) and k.dtype == v.dtype == q.dtype
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and q.shape[1] % k.shape[1] == 0):
        return False
    if meta.kv_caches is not None:
        k_cache, v_cache = meta.kv_caches[0]
        if (k_cache.dtype != q.dtype or v_cache.stride() != k_cache.stride() or k_cache.stride(-1) != 1
                or meta.block_tables is None or meta.slot_mapping is None
                or (meta.context_lens is None and meta.context_lens_t is None)):
            return False
    return use_triton(q, k, v)


def attention(q, k, v, meta: AttnMeta, layer: int, scale: float, sliding_window: int | None = None, rope=None,
              decode_rope: bool = True):
    """q [N, H, D], k/v [N, KVH, D] for the new tokens -> [N, H * D]. rope: (cos, sin) to rotate q and k with
    first (`apply_rotary`: q and k may be rotated in place). With a cache, the new K/V are written into it first;
    on the Triton path the rotation and that write are one kernel (the decode kernel in a step of decodes, if
    decode_rope). Triton on CUDA (decodes through the split-KV kernel, prefill chunks through the varlen kernel),
    else the reference."""
    fused = (rope is not None and meta.kv_caches is not None and _triton_ok(q, k, v, meta)
             and rotary_triton_ok(q, k, *rope))
    if rope is not None and not fused:
        q, k = apply_rotary(q, k, *rope)
    if _triton_ok(q, k, v, meta):
        return attention_triton(q, k, v, meta, layer, scale, sliding_window, rope if fused else None, decode_rope)
    if meta.kv_caches is not None and meta.context_lens is None:  # device-only meta (a captured decode step)
        k_cache, v_cache = meta.kv_caches[layer]
        write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_decode_ref(q, k_cache, v_cache, meta.block_tables, meta.context_lens_t, scale, sliding_window)
    return attention_ref(q, k, v, meta, layer, scale, sliding_window)
