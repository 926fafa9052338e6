"""The Gumbel-max draw: the Triton kernel equals its reference, and the hash noise is uniform and row-independent."""
import math

import pytest
import torch

from brrr.kernels.sampling import (ARGMAX_CHUNK, argmax_triton, gumbel_argmax_ref, gumbel_argmax_triton,
                                   gumbel_noise_ref, row_keys)


@pytest.mark.parametrize("batch,vocab", [(1, 7), (3, 2049), (5, 5000), (2, 2 * ARGMAX_CHUNK + 3)])
def test_triton_draw_equals_reference(device, batch, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(batch, vocab, generator=g) * 3
    logits[0, ::3] = float("-inf")  # filtered tokens are never drawn
    temp = torch.rand(batch, generator=g) + 0.3
    keys = torch.from_numpy(row_keys(range(batch), [4] * batch))
    logits, temp, keys = logits.to(device), temp.to(device), keys.to(device)
    want = gumbel_argmax_ref(logits, temp, keys)
    assert torch.equal(gumbel_argmax_triton(logits, temp, keys), want)
    assert want[0] % 3 != 0


def test_noise_is_uniform_and_keys_are_distinct():
    keys = row_keys([0, 0, 1, 2**70 + 5], [0, 1, 0, 0])  # any int seeds; the step changes the key
    assert len(set(keys.tolist())) == 4 and (keys >= 0).all() and (keys < 2**32).all()
    noise = gumbel_noise_ref(torch.from_numpy(keys), 20000)
    u = torch.exp(-torch.exp(-noise))  # back to the uniforms
    counts = torch.histc(u[0], bins=20, min=0, max=1)
    assert ((counts - 1000) ** 2 / 1000).sum() < 43.8  # chi-square, 19 dof, p = 0.001
    assert abs(torch.corrcoef(u[:2])[0, 1]) < 4 / math.sqrt(20000)  # consecutive steps are uncorrelated


def test_greedy_argmax_is_torchs_across_parts(device):
    """Rows split into parts of ARGMAX_CHUNK columns: the first column of a tie wins across parts and within one,
    an all -inf row gives 0, as torch.argmax."""
    vocab = 3 * ARGMAX_CHUNK + 5
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, [7, ARGMAX_CHUNK + 1, vocab - 1]] = 9.0  # tie across parts
    logits[1, [ARGMAX_CHUNK + 2, ARGMAX_CHUNK + 9]] = 9.0  # tie inside a part
    logits[2] = float("-inf")
    logits[3, vocab - 1] = 9.0  # the last column
    logits = logits.to(device)
    got = argmax_triton(logits)
    assert torch.equal(got, logits.argmax(-1)) and got.tolist() == [7, ARGMAX_CHUNK + 2, 0, vocab - 1]


def test_a_filtered_token_is_never_drawn_even_at_the_top_noise_value(device):
    """Key 13638 hashes column 4081 to the largest uniform, (2^24 - 0.5) / 2^24, which rounds to 1 in fp32: its noise
    was +inf, so that column was drawn whatever its logit, -inf (a grammar mask, top-k) included."""
    key, col = 13638, 4081
    noise = gumbel_noise_ref(torch.tensor([key]), col + 1)
    assert torch.isfinite(noise).all() and noise[0, col] == noise.max()
    logits = torch.zeros(1, col + 1)
    logits[0, col] = float("-inf")
    temp, keys = torch.ones(1), torch.tensor([key])
    want = gumbel_argmax_ref(logits, temp, keys)
    assert want.item() != col
    logits, temp, keys = logits.to(device), temp.to(device), keys.to(device)
    assert gumbel_argmax_triton(logits, temp, keys).item() == want.item()
