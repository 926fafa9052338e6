"""The grouped LoRA shrink/expand kernels against their plain-torch references, and the pair against the dense
per-row formula y + (x @ A[slot].T) @ B[slot].T: mixed slots, base-only rows, a packed projection's slices (each
with its own B and its own part of the rank), row counts that are not a multiple of the block."""
import pytest
import torch

from brrr.kernels.lora import lora_apply, lora_rows
from brrr.kernels.lora.expand import lora_expand_ref, lora_expand_triton
from brrr.kernels.lora.shrink import lora_shrink_ref, lora_shrink_triton


def _case(device, dtype, n, k, outs, slots=4, rank=16, seed=0):  # rank: the slots' (a power of two >= 16)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g).to(dtype).to(device)
    a = (torch.randn(slots, len(outs) * rank, k, generator=g) / k**0.5).to(dtype).to(device)
    b = torch.randn(slots, sum(outs), rank, generator=g).to(dtype).to(device)
    y = torch.randn(n, sum(outs), generator=g).to(dtype).to(device)
    row_slots = torch.randint(-1, slots, (n,), generator=g, dtype=torch.int32).to(device)
    offsets = tuple(int(v) for v in torch.tensor([0, *outs]).cumsum(0))
    return x, a, b, y, row_slots, offsets


def _dense(x, a, b, y, row_slots, offsets, rank):
    """Row by row, slice by slice: the formula the kernels implement."""
    out = y.float().clone()
    for i, s in enumerate(row_slots.tolist()):
        if s < 0:
            continue
        for j, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
            t = x[i].float() @ a[s, j * rank:(j + 1) * rank].float().T
            out[i, lo:hi] += t @ b[s, lo:hi].float().T
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,outs,rank", [(5, 64, (64,), 16), (37, 96, (64, 32, 32), 16), (20, 128, (40, 40), 16),
                                           (150, 64, (32, 16), 16), (9, 64, (48, 16, 16), 128)])
def test_shrink_expand_match_reference(device, dtype, n, k, outs, rank):
    x, a, b, y, row_slots, offsets = _case(device, dtype, n, k, outs, rank=rank)
    rows = lora_rows(row_slots, a.shape[0])
    t_ref = lora_shrink_ref(x, a, rows)
    t = lora_shrink_triton(x, a, rows)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(t, t_ref, atol=tol, rtol=tol)
    assert (t[row_slots < 0] == 0).all()
    offsets_t = torch.tensor(offsets, dtype=torch.int32, device=device)
    got = lora_expand_triton(y.clone(), t_ref, b, rows, offsets, offsets_t)
    want = lora_expand_ref(y.clone(), t_ref, b, rows, offsets)
    torch.testing.assert_close(got.float(), want.float(), atol=tol * 10, rtol=tol)
    assert torch.equal(got[row_slots < 0], y[row_slots < 0])  # base-only rows untouched
    dense = _dense(x, a, b, y, row_slots, offsets, rank)
    torch.testing.assert_close(lora_apply(y.clone(), x, a, b, rows, offsets, offsets_t).float(), dense,
                               atol=tol * 20, rtol=tol * 2)


def test_rows_grouping(device):
    slots = torch.tensor([2, -1, 0, 2, 2, -1, 1], dtype=torch.int32, device=device)
    rows = lora_rows(slots, 4)
    assert rows.counts.tolist() == [1, 1, 3, 0]
    assert rows.starts.tolist() == [2, 3, 4, 7]
    order = rows.order.tolist()
    assert sorted(order[:2]) == [1, 5] and order[2:] == [2, 6, 0, 3, 4]
    assert rows.num_blocks == 1 + 4  # cdiv(7, 16) + slots
    used = rows.block_count > 0
    assert rows.block_slot[used].tolist() == [0, 1, 2] and rows.block_start[used].tolist() == [2, 3, 4]
    assert rows.block_count[used].tolist() == [1, 1, 3] and rows.block_count.sum() == 5


def test_rows_in_blocks_of_16(device):
    """40 rows of slot 1 and 3 of slot 0: blocks of at most 16 rows, each inside one slot, covering every row."""
    slots = torch.tensor([1] * 20 + [0, -1, 0] + [1] * 20 + [0], dtype=torch.int32, device=device)
    rows = lora_rows(slots, 3)
    used = rows.block_count > 0
    assert rows.block_slot[used].tolist() == [0, 1, 1, 1]
    assert rows.block_count[used].tolist() == [3, 16, 16, 8]
    assert rows.block_start[used].tolist() == [1, 4, 20, 36]
    assert rows.num_blocks == 3 + 3
