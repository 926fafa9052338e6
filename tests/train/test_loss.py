"""The chunked linear cross-entropy (brrr/train/loss.py) against the eager F.cross_entropy(lm_head(h).float()):
the same loss and the same gradients for hidden states and the head's weight, in fp32 (to fp32 rounding: the
chunks sum the same products in another order) and under bf16 autocast (to bf16 rounding: each chunk's dW is
rounded once more), with ignored targets, both reductions, several chunks, a frozen head, no-grad evaluation, and
through CausalLMLoss on a tiny model (tied and untied head)."""
import json

import pytest
import torch
import torch.nn.functional as F

import brrr.train.loss as loss_module
from brrr.analysis.train import loss_chunk_rows
from brrr.train.loss import CausalLMLoss, chunk_loss_and_dlogits, head_weight, linear_cross_entropy
from brrr.train.shapes import resolve_config
from brrr.train.pretrain import build_model
from tests.train.conftest import TINY_MODEL


def _inputs(tokens=100, hidden=24, vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.2).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=g)
    t[::5] = -100
    return h, w, t


def _loss_and_grads(fn, h, w, t, reduction, weight_scale=3.0):
    loss = fn(h, w, t, reduction)
    return (loss.detach(), *torch.autograd.grad(loss * weight_scale, (h, w)))


def _eager(h, w, t, reduction):
    return F.cross_entropy(F.linear(h, w).float(), t, reduction=reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_equals_eager_in_fp32(reduction):
    h, w, t = _inputs()
    want = _loss_and_grads(_eager, h, w, t, reduction)
    got = _loss_and_grads(lambda *a: linear_cross_entropy(*a, rows_per_chunk=32), h, w, t, reduction)  # 4 chunks
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_equals_eager_under_bf16_autocast():
    h, w, t = _inputs(tokens=200, hidden=64, vocab=500)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _loss_and_grads(_eager, h, w, t, "mean")
        got = _loss_and_grads(lambda *a: linear_cross_entropy(*a, rows_per_chunk=64), h, w, t, "mean")
    assert got[0].dtype == want[0].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)  # the same bf16 logits, the same fp32 math
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


def test_frozen_head_and_no_grad():
    h, w, t = _inputs()
    w.requires_grad_(False)
    (gh,) = torch.autograd.grad(linear_cross_entropy(h, w, t, rows_per_chunk=32), h)
    torch.testing.assert_close(gh, torch.autograd.grad(_eager(h, w, t, "mean"), h)[0], rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        total = linear_cross_entropy(h, w, t, "sum", rows_per_chunk=32)
    assert not total.requires_grad
    torch.testing.assert_close(total, _eager(h, w, t, "sum").detach(), rtol=1e-6, atol=1e-4)


def test_chunk_rows_bad_reduction_and_a_second_backward():
    assert loss_chunk_rows(128256) == 1024 and loss_chunk_rows(32000) == 4096 and loss_chunk_rows(10**7) == 128
    h, w, t = _inputs()
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, t, "none")
    loss = linear_cross_entropy(h, w, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward twice"):
        loss.backward()


def test_head_weight_takes_only_a_plain_head():
    head, h = torch.nn.Linear(8, 20, bias=False), torch.randn(3, 8)
    assert head_weight(head, h) is head.weight
    assert head_weight(torch.nn.Linear(8, 20), h) is None  # a bias
    with torch.autocast("cpu", dtype=torch.float16):  # fp16's loss scale must reach dlogits before the fp16 cast
        assert head_weight(head, h) is None


@pytest.mark.parametrize("tied", [False, True])
def test_causal_lm_loss_equals_the_logits_path(tmp_path, monkeypatch, tied):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_MODEL, "tie_word_embeddings": tied}))
    cfg = resolve_config(str(path), 96, {"bos": 1, "eos": 2, "im_end": 3}, 32)
    model = build_model(cfg, "cpu", seed=1)
    monkeypatch.setattr(loss_module, "loss_chunk_rows", lambda vocab: 24)  # 3 chunks of a 2 x 32-token batch
    inputs = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(2))
    targets = inputs.roll(-1, 1)
    loss = CausalLMLoss(model)
    got = loss(inputs, targets)
    got_grads = torch.autograd.grad(got, list(model.parameters()))
    meta, positions = loss.meta(2, 32, "cpu")
    want = F.cross_entropy(model.compute_logits(model(inputs.reshape(-1), positions, meta)), targets.reshape(-1))
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for (name, _), a, b in zip(model.named_parameters(), got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)


def test_compiled_equals_eager(monkeypatch):
    """On CUDA each chunk's loss and dlogits run compiled (fused, the fp32 logits never stored), and one process's
    --compile traces the whole loss around it: both give eager's numbers here, with the CUDA dispatch forced on CPU,
    for two chunk lengths (one dynamic graph) and bf16 weights."""
    compiled = torch.compile(chunk_loss_and_dlogits, dynamic=True)
    monkeypatch.setattr(loss_module, "_chunk_step", lambda device: compiled)
    h, w, t = _inputs(tokens=48, hidden=32, vocab=300)
    h, w = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    want = _loss_and_grads(_eager, h, w, t, "mean")
    inner = _loss_and_grads(lambda *a: linear_cross_entropy(*a, rows_per_chunk=32), h, w, t, "mean")
    outer = torch.compile(lambda *a: linear_cross_entropy(*a, rows_per_chunk=32))
    for got in (inner, _loss_and_grads(outer, h, w, t, "mean")):
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        for a, b in zip(got[1:], want[1:]):  # bf16 gradients: a rounding step apart at most
            assert a.dtype == torch.bfloat16
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-2 * b.float().abs().max().item())
