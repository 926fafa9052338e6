"""GPTQ's column sweep: the Triton kernel against the torch loop it replaces, on one block of columns. Both do the
same fp32 operations in the same order (correctly rounded divisions, no fused multiply-adds), so the codes, the
scaled errors and (lazy groups) the scales and zeros must be equal, not close. Rows not a multiple of the kernel's
16, a block narrower than 128 columns, static groups (act-order: any column order) and lazy ones, asymmetric and
symmetric."""
import pytest
import torch

from brrr.kernels.quant import gptq_block as gb


def _block(rows, cols, group, lazy, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    a = torch.randn(cols, cols, generator=g) / cols ** 0.5 + torch.eye(cols)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(a @ a.T + 0.1 * torch.eye(cols))),
                                 upper=True)
    groups = 4
    if lazy:
        group_of = (torch.arange(cols) // group).int()
        scale, zero = torch.zeros(rows, groups), torch.zeros(rows, groups)
    else:  # act-order: each column's group from a permutation of the layer's columns
        group_of = torch.randint(0, groups, (cols,), generator=g).int()
        scale = torch.rand(rows, groups, generator=g) * 0.2 + 0.05
        zero = torch.randint(0, 16, (rows, groups), generator=g).float()
    return w, hinv, scale, zero, group_of


@pytest.mark.parametrize("rows,cols,group,lazy,symmetric", [
    (40, 128, 32, True, False), (33, 64, 64, True, True), (16, 96, 32, False, False), (50, 128, 128, False, False),
    (20, 128, 128, True, False)])
def test_gptq_block_kernel_matches_the_loop(device, rows, cols, group, lazy, symmetric):
    w, hinv, scale, zero, group_of = (t.to(device) for t in _block(rows, cols, group, lazy, seed=rows))
    want_s, want_z = scale.clone(), zero.clone()  # the loop on the same device: torch rounds `x / 15` per device
    want_q, want_e = gb.gptq_block_ref(w.clone(), hinv, want_s, want_z, group_of, group, lazy, symmetric)
    s, z = scale.clone(), zero.clone()
    q, e = gb.gptq_block_triton(w, hinv, s, z, group_of, group, lazy, symmetric)
    assert torch.equal(q, want_q) and torch.equal(e, want_e)
    assert torch.equal(s, want_s) and torch.equal(z, want_z)
    assert 0 <= want_q.min() and want_q.max() <= 15 and len(want_q.unique()) > 8  # a real spread of codes
