"""The batch-invariant mode's switch: what it routes, that it is thread-local and nestable, and the invariant forms
of RMSNorm and SiLU-and-mul it selects."""
import threading

import torch
import torch.nn.functional as F

from brrr.kernels.activation import silu_and_mul, silu_and_mul_invariant
from brrr.kernels.batch_invariant import batch_invariant, batch_invariant_on
from brrr.kernels.dispatch import use_triton
from brrr.kernels.invariant_matmul import mm_invariant_ref
from brrr.kernels.rms_norm import _TritonRMSNorm, rms_norm, rms_norm_ref


def test_matmuls_are_routed_inside_the_mode_only():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 64, generator=g), torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    want = mm_invariant_ref(x, w.t())
    with batch_invariant():
        assert batch_invariant_on() and not use_triton(torch.empty(0))
        assert torch.equal(F.linear(x, w), want)
        assert torch.equal(x @ w.t(), want) and torch.equal(torch.matmul(x, w.t()), want)
        assert torch.equal(F.linear(x, w, b), want + b)
        layer = torch.nn.Linear(64, 48)
        layer.weight.data, layer.bias.data = w, b
        assert torch.equal(layer(x), want + b)  # a model's nn.Linear, no module swap
        with batch_invariant():  # nested: still on, and still on after the inner block
            pass
        assert batch_invariant_on()
        seen = []
        worker = threading.Thread(target=lambda: seen.append(batch_invariant_on()))
        worker.start()
        worker.join()
        assert seen == [False]  # another thread's model is not switched
    assert not batch_invariant_on()
    assert torch.equal(F.linear(x, w), x @ w.t())


def test_rms_norm_of_one_row_equals_that_row_in_a_batch():
    x = torch.randn(4, 40_000, generator=torch.Generator().manual_seed(1))  # a lone row of 32k+: a two-pass sum
    weight = torch.rand(40_000) + 0.5
    with batch_invariant():
        full = rms_norm(x, weight, 1e-6)
        assert all(torch.equal(rms_norm(x[i:i + 1], weight, 1e-6), full[i:i + 1]) for i in range(4))
    torch.testing.assert_close(full, rms_norm_ref(x, weight, 1e-6))


def test_silu_and_mul_elements_do_not_depend_on_the_tensor_around_them():
    g = torch.Generator().manual_seed(2)
    gate, up = torch.randn(9, 100, generator=g) * 4, torch.randn(9, 100, generator=g)
    full = silu_and_mul_invariant(gate, up)
    assert all(torch.equal(silu_and_mul_invariant(gate[i:i + 1], up[i:i + 1])[0], full[i]) for i in range(9))
    with batch_invariant():
        assert torch.equal(silu_and_mul(gate, up), full)
    torch.testing.assert_close(full, F.silu(gate) * up)


def test_the_triton_rms_norm_carries_the_reference_gradient(device):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g).to(device).requires_grad_()
    weight = (torch.rand(64, generator=g) + 0.5).to(device).requires_grad_()
    out = _TritonRMSNorm.apply(x, weight, 1e-6)
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    got = x.grad, weight.grad
    x.grad = weight.grad = None
    rms_norm_ref(x, weight, 1e-6).square().sum().backward()
    torch.testing.assert_close(got, (x.grad, weight.grad), atol=1e-4, rtol=1e-4)
