"""Varlen causal attention for prefill chunks: the new tokens of each sequence against its cached prefix (through
the block table) and themselves. Tiles are `plan.prefill_plan`'s, or autotuned over `plan.PREFILL_TILES`.

On Hopper and later the new tokens' q, k and v tiles come through TMA descriptors (`tma_ok`): the copy engine
fetches a whole [rows, head dim] tile, with no per-element address arithmetic or masks in registers, which left
the tensor cores more of each step (a probe of this loop on the H200, hd128 causal, (128, 128) tiles: 451 vs 389
TFLOP/s at 4 x 4k, 500 vs 449 at 1 x 16k; cuDNN 547 and 579). A tile may run past its sequence into the next
one's rows (the descriptor bounds only the tensor): the causal mask and the masked store cover those rows. The
cached prefix is read through the block table as before.
"""
from __future__ import annotations

import logging

import torch

from brrr.kernels.attention.helpers import LOG2E, precision
from brrr.kernels.attention.plan import PREFILL_TILES, prefill_plan, prefill_tile_bucket
from brrr.kernels.dispatch import next_power_of_2

try:
    import triton
    import triton.language as tl
except Exception:
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # no triton, or one older than 3.4
    TensorDescriptor = None

log = logging.getLogger(__name__)

if triton is not None:
    from brrr.kernels.attention.helpers import _online_softmax_step, _paged_rows

    @triton.jit
    def _prefill_kernel(Q, K, V, KC, VC, KS, VS, O, CU_Q, CTX, BT,
                        stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
                        stride_cb, stride_ct, stride_ch, stride_bt, block_size, qk_scale, window, max_q_bucket,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CACHE: tl.constexpr,
                        SKIP_SINGLE: tl.constexpr, SLIDING: tl.constexpr, PREC: tl.constexpr,
                        KV_FP8: tl.constexpr = False, TMA: tl.constexpr = False):
        """One program: BLOCK_M new tokens of one sequence, one query head. Keys come in two parts: the cached
        prefix (HAS_CACHE: ctx - q_len tokens through the block table, all visible) and the new tokens themselves
        (contiguous k/v, causal: tiles left of the diagonal unmasked, the diagonal tiles masked). KV_FP8: the cache
        is float8 with scales KS, VS: each cached tile is cast to q's dtype in registers, the new tokens' k/v come as
        their fp8 values already cast (unscaled), KS scales every score and VS the output. TMA: Q, K and V are tensor
        descriptors over [tokens, heads x HEAD_DIM] (HEAD_DIM == BLOCK_D), not pointers."""
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
        if TMA:
            q = Q.load([q_start + m_blk * BLOCK_M, h * HEAD_DIM])
        else:
            q = tl.load(Q + q_rows[:, None] * stride_qn + h * stride_qh + d[None, :],
                        mask=(offs_m < q_len)[:, None] & dm[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        first_q = m_blk * BLOCK_M  # index (within the new tokens) of this block's first query
        if KV_FP8:  # every key and value is the cache's fp8 value, cast exactly: K's scale joins the score scale
            qk_scale = qk_scale * tl.load(KS)
        if HAS_CACHE:
            lo = 0
            if SLIDING:
                lo = tl.maximum(0, (prefix + first_q - window + 1) // BLOCK_N * BLOCK_N)
            for start in range(lo, prefix, BLOCK_N):
                n = start + tl.arange(0, BLOCK_N)
                nm = n < prefix
                rows = _paged_rows(BT, b, stride_bt, n, nm, kvh, block_size, stride_cb, stride_ct, stride_ch)
                kt = tl.load(KC + rows[None, :] + d[:, None], mask=nm[None, :] & dm[:, None], other=0.0)
                s = tl.dot(q, kt.to(q.dtype), input_precision=PREC) * qk_scale
                visible = nm[None, :]
                if SLIDING:
                    visible = visible & (n[None, :] > (prefix + offs_m)[:, None] - window)
                s = tl.where(visible, s, float("-inf"))
                v = tl.load(VC + rows[:, None] + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
                m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v.to(q.dtype), PREC)
        lo = 0
        if SLIDING:
            lo = tl.maximum(0, (first_q - window + 1) // BLOCK_N * BLOCK_N)
        if not TMA:
            k_base = K + kvh * stride_kh
            v_base = V + kvh * stride_vh
        for start in range(lo, first_q, BLOCK_N):  # fully visible tiles (BLOCK_N divides BLOCK_M)
            n = start + tl.arange(0, BLOCK_N)
            if TMA:
                kt = K.load([q_start + start, kvh * HEAD_DIM]).T
            else:
                k_rows = (q_start + n).to(tl.int64)
                kt = tl.load(k_base + k_rows[None, :] * stride_kn + d[:, None], mask=dm[:, None], other=0.0)
            s = tl.dot(q, kt, input_precision=PREC) * qk_scale
            if SLIDING:
                s = tl.where(n[None, :] > offs_m[:, None] - window, s, float("-inf"))
            if TMA:
                v = V.load([q_start + start, kvh * HEAD_DIM])
            else:
                v = tl.load(v_base + k_rows[:, None] * stride_vn + d[None, :], mask=dm[None, :], other=0.0)
            m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, PREC)
        hi = tl.minimum(q_len, first_q + BLOCK_M)
        for start in range(first_q, hi, BLOCK_N):  # the diagonal: causal mask
            n = start + tl.arange(0, BLOCK_N)
            nm = n < q_len
            if TMA:  # rows past q_len: the next sequence's (or zeros), masked below
                kt = K.load([q_start + start, kvh * HEAD_DIM]).T
            else:
                k_rows = (q_start + n).to(tl.int64)
                kt = tl.load(k_base + k_rows[None, :] * stride_kn + d[:, None], mask=nm[None, :] & dm[:, None],
                             other=0.0)
            s = tl.dot(q, kt, input_precision=PREC) * qk_scale
            visible = nm[None, :] & (n[None, :] <= offs_m[:, None])
            if SLIDING:
                visible = visible & (n[None, :] > offs_m[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            if TMA:
                v = V.load([q_start + start, kvh * HEAD_DIM])
            else:
                v = tl.load(v_base + k_rows[:, None] * stride_vn + d[None, :], mask=nm[:, None] & dm[None, :],
                            other=0.0)
            m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, PREC)
        if KV_FP8:  # and V's the output
            acc = acc * tl.load(VS)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # (rows past q_len under a sliding window)
        tl.store(O + q_rows[:, None] * stride_on + h * stride_oh + d[None, :], out.to(O.dtype.element_ty),
                 mask=(offs_m < q_len)[:, None] & dm[None, :])
    def _prune_prefill(configs, named_args, **kwargs):
        block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
        allowed = set(PREFILL_TILES[prefill_tile_bucket(block_d)])
        return [c for c in configs
                if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in allowed]

    def _tile_descriptors(nargs):
        """Before each launch of a tile config: the descriptors' block shapes follow its BLOCK_M and BLOCK_N."""
        if nargs.get("TMA"):
            _set_blocks(nargs["Q"], nargs["K"], nargs["V"], nargs["BLOCK_M"], nargs["BLOCK_N"])

    _prefill_kernel_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st, pre_hook=_tile_descriptors)
                 for tiles in PREFILL_TILES.values() for bm, bn, w, st in dict.fromkeys(tiles)],
        key=["BLOCK_D", "GROUP", "HAS_CACHE", "SLIDING", "KV_FP8", "TMA", "max_q_bucket"],
        prune_configs_by={"early_config_prune": _prune_prefill})(_prefill_kernel)


def _set_blocks(q_desc, k_desc, v_desc, block_m: int, block_n: int) -> None:
    dim = q_desc.block_shape[1]
    q_desc.block_shape = [block_m, dim]
    k_desc.block_shape = v_desc.block_shape = [block_n, dim]


def tma_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the new tokens' tiles can come through TMA descriptors: Hopper or later, 16-bit, a power-of-two
    head dim (the tile is the head), each tensor's heads packed in a row whose stride and base are 16-byte aligned
    (what a descriptor needs; q, k and v may be column slices of one fused qkv output)."""
    if TensorDescriptor is None or _tma_failed or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    dim = q.shape[-1]
    if dim != next_power_of_2(dim) or not 16 <= dim <= 256 or torch.cuda.get_device_capability(q.device)[0] < 9:
        return False
    return all(t.dtype == q.dtype and t.stride(2) == 1 and t.stride(1) == dim and t.stride(0) * 2 % 16 == 0
               and t.data_ptr() % 16 == 0 for t in (q, k, v))


def _descriptor(t: torch.Tensor) -> "TensorDescriptor":
    """[tokens, heads, D] -> a descriptor over [tokens, heads x D]; block shape set per tile config."""
    n, heads, dim = t.shape
    return TensorDescriptor(t, [n, heads * dim], [t.stride(0), 1], [16, dim])


_tma_failed = False  # set once a TMA launch has failed to compile here: later calls take the pointer loads


def tuned_prefill_config():
    """The config the prefill autotuner chose (None before a tuned launch, and without Triton)."""
    return None if triton is None else getattr(_prefill_kernel_tuned, "best_config", None)


def prefill_attention_triton(q, k, v, cu_seqlens_q, max_seqlen_q, scale, k_cache=None, v_cache=None,
                             context_lens=None, block_tables=None, sliding_window=None, skip_single=False,
                             out=None, config=None, kv_scales=None, tma=None):
    """Varlen causal attention for the new tokens q/k/v [N, H|KVH, D] of B sequences (cu_seqlens_q [B+1]).
    With a cache (k_cache, context_lens [B] on the device, block_tables), sequence b's first
    context_lens[b] - q_len keys come from the paged cache; the new tokens' own k/v are read from k and v.
    config: {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} instead of `plan.prefill_plan`'s tile (tests).
    kv_scales: (k_scale, v_scale) fp32 [1] of an fp8 cache: k and v are then the new tokens' fp8 values as q's dtype,
    unscaled (`kv_quant.quantize(x, scale, fp8).to(q.dtype)`, exact), as the cache holds them. tma: the new tokens'
    tiles through TMA descriptors (None: where `tma_ok`; True: tests, under Triton's interpreter too)."""
    global _tma_failed
    if tma is None:
        tma = tma_ok(q, k, v)
    if tma:
        try:
            return _prefill(q, k, v, cu_seqlens_q, max_seqlen_q, scale, k_cache, v_cache, context_lens,
                            block_tables, sliding_window, skip_single, out, config, kv_scales, True)
        except Exception as e:  # a Triton that cannot lower descriptors here: warn once, then the pointer loads
            if not q.is_cuda:
                raise
            _tma_failed = True
            log.warning("prefill attention: TMA tiles failed (%s: %s); using pointer loads", type(e).__name__,
                        str(e)[:300])
    return _prefill(q, k, v, cu_seqlens_q, max_seqlen_q, scale, k_cache, v_cache, context_lens, block_tables,
                    sliding_window, skip_single, out, config, kv_scales, False)


def _prefill(q, k, v, cu_seqlens_q, max_seqlen_q, scale, k_cache, v_cache, context_lens, block_tables,
             sliding_window, skip_single, out, config, kv_scales, tma: bool):
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
    ks, vs = kv_scales if kv_scales is not None else (q, q)
    q_arg, k_arg, v_arg = (_descriptor(q), _descriptor(k), _descriptor(v)) if tma else (q, k, v)
    args = (q_arg, k_arg, v_arg, k_cache, v_cache, ks, vs, out, cu_seqlens_q, context_lens, block_tables,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
            out.stride(1), *cache_strides, bt_stride, block_size, scale * LOG2E, sliding_window or 0,
            min(next_power_of_2(max_seqlen_q), 8192))
    meta = dict(GROUP=n_heads // k.shape[1], HEAD_DIM=dim, BLOCK_D=block_d, HAS_CACHE=has_cache,
                SKIP_SINGLE=skip_single, SLIDING=sliding_window is not None, PREC=precision(q),
                KV_FP8=kv_scales is not None, TMA=tma)
    if config is None:
        config = prefill_plan(dim, q.dtype, max_seqlen_q)
    if config is None:
        def grid(c):
            return (triton.cdiv(max_seqlen_q, c["BLOCK_M"]), batch, n_heads)
        _prefill_kernel_tuned[grid](*args, **meta)
    else:
        assert config["BLOCK_M"] % config["BLOCK_N"] == 0, "BLOCK_N must divide BLOCK_M"
        grid = (triton.cdiv(max_seqlen_q, config["BLOCK_M"]), batch, n_heads)
        if tma:
            _set_blocks(q_arg, k_arg, v_arg, config["BLOCK_M"], config["BLOCK_N"])
        _prefill_kernel[grid](*args, **meta, **config)
    return out
