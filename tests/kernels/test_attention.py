"""Paged attention: the Triton KV write, split-KV decode and varlen prefill kernels against attention_ref.

Small shapes for Triton's CPU interpreter: odd lengths, GQA ratios 1/2/4 and MQA, contexts ending on and just past
block boundaries, an empty prefix, a prefix ending mid-block, a full prefix hit (one new token over a cached
prompt), sliding windows, head dims 64/128/256, and mixed decode + prefill steps through the `attention` path.
"""
import dataclasses
import math

import pytest
import torch

from brrr.kernels import dispatch
from brrr.kernels.attention import (AttnMeta, attention_ref, attention_triton, decode_attention_triton, decode_plan,
                                    paged_decode_ref, prefill_attention_triton, write_kv_ref, write_kv_triton)
from brrr.kernels.attention.plan import _part_tiles, decode_splits, lean_mma_plan
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_step(q_lens, ctx_lens, heads, kv_heads, dim, block_size, dtype, device, seed=0):
    """A step over a shuffled paged cache already holding every sequence's prefix: (q, k, v, meta)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    width = max(need)
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(2))
    n_tokens = sum(q_lens)
    q = torch.randn(n_tokens, heads, dim, generator=g).to(dtype).to(device)
    k, v = (torch.randn(n_tokens, kv_heads, dim, generator=g).to(dtype).to(device) for _ in range(2))
    slots = [t[p // block_size] * block_size + p % block_size
             for t, ql, c in zip(tables, q_lens, ctx_lens) for p in range(c - ql, c)]
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    meta = AttnMeta(cu_seqlens_q=cu.to(device), seqlens_q=list(q_lens), context_lens=list(ctx_lens),
                    slot_mapping=torch.tensor(slots, device=device),
                    block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                              device=device),
                    kv_caches=[(k_cache, v_cache)])
    return q, k, v, meta


def clone_meta(meta):
    return AttnMeta(cu_seqlens_q=meta.cu_seqlens_q, seqlens_q=meta.seqlens_q, context_lens=meta.context_lens,
                    slot_mapping=meta.slot_mapping, block_tables=meta.block_tables,
                    kv_caches=[(k.clone(), v.clone()) for k, v in meta.kv_caches])


def run_both(q, k, v, meta, scale, window=None):
    """Triton and reference over the same step, each on its own copy of the cache; the caches must agree too."""
    ref_meta = clone_meta(meta)
    want = attention_ref(q, k, v, ref_meta, 0, scale, window)
    got = attention_triton(q, k, v, meta, 0, scale, window)
    assert torch.equal(meta.kv_caches[0][0], ref_meta.kv_caches[0][0])
    assert torch.equal(meta.kv_caches[0][1], ref_meta.kv_caches[0][1])
    return got, want


def skip_interpreted_bf16(device, dtype):
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584); "
                    "bf16 attention is checked on the GPU (here when CUDA is present, and tests/gpu)")


def assert_close(got, want, dtype):
    assert got.shape == want.shape and torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_write_kv_scatters_and_skips_padding(device):
    g = torch.Generator().manual_seed(0)
    shape = (6, 4, 3, 16)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(device) for _ in range(2))
    k, v = (torch.randn(5, 3, 16, generator=g).to(device) for _ in range(2))
    slots = torch.tensor([22, 3, -1, 4, 17], device=device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    write_kv_ref(k[keep], v[keep], want_k, want_v, slots[keep])
    write_kv_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1), (8, 2)])
def test_decode_step(device, dtype, heads, kv_heads):
    """One new token per sequence; contexts of 1, a block, a block + 1 and a long odd one."""
    skip_interpreted_bf16(device, dtype)
    q, k, v, meta = make_step([1, 1, 1, 1], [1, 8, 9, 45], heads, kv_heads, 32, 8, dtype, device)
    got, want = run_both(q, k, v, meta, 32**-0.5)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_split_kv(device, splits, window):
    """The split-KV partition and its reduction: splits that are empty, partial and longer than the context."""
    q, k, v, meta = make_step([1, 1, 1], [3, 64, 37], 4, 2, 32, 16, torch.float32, device, seed=splits)
    ref = attention_ref(q, k, v, clone_meta(meta), 0, 0.2, window)
    write_kv_ref(k, v, *meta.kv_caches[0], meta.slot_mapping)
    ctx = torch.tensor(meta.context_lens, dtype=torch.int32, device=device)
    out = decode_attention_triton(q, *meta.kv_caches[0], meta.cu_seqlens_q, ctx, meta.block_tables, 0.2, window,
                                  num_splits=splits, block_n=16, min_part=1)
    assert_close(out.view(3, -1), ref, torch.float32)


def test_decode_low_context_bound_still_reads_everything(device):
    """max_context_len below the real context (a caller's mistake): the last split reads to the end anyway."""
    q, k, v, meta = make_step([1, 1], [50, 20], 4, 2, 32, 8, torch.float32, device)
    ref = attention_ref(q, k, v, clone_meta(meta), 0, 0.2)
    write_kv_ref(k, v, *meta.kv_caches[0], meta.slot_mapping)
    ctx = torch.tensor(meta.context_lens, dtype=torch.int32, device=device)
    out = decode_attention_triton(q, *meta.kv_caches[0], meta.cu_seqlens_q, ctx, meta.block_tables, 0.2,
                                  max_context_len=16, num_splits=2, block_n=16, min_part=1)
    assert_close(out.view(2, -1), ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits,window", [(1, None), (3, None), (2, None), (2, 7)])
def test_decode_with_rope_is_the_rotary_kernel_then_decode(device, dtype, splits, window):
    """A step of decodes only (GQA 4:2, a padded row with context 0 and slot -1): q and k unrotated from a packed
    projection, rotated inside the decode kernel, the new k/v written to the cache by the part holding the last
    position (split in 1-3 parts, 2 parts of 40 keys holding two tiles each, a sliding window). The cache ends bit
    for bit as the rotary kernel writes it (rotations rounded as torch rounds them), the output within rounding of
    rotary + the plain decode kernel."""
    skip_interpreted_bf16(device, dtype)
    from brrr.config import RopeConfig
    from brrr.kernels.rotary import apply_rotary_triton, rope_inv_freq, rotary_cos_sin

    heads, kv, dim = 4, 2, 32
    q0, k0, v0, meta = make_step([1, 1, 1, 1], [1, 9, 40, 1], heads, kv, dim, 8, dtype, device, seed=splits)
    qkv = torch.cat([q0.flatten(1), k0.flatten(1), v0.flatten(1)], 1)  # q, k, v as views of one projection
    q, k, v = (qkv[:, a:b].view(4, -1, dim) for a, b in ((0, heads * dim), (heads * dim, (heads + kv) * dim),
                                                         ((heads + kv) * dim, (heads + 2 * kv) * dim)))
    inv_freq, scale = rope_inv_freq(RopeConfig(), dim, 128)
    cos, sin = (t.to(device) for t in rotary_cos_sin(torch.tensor([0, 8, 39, 0]), inv_freq, scale, dtype))
    ctx = torch.tensor([1, 9, 40, 0], dtype=torch.int32, device=device)  # the last row: padding
    slots = meta.slot_mapping.clone()
    slots[3] = -1
    want_meta = clone_meta(meta)
    qr, kr = apply_rotary_triton(q.clone(), k.clone(), cos, sin, cache=(v, *want_meta.kv_caches[0], slots))
    kw = dict(num_splits=splits, block_n=16, min_part=1)
    want = decode_attention_triton(qr, *want_meta.kv_caches[0], meta.cu_seqlens_q, ctx, meta.block_tables, 0.2,
                                   window, **kw)
    before = qkv.clone()
    got = decode_attention_triton(q, *meta.kv_caches[0], meta.cu_seqlens_q, ctx, meta.block_tables, 0.2, window,
                                  rope=(k, v, cos, sin, slots), **kw)
    assert torch.equal(meta.kv_caches[0][0], want_meta.kv_caches[0][0])
    assert torch.equal(meta.kv_caches[0][1], want_meta.kv_caches[0][1])
    assert torch.equal(qkv, before)  # q and k are read, not rotated in place
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    assert_close(got, want, dtype)


def check_rope_decode(lens, heads, kv_heads, dim, block_size, dtype, device, window, bound, seed, kernel,
                      plan=None):
    """One decode step of the given contexts (the last row padded: context 0, slot -1) with q and k unrotated,
    through decode_attention_triton's rope path (`kernel`, the plan's at this bound, or `plan`): the cache ends bit
    for bit as the rotary kernel writes it, the padded row is zeros, the others within rounding of the reference
    over the rotated q."""
    from brrr.config import RopeConfig
    from brrr.kernels.rotary import apply_rotary_triton, rope_inv_freq, rotary_cos_sin

    q, k, v, meta = make_step([1] * len(lens), lens, heads, kv_heads, dim, block_size, dtype, device, seed=seed)
    inv_freq, scale = rope_inv_freq(RopeConfig(), dim, 512)
    pos = torch.tensor([n - 1 for n in lens[:-1]] + [0])
    cos, sin = (t.to(device) for t in rotary_cos_sin(pos, inv_freq, scale, dtype))
    ctx = torch.tensor(lens[:-1] + [0], dtype=torch.int32, device=device)
    slots = meta.slot_mapping.clone()
    slots[-1] = -1
    want_meta = clone_meta(meta)
    qr, _ = apply_rotary_triton(q.clone(), k.clone(), cos, sin, cache=(v, *want_meta.kv_caches[0], slots))
    want = paged_decode_ref(qr, *want_meta.kv_caches[0], meta.block_tables, ctx, 0.2, window)
    plan = plan or decode_plan(len(lens), bound, heads, kv_heads, dim, dtype, block_size, q.device)
    assert plan.kernel == kernel
    got = decode_attention_triton(q, *meta.kv_caches[0], meta.cu_seqlens_q, ctx, meta.block_tables, 0.2, window,
                                  max_context_len=bound, rope=(k, v, cos, sin, slots), plan=plan)
    assert torch.equal(meta.kv_caches[0][0], want_meta.kv_caches[0][0])
    assert torch.equal(meta.kv_caches[0][1], want_meta.kv_caches[0][1])
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))
    assert_close(got[:-1], want.view_as(got)[:-1], dtype)  # (SDPA's fused GPU kernels give NaN for the empty row)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, None), (8, 2, None), (4, 1, 7)])
@pytest.mark.parametrize("warps", [None, 4])
def test_lean_decode_with_rope(device, dtype, heads, kv_heads, window, warps):
    """The lean decode kernel (one program a query head, the whole context in one tile of 4 chunks, no tl.dot, so
    bf16 runs under the interpreter too) over contexts of 1, 65 (64 cached keys: one chunk, full), 40 (one chunk),
    129 (two, full), 200 (all four) and a padded row. In 8 warps (a warp's keys two rows a chunk) and, fp32 only, in
    4 (four rows)."""
    if warps and dtype != torch.float32:
        pytest.skip("one dtype for 4 warps")
    plan = decode_plan(6, 256, heads, kv_heads, 32, dtype, 8, torch.device(device))
    if warps:
        plan = dataclasses.replace(plan, num_warps=warps)
    check_rope_decode([1, 65, 40, 129, 200, 1], heads, kv_heads, 32, 8, dtype, device, window, 256, seed=heads,
                      kernel="lean", plan=plan)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,window", [(8, 2, None), (4, 4, None), (8, 1, 7), (6, 2, None)])
@pytest.mark.parametrize("bound", [256, 64])
def test_lean_mma_decode_with_rope(device, dtype, heads, kv_heads, window, bound):
    """The lean kernel on tensor cores (lean_mma.py: head dim 128, one program a kv head, its query heads the MMA's
    columns; on the CPU its portable partials) over contexts of 1, 65, 40, 129 and 200 keys (bound 256, the plan's
    own: 8 warps of two 16-key blocks each; bound 64, below the plan's threshold, given the plan: contexts up to 64,
    two warps) and a padded row."""
    lens = [1, 65, 40, 129, 200, 1] if bound == 256 else [1, 64, 40, 17, 33, 1]
    check_rope_decode(lens, heads, kv_heads, 128, 16, dtype, device, window, bound, seed=heads + kv_heads,
                      kernel="lean_mma", plan=None if bound == 256 else lean_mma_plan(bound))


@pytest.mark.parametrize("bound", [None, 512])
@pytest.mark.parametrize("q_lens,ctx", [([1, 1, 1], [5, 17, 33]), ([1, 4, 1], [5, 17, 33]),
                                        ([1, 1, 1, 1], [1, 64, 65, 200])])
def test_attention_with_rope_decodes_only_or_mixed(device, q_lens, ctx, bound):
    """attention_triton given (cos, sin): a step of decodes takes the decode kernel's rotation (the lean kernel at
    the step's own bound, or at a bound of 512 the split one: one-tile parts of 64 keys, each part's first tile read
    before the PDL wait), a mixed step the rotary kernel; all give the reference's output over rotated q/k and leave
    the same cache."""
    from brrr.config import RopeConfig
    from brrr.kernels.rotary import apply_rotary_ref, rope_inv_freq, rotary_cos_sin

    q, k, v, meta = make_step(q_lens, ctx, 4, 2, 32, 8, torch.float32, device)
    meta.max_context_len = bound
    inv_freq, scale = rope_inv_freq(RopeConfig(), 32, 128)
    pos = torch.cat([torch.arange(c - n, c) for n, c in zip(q_lens, ctx)])
    cos, sin = (t.to(device) for t in rotary_cos_sin(pos, inv_freq, scale, torch.float32))
    ref_meta = clone_meta(meta)
    want = attention_ref(*apply_rotary_ref(q, k, cos, sin), v, ref_meta, 0, 0.2)
    got = attention_triton(q.clone(), k.clone(), v, meta, 0, 0.2, rope=(cos, sin))
    assert torch.equal(meta.kv_caches[0][0], ref_meta.kv_caches[0][0])
    assert torch.equal(meta.kv_caches[0][1], ref_meta.kv_caches[0][1])
    assert_close(got, want, torch.float32)


def test_decode_padded_rows_and_prefill_rows(device):
    """A zero context (a padded graph row) gives zeros; a sequence with several new tokens is left alone."""
    q, k, v, meta = make_step([1, 3, 1], [10, 12, 5], 4, 2, 32, 8, torch.float32, device)
    write_kv_ref(k, v, *meta.kv_caches[0], meta.slot_mapping)
    ctx = torch.tensor([10, 12, 0], dtype=torch.int32, device=device)
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        decode_attention_triton(q, *meta.kv_caches[0], meta.cu_seqlens_q, ctx, meta.block_tables, 0.2, out=out,
                                num_splits=splits, block_n=16, min_part=1)
        assert torch.isfinite(out[0]).all()
        assert torch.isnan(out[1:4]).all()  # rows of the 3-token sequence: not the decode kernel's
        assert torch.equal(out[4], torch.zeros_like(out[4]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_prefill_head_dims(device, dtype, dim):
    """A new sequence (empty prefix) and a chunk over a prefix that ends mid-block, GQA 2."""
    skip_interpreted_bf16(device, dtype)
    q, k, v, meta = make_step([19, 6], [19, 29], 4, 2, dim, 8, dtype, device, seed=dim)
    got, want = run_both(q, k, v, meta, dim**-0.5)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("window", [None, 5, 16])
def test_mixed_step_through_attention(device, window):
    """Decodes, a full prefix hit (1 new token over a 33-token cached prompt), chunks starting on and off block
    boundaries, MQA, odd lengths; sliding windows narrower than a block and as wide as one."""
    q, k, v, meta = make_step([1, 17, 1, 5, 33, 2], [9, 17, 34, 21, 49, 2], 4, 1, 32, 8, torch.float32, device)
    got, want = run_both(q, k, v, meta, 0.25, window)
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("window", [None, 6])
def test_prefill_without_cache(device, window):
    """Cache-free varlen causal attention (training-shaped metas, profiling, one-shot scoring)."""
    lens = [1, 5, 17, 33]
    g = torch.Generator().manual_seed(4)
    n = sum(lens)
    q = torch.randn(n, 4, 64, generator=g).to(device)
    k, v = (torch.randn(n, 2, 64, generator=g).to(device) for _ in range(2))
    meta = AttnMeta.causal(lens, device)
    want = attention_ref(q, k, v, meta, 0, 0.125, window)
    got = attention_triton(q, k, v, meta, 0, 0.125, window)
    assert_close(got, want, torch.float32)


def test_prefill_tile_configs(device):
    """Tiles where BLOCK_N < BLOCK_M (several unmasked tiles before the diagonal) agree with square tiles."""
    q, k, v, meta = make_step([40, 3], [50, 3], 4, 2, 32, 8, torch.float32, device)
    write_kv_ref(k, v, *meta.kv_caches[0], meta.slot_mapping)
    ctx = torch.tensor(meta.context_lens, dtype=torch.int32, device=device)
    outs = [prefill_attention_triton(q, k, v, meta.cu_seqlens_q, 40, 0.2, *meta.kv_caches[0], ctx,
                                     meta.block_tables, config=dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=4,
                                                                    num_stages=1))
            for bm, bn in ((16, 16), (32, 16), (32, 32))]
    want = attention_ref(q, k, v, clone_meta(meta), 0, 0.2).view_as(outs[0])
    for out in outs:
        assert_close(out, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
def test_prefill_tma_tiles(device, dtype, window):
    """The new tokens' tiles through TMA descriptors (forced here; on Hopper the default): sequences whose tiles
    run past their end into the next one's rows, a prefix ending mid-block, BLOCK_N < BLOCK_M, with and without a
    cache, equal to the reference. q, k and v are column slices of one fused qkv tensor, as a model passes them."""
    skip_interpreted_bf16(device, dtype)
    lens, prefixes, heads, kv_heads, dim = [40, 3, 21], [10, 0, 7], 4, 2, 32
    q0, k0, v0, meta = make_step(lens, [n + p for n, p in zip(lens, prefixes)], heads, kv_heads, dim, 8, dtype,
                                 device, seed=11)
    qkv = torch.cat([t.flatten(1) for t in (q0, k0, v0)], dim=1)
    q, k, v = (x.unflatten(1, (-1, dim)) for x in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1))
    write_kv_ref(k, v, *meta.kv_caches[0], meta.slot_mapping)
    ctx = torch.tensor(meta.context_lens, dtype=torch.int32, device=device)
    cfg = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    got = prefill_attention_triton(q, k, v, meta.cu_seqlens_q, max(lens), 0.2, *meta.kv_caches[0], ctx,
                                   meta.block_tables, window, config=cfg, tma=True)
    want = attention_ref(q, k, v, clone_meta(meta), 0, 0.2, window).view_as(got)
    assert_close(got, want, dtype)
    causal = AttnMeta.causal(lens, device)
    got = prefill_attention_triton(q, k, v, causal.cu_seqlens_q, max(lens), 0.2, sliding_window=window, config=cfg,
                                   tma=True)
    assert_close(got, attention_ref(q, k, v, causal, 0, 0.2, window).view_as(got), dtype)


def test_decode_splits_heuristic():
    """A batch that fills a wave of the GPU is not split; fewer sequences x kv heads are, to one wave under a short
    bound and ~4 programs per SM under a long one, at most 64 parts, never more than the bound has
    DECODE_MIN_PART-key parts; the wave is what fits once."""
    dev = torch.device("cpu")  # 132 SMs assumed off a GPU
    assert decode_splits(64, 8, 4096, dev) == (1, 1)
    assert decode_splits(17, 8, 4096, dev) == (1, 1)
    assert decode_splits(16, 8, 8192, dev) == (math.ceil(4 * 132 / 128), 1)
    assert decode_splits(16, 8, 2048, dev) == (1, 1)
    assert decode_splits(8, 8, 2048, dev) == (2, 2)
    assert decode_splits(1, 8, 32768, dev) == (64, 16)
    assert decode_splits(1, 8, 2048, dev) == (16, 16)
    assert decode_splits(1, 8, 256, dev) == (1, 1)
    assert decode_splits(1, 1, 10**6, dev) == (64, 132)


def test_decode_part_tiles():
    """The most key tiles a decode program reads over contexts up to the bound, which picks one pipeline stage
    (<= 2): one-tile RoPE parts and the plain kernel's whole first 256 keys stay within two, a long batch-1 bound
    reaches 512-key parts, an unsplit full batch reads the whole bound."""
    assert _part_tiles(208, 4, 16, 64, 64, 1) == 1  # RoPE path, the benchmark's bound: 4 parts of <= 64 keys
    assert _part_tiles(2048, 16, 16, 64, 64, 1) == 2  # past 16 x 64 keys a part holds two tiles
    assert _part_tiles(208, 2, 16, 128, 128, 2) == 2  # plain path: <= 256 keys in one program
    assert _part_tiles(2048, 16, 16, 128, 128, 2) == 2
    assert _part_tiles(8192, 64, 16, 128, 128, 2) == 4  # 16 parts of 512 keys
    assert _part_tiles(32768, 64, 16, 128, 128, 2) == 4  # 64 parts of 512
    assert _part_tiles(65536, 64, 16, 128, 128, 2) == 8  # capped at 64 parts: 1024 keys each
    assert _part_tiles(4096, 1, 1, 128, 64, 2) == 64  # a full batch is not split


@pytest.mark.parametrize("block_n", [16, 32])
def test_decode_parts_from_each_context(device, block_n):
    """One graph-sized launch (a bound of 64 parts) over sequences of 1 to 300 keys, each cut by its own length:
    one part (written directly), several (combined by the last to arrive), the bound's last part, and every
    arrival count left at zero for the next launch."""
    lens = [1, 17, 40, 64, 65, 200, 300]
    q, k, v, meta = make_step([1] * len(lens), lens, 4, 2, 32, 16, torch.float32, device, seed=3)
    ref = attention_ref(q, k, v, clone_meta(meta), 0, 0.2)
    write_kv_ref(k, v, *meta.kv_caches[0], meta.slot_mapping)
    ctx = torch.tensor(meta.context_lens, dtype=torch.int32, device=device)
    for min_part in (16, 48, 1000):
        out = decode_attention_triton(q, *meta.kv_caches[0], meta.cu_seqlens_q, ctx, meta.block_tables, 0.2,
                                      num_splits=64, block_n=block_n, min_part=min_part)
        assert_close(out.view(len(lens), -1), ref, torch.float32)
    assert int(dispatch._ARRIVALS[ctx.device].sum()) == 0

