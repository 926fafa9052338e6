"""LoRA expand: y[row, slice] += t[row, slice's rank] @ B[slot(row), slice].T, in place.

B: [slots, out_total, rank]: for a packed projection the B matrices of its slices one after another along `out`
(slice j's rows start at offsets[j]), each [out_j, rank], the adapter's scaling folded in. t: the shrink's fp32
output, slice j's part at columns [j * rank, (j + 1) * rank). Each slice has its own B and its own part of t, so a
packed q/k/v projection gets exactly the three separate updates. Rows without an adapter are left as they are.
One program: a block of one slot's rows (rows.py) by a block of one slice's output columns; no two programs write
the same element."""
from __future__ import annotations

import torch

from brrr.kernels.dispatch import use_triton
from brrr.kernels.lora.rows import BLOCK_M, LoraRows, ieee_dot


def lora_expand_ref(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, rows: LoraRows,
                    offsets: tuple[int, ...]) -> torch.Tensor:
    rank = b.shape[2]
    for slot in rows.slots.unique().tolist():
        if slot < 0:
            continue
        mine = rows.slots == slot
        for j, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
            delta = t[mine, j * rank:(j + 1) * rank] @ b[slot, lo:hi].float().T
            y[mine, lo:hi] = (y[mine, lo:hi].float() + delta).to(y.dtype)
    return y


try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:
    @triton.jit(do_not_specialize=["n_blocks"])
    def _expand_kernel(T, B, Y, ORDER, BLOCK_SLOT, BLOCK_START, BLOCK_COUNT, OFFSETS, n_blocks, stride_tm, stride_bs,
                       stride_bn, stride_ym, RANK: tl.constexpr, BLOCK_RANK: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        pid, part = tl.program_id(0), tl.program_id(1)
        block, pid_n = pid // n_blocks, pid % n_blocks
        count = tl.load(BLOCK_COUNT + block)
        if count == 0:  # an unused block of rows
            return
        slot = tl.load(BLOCK_SLOT + block)
        lo = tl.load(OFFSETS + part)
        size = tl.load(OFFSETS + part + 1) - lo
        if pid_n * BLOCK_N >= size:
            return
        m = tl.arange(0, BLOCK_M)
        m_mask = m < count
        rows = tl.load(ORDER + tl.load(BLOCK_START + block) + m, mask=m_mask, other=0).to(tl.int64)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < size
        delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, RANK, BLOCK_RANK):  # a large rank in chunks: the tiles stay small
            r = r0 + tl.arange(0, BLOCK_RANK)
            t = tl.load(T + rows[:, None] * stride_tm + part * RANK + r[None, :], mask=m_mask[:, None], other=0.0)
            b = tl.load(B + slot.to(tl.int64) * stride_bs + (lo + n)[:, None] * stride_bn + r[None, :],
                        mask=n_mask[:, None], other=0.0)  # [BLOCK_N, BLOCK_RANK], as B is laid out (rank contiguous)
            if IEEE:
                delta += tl.dot(t, tl.trans(b.to(tl.float32)), input_precision="ieee")
            else:
                delta += tl.dot(t, tl.trans(b.to(tl.float32)))
        y_ptrs = Y + rows[:, None] * stride_ym + lo + n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(Y.dtype.element_ty), mask=mask)


def lora_expand_triton(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, rows: LoraRows,
                       offsets: tuple[int, ...], offsets_t: torch.Tensor) -> torch.Tensor:
    assert y.stride(1) == 1 and b.stride(2) == 1
    block_n = 128
    widest = max(hi - lo for lo, hi in zip(offsets[:-1], offsets[1:]))
    n_blocks = triton.cdiv(widest, block_n)
    grid = (rows.num_blocks * n_blocks, len(offsets) - 1)
    _expand_kernel[grid](t, b, y, rows.order, rows.block_slot, rows.block_start, rows.block_count, offsets_t,
                         n_blocks, t.stride(0), b.stride(0), b.stride(1), y.stride(0), RANK=b.shape[2],
                         BLOCK_RANK=min(b.shape[2], 64),
                         BLOCK_M=BLOCK_M, BLOCK_N=block_n,
                         IEEE=ieee_dot(y), num_warps=4)
    return y


def lora_expand(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, rows: LoraRows, offsets: tuple[int, ...],
                offsets_t: torch.Tensor) -> torch.Tensor:
    """offsets: the slices' bounds along `out` (len slices + 1), on the host; offsets_t: the same, int32 on y's
    device (the kernel reads them; a captured graph keeps their address)."""
    if triton is not None and use_triton(y, t, b):
        return lora_expand_triton(y, t, b, rows, offsets, offsets_t)
    return lora_expand_ref(y, t, b, rows, offsets)
