"""The new tokens' K/V scattered into the paged cache by slot (the Triton form of `reference.write_kv_ref`)."""
from __future__ import annotations

from brrr.kernels.dispatch import next_power_of_2
from brrr.kernels.pdl import pdl_on

try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:
    from brrr.kernels.pdl import wait_previous

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
