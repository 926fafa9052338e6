"""The decode graph's input staging kernel against its torch reference (brrr/kernels/graph_inputs.py)."""
import numpy as np
import pytest
import torch

from brrr.kernels.graph_inputs import stage_decode_inputs_ref, stage_decode_inputs_triton


def _buffers(device, n=8, max_blocks=160):
    """Static buffers as the runner's, filled with junk the staging must overwrite."""
    return (torch.full((n,), 7, dtype=torch.long, device=device), torch.full((n,), 7, dtype=torch.long, device=device),
            torch.full((n,), 7, dtype=torch.long, device=device), torch.full((n,), 7, dtype=torch.int32, device=device),
            torch.full((n, max_blocks), 7, dtype=torch.int32, device=device))


@pytest.mark.parametrize("g,b,width", [(1, 1, 1), (4, 3, 5), (8, 8, 140), (8, 5, 16)])
@pytest.mark.parametrize("gather", [False, True])
def test_staging_kernel_writes_what_the_torch_copies_write(device, g, b, width, gather):
    """Rows and padding, a table wider than one 128-column tile, and ids gathered from the previous step's tokens
    by a row index (a finished sequence's row skipped)."""
    rng = np.random.default_rng(g * 100 + b * 10 + width)
    host = rng.integers(0, 1000, size=4 * g + b * width).astype(np.int64)
    stage = torch.from_numpy(host).to(device)
    ids_from = None
    if gather:
        tokens = torch.from_numpy(rng.integers(0, 50000, size=b + 2)).to(device)
        ids_from = (tokens, torch.from_numpy(rng.permutation(b + 2)[:b]).to(device))
    want, got = _buffers(device), _buffers(device)
    stage_decode_inputs_ref(stage, g, b, width, *want, ids_from)
    stage_decode_inputs_triton(stage, g, b, width, *got, ids_from)
    for w, x in zip(want, got):
        assert torch.equal(w, x)
