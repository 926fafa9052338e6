"""The Triton latent attention of MLA's absorbed decode (brrr/kernels/mla_decode.py) against `mla_decode_ref`:
scattered blocks, contexts shorter than a loop step and longer than several parts, more parts than a short context
fills (empty parts), 5 heads (below tl.dot's 16 rows) and 20 (one group of 64, the other tiles); unwritten cache
slots hold NaN and must never be read."""
import pytest
import torch

from brrr.kernels.mla_attention import mla_decode_ref
from brrr.kernels.mla_decode import mla_decode_latent_triton, mla_decode_ok, mla_decode_splits

H, NOPE, ROPE, V, R, BS = 5, 16, 16, 12, 32, 4


def _case(dtype, contexts, gen, heads=H):
    w = torch.randn(heads, NOPE + V, R, generator=gen) * 0.2
    w_kb, w_vb = w[:, :NOPE].to(dtype), w[:, NOPE:].to(dtype)
    per = [-(-c // BS) for c in contexts]
    perm = torch.randperm(sum(per) + 5, generator=gen)
    tables = torch.zeros(len(contexts), max(per) + 2, dtype=torch.int32)  # padded wider, as a graph's tables are
    at = 0
    for b, n in enumerate(per):
        tables[b, :n] = perm[at:at + n]
        at += n
    cache = torch.full((len(perm), BS, 1, R + ROPE), float("nan"), dtype=dtype)
    for b, c in enumerate(contexts):
        t = torch.arange(c)
        cache.view(-1, R + ROPE)[tables[b, t // BS].long() * BS + t % BS] = torch.randn(c, R + ROPE, generator=gen).to(dtype)
    q_nope = torch.randn(len(contexts), heads, NOPE, generator=gen).to(dtype)
    q_rope = torch.randn(len(contexts), heads, ROPE, generator=gen).to(dtype)
    return q_nope, q_rope, cache, tables, torch.tensor(contexts, dtype=torch.int32), w_kb, w_vb


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [None, 1, 3, 9])
@pytest.mark.parametrize("heads", [H, 20])  # one group of 16 rows; one of 64 (the other tiles)
def test_latent_decode_kernel_equals_the_reference(device, dtype, splits, heads):
    gen = torch.Generator().manual_seed(3)
    q_nope, q_rope, cache, tables, ctx, w_kb, w_vb = _case(dtype, [1, 37, 70], gen, heads)
    scale = (NOPE + ROPE) ** -0.5
    want = mla_decode_ref(q_nope, q_rope, cache, tables, ctx, w_kb, w_vb, scale)
    assert mla_decode_ok(q_nope, cache, R)
    q = torch.cat((torch.einsum("bhd,hdr->bhr", q_nope, w_kb), q_rope), dim=-1).to(device)
    o_lat = mla_decode_latent_triton(q, cache.to(device), tables.to(device), ctx.to(device), R, scale, splits)
    got = torch.einsum("bhr,hvr->bhv", o_lat.cpu(), w_vb)
    assert torch.isfinite(got).all()
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_the_split_rule():
    assert mla_decode_splits(64, 1, 4096) == 4  # two programs on each of 132 SMs over 64 sequences
    assert mla_decode_splits(1, 1, 4096) == 32  # one sequence: parts of 128 tokens
    assert mla_decode_splits(1, 1, 65536) == 64  # capped
    assert mla_decode_splits(1, 1, 40) == 1  # a context under one part is not split
    assert mla_decode_splits(256, 2, 4096) == 1


def test_shapes_the_kernel_does_not_take():
    cache = torch.zeros(4, BS, 1, 40 + 16)  # r = 40: not a power of two
    assert not mla_decode_ok(torch.zeros(1, H, NOPE), cache, 40)
    assert not mla_decode_ok(torch.zeros(1, H, NOPE, dtype=torch.float16), torch.zeros(4, BS, 1, R + ROPE), R)
