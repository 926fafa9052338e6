"""Batch-invariant attention: a query row's output is the same bits as a decode, inside a prefill chunk, after a
cached prefix, beside other sequences, and in a full-sequence forward without a cache; the torch form on CPU, the
Triton form on the GPU or under Triton's interpreter."""
import pytest
import torch

from brrr.kernels import AttnMeta
from brrr.kernels.attention import invariant
from brrr.kernels.attention.invariant import attention_invariant_ref, attention_invariant_triton
from brrr.kernels.attention.reference import attention_ref

H, KVH, D, BS = 4, 2, 16, 16


def _qkv(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, D, generator=g).to(dtype) for h in (H, KVH, KVH)]


class Paged:
    """A paged cache, one block table a sequence; `meta` describes a step of (seq, start, count) pieces."""

    def __init__(self, device, dtype, lengths):
        self.caches = [tuple(torch.zeros(64, BS, KVH, D, dtype=dtype, device=device) for _ in range(2))]
        blocks = iter(torch.randperm(64).tolist())
        self.tables = torch.tensor([[next(blocks) for _ in range(-(-max(lengths) // BS))] for _ in lengths],
                                   dtype=torch.int32, device=device)
        self.device = device

    def meta(self, pieces):
        tables = self.tables.cpu()  # the slots are laid out on the host, then moved with the rest
        slots = torch.cat([tables[seq, torch.arange(s, s + n) // BS].long() * BS + torch.arange(s, s + n) % BS
                           for seq, s, n in pieces])
        lens = [n for _, _, n in pieces]
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        return AttnMeta(cu_seqlens_q=cu.to(self.device), seqlens_q=lens, context_lens=[s + n for _, s, n in pieces],
                        slot_mapping=slots.to(self.device), block_tables=self.tables[[seq for seq, _, _ in pieces]],
                        kv_caches=self.caches)


def _pieces_qkv(qkv, pieces):
    return [torch.cat([qkv[seq][i][s:s + n] for seq, s, n in pieces]) for i in range(3)]


def _run(fn, paged, qkv, pieces, window=None):
    q, k, v = (t.to(paged.device) for t in _pieces_qkv(qkv, pieces))
    return fn(q, k, v, paged.meta(pieces), 0, D ** -0.5, window).cpu()


def _check_invariant(fn, device, dtype, window=None, lengths=(150, 40, 90)):
    """lengths[0] spans three chunks of keys, the last one partial."""
    n0, n1, n2 = lengths
    assert n0 > 2 * invariant.KV_CHUNK and n0 % invariant.KV_CHUNK
    qkv = [_qkv(n, dtype, seed) for seed, n in enumerate(lengths)]
    q0, k0, v0 = (t.to(device) for t in qkv[0])
    full = fn(q0, k0, v0, AttnMeta.causal([n0], device), 0, D ** -0.5, window).cpu()  # a trainer's forward
    # the same sequence through a paged cache: a prefill chunk, the next chunk beside another sequence's prefill,
    # then its last token as a decode beside two other sequences' decodes
    paged = Paged(device, dtype, lengths)
    cut = 2 * n0 // 3
    a = _run(fn, paged, qkv, [(0, 0, cut)], window)
    b = _run(fn, paged, qkv, [(1, 0, n1 - 1), (0, cut, n0 - 1 - cut)], window)
    _run(fn, paged, qkv, [(2, 0, n2 - 1)], window)
    c = _run(fn, paged, qkv, [(2, n2 - 1, 1), (0, n0 - 1, 1), (1, n1 - 1, 1)], window)
    assert torch.equal(a, full[:cut])
    assert torch.equal(b[n1 - 1:], full[cut:n0 - 1])
    assert torch.equal(c[1], full[n0 - 1])
    # the same decode alone: the batch around it changes nothing
    assert torch.equal(_run(fn, paged, qkv, [(0, n0 - 1, 1)], window)[0], full[n0 - 1])
    return full, qkv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_form_is_invariant_and_is_attention(dtype):
    full, qkv = _check_invariant(attention_invariant_ref, "cpu", dtype)
    want = attention_ref(*qkv[0], AttnMeta.causal([150], "cpu"), 0, D ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full.float(), want.float(), atol=tol, rtol=tol)


def test_the_torch_form_with_a_sliding_window():
    full, qkv = _check_invariant(attention_invariant_ref, "cpu", torch.float32, window=70)
    want = attention_ref(*qkv[0], AttnMeta.causal([150], "cpu"), 0, D ** -0.5, sliding_window=70)
    torch.testing.assert_close(full, want, atol=1e-5, rtol=1e-5)


def test_the_triton_form_is_invariant_and_matches_the_torch_form(device, monkeypatch):
    monkeypatch.setattr(invariant, "KV_CHUNK", 16)  # the interpreter runs each program in Python: few short rows
    full, qkv = _check_invariant(attention_invariant_triton, device, torch.float32, window=20, lengths=(40, 6, 9))
    want = attention_invariant_ref(*qkv[0], AttnMeta.causal([40], "cpu"), 0, D ** -0.5, 20)
    torch.testing.assert_close(full, want, atol=1e-5, rtol=1e-5)


def test_a_trainers_gradient_is_attentions(device, monkeypatch):
    """Under autograd with no cache (a trainer's forward) the Triton form's values are the torch form's and its
    gradients are attention's (SDPA's backward: only the forward must be invariant)."""
    monkeypatch.setattr(invariant, "KV_CHUNK", 16)
    lengths = [40, 9]
    leaves = [t.to(device).requires_grad_() for t in _qkv(sum(lengths), torch.float32, 7)]
    out = invariant.attention_invariant(*leaves, AttnMeta.causal(lengths, device), 0, D ** -0.5)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad)
    torch.testing.assert_close(out, attention_invariant_ref(*[t.detach() for t in leaves],
                                                            AttnMeta.causal(lengths, device), 0, D ** -0.5))
    want_out = attention_ref(*leaves, AttnMeta.causal(lengths, device), 0, D ** -0.5)
    want = torch.autograd.grad(want_out, leaves, grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
