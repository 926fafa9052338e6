"""The batch-invariant matmul: a row's output is the same bits for any number of rows around it, whatever its place
among them; the torch form on CPU, the Triton form on the GPU or under Triton's interpreter."""
import pytest
import torch
import torch.nn.functional as F

from brrr.kernels.invariant_matmul import ROWS, linear_invariant, mm_invariant_ref, mm_invariant_triton


def _rows_are_invariant(mm, x, w):
    """Every row of x computed alone equals it computed inside slices of several sizes and offsets."""
    alone = torch.cat([mm(x[i:i + 1], w) for i in range(x.shape[0])])
    for start, count in ((0, 2), (1, 3), (3, 7), (0, ROWS), (2, ROWS + 3), (0, x.shape[0])):
        assert torch.equal(mm(x[start:start + count], w), alone[start:start + count]), (start, count)
    return alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, n", [(64, 320), (1024, 96)])
def test_the_torch_form_is_row_invariant_and_is_the_product(dtype, k, n):
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(40, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    alone = _rows_are_invariant(mm_invariant_ref, x, w.t())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(alone.float(), F.linear(x, w).float(), atol=tol * k ** 0.5, rtol=tol)


def test_linear_adds_the_bias_and_has_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g, requires_grad=True)
    w, b = torch.randn(32, 64, generator=g, requires_grad=True), torch.randn(32, generator=g, requires_grad=True)
    out = linear_invariant(x, w, b)
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    out.square().sum().backward()
    gx, gw, gb = x.grad, w.grad, b.grad
    x.grad = w.grad = b.grad = None
    F.linear(x, w, b).square().sum().backward()
    for got, want in ((gx, x.grad), (gw, w.grad), (gb, b.grad)):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


def test_the_triton_form_is_row_invariant_and_matches_the_torch_form(device):
    """On the GPU the kernel's own sums; under Triton's interpreter each tl.dot is numpy's matmul, whose OpenBLAS
    kernel (picked for the CPU at run time) may sum a row differently by its place in the tile, so there the inputs
    are small integers, exact in fp32 in any order: what is checked is the kernel's tiling and masks."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(21, 48, generator=g), torch.randn(40, 48, generator=g)
    if device == "cpu":
        x, w = x.mul(4).round(), w.mul(4).round()
    x, w = x.to(device), w.to(device)
    alone = _rows_are_invariant(mm_invariant_triton, x, w.t())
    torch.testing.assert_close(alone.cpu(), mm_invariant_ref(x.cpu(), w.t().cpu()), atol=1e-4, rtol=1e-4)
