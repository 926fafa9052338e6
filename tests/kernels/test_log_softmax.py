"""The row-invariant log-softmax the sampler and a trainer share."""
import torch

from brrr.kernels.log_softmax import _TritonLogSoftmax, log_softmax, log_softmax_triton


def test_the_reference_is_row_invariant_at_a_large_vocabulary():
    x = torch.randn(8, 152_000, generator=torch.Generator().manual_seed(0)) * 3
    full = log_softmax(x)
    assert all(torch.equal(log_softmax(x[i:i + 1])[0], full[i]) for i in range(8))


def test_the_triton_form_is_row_invariant_and_is_log_softmax(device):
    x = (torch.randn(5, 2500, generator=torch.Generator().manual_seed(1)) * 3).to(device)
    full = log_softmax_triton(x)
    assert all(torch.equal(log_softmax_triton(x[i:i + 1])[0], full[i]) for i in range(5))
    torch.testing.assert_close(full.cpu(), torch.log_softmax(x.cpu(), -1), atol=1e-5, rtol=1e-5)


def test_the_triton_form_has_softmax_gradients(device):
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(2)).to(device).requires_grad_()
    g = torch.randn(3, 100).to(device)
    (_TritonLogSoftmax.apply(x) * g).sum().backward()
    got, x.grad = x.grad, None
    (torch.log_softmax(x, -1) * g).sum().backward()
    torch.testing.assert_close(got, x.grad, atol=1e-5, rtol=1e-5)
