"""LoRA shrink: t[row] = x[row] @ A[slot(row)].T, the rank-sized projection of every row that has an adapter.

A: [slots, R_total, in], the A matrices of one serving module's slices stacked along the rank (a packed q/k/v
projection has three, each padded to the slot rank). t is fp32 [N, R_total]; rows without an adapter stay zero.
The Triton kernel takes a block of one slot's rows per program (rows.py), and splits `in` across programs so a
decode step, which has few rows per adapter, still spreads the read of A over the whole GPU; the partial sums meet
in t by atomic adds."""
from __future__ import annotations

import torch

from brrr.kernels.dispatch import next_power_of_2, use_triton
from brrr.kernels.lora.rows import BLOCK_M, LoraRows, ieee_dot


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, rows: LoraRows, out: torch.Tensor | None = None) -> torch.Tensor:
    t = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device) if out is None else out
    for slot in rows.slots.unique().tolist():
        if slot >= 0:
            mine = rows.slots == slot
            t[mine] = x[mine].float() @ a[slot].float().T
    return t


try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:
    @triton.jit(do_not_specialize=["k_size", "r_total"])
    def _shrink_kernel(X, A, T, ORDER, BLOCK_SLOT, BLOCK_START, BLOCK_COUNT, k_size, r_total, stride_xm, stride_as,
                       stride_ar, stride_tm, K_PER_PROGRAM: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        block, pid_k, pid_r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        count = tl.load(BLOCK_COUNT + block)
        if count == 0:  # an unused block: the grid is sized for the most blocks a step can have
            return
        slot = tl.load(BLOCK_SLOT + block)
        m = tl.arange(0, BLOCK_M)
        m_mask = m < count
        rows = tl.load(ORDER + tl.load(BLOCK_START + block) + m, mask=m_mask, other=0).to(tl.int64)
        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        r_mask = r < r_total
        a_base = A + slot.to(tl.int64) * stride_as
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K_PER_PROGRAM, BLOCK_K):
            k = pid_k * K_PER_PROGRAM + k0 + tl.arange(0, BLOCK_K)
            k_mask = k < k_size
            x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            a = tl.load(a_base + r[:, None] * stride_ar + k[None, :], mask=r_mask[:, None] & k_mask[None, :],
                        other=0.0)  # [BLOCK_R, BLOCK_K], as A is laid out (K contiguous)
            if IEEE:
                acc += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(a))
        tl.atomic_add(T + rows[:, None] * stride_tm + r[None, :], acc, mask=m_mask[:, None] & r_mask[None, :])


def shrink_plan(num_rows: int, k_size: int, num_slots: int) -> tuple[int, int]:
    """(BLOCK_K, K per program). Decode steps have a few rows per adapter: split `in` so that the programs of all
    active slots cover the GPU; long prefills have many row blocks already."""
    block_k = 64
    k_per_program = 256 if num_rows <= 64 * num_slots else 1024
    return block_k, max(block_k, min(k_per_program, next_power_of_2(k_size)))


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, rows: LoraRows, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
    n, k_size = x.shape
    assert x.stride(1) == 1 and a.stride(2) == 1
    t = torch.zeros(n, a.shape[1], dtype=torch.float32, device=x.device) if out is None else out
    assert t.stride(1) == 1 and t.dtype == torch.float32
    block_k, k_per_program = shrink_plan(n, k_size, rows.num_slots)
    block_r = min(64, max(16, next_power_of_2(a.shape[1])))  # a large rank takes several programs, not one big tile
    grid = (rows.num_blocks, triton.cdiv(k_size, k_per_program), triton.cdiv(a.shape[1], block_r))
    _shrink_kernel[grid](x, a, t, rows.order, rows.block_slot, rows.block_start, rows.block_count, k_size,
                         a.shape[1], x.stride(0), a.stride(0), a.stride(1), t.stride(0),
                         K_PER_PROGRAM=k_per_program, BLOCK_M=BLOCK_M,
                         BLOCK_R=block_r, BLOCK_K=block_k, IEEE=ieee_dot(x),
                         num_warps=4)
    return t


def lora_shrink(x: torch.Tensor, a: torch.Tensor, rows: LoraRows, out: torch.Tensor | None = None) -> torch.Tensor:
    """out: a zeroed fp32 [N, R_total] (a column block of one buffer a step zeroes once for every module: one
    memset a step instead of one a module), else a new one."""
    if triton is not None and use_triton(x, a):
        return lora_shrink_triton(x, a, rows, out)
    return lora_shrink_ref(x, a, rows, out)
