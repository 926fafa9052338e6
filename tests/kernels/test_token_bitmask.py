"""The token-bitmask kernel equals the plain reading of llguidance's layout, for every row or an index of rows."""
import pytest
import torch

from brrr.engine.guided.bitmask import apply_token_bitmask_ref, bitmask_words
from brrr.kernels.token_bitmask import BLOCK, apply_token_bitmask_triton


@pytest.mark.parametrize("batch,vocab,rows", [(3, 37, None), (4, BLOCK + 33, [2, 0]), (2, 2 * BLOCK, [1])])
def test_kernel_equals_reference(device, batch, vocab, rows):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(batch, vocab, generator=g)
    groups = batch if rows is None else len(rows)
    bitmask = torch.randint(-2**31, 2**31 - 1, (groups, bitmask_words(vocab)), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0, 0] = 0  # a word with every token banned
    want = apply_token_bitmask_ref(logits, bitmask, rows)
    index = None if rows is None else torch.tensor(rows, device=device)
    got = apply_token_bitmask_triton(logits.to(device), bitmask.to(device), index)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
